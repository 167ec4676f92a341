"""The public Python API: SpeculativeDecoder and its results."""

from __future__ import annotations

import asyncio
import atexit
import enum
import functools
import json
import math
import numbers
import operator
import os
import queue
import random
import re
import sys
import threading
import time
import warnings
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Generator, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, SupportsFloat, SupportsIndex, Union

from specdec_native import _core, calibration
from specdec_native.tools import COMPACT_JSON, GENERIC, ToolSyntax, template_syntax

PathLike = Union[str, "os.PathLike[str]"]
MAX_DRAFT: int = _core.MAX_DRAFT  # the longest draft a step may verify
MAX_TOP_LOGPROBS: int = _core.MAX_TOP_LOGPROBS
MAX_PARALLEL: int = _core.MAX_PARALLEL  # the most requests one decoder serves at once
INT32_MIN, INT32_MAX = -(1 << 31), (1 << 31) - 1  # the engine's counts and token ids are 32-bit
FLOAT32_TINY, FLOAT32_MAX = 1e-30, 1e38  # sampling settings are 32-bit floats in the engine
AUTO = "auto"
DRAFT_RULES = ("auto", "sample", "argmax")  # generate(draft_rule=...)
NGRAM = "ngram"  # as the draft: propose from n-gram matches in the context, no draft model
# What the API takes: Python's numbers and numpy's (np.int64, np.float32, ...; bool is refused).
Integer = SupportsIndex
Number = SupportsFloat
Prompt = Union[str, Iterable[SupportsIndex]]  # text, or token ids (a list, a numpy array, ...)
DraftLength = Union[Integer, str]  # a fixed K, or "auto"


class EngineClosedError(RuntimeError):
    """The decoder was used after close()."""


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type (a TypeError, and a ValueError like every bad argument)."""


# llama.cpp's OpenMP threads do not survive fork(): a child forked from a process that has run
# the engine hangs in its first decode. Refuse there with a clear error instead.
_used_in_this_process = False
_forked_after_use = False


def _after_fork_in_child() -> None:
    global _forked_after_use
    _forked_after_use = _forked_after_use or _used_in_this_process


os.register_at_fork(after_in_child=_after_fork_in_child)


def _check_not_forked() -> None:
    global _used_in_this_process
    if _forked_after_use:
        raise RuntimeError(
            "specdec cannot run in a process forked from one that already ran it (llama.cpp's "
            "worker threads do not survive fork); use multiprocessing's 'spawn' or "
            "'forkserver' start method"
        )
    _used_in_this_process = True


_EXIT_WAIT_S = 10.0  # how long exit waits for calls into the engine to come back

# Decoders still open, closed at exit: a generation running on a daemon thread while the
# interpreter shuts down would otherwise be torn down mid-call (and the process abort).
_open_decoders: weakref.WeakSet[SpeculativeDecoder] = weakref.WeakSet()


@atexit.register
def _close_open_decoders() -> None:
    if _forked_after_use:  # the engines' threads are the parent's: nothing here to stop
        return
    for dec in list(_open_decoders):
        try:
            dec.close()
        except Exception:  # exiting anyway: one decoder's trouble must not keep the others open
            pass
    # Their generations end "cancelled"; let the threads that ran them take the GIL back before
    # the interpreter finalizes (a thread doing so after would abort the process).
    if not _core.drain_native_calls(_EXIT_WAIT_S):
        warnings.warn(
            f"a call into specdec's engine was still running {_EXIT_WAIT_S:g} s after exit began",
            RuntimeWarning,
            stacklevel=1,
        )


@dataclass(frozen=True)
class Stats:
    """Counters and timers of one generation (times in seconds): the engine's (csrc/stats.h,
    whose Stats::visit names them), with their types and the rates derived from them."""

    n_prompt: int
    n_prompt_cached: int  # prompt tokens already in the slot's cache (an earlier request's)
    n_prompt_chunks: int  # target decodes that read the rest of the prompt
    n_generated: int
    first_from_prompt: bool  # the first token came with the prompt's decode (its time in t_prompt)
    n_target_passes: int  # target decodes after the prompt, one per step
    n_drafted: int
    n_accepted: int
    n_cut: int
    n_speculative_steps: int
    n_fallback_steps: int
    n_p_min_stops: int  # model drafts cut short by draft_p_min
    n_draft_read: int  # committed tokens (the prompt's included) the draft model read to draft
    fallback_reason: str
    draft_error: str  # why drafting was dropped for this request ("" when it was not)
    n_shared_steps: int  # steps batched with other requests' rows in the target's decode
    recalibrated: bool  # its steps found the stored costs off; they were measured again after it
    steps_at_k: list[int]
    drafted_by_model: int
    accepted_by_model: int
    drafted_by_ngram: int
    accepted_by_ngram: int
    drafted_by_grammar: int  # tokens a grammar forced, drafted without a model
    accepted_by_grammar: int
    drafted_by_index: int  # copied from earlier requests' outputs (the shared n-gram index)
    accepted_by_index: int
    drafted_by_prediction: int  # copied from the output the caller predicted
    accepted_by_prediction: int
    n_prediction: int  # tokens of the prediction (as far as the context goes)
    n_prediction_in_output: int  # of them, the output's, in order (longest common subsequence)
    n_argmax_drafted: int  # sampling: model drafts that were the draft's argmax (point masses)
    accepted_at: list[int]
    proposed_at: list[int]
    t_queue: float  # waiting for a free slot
    t_prompt: float
    t_first_token: float  # from the call (queue included) to the first token; 0 if none
    t_draft: float
    t_verify: float
    t_total: float

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / proposed draft tokens (0 when nothing was drafted)."""
        return self.n_accepted / self.n_drafted if self.n_drafted else 0.0

    @property
    def tokens_per_pass(self) -> float:
        """Mean tokens committed per target pass (accepted drafts + one target token)."""
        passes = self.n_target_passes
        return (self.n_accepted + passes) / passes if passes else 0.0

    @property
    def t_generation(self) -> float:
        return max(self.t_total - self.t_prompt, 0.0)

    @property
    def tokens_per_second(self) -> float:
        """Tokens per second of generation: the prompt's time excluded, and so the first token
        when it came with the prompt's decode (as llama.cpp's eval rate counts)."""
        t = self.t_generation
        return max(self.n_generated - self.first_from_prompt, 0) / t if t > 0 else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        """For draft position i (from 1): accepted / proposed there."""
        return [
            (a / p if p else 0.0)
            for a, p in zip(self.accepted_at + [0] * len(self.proposed_at), self.proposed_at)
        ]

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(
            acceptance_rate=self.acceptance_rate,
            tokens_per_pass=self.tokens_per_pass,
            tokens_per_second=self.tokens_per_second,
            acceptance_by_position=self.acceptance_by_position,
            t_generation=self.t_generation,
        )
        return d


class FinishReason(str, enum.Enum):
    """Why a generation ended; compares equal to its name ("stop" == FinishReason.STOP)."""

    STOP = "stop"  # an end-of-generation token or a stop string
    LENGTH = "length"  # max_tokens
    CONTEXT = "context"  # the context is full
    CANCELLED = "cancelled"
    TIMEOUT = "timeout"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the target at its position (temperature 1, after
    logit_bias and penalties, masked by the grammar), and the likeliest tokens' there, most
    likely first."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


def _token_logprobs(raw: list[tuple[int, float, list[tuple[int, float]]]]) -> list[TokenLogprob]:
    return [TokenLogprob(t, lp, list(top)) for t, lp, top in raw]


@dataclass(frozen=True)
class GenerationResult:
    text: str
    tokens: list[int]
    finish_reason: FinishReason
    stats: Stats
    prompt_tokens: list[int] = field(default_factory=list)
    # Greedy only: per token, the target's top-1 minus top-2 logit where it chose that token.
    margins: list[float] = field(default_factory=list)
    # Greedy, ended by an end-of-generation token: the margin where it chose that token.
    stop_margin: float | None = None
    # When asked for (logprobs=n): per token, its log-probability and the n likeliest tokens'.
    logprobs: list[TokenLogprob] | None = None
    # When asked for (prompt_logprobs=n): the same for each prompt token but the first. A
    # generation cut short while it read its prompt (a timeout, a cancel) has fewer.
    prompt_logprobs: list[TokenLogprob] | None = None
    # With logprobs, ended by an end-of-generation token: that token's (it is not in tokens);
    # ended by a stop string: that of the first token whose text it cut whole (those have none).
    stop_logprob: TokenLogprob | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "tokens": self.tokens,
            "finish_reason": self.finish_reason,
            "stats": self.stats.as_dict(),
        }


# Argument checks: here, what this layer needs to hand a value over (a type, a size the engine's
# 32-bit fields hold, what None and "auto" stand for); in the engine, what a value must be to
# mean something (max_tokens >= 1, top_p in [0, 1], ...), once for every caller.


def _check_int(name: str, value: Any, lo: int = INT32_MIN, hi: int = INT32_MAX) -> int:
    """An integer (numpy's too) in [lo, hi]."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise ArgumentTypeError(f"{name} must be an integer, got {value!r}")
    v = operator.index(value)
    if hi == INT32_MAX and lo > INT32_MIN and v < lo:
        raise ValueError(f"{name} must be >= {lo}, got {v}")
    if not lo <= v <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {v}")
    return v


MAX_NGRAM_INDEX_MB = 1 << 16  # 64 GiB: its positions are 32-bit
MIN_NGRAM_INDEX_MB = 0.01  # less holds too little to be worth its lookups


NGRAM_MODES = ("auto", "on", "off")  # SpeculativeDecoder.ngram_mode


def _ngram_use(ngram: Any, draft_model: bool) -> str:
    """The engine's n-gram mode: "on" (every request copies), "auto" (requests under auto weigh
    copies against the draft model), "off"."""
    if ngram is None:
        return "auto" if draft_model else "off"
    if not isinstance(ngram, bool):
        raise ArgumentTypeError(f"ngram must be None, True or False, got {ngram!r}")
    return "on" if ngram else "off"


def _index_bytes(mb: Any) -> int:
    """The shared n-gram index's budget in bytes, from MiB."""
    ok = lambda v: v == 0 or MIN_NGRAM_INDEX_MB <= v <= MAX_NGRAM_INDEX_MB  # noqa: E731
    rule = f"0 (off) or in [{MIN_NGRAM_INDEX_MB}, {MAX_NGRAM_INDEX_MB}]"
    return int(_check_float("ngram_index_mb", mb, ok, rule) * (1 << 20))


def _check_float(
    name: str,
    value: Any,
    ok: Callable[[float], bool] = lambda _: True,
    rule: str = "a finite number",
) -> float:
    """A finite number (numpy's too) passing `ok`, that the engine's 32-bit floats can hold."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(f"{name} must be a number, got {value!r}")
    try:
        v = float(value)
    except OverflowError:
        raise ValueError(f"{name} must be {rule}, got a number too large") from None
    if math.isnan(v) or math.isinf(v) or not ok(v):
        raise ValueError(f"{name} must be {rule}, got {value!r}")
    if v != 0 and not FLOAT32_TINY <= abs(v) <= FLOAT32_MAX:
        raise ValueError(f"{name} is {v!r}: too far from 1 for a 32-bit float")
    return v


def _check_prediction(value: Any) -> str | tuple[int, ...]:
    """A prediction: text, or token ids (None: none)."""
    if value is None:
        return ""
    if isinstance(value, str):
        return _check_text("prediction", value)
    if isinstance(value, (bytes, bytearray, memoryview)) or not isinstance(value, Sequence):
        raise ArgumentTypeError(
            f"prediction must be str or a list of token ids, got {type(value).__name__}"
        )
    return tuple(_check_int("prediction token", t, 0) for t in value)


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ArgumentTypeError(f"{name} must be True or False, got {value!r}")
    return value


def _check_text(name: str, value: Any) -> str:
    """A str that is valid Unicode (no lone surrogates), for the engine's UTF-8."""
    if not isinstance(value, str):
        raise ArgumentTypeError(f"{name} must be a string, got {value!r}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name} is not valid Unicode (lone surrogate at {e.start})") from None
    return value


def _is_auto(n_draft: Any) -> bool:
    if isinstance(n_draft, str):
        if n_draft != AUTO:
            raise ValueError(f"n_draft must be an integer or 'auto', got {n_draft!r}")
        return True
    return False


def _check_model_path(name: str, path: PathLike) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{name} must be a path, got {type(path).__name__}")
    p = Path(os.fspath(path))
    try:
        if not p.exists():
            raise FileNotFoundError(f"{name} model not found: {p}")
        if not p.is_file():
            raise ValueError(f"{name} model is not a file: {p}")
    except OSError as e:
        if isinstance(e, FileNotFoundError):
            raise
        raise ValueError(f"{name} model path cannot be used ({e.strerror}): {p}") from None
    return _native_path(f"{name} model path", p)


def _native_path(name: str, path: PathLike) -> str:
    """A path as the engine takes it: UTF-8 text (a file name of other bytes must be renamed)."""
    text = os.fspath(path)
    if not isinstance(text, str):
        raise TypeError(f"{name} must be a str path, got bytes")
    if "\0" in text:
        raise ValueError(f"{name} holds a NUL character: {text!r}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{name} is not valid UTF-8: {text!r}") from None
    return text


DEFAULT_N_BATCH = 512  # llama.cpp's default logical batch
# Async calls waiting in the engine's queue with a thread of their own, beyond one per slot.
ASYNC_QUEUE_THREADS = 32


def check_engine_sizes(
    *,
    n_ctx: int,
    n_batch: int,
    n_parallel: int,
    n_threads: int | None,
    n_gpu_layers: int,
    draft_n_gpu_layers: int | None,
) -> tuple[int, int]:
    """The decoder's sizes checked (ValueError), before anything loads: the engine's thread
    count (0: llama.cpp's default) and the draft's GPU layers."""
    _check_int("n_ctx", n_ctx, 16, 1 << 20)
    _check_int("n_batch", n_batch, 1, 1 << 16)
    _check_int("n_parallel", n_parallel)
    threads = 0 if n_threads is None else _check_int("n_threads", n_threads, 1, 1024)
    _check_int("n_gpu_layers", n_gpu_layers, -1)
    d_ngl = n_gpu_layers if draft_n_gpu_layers is None else draft_n_gpu_layers
    return threads, _check_int("draft_n_gpu_layers", d_ngl, -1)


# The decoders from_llama made on each Llama, which its closing closes first. Weak both ways: a
# decoder closed or collected is gone from here, and its contexts with it.
_borrowers: weakref.WeakKeyDictionary[Any, weakref.WeakSet[SpeculativeDecoder]] = (
    weakref.WeakKeyDictionary()
)


def _lend_to(llm: Any, decoder: SpeculativeDecoder) -> None:
    """Closing `llm` will close `decoder` first, before llama-cpp-python frees the weights it
    uses (its stack runs last in, first out): one callback per Llama, however many decoders."""
    stack = getattr(llm, "_stack", None)
    if stack is None:
        return
    if llm not in _borrowers:
        _borrowers[llm] = weakref.WeakSet()
        stack.callback(_close_borrowers, _borrowers[llm])
    _borrowers[llm].add(decoder)


def _timeout_from_now(kwargs: dict[str, Any]) -> dict[str, Any]:
    """An async call's timeout as a deadline from the call itself, so that time spent waiting
    for a thread counts, as time waiting for the decoder does."""
    try:
        given = {name: kwargs[name] for name in ("timeout", "deadline") if name in kwargs}
        timing = GenerationSettings.checked(**given)
    except ValueError:
        return kwargs  # generate() raises it, in its place among every check
    if timing.timeout is None:
        return kwargs
    ends = time.monotonic() + timing.timeout
    deadline = ends if timing.deadline is None else min(ends, timing.deadline)
    return {**kwargs, "timeout": None, "deadline": deadline}


def _close_borrowers(decoders: weakref.WeakSet[SpeculativeDecoder]) -> None:
    for decoder in list(decoders):
        decoder.close()


def _model_address(llm: Any) -> int:
    """The address of a llama_cpp.Llama's llama_model (0 for None or a closed one)."""
    if llm is None:
        return 0
    import ctypes

    model = getattr(llm, "model", None)
    if model is None:
        return 0
    return int(ctypes.cast(model, ctypes.c_void_p).value or 0)


def _check_stop(stop: str | Sequence[str] | None) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, (bytes, bytearray, memoryview)):
        raise ArgumentTypeError("stop must be a str or a list of str, not bytes")
    if not isinstance(stop, (str, Iterable)):
        raise ArgumentTypeError(f"stop must be a str or a list of str, got {type(stop).__name__}")
    items = [stop] if isinstance(stop, str) else list(stop)
    for s in items:
        _check_text("a stop string", s)
    return items


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template: a name llama.cpp knows ("chatml", "gemma", ...), or the text of a
    Jinja template (the user's, or the model's own), rendered in a sandbox as Hugging Face's
    chat templates are."""

    name: str = ""
    jinja: Any = None  # the compiled template
    tool_syntax: ToolSyntax = GENERIC  # how it writes tool calls (tools.template_syntax)

    @classmethod
    def of(cls, template: str | None) -> ChatTemplate | None:
        if template is None:
            return None
        _check_text("chat_template", template)
        if _is_jinja(template):
            return cls(jinja=_compile_jinja(template), tool_syntax=template_syntax(template))
        names = _core.chat_template_names()
        if template not in names:
            raise ValueError(
                f"unknown chat template {template!r}: a Jinja template's text, or one of "
                f"{', '.join(sorted(names))}"
            )
        return cls(name=template)

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        bos_token: str,
        eos_token: str,
        tools: list[dict[str, Any]] | None = None,
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        import jinja2

        try:
            return _within_budget(
                lambda: str(
                    self.jinja.render(
                        **(variables or {}),
                        messages=messages,
                        tools=tools,
                        add_generation_prompt=add_generation_prompt,
                        bos_token=bos_token,
                        eos_token=eos_token,
                    )
                )
            )
        except jinja2.TemplateError as e:
            raise ValueError(f"the chat template failed on these messages: {e}") from None
        except RecursionError:
            raise ValueError("the chat template failed on these messages: too deep") from None
        except Exception as e:  # its own arithmetic, the sandbox's limits: still the messages'
            raise ValueError(
                f"the chat template failed on these messages: {type(e).__name__}: {e}"
            ) from None


# A chat template may come from a model file, which nobody vetted: its rendering is bounded in
# time and in the memory it takes (a loop of loops, a string doubled in a loop).
TEMPLATE_SECONDS = 2.0
TEMPLATE_MEMORY_BYTES = 256 << 20
TEMPLATE_REPEAT_ITEMS = 1_000_000


class TemplateBudgetError(Exception):
    pass


def _within_budget(render: Callable[[], str]) -> str:
    """render(), stopped past TEMPLATE_SECONDS or once the process holds TEMPLATE_MEMORY_BYTES
    more than when it began: checked at every line the compiled template runs (Jinja compiles
    to Python), so no loop escapes it."""
    if sys.gettrace() is not None:  # a debugger or a coverage tool traces this thread
        return render()
    deadline = time.monotonic() + TEMPLATE_SECONDS
    statm = os.open("/proc/self/statm", os.O_RDONLY)
    page = os.sysconf("SC_PAGE_SIZE")

    def resident() -> int:
        return int(os.pread(statm, 64, 0).split()[1]) * page

    most = resident() + TEMPLATE_MEMORY_BYTES

    def guard(frame: Any, event: str, arg: Any) -> Any:
        if time.monotonic() > deadline:
            raise TemplateBudgetError(f"it ran for over {TEMPLATE_SECONDS:g} s")
        if resident() > most:
            raise TemplateBudgetError(f"it took over {TEMPLATE_MEMORY_BYTES >> 20} MiB")
        return guard

    def template_frames(frame: Any, event: str, arg: Any) -> Any:
        # The template's own code holds its loops; Jinja's helpers are left untraced.
        return guard if frame.f_code.co_filename == "<template>" else None

    sys.settrace(template_frames)
    try:
        return render()
    finally:
        sys.settrace(None)
        os.close(statm)


def _is_jinja(text: str) -> bool:
    return "{{" in text or "{%" in text


def _to_json(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Chat templates are written for Hugging Face's tojson, which does not escape HTML.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


@functools.lru_cache(maxsize=8)
def _compiled_template(text: str) -> ChatTemplate | None:
    """A model's own Jinja chat template, compiled; None where it is none or does not compile
    (llama.cpp's built-in formats read it then). Kept: a template that takes tools renders
    chats without them too, and decoders of one model share it."""
    if not _is_jinja(text):
        return None
    try:
        return ChatTemplate(jinja=_compile_jinja(text), tool_syntax=template_syntax(text))
    except ValueError:
        return None


def _model_template(
    info: dict[str, Any], keys: tuple[str, ...] = ("chat_template_tool_use", "chat_template")
) -> ChatTemplate:
    """The first of the model's own chat templates under `keys` that takes tools, compiled;
    else an empty one."""
    for key in keys:
        text = info.get(key) or ""
        if template_syntax(text).templated and (template := _compiled_template(text)):
            return template
    return ChatTemplate()


_MESSAGE_TEXT = ("role", "content", "tool_call_id", "name")


def _chat_message(i: int, m: Any) -> dict[str, Any]:
    """Message i's keys the templates read, checked: role and content text, tool_call_id
    text, tool_calls a list of calls ({"function": {"name": text, "arguments": ...}})."""
    if not isinstance(m, dict) or "role" not in m or "content" not in m:
        raise ValueError("each message must be a dict with 'role' and 'content'")
    out: dict[str, Any] = {}
    if m["role"] == "developer":
        # OpenAI's "developer" role is the system message's, to Jinja templates and llama.cpp's
        # built-in formats alike, none of which knows that role.
        m = {**m, "role": "system"}
    if m.get("content") is None and m.get("tool_calls"):  # an assistant's calls alone
        m = {**m, "content": ""}
    for key in _MESSAGE_TEXT:
        if m.get(key) is not None or key in ("role", "content"):
            value = _check_text(f"message {i}'s {key}", m[key])
            if "\0" in value:
                raise ValueError(f"message {i}'s {key} contains a NUL character")
            out[key] = value
    if m.get("tool_calls"):  # None or [] (as model_dump() writes them): no calls
        calls = m["tool_calls"]
        ok = isinstance(calls, list) and all(
            isinstance(c, dict)
            and isinstance(c.get("function"), dict)
            and isinstance(c["function"].get("name"), str)
            for c in calls
        )
        if not ok:
            raise ValueError(f"message {i}'s tool_calls must be a list of function calls")
        out["tool_calls"] = calls
    return out


# What a chat template is always given; chat_template_kwargs may not replace them.
_TEMPLATE_INPUTS = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")


def _template_variables(given: Mapping[str, Any] | None) -> dict[str, Any]:
    if given is None:
        return {}
    if not isinstance(given, Mapping) or not all(isinstance(k, str) for k in given):
        raise ArgumentTypeError("chat_template_kwargs must be a mapping of names to values")
    taken = sorted(set(given) & set(_TEMPLATE_INPUTS))
    if taken:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(taken)}")
    return dict(given)


def _compile_jinja(text: str) -> Any:
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ValueError(f"the chat template refused the messages: {message}")

    def strftime_now(format: str) -> str:
        return time.strftime(format)

    class Sandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*"])

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            # A repetition ('x' * 10**9) is the one operator that makes much from little.
            if isinstance(right, int) and hasattr(left, "__len__"):
                if len(left) * right > TEMPLATE_REPEAT_ITEMS:
                    raise TemplateBudgetError("it repeats a value past 1,000,000 items")
            return super().call_binop(context, operator, left, right)

    env = Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.filters["tojson"] = _to_json
    try:
        return env.from_string(text)
    except jinja2.TemplateError as e:
        raise ValueError(f"the chat template is not a valid Jinja template: {e}") from None
    except (RecursionError, SyntaxError, MemoryError) as e:  # nested past what Python compiles
        raise ValueError(
            f"the chat template is not a usable Jinja template: {type(e).__name__}"
        ) from None


# A grammar's kind (the engine's name) -> the generate() argument that gives it.
CONSTRAINT_ARGUMENTS = {
    "json_schema": "json_schema",
    "lark": "grammar",
    "regex": "regex",
    "json_object": "json_object",
}


def constraint_of(
    json_schema: Any = None,
    grammar: str | None = None,
    regex: str | None = None,
    json_object: bool = False,
) -> tuple[str, Any] | None:
    """generate()'s grammar arguments as one (kind, text), at most one of them given: a JSON
    schema (a dict, or its JSON text), a Lark grammar, a regular expression, or any JSON object."""
    values = {"json_schema": json_schema, "lark": grammar, "regex": regex}
    values["json_object"] = "" if _check_bool("json_object", json_object) else None
    given = [(kind, value) for kind, value in values.items() if value is not None]
    if len(given) > 1:
        raise ValueError(
            f"give at most one of {', '.join(CONSTRAINT_ARGUMENTS.values())}, got "
            + ", ".join(CONSTRAINT_ARGUMENTS[k] for k, _ in given)
        )
    if not given:
        return None
    kind, value = given[0]
    if isinstance(value, str):
        _check_text(CONSTRAINT_ARGUMENTS[kind], value)
    if kind == "json_schema" and isinstance(value, (dict, bool)):
        return ("json_schema", json.dumps(value))
    return (kind, value)


def _check_constraint(kind: Any, text: Any) -> tuple[str, str]:
    """A (kind, text) checked where Python can say more than the engine (which refuses what
    llguidance refuses, NUL characters included)."""
    name = CONSTRAINT_ARGUMENTS.get(kind)
    if name is None:
        raise ValueError(f"constraint kind must be one of {', '.join(CONSTRAINT_ARGUMENTS)}")
    if not isinstance(text, str):
        raise ArgumentTypeError(f"{name} must be a string, got {type(text).__name__}")
    if kind == "json_schema":
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"json_schema is not JSON: {e.msg} at {e.pos}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError("json_schema must be a JSON object (or true/false)")
        if isinstance(schema, dict) and "x-guidance" not in schema:
            text = json.dumps({**schema, "x-guidance": COMPACT_JSON})
    elif kind == "json_object":
        kind, text = "json_schema", json.dumps({"type": "object", "x-guidance": COMPACT_JSON})
    elif not text.strip():
        raise ValueError(f"{name} is empty")
    elif kind == "lark":
        text = _as_lark(text)
    return (kind, text)


# llguidance's converter takes time quadratic in the rules (0.2 s for 500 on a 2-core Xeon).
MAX_GBNF_RULES = 500
_GBNF_RULE = re.compile(r"(?m)^\s*[A-Za-z0-9_-]+\s*::=")


def _as_lark(grammar: str) -> str:
    """A GBNF grammar (llama.cpp's: rules written `name ::= ...`) in Lark syntax, as llguidance
    reads it; anything else is taken for Lark."""
    rules = len(_GBNF_RULE.findall(grammar))
    if not rules:
        return grammar
    if rules > MAX_GBNF_RULES:
        raise ValueError(f"a GBNF grammar may have at most {MAX_GBNF_RULES} rules, got {rules}")
    try:
        from llguidance.gbnf_to_lark import gbnf_to_lark
    except ImportError:  # the engine says llguidance is missing
        return grammar
    try:
        return gbnf_to_lark(grammar)
    except Exception as e:  # the converter has its own errors, and fails on some input otherwise
        raise ValueError(f"grammar: GBNF this cannot read: {e}") from None


def _check_logit_bias(bias: Any) -> tuple[tuple[int, float], ...]:
    """{token: bias} (or (token, bias) pairs) as pairs; the engine checks the ranges."""
    items = bias.items() if isinstance(bias, dict) else bias
    try:
        pairs = [(t, b) for t, b in items]
    except (TypeError, ValueError):
        raise ArgumentTypeError("logit_bias must be a dict of token id: bias") from None
    return tuple(
        (_check_int("logit_bias token", t, 0), _check_float("logit_bias value", b))
        for t, b in pairs
    )


def _load_llguidance() -> None:
    """llguidance's C API for the engine, from the installed wheel (once)."""
    try:
        from llguidance import _lib
    except ImportError:
        raise ValueError(
            "structured output (json_schema, grammar, regex) needs llguidance: "
            "pip install llguidance"
        ) from None
    _core.load_constraint_library(str(_lib.__file__))


@dataclass(frozen=True)
class GenerationSettings:
    """What one generation is asked to do, the one definition generate() and the server share:
    `checked()` validates every field (one message each) and `engine_request()` maps it, once,
    to the engine's request. The fields are generate()'s, which documents them."""

    max_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None  # None: a random seed for each call
    stop: tuple[str, ...] = ()
    n_draft: int | str | None = None  # None: the decoder's (a K, or "auto")
    draft_p_min: float = 0.0
    draft_rule: str = "auto"
    timeout: float | None = None  # seconds from the call
    deadline: float | None = None  # a time.monotonic() value
    # A grammar the output must match: (kind, text), kind a key of CONSTRAINT_ARGUMENTS.
    constraint: tuple[str, str] | None = None
    logprobs: int | None = None  # None: none; n: each token's and its n likeliest alternatives'
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    ngram_index: bool = True  # False: neither drafts from the shared index nor adds to it
    ignore_eos: bool = False  # True: end-of-generation tokens are never generated
    prompt_logprobs: int | None = None  # n: each prompt token's (but the first) and n others'
    # The output the caller expects, drafted by copying it: text, or token ids ("": none).
    prediction: str | tuple[int, ...] = ""

    @classmethod
    def checked(cls, **given: Any) -> GenerationSettings:
        """Settings from Python's or numpy's values, each checked (ValueError, or
        ArgumentTypeError for a wrong type); unnamed fields keep their defaults."""
        unknown = sorted(set(given) - {f.name for f in fields(cls)})
        if unknown:
            raise ArgumentTypeError(f"unknown generation settings: {', '.join(unknown)}")
        d = {**{f.name: f.default for f in fields(cls)}, **given}
        if d["draft_rule"] not in DRAFT_RULES:
            raise ValueError(
                f"draft_rule must be one of {', '.join(DRAFT_RULES)}, got {d['draft_rule']!r}"
            )
        n_draft = d["n_draft"]
        seed, timeout, deadline = d["seed"], d["timeout"], d["deadline"]
        constraint = d["constraint"]
        return cls(
            constraint=None if constraint is None else _check_constraint(*constraint),
            logprobs=None
            if d["logprobs"] is None
            else _check_int("logprobs", d["logprobs"], 0, MAX_TOP_LOGPROBS),
            logit_bias=_check_logit_bias(d["logit_bias"]),
            presence_penalty=_check_float("presence_penalty", d["presence_penalty"]),
            frequency_penalty=_check_float("frequency_penalty", d["frequency_penalty"]),
            repeat_penalty=_check_float(
                "repeat_penalty", d["repeat_penalty"], lambda v: v > 0, "a finite number > 0"
            ),
            repeat_last_n=_check_int("repeat_last_n", d["repeat_last_n"], -1),
            ngram_index=_check_bool("ngram_index", d["ngram_index"]),
            ignore_eos=_check_bool("ignore_eos", d["ignore_eos"]),
            prompt_logprobs=None
            if d["prompt_logprobs"] is None
            else _check_int("prompt_logprobs", d["prompt_logprobs"], 0, MAX_TOP_LOGPROBS),
            prediction=_check_prediction(d["prediction"]),
            max_tokens=_check_int("max_tokens", d["max_tokens"]),
            temperature=_check_float("temperature", d["temperature"]),
            top_k=_check_int("top_k", d["top_k"]),
            top_p=_check_float("top_p", d["top_p"]),
            min_p=_check_float("min_p", d["min_p"]),
            seed=None if seed is None else _check_int("seed", seed, 0, (1 << 64) - 1),
            stop=tuple(_check_stop(d["stop"])),
            n_draft=(
                None
                if n_draft is None
                else AUTO
                if _is_auto(n_draft)
                else _check_int("n_draft", n_draft, 0)
            ),
            draft_p_min=_check_float("draft_p_min", d["draft_p_min"]),
            draft_rule=d["draft_rule"],
            timeout=None
            if timeout is None
            else _check_float("timeout", timeout, lambda v: v > 0, "a number of seconds > 0"),
            deadline=None
            if deadline is None
            else _check_float("deadline", deadline, lambda v: True, "a time.monotonic() value"),
        )

    def engine_request(
        self, tokens: list[int], adaptive_default: bool, cancel: _core.CancelFlag | None
    ) -> _core.Request:
        """The engine's request for these settings after `tokens` (the engine checks what the
        values must be to mean something, for every caller)."""
        adaptive = self.adaptive(adaptive_default)
        request = _core.Request()
        request.prompt = tokens
        request.max_tokens = self.max_tokens
        request.temperature = self.temperature
        request.top_k = self.top_k
        request.top_p = self.top_p
        request.min_p = self.min_p
        request.seed = random.getrandbits(64) if self.seed is None else self.seed
        request.stop = list(self.stop)
        # -1: the decoder's K, so that a K of the caller's is >= 0.
        request.n_draft = -1 if self.n_draft is None or adaptive else int(self.n_draft)
        request.adaptive = adaptive
        request.draft_p_min = self.draft_p_min
        request.draft_rule = self.draft_rule
        request.timeout = self._seconds_left()
        request.cancel = cancel
        request.logprobs = -1 if self.logprobs is None else self.logprobs
        request.logit_bias = list(self.logit_bias)
        request.presence_penalty = self.presence_penalty
        request.frequency_penalty = self.frequency_penalty
        request.repeat_penalty = self.repeat_penalty
        request.repeat_last_n = self.repeat_last_n
        # The index changes with every request served: drafts from it would make a seed's
        # sampled text depend on what came before (greedy text does not).
        repeatable = self.seed is not None and self.temperature > 0 and not adaptive
        request.ngram_index = self.ngram_index and not repeatable
        request.ignore_eos = self.ignore_eos
        request.prompt_logprobs = -1 if self.prompt_logprobs is None else self.prompt_logprobs
        if self.constraint is not None:
            _load_llguidance()
            request.constraint_kind, request.constraint = self.constraint
        return request

    def check_values(self) -> GenerationSettings:
        """These settings, once the engine's checks of their values pass (ValueError for the
        first that fails): what a caller can check before a model is loaded."""
        _core.check_request_values(self.engine_request([], False, None))
        return self

    def adaptive(self, decoder_default: bool) -> bool:
        """Whether K is chosen each step ("auto"): this call's n_draft, else the decoder's."""
        return decoder_default if self.n_draft is None else self.n_draft == AUTO

    def _seconds_left(self) -> float:
        """The engine's timeout (0: none) from timeout and deadline, whichever comes first."""
        seconds = self.timeout or 0.0
        if self.deadline is not None:
            # The engine's timeout must be > 0; a deadline already past times out at once.
            left = max(self.deadline - time.monotonic(), 1e-6)
            seconds = min(seconds, left) if seconds else left
        return seconds


class SpeculativeDecoder:
    """A target model, optionally a draft model, and the speculative loop between them.

    ``draft`` is a GGUF path, or "ngram" to draft from earlier occurrences of the text's last
    n-gram (prompt lookup; no draft model). With a draft model, ``ngram`` says which requests
    also copy such matches: by default (None) those under "auto", which each step draft the
    proposal expected to commit tokens faster (a copy or the model's tokens), while a fixed K
    drafts with the model alone; ``True`` every request, a fixed K copying first and asking the
    model where there is no match; ``False`` none. ``ngram_index_mb`` > 0 (with ``ngram=True``
    or ``draft="ngram"``) also copies from the outputs of earlier requests to this decoder, kept
    in one index of at most that many MiB (the older half forgotten when full): agent loops
    repeat their tool calls, plans and quotes from one request to the next.

    ``n_draft`` (K) is how many tokens the draft proposes per step; without a draft, or with
    ``n_draft=0``, the same engine decodes with the target alone (the baseline).
    ``n_parallel`` requests generate at once: calls from several threads (or tasks, with the
    async methods) share one batched step per token, each in its own slot of both contexts
    (each slot holds ``n_ctx`` tokens); further calls wait for a slot. A new request takes the
    free slot whose cache shares the longest prefix with its prompt and decodes only the rest.

    ``calibration_cache``: under "auto", reuse the decode costs measured by an earlier run with
    the same models, settings and machine, and store newly measured ones
    ($SPECDEC_CACHE/calibration).
    """

    def __init__(
        self,
        target: PathLike,
        draft: PathLike | None = None,
        *,
        n_draft: DraftLength = AUTO,
        n_ctx: int = 4096,
        n_batch: int = DEFAULT_N_BATCH,
        n_threads: int | None = None,
        n_gpu_layers: int = 0,
        draft_n_gpu_layers: int | None = None,
        ngram: bool | None = None,
        ngram_min: int = 1,
        ngram_max: int = 4,
        ngram_index_mb: float = 0.0,
        calibration_cache: bool = True,
        n_parallel: int = 1,
        chat_template: str | None = None,
        verbose: bool = False,
        _borrow: tuple[Any, Any] = (None, None),
    ) -> None:
        _check_not_forked()
        target_path = _check_model_path("target", target)
        self._chat_template = ChatTemplate.of(chat_template)
        # The model's templates for chats with tools and without, compiled when first needed.
        self._own_template: ChatTemplate | None = None
        self._own_plain: ChatTemplate | None = None
        self._special: dict[str, int | None] = {}  # special_tokens' answers, by text
        if draft is not None and os.fspath(draft) == NGRAM:
            if ngram is False:
                raise ValueError('ngram=False contradicts draft="ngram"')
            draft, ngram = None, True
        draft_path = None if draft is None else _check_model_path("draft", draft)
        ngram_use = _ngram_use(ngram, draft_path is not None)
        _check_int("ngram_min", ngram_min)
        _check_int("ngram_max", ngram_max)
        index_bytes = _index_bytes(ngram_index_mb)
        if index_bytes and ngram_use != "on":
            raise ValueError(
                'ngram_index_mb needs ngram=True or draft="ngram": the shared index serves '
                "requests that copy at every K"
            )
        self._adaptive = _is_auto(n_draft)
        # Under "auto" every request is adaptive unless it names its own K: no default K.
        fixed_k = 0 if self._adaptive else _check_int("n_draft", n_draft)
        threads, d_ngl = check_engine_sizes(
            n_ctx=n_ctx,
            n_batch=n_batch,
            n_parallel=n_parallel,
            n_threads=n_threads,
            n_gpu_layers=n_gpu_layers,
            draft_n_gpu_layers=draft_n_gpu_layers,
        )
        if (n_gpu_layers or d_ngl) and not _core.supports_gpu_offload():
            warnings.warn(
                "this llama.cpp build has no GPU offload: the layers stay on the CPU "
                "(README: GPUs and other CPUs)",
                RuntimeWarning,
                stacklevel=2,
            )
        self._engine: _core.Engine | None = _core.Engine(
            target_path,
            draft_path,
            n_draft=fixed_k,
            n_ctx=n_ctx,
            n_batch=n_batch,
            n_threads=threads,
            n_gpu_layers=n_gpu_layers,
            draft_n_gpu_layers=d_ngl,
            ngram=ngram_use,
            ngram_min=ngram_min,
            ngram_max=ngram_max,
            verbose=verbose,
            target_model=_model_address(_borrow[0]),
            draft_model=_model_address(_borrow[1]),
            n_parallel=n_parallel,
            ngram_index_bytes=index_bytes,
        )
        # Llama objects whose weights the engine uses: kept alive as long as it is.
        self._borrowed = [llm for llm in _borrow if llm is not None]
        # The async variants' threads, each blocked in a call: enough for every slot and a
        # queue, so that they never wait for asyncio's small shared pool (nor hold it from the
        # application's own work). Created as calls come.
        self._async_threads = ThreadPoolExecutor(
            n_parallel + ASYNC_QUEUE_THREADS, thread_name_prefix="specdec-async"
        )
        _open_decoders.add(self)
        self.target_path = target_path
        self.draft_path = draft_path
        self._ngram_mode = ngram_use
        # Where the "auto" policy's cost curve came from: None (not yet), "measured", "cache".
        self._calibration: str | None = None
        self._cannot_pay_before = 0  # measurements in a row the stored curve could not pay by
        # One thread at a time reads the stored curve: first requests racing for it set it once.
        self._calibration_lock = threading.Lock()
        self._stored_read = False
        self._calibration_key = (
            calibration.inputs(
                Path(target_path),
                Path(draft_path) if draft_path else ("ngram" if ngram_use == "on" else None),
                {
                    "n_threads": threads,
                    "n_batch": n_batch,
                    "n_gpu_layers": n_gpu_layers,
                    "draft_n_gpu_layers": d_ngl,
                    "ngram": ngram_use == "on",  # (as stored before "auto" existed)
                    "n_parallel": n_parallel,
                },
            )
            if calibration_cache
            else None
        )

    @classmethod
    def from_llama(cls, target: Any, draft: Any = None, **kwargs: Any) -> SpeculativeDecoder:
        """A decoder on the models of ``llama_cpp.Llama`` objects you already have: their
        weights are used as loaded, not loaded again; the decoder has its own contexts.
        ``draft`` is another ``Llama``, "ngram", or None; other arguments as for the
        constructor (``n_ctx`` defaults to the target Llama's). Closing one of the Llama objects
        closes the decoder first (a generation running ends "cancelled"); it then raises
        EngineClosedError.
        """
        from llama_cpp import Llama

        draft_llm = None if draft is None or isinstance(draft, str) else draft
        llms = [("target", target)] + ([("draft", draft_llm)] if draft_llm is not None else [])
        for name, llm in llms:
            if not isinstance(llm, Llama):
                raise ArgumentTypeError(
                    f"the {name} must be a llama_cpp.Llama"
                    + (', "ngram" or None' if name == "draft" else "")
                    + f", got {type(llm).__name__}"
                )
        for name, llm in llms:
            if _model_address(llm) == 0:
                raise ValueError(f"the {name} Llama has no loaded model (closed?)")
        kwargs.setdefault("n_ctx", max(int(target.n_ctx()), 16))
        kwargs.setdefault("n_gpu_layers", int(target.model_params.n_gpu_layers))
        if draft_llm is not None:
            kwargs.setdefault("draft_n_gpu_layers", int(draft_llm.model_params.n_gpu_layers))
        decoder = cls(
            target.model_path,
            draft if draft_llm is None else draft_llm.model_path,
            _borrow=(target, draft_llm),
            **kwargs,
        )
        for llm in (target, draft_llm):
            if llm is not None:
                _lend_to(llm, decoder)  # a generation running included
        return decoder

    # -- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        """Stops a generation another thread is running (it ends "cancelled"), waits for it, and
        frees both models' contexts (the weights, once no other decoder uses them). Idempotent.
        From inside this decoder's own callback it raises ReentrantCallError."""
        engine = self._engine
        if engine is None:
            return
        engine.shutdown()
        self._engine = None
        self._async_threads.shutdown(wait=False)  # calls still queued raise EngineClosedError
        _open_decoders.discard(self)

    def __enter__(self) -> SpeculativeDecoder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._engine is None

    def _live(self) -> _core.Engine:
        _check_not_forked()
        if any(llm.model is None for llm in self._borrowed):
            raise EngineClosedError("a llama_cpp.Llama whose weights this decoder uses was closed")
        if self._engine is None:
            raise EngineClosedError("this SpeculativeDecoder is closed")
        return self._engine

    # -- properties ------------------------------------------------------------------------

    @property
    def n_draft(self) -> int | str:
        """K, or "auto" when the decoder chooses K each step from measured costs."""
        engine = self._live()
        return AUTO if self._adaptive else engine.n_draft

    @property
    def has_draft(self) -> bool:
        return self._live().has_draft

    @property
    def n_ctx(self) -> int:
        return self._live().n_ctx

    @property
    def ngram_mode(self) -> str:
        """What n-gram drafting does, the ``ngram`` argument resolved: "auto" (requests under
        ``auto`` weigh copies of their own text's n-grams against the draft model), "on" (every
        request copies; with a shared index), "off"."""
        self._live()
        return self._ngram_mode

    @property
    def n_parallel(self) -> int:
        """How many requests generate at once."""
        return self._live().n_parallel

    @property
    def n_threads_now(self) -> int:
        """Threads the decodes use now. Without ``n_threads``, all cores while the machine is
        otherwise idle and fewer while other processes keep cores busy (one decode's threads
        wait for each other, and one the kernel deschedules stalls them all)."""
        return self._live().n_threads_now

    @property
    def ngram_index(self) -> dict[str, int]:
        """The shared n-gram index now (``ngram_index_mb``): tokens held, estimated bytes."""
        e = self._live()
        return {"tokens": e.ngram_index_tokens, "bytes": e.ngram_index_bytes}

    def save_ngram_index(self, path: PathLike) -> None:
        """Writes the shared n-gram index (``ngram_index_mb``) to ``path``, once no request is
        generating; ``load_ngram_index`` in a later process starts from it. OSError when the
        file cannot be written, ValueError without an index."""
        self._live().save_ngram_index(_native_path("the index path", path))

    def load_ngram_index(self, path: PathLike) -> None:
        """Replaces the shared n-gram index with one ``save_ngram_index`` wrote (for this
        model's vocabulary; kept within this decoder's budget). OSError when the file cannot be
        read, ValueError when it is no index of this vocabulary."""
        self._live().load_ngram_index(_native_path("the index path", path))

    def info(self) -> dict[str, Any]:
        """Architecture, size and vocabulary of the target (and draft)."""
        e = self._live()
        return {"target": e.model_info(False), "draft": e.model_info(True) or None}

    # -- text ------------------------------------------------------------------------------

    def tokenize(
        self, text: str, *, add_special: bool = True, parse_special: bool = False
    ) -> list[int]:
        _check_text("text", text)
        _check_bool("add_special", add_special)
        _check_bool("parse_special", parse_special)
        return self._live().tokenize(text, add_special, parse_special)

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self._live().detokenize([_check_int("token", t, 0) for t in tokens])

    def token_bytes(self, tokens: Sequence[int]) -> list[bytes]:
        """Each token's bytes as the target's tokenizer writes it (a piece of a UTF-8 character,
        for some)."""
        return self._live().token_bytes([_check_int("token", t, 0) for t in tokens])

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[dict[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """Formats messages ([{"role": ..., "content": ...}]) with the decoder's chat template:
        ``chat_template`` as given to the constructor, else the model's own.

        ``chat_template_kwargs``: more variables for a Jinja template (Qwen3's
        ``enable_thinking``, as llama-server and Hugging Face pass them); a template read by
        llama.cpp's built-in formats takes none.

        The model's own default template is rendered as Jinja (as Hugging Face and
        llama-server render it: its own default system message included), or read by
        llama.cpp's built-in formats where it does not compile; a GGUF's separate ``tool_use``
        template renders chats with tools only.

        ``tools`` (OpenAI's shape), and messages with "tool_calls" (arguments as objects),
        need a Jinja template that takes tools (``tool_syntax.templated``); it also sees a
        tool message's "tool_call_id"."""
        if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Iterable):
            raise ArgumentTypeError(
                f"messages must be a list of message dicts, got {type(messages).__name__}"
            )
        checked = [_chat_message(i, m) for i, m in enumerate(messages)]
        if not checked:
            raise ValueError("messages must not be empty")
        _check_bool("add_generation_prompt", add_generation_prompt)
        engine = self._live()
        with_tools = tools is not None or any("tool_calls" in m for m in checked)
        if with_tools:
            template = self._tools_template()
        else:
            template = self._chat_template or self._plain_template()
        if with_tools and template is None:
            raise ValueError(
                "tools need a chat template that takes them (tool_syntax.templated); this "
                "decoder's writes tool calls in the generic format (specdec_native.tools)"
            )
        variables = _template_variables(chat_template_kwargs)
        if template is not None and template.jinja is not None:
            info = engine.model_info(False)
            bos, eos = (
                engine.detokenize([t]) if t >= 0 else "" for t in (info["bos"], info["eos"])
            )
            listed = None if tools is None else [dict(t) for t in tools]
            text = template.render(checked, add_generation_prompt, bos, eos, listed, variables)
            # As llama.cpp renders: the BOS (or EOS) that tokenizing the prompt adds is not
            # written twice, whether the template wrote it as bos_token or as text.
            if info["add_bos"] and bos and text.startswith(bos):
                text = text[len(bos) :]
            if info["add_eos"] and eos and text.endswith(eos):
                text = text[: -len(eos)]
            return text
        if variables:
            raise ValueError(
                "chat_template_kwargs need a Jinja chat template (chat_template=, or serve "
                "--chat-template FILE); this one is read by llama.cpp's built-in formats"
            )
        pairs = [(m["role"], m["content"]) for m in checked]
        return engine.apply_chat_template(
            pairs, add_generation_prompt, template.name if template else ""
        )

    @property
    def tool_syntax(self) -> ToolSyntax:
        """How the chat template writes tool calls (specdec_native.tools): ``.name`` "hermes"
        where it takes the tools and writes calls in <tool_call> tags, "llama3" where it writes
        a call as a message of JSON with "parameters", "mistral" where it writes them as a
        JSON array after [TOOL_CALLS] (the server then renders tools through it), else
        "generic" (the server's own JSON format)."""
        template = self._tools_template()
        return GENERIC if template is None else template.tool_syntax

    def special_tokens(self, texts: Sequence[str]) -> dict[str, int]:
        """Those of ``texts`` that are each one special token of the target's vocabulary
        (Qwen's <tool_call>, Mistral's [TOOL_CALLS]), with their ids: tool-call grammars write
        them by id."""
        engine = self._live()
        for text in texts:
            if text not in self._special:
                tokens = engine.tokenize(_check_text("a special token's text", text), False, True)
                one = len(tokens) == 1 and engine.grammar_special(tokens[0])
                self._special[text] = tokens[0] if one else None
        return {text: t for text in texts if (t := self._special[text]) is not None}

    def _plain_template(self) -> ChatTemplate | None:
        """The model's own default template as Jinja, for chats without tools (as Hugging Face
        and llama-server render it: a default system message it writes included); None where
        it does not compile: llama.cpp's built-in reading of it."""
        if self._own_plain is None:
            text = self._live().model_info(False).get("chat_template") or ""
            self._own_plain = _compiled_template(text) or ChatTemplate()
        return self._own_plain if self._own_plain.jinja is not None else None

    def _tools_template(self) -> ChatTemplate | None:
        """The Jinja template that renders tools: the one given, else the model's own; None
        where neither takes tools."""
        template = self._chat_template
        if template is None:
            if self._own_template is None:
                self._own_template = _model_template(self._live().model_info(False))
            template = self._own_template
        return template if template.tool_syntax.templated else None

    def next_token_logits(self, tokens: Prompt, *, batched: bool = True) -> list[float]:
        """The target's logits for the token after ``tokens``, read afresh: in batches (as the
        verify pass reads), or one token per decode (as target-only generation reads)."""
        _check_bool("batched", batched)
        return self._live().next_token_logits(self._prompt_tokens(tokens), batched)

    def measure_decode_cost(
        self, prompt: Prompt, max_n: int = 9, *, repeats: int = 5, draft: bool = False
    ) -> list[float]:
        """Seconds per decode of n = 1..max_n tokens after ``prompt`` on the target (or the
        draft): the cost curve t(n) that decides which K pays on this machine."""
        tokens = self._prompt_tokens(prompt)
        _check_int("max_n", max_n, 1, MAX_DRAFT + 1)
        _check_int("repeats", repeats, 1, 1000)
        _check_bool("draft", draft)
        return self._live().measure_decode_cost(tokens, max_n, repeats, draft)

    def calibrate(self, prompt: Prompt = "The") -> None:
        """Measures the costs the "auto" draft length needs, now and afresh (otherwise they are
        read from the calibration cache, or measured on first use), and stores them."""
        engine = self._live()
        engine.calibrate(self._prompt_tokens(prompt))
        self._calibration = "measured"
        self._store_calibration(engine)

    def policy_state(self) -> dict[str, Any]:
        """The adaptive policy's running acceptance per position, cost estimates and expected
        rate per K; "calibration" says where its cost curve came from."""
        state = self._live().policy_state()
        state["calibration"] = self._calibration or ("measured" if state["calibrated"] else None)
        return state

    def _load_calibration(self, engine: _core.Engine) -> None:
        with self._calibration_lock:
            self._load_calibration_locked(engine)

    def _load_calibration_locked(self, engine: _core.Engine) -> None:
        # Read once: a decoder that has not measured yet (a target alone that has had nothing
        # to draft) finds what it found before.
        if self._stored_read or self._calibration_key is None:
            return
        self._stored_read = True
        if engine.policy_state()["calibrated"]:
            return
        stored = calibration.load(self._calibration_key)
        if stored is None:
            return
        if not stored.trusted:  # "draft too slow", not confirmed yet: the engine measures
            self._cannot_pay_before = stored.cannot_pay
            return
        try:
            engine.set_calibration(
                stored.verify_costs,
                stored.draft_costs,
                stored.batch_verify_costs,
                stored.batch_draft_costs,
            )
        except ValueError:  # written by another version, or damaged: measure instead
            return
        self._calibration = "cache"

    def _store_calibration(self, engine: _core.Engine) -> None:
        state = engine.policy_state()
        if self._calibration_key is not None and state["calibrated"]:
            self._calibration = self._calibration or "measured"
            cannot_pay = 0 if state["drafting_can_pay"] else self._cannot_pay_before + 1
            curve = calibration.Stored(
                state["verify_costs"],
                state["draft_costs"],
                cannot_pay,
                state["batch_verify_costs"],
                state["batch_draft_costs"],
            )
            calibration.save(self._calibration_key, curve)

    # -- generation ------------------------------------------------------------------------

    def _prompt_tokens(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, (bytes, bytearray, memoryview)):
            raise ArgumentTypeError(
                "the prompt must be str or a list of token ids, not bytes: decode it"
            )
        if not isinstance(prompt, (str, Iterable)):
            raise ArgumentTypeError(
                f"the prompt must be str or a list of token ids, got {type(prompt).__name__}"
            )
        if isinstance(prompt, str):
            if prompt == "":
                raise ValueError("the prompt is empty")
            tokens = self.tokenize(prompt, add_special=True, parse_special=True)
        else:
            tokens = [_check_int("prompt token", t, 0) for t in prompt]
        return tokens

    def _prediction_tokens(self, prediction: str | tuple[int, ...]) -> list[int]:
        """A prediction's tokens as the output would spell them: no BOS, special tokens as
        text."""
        if isinstance(prediction, str):
            # Past the context the output cannot go (tokens average far below 32 characters).
            text = prediction[: 32 * self.n_ctx]
            return self.tokenize(text, add_special=False) if text else []
        return list(prediction)  # the engine uses what the context can hold

    def generate(
        self,
        prompt: Prompt,
        max_tokens: Integer = 128,
        *,
        temperature: Number = 0.0,
        top_k: Integer = 0,
        top_p: Number = 1.0,
        min_p: Number = 0.0,
        seed: Integer | None = None,
        stop: str | Sequence[str] | None = None,
        n_draft: DraftLength | None = None,
        draft_p_min: Number = 0.0,
        draft_rule: str = "auto",
        timeout: Number | None = None,
        deadline: Number | None = None,
        json_schema: dict[str, Any] | str | None = None,
        grammar: str | None = None,
        regex: str | None = None,
        json_object: bool = False,
        logprobs: Integer | None = None,
        logit_bias: dict[int, float] | None = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repeat_penalty: float = 1.0,
        repeat_last_n: int = 64,
        ngram_index: bool = True,
        ignore_eos: bool = False,
        prompt_logprobs: Integer | None = None,
        prediction: str | Sequence[int] | None = None,
        on_text: Callable[[str], None] | None = None,
        on_start: Callable[[], None] | None = None,
        cancel: _core.CancelFlag | None = None,
    ) -> GenerationResult:
        """Generates up to ``max_tokens`` tokens after ``prompt`` (text or token ids).

        temperature 0 is greedy. Otherwise target and draft distributions both get temperature,
        top_k, top_p and min_p (in that order), and rejection sampling makes the output follow
        the target's distribution exactly. ``seed`` fixes the random stream (None: random).
        ``n_draft`` overrides the decoder's K for this call (an integer, or "auto": choose K each
        step to maximise expected tokens per second from this machine's measured draft and
        verify costs and the running acceptance, falling back to target-only decoding where
        speculation does not pay). ``draft_p_min`` stops a draft early when the draft model's
        probability of its next token is below it. ``draft_rule`` (sampling with a draft model):
        "sample" drafts x ~ q and accepts with min(1, p/q); "argmax" drafts q's most likely
        token and accepts it with p(x); "auto" drafts each step by whichever this call's
        verified positions so far say is accepted more often. All three are exact.
        ``timeout`` (seconds, from this call, waiting for the decoder included) ends the
        generation with finish_reason "timeout"; ``deadline`` (a ``time.monotonic()`` value) does
        the same at that moment, counted from wherever the caller started its clock (a server
        queue, say). ``cancel`` (a ``CancelFlag``) stops this call
        alone, from any thread, with finish_reason "cancelled".
        ``on_text`` receives the text as it is committed, in whole UTF-8 characters.
        ``on_start`` is called once, before any text, when the request takes a slot: every check
        has passed and it no longer waits (never for a call that ends while it waits).
        Structured output (at most one; needs the llguidance package): ``json_schema`` (a dict or
        its JSON text), ``grammar`` (Lark syntax as llguidance reads it, or llama.cpp's GBNF,
        which llguidance's converter turns into Lark), ``regex``, or ``json_object=True`` (any
        JSON object). Every token is one the grammar allows; the
        output is the target's distribution restricted to what the grammar allows, drafts
        included (the draft model's distribution is masked the same way; an n-gram copy is cut
        at its first token the grammar forbids). A grammar that does
        not compile, or has no complete match, raises ValueError naming the problem; output the
        grammar could not finish within ``max_tokens`` ends with finish_reason "length". A
        ``stop`` string ends the output where it appears under a grammar too, as OpenAI's
        and llama-server's do (finish_reason "stop"): the structure is then cut where the
        caller asked.
        ``logprobs=n`` (0-20) fills ``result.logprobs``: each token's log-probability under the
        target at its position (temperature 1, after logit_bias and penalties, masked by the
        grammar) and the n likeliest
        tokens' there, read from the verify pass that chose it (no extra decode).
        ``logit_bias`` ({token id: -100..100}) is added to the target's logits;
        ``presence_penalty`` and ``frequency_penalty`` (-2..2, OpenAI's) lower a token's logit
        once it has been generated and by how often (the prompt does not count). They change the
        target's distribution, which speculation keeps exactly: each verified position is
        penalised by the tokens before it, drafted ones included. ``repeat_penalty`` (> 0, 1:
        off; llama.cpp's) divides the positive logits, and multiplies the negative ones, of the
        tokens among the last ``repeat_last_n`` of the sequence (prompt included; -1: all of it,
        0: none), before the two above.
        ``ngram_index=False`` keeps this call out of the decoder's shared n-gram index
        (``ngram_index_mb``): it neither drafts from earlier requests' outputs nor adds its own.
        ``ignore_eos=True`` removes the end-of-generation tokens from the target's distribution
        (as llama.cpp's ignore_eos): the call runs to ``max_tokens``, a stop string or a full
        context (a benchmark's fixed length); not with structured output, which ends only so.
        ``prompt_logprobs=n`` (0-20) fills ``result.prompt_logprobs`` with each prompt token's
        log-probability after the tokens before it (all but the first), and the n likeliest
        tokens', under the target model's own distribution (temperature 1, before logit_bias,
        penalties and any grammar): what a scorer or a perplexity wants. The prompt is then
        read whole, without a cached prefix.
        ``prediction`` (text or token ids; OpenAI's predicted outputs) is the output the caller
        expects, a file's text before an edit, say: drafts copy it where the output keeps to it
        (point masses, so the output is the target's, whatever the prediction), on any decoder,
        one without a draft model or n-gram drafting too (there the call also copies its own
        text, and under "auto" the first such call measures the costs). Its copies' acceptance
        is learnt over the decoder's calls. ``stats.drafted_by_prediction``,
        ``accepted_by_prediction``, ``n_prediction`` and ``n_prediction_in_output`` count its
        tokens.
        Ctrl-C raises KeyboardInterrupt; the decoder stays usable.
        """
        settings = GenerationSettings.checked(
            max_tokens=max_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            seed=seed,
            stop=stop,
            n_draft=n_draft,
            draft_p_min=draft_p_min,
            draft_rule=draft_rule,
            timeout=timeout,
            deadline=deadline,
            constraint=constraint_of(json_schema, grammar, regex, json_object),
            logprobs=logprobs,
            logit_bias=logit_bias or {},
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            repeat_penalty=repeat_penalty,
            repeat_last_n=repeat_last_n,
            ngram_index=ngram_index,
            ignore_eos=ignore_eos,
            prompt_logprobs=prompt_logprobs,
            prediction=prediction,
        )
        return self.run(prompt, settings, on_text=on_text, on_start=on_start, cancel=cancel)

    def run(
        self,
        prompt: Prompt,
        settings: GenerationSettings,
        *,
        on_text: Callable[[str], None] | None = None,
        on_start: Callable[[], None] | None = None,
        cancel: _core.CancelFlag | None = None,
        on_logprobs: Callable[[list[TokenLogprob]], None] | None = None,
    ) -> GenerationResult:
        """generate() with its settings as one GenerationSettings (see `checked()`).
        ``on_logprobs`` (when the settings ask for logprobs) receives, just before each piece of
        text reaches ``on_text``, the logprobs of the tokens committed since the last piece."""
        engine = self._live()
        tokens = self._prompt_tokens(prompt)
        if not isinstance(settings, GenerationSettings):
            raise ArgumentTypeError(
                f"settings must be GenerationSettings, got {type(settings).__name__}"
            )
        if cancel is not None and not isinstance(cancel, _core.CancelFlag):
            raise TypeError(f"cancel must be a CancelFlag, got {type(cancel).__name__}")
        first_adaptive = (
            settings.adaptive(self._adaptive)
            and self._calibration is None
            and self._calibration_key is not None
        )
        if first_adaptive:
            self._load_calibration(engine)
        request = settings.engine_request(tokens, self._adaptive, cancel)
        request.prediction = self._prediction_tokens(settings.prediction)
        out = engine.generate(
            request,
            on_text,
            on_start,
            None if on_logprobs is None else lambda raw: on_logprobs(_token_logprobs(raw)),
        )
        if out["stats"]["draft_error"]:
            warnings.warn(
                f"drafting was dropped for this request: {out['stats']['draft_error']}",
                RuntimeWarning,
                stacklevel=2,
            )
        result = GenerationResult(
            text=out["text"],
            tokens=list(out["tokens"]),
            finish_reason=FinishReason(out["finish_reason"]),
            stats=Stats(**out["stats"]),
            prompt_tokens=tokens,
            margins=list(out["margins"]),
            stop_margin=None if math.isnan(out["stop_margin"]) else out["stop_margin"],
            logprobs=None if settings.logprobs is None else _token_logprobs(out["logprobs"]),
            prompt_logprobs=None
            if settings.prompt_logprobs is None
            else _token_logprobs(out["prompt_logprobs"]),
            stop_logprob=next(iter(_token_logprobs(out["stop_logprob"])), None),
        )
        if out["stats"]["recalibrated"]:
            self._calibration = "measured"
            self._store_calibration(engine)
        elif first_adaptive and self._calibration is None:
            self._store_calibration(engine)
        return result

    def stream(
        self, prompt: Prompt, max_tokens: Integer = 128, **kwargs: Any
    ) -> Generator[str, None, None]:
        """Yields text pieces as they are generated (same arguments as generate()).

        Generation runs in a worker thread; closing the iterator early (break, or an exception
        in the consumer) cancels it.
        """
        if "on_text" in kwargs:
            raise ValueError("stream() does not take on_text")
        if "cancel" in kwargs:
            raise ValueError("stream() does not take cancel: close the iterator to stop it")
        engine = self._live()
        if engine.running_on_this_thread:
            # The worker would wait for the generation this thread is running, and it for us.
            raise _core.ReentrantCallError(
                "the engine is already running on this thread: a callback cannot call stream "
                "on the decoder that is calling it"
            )
        pieces: queue.Queue[tuple[str, Any]] = queue.Queue()
        done = threading.Event()
        flag = _core.CancelFlag()

        def work() -> None:
            try:
                result = self.generate(
                    prompt,
                    max_tokens,
                    on_text=lambda t: pieces.put(("text", t)),
                    cancel=flag,
                    **kwargs,
                )
                pieces.put(("done", result))
            except BaseException as exc:  # handed to the consumer thread
                pieces.put(("error", exc))
            finally:
                done.set()

        worker = threading.Thread(target=work, name="specdec-stream", daemon=True)
        worker.start()
        try:
            while True:
                kind, value = pieces.get()
                if kind == "text":
                    yield value
                elif kind == "error":
                    raise value
                else:
                    return
        finally:
            if not done.is_set():
                flag.cancel()  # this generation only, running or still waiting its turn
            worker.join()

    async def agenerate(
        self, prompt: Prompt, max_tokens: Integer = 128, **kwargs: Any
    ) -> GenerationResult:
        """generate() for asyncio code: runs on a worker thread, so the event loop is never
        blocked. Cancelling the awaiting task stops the generation."""
        if "cancel" in kwargs:
            raise ValueError("agenerate() does not take cancel: cancel the task instead")
        flag = _core.CancelFlag()
        kwargs = _timeout_from_now(kwargs)
        call = functools.partial(self.generate, prompt, max_tokens, cancel=flag, **kwargs)
        try:
            result: GenerationResult = await self._on_async_thread(asyncio.get_running_loop(), call)
            return result
        except asyncio.CancelledError:
            flag.cancel()
            raise

    def _on_async_thread(
        self, loop: asyncio.AbstractEventLoop, call: Callable[[], Any]
    ) -> asyncio.Future[Any]:
        try:
            return loop.run_in_executor(self._async_threads, call)
        except RuntimeError:  # its threads are shut down: the decoder was closed
            self._live()  # EngineClosedError
            raise

    async def astream(
        self, prompt: Prompt, max_tokens: Integer = 128, **kwargs: Any
    ) -> AsyncGenerator[str, None]:
        """stream() for asyncio code: yields text pieces as they are generated, without blocking
        the event loop. Leaving the loop early (break, an exception, a cancelled task) stops the
        generation."""
        async for item in self.astream_events(prompt, max_tokens, **kwargs):
            if isinstance(item, str):
                yield item

    async def astream_events(
        self, prompt: Prompt, max_tokens: Integer = 128, **kwargs: Any
    ) -> AsyncIterator[str | GenerationResult]:
        """As astream(), and last the GenerationResult (stats, finish reason)."""
        for name in ("on_text", "cancel"):
            if name in kwargs:
                raise ValueError(f"astream() and astream_events() do not take {name}")
        kwargs = _timeout_from_now(kwargs)
        loop = asyncio.get_running_loop()
        pieces: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        flag = _core.CancelFlag()

        def put(item: tuple[str, Any]) -> None:
            loop.call_soon_threadsafe(pieces.put_nowait, item)

        def work() -> None:
            try:
                result = self.generate(
                    prompt,
                    max_tokens,
                    on_text=lambda t: put(("text", t)),
                    cancel=flag,
                    **kwargs,
                )
                put(("done", result))
            except BaseException as exc:  # handed to the consumer's task
                put(("error", exc))

        worker = self._on_async_thread(loop, work)
        try:
            while True:
                kind, value = await pieces.get()
                if kind == "error":
                    raise value
                yield value
                if kind == "done":
                    return
        finally:
            flag.cancel()  # no effect once the generation has finished
            await asyncio.shield(worker)

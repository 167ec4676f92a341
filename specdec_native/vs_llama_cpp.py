"""specdec against llama.cpp's own speculative decoding (`llama-speculative-simple`), side by side.

Each round runs every configuration once on each prompt, in an order rotated per round: specdec's
target-only, its fixed K's and `auto` in this process, and llama.cpp's speculation types (n-gram
drafting: ngram-simple, ngram-map-k, ngram-mod; with a draft model: draft-simple at each fixed
K, alone and after ngram-mod) as subprocesses. Speed is generated tokens / generation time for
both (prompt excluded), and every speed-up is over specdec's target-only run of the same prompt
and round, so a slow spell of a shared machine falls on both sides of a ratio.

llama.cpp's tools are built from the llama.cpp tree inside the pinned llama-cpp-python sdist by
scripts/build_llama_cpp_tools.sh; nothing of llama.cpp is part of specdec.
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specdec_native._paths import cache_base
from specdec_native.bench import machine_info, ngram_line, pyplot, rotated
from specdec_native.decoder import SpeculativeDecoder

NGRAM_TYPES = ("ngram-simple", "ngram-map-k", "ngram-mod")
RUN_TIMEOUT_S = 600

_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
_DRAFTED = re.compile(r"n_drafted\s*=\s*(\d+)")
_ACCEPTED = re.compile(r"n_accept\s*=\s*(\d+)")


@dataclass
class Run:
    """One generation: its speed and, when it drafted, its acceptance."""

    tokens_per_second: float
    n_generated: int
    n_drafted: int
    n_accepted: int

    @property
    def acceptance(self) -> float:
        return self.n_accepted / self.n_drafted if self.n_drafted else 0.0


@dataclass
class Row:
    engine: str  # "specdec" or "llama.cpp"
    config: str  # "target-only", "auto", "K=3", "ngram-simple", "draft-simple K=3", ...
    temperature: float
    prompt: str
    runs: list[Run] = field(default_factory=list)
    speedups: list[float] = field(default_factory=list)  # per round, over target-only


@dataclass
class Comparison:
    target: str
    draft: str | None  # a GGUF path, "ngram", or None
    max_tokens: int
    repeats: int
    machine: dict[str, Any]
    rows: list[Row] = field(default_factory=list)
    ngram: str | None = None  # specdec's n-gram mode (SpeculativeDecoder.ngram_mode)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def find_tools(directory: Path | None) -> Path:
    """The directory holding llama-speculative-simple; a clear error when it is not built."""
    built = cache_base() / "llama-cpp-tools-0.3.36/build/bin"  # scripts/build_llama_cpp_tools.sh
    d = directory or Path(os.environ.get("SPECDEC_LLAMA_CPP_BIN") or built)
    if not (d / "llama-speculative-simple").is_file():
        raise RuntimeError(
            f"llama-speculative-simple not found in {d}: build llama.cpp's tools with "
            "scripts/build_llama_cpp_tools.sh (about 5 minutes, once) or pass --llama-cpp-bin"
        )
    return d


def parse_output(text: str) -> Run:
    """The figures llama-speculative-simple prints at the end of a run."""
    decoded = _DECODED.search(text)
    if not decoded:
        tail = " | ".join(text.strip().splitlines()[-3:])
        raise RuntimeError(f"llama-speculative-simple printed no speed: {tail}")
    n, seconds = int(decoded.group(1)), float(decoded.group(2))
    drafted, accepted = _DRAFTED.search(text), _ACCEPTED.search(text)
    return Run(
        tokens_per_second=n / seconds if seconds > 0 else 0.0,
        n_generated=n,
        n_drafted=int(drafted.group(1)) if drafted else 0,
        n_accepted=int(accepted.group(1)) if accepted else 0,
    )


def model_draft_specs(ks: Sequence[int]) -> list[str]:
    """llama.cpp's configurations with a draft model at each K: the model alone, and its
    ngram-mod drafts first (as specdec's `auto` weighs copies beside the model)."""
    return [f"{types} K={k}" for types in ("draft-simple", "ngram-mod,draft-simple") for k in ks]


def llama_cpp_args(
    tools: Path,
    target: Path,
    draft: Path | None,
    spec: str,
    *,
    prompt: str,
    max_tokens: int,
    temperature: float,
    seed: int,
    n_ctx: int,
    n_threads: int,
    n_gpu_layers: int,
) -> list[str]:
    """The command line for one llama.cpp run. `spec` is an n-gram type, 'draft-simple K=k', or
    'ngram-mod,draft-simple K=k' (its n-gram drafts first, the model where they have none).
    Sampling is plain temperature (no top-k/top-p/min-p), as in specdec's runs."""
    args = [str(tools / "llama-speculative-simple"), "-m", str(target), "-p", prompt]
    # With -n N it generates N + 1 tokens (its loop ends past N); N - 1 makes it the same N.
    n_predict = max(max_tokens - 1, 0)
    args += ["-n", str(n_predict), "--temp", str(temperature), "--seed", str(seed)]
    args += ["--top-k", "0", "--top-p", "1", "--min-p", "0", "-c", str(n_ctx)]
    args += ["-t", str(n_threads), "-ngl", str(n_gpu_layers)]
    types, _, k = spec.partition(" K=")
    if "draft-simple" in types.split(","):
        assert draft is not None
        args += ["-md", str(draft), "--spec-type", types, "--spec-draft-n-max", k]
        args += ["-ngld", str(n_gpu_layers)]
    else:
        args += ["--spec-type", spec]
    return args


def run_llama_cpp(args: Sequence[str]) -> Run:
    try:
        done = subprocess.run(
            args,
            capture_output=True,
            text=True,
            errors="replace",  # it prints text as it decodes it, a character split across pieces
            timeout=RUN_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"llama-speculative-simple ran past {RUN_TIMEOUT_S} s") from e
    if done.returncode != 0:
        tail = " | ".join(done.stderr.strip().splitlines()[-3:])
        raise RuntimeError(f"llama-speculative-simple failed ({done.returncode}): {tail}")
    return parse_output(done.stderr + done.stdout)


def compare(
    target: Path,
    draft: Path | None,
    *,
    prompts: dict[str, str],
    ks: Sequence[int | str],
    temperatures: Sequence[float],
    max_tokens: int,
    repeats: int,
    seed: int,
    n_ctx: int,
    n_threads: int | None,
    n_gpu_layers: int,
    tools: Path,
    ngram: bool | None = None,
    progress: Callable[[str], None] = lambda _: None,
) -> Comparison:
    ngram_alone = draft is not None and str(draft) == "ngram"
    model_draft = None if ngram_alone or draft is None else draft
    fixed = [k for k in ks if isinstance(k, int) and k > 0]
    ours: list[int | str] = [0, *fixed, *(["auto"] if "auto" in ks else [])]
    theirs = list(NGRAM_TYPES) if ngram_alone else model_draft_specs(fixed)
    threads = n_threads or os.cpu_count() or 1
    report = Comparison(str(target), str(draft) if draft else None, max_tokens, repeats, {})
    report.machine = machine_info()
    with SpeculativeDecoder(
        target, draft, n_ctx=n_ctx, n_threads=threads, n_gpu_layers=n_gpu_layers, ngram=ngram
    ) as dec:
        report.ngram = dec.ngram_mode
        first = next(iter(prompts.values()))
        dec.generate(first, 16, n_draft=0)
        if "auto" in ks:
            dec.calibrate(first)
        configs: list[tuple[str, int | str]] = [("specdec", k) for k in ours]
        configs += [("llama.cpp", s) for s in theirs]
        for temp in temperatures:
            for name, text in prompts.items():
                rows = {c: Row(c[0], _label(c[1]), temp, name) for c in configs}
                for rep in range(repeats):
                    progress(f"T={temp:g} {name}: round {rep + 1}/{repeats}")
                    for engine, cfg in rotated(configs, rep):
                        if engine == "specdec":
                            r = dec.generate(
                                text, max_tokens, n_draft=cfg, temperature=temp, seed=seed + rep
                            )
                            s = r.stats
                            run = Run(s.tokens_per_second, s.n_generated, s.n_drafted, s.n_accepted)
                        else:
                            run = run_llama_cpp(
                                llama_cpp_args(
                                    tools,
                                    target,
                                    model_draft,
                                    str(cfg),
                                    prompt=text,
                                    max_tokens=max_tokens,
                                    temperature=temp,
                                    seed=seed + rep,
                                    n_ctx=n_ctx,
                                    n_threads=threads,
                                    n_gpu_layers=n_gpu_layers,
                                )
                            )
                        rows[(engine, cfg)].runs.append(run)
                base = rows[("specdec", 0)].runs
                for row in rows.values():
                    row.speedups = [
                        r.tokens_per_second / b.tokens_per_second if b.tokens_per_second else 0.0
                        for r, b in zip(row.runs, base)
                    ]
                    report.rows.append(row)
    return report


def _label(cfg: int | str) -> str:
    if cfg == 0:
        return "target-only"
    return f"K={cfg}" if isinstance(cfg, int) else str(cfg)


def summary(report: Comparison) -> list[dict[str, Any]]:
    """Per temperature and configuration, over prompts and rounds: mean tok/s, mean speed-up,
    acceptance (accepted / drafted, pooled), and tokens generated per run."""
    out: list[dict[str, Any]] = []
    keys = dict.fromkeys((r.temperature, r.engine, r.config) for r in report.rows)
    for temp, engine, config in keys:
        rows = [
            r for r in report.rows if (r.temperature, r.engine, r.config) == (temp, engine, config)
        ]
        runs = [run for r in rows for run in r.runs]
        drafted = sum(run.n_drafted for run in runs)
        out.append(
            {
                "temperature": temp,
                "engine": engine,
                "config": config,
                "tokens_per_second": statistics.mean(run.tokens_per_second for run in runs),
                "speedup": statistics.mean(s for r in rows for s in r.speedups),
                "acceptance": sum(run.n_accepted for run in runs) / drafted if drafted else None,
                "tokens": statistics.mean(run.n_generated for run in runs),
            }
        )
    return out


def format_summary(report: Comparison) -> str:
    rows = summary(report)
    lines = [
        f"{'T':>4} {'engine':<10} {'config':<26} {'tok/s':>7} {'speedup':>8} {'accept':>7} "
        f"{'tokens':>7}",
        "-" * 75,
    ]
    for r in rows:
        acc = f"{r['acceptance']:.2f}" if r["acceptance"] is not None else "-"
        lines.append(
            f"{r['temperature']:>4g} {r['engine']:<10} {r['config']:<26} "
            f"{r['tokens_per_second']:>7.1f} {r['speedup']:>7.2f}x {acc:>7} {r['tokens']:>7.0f}"
        )
    for temp in dict.fromkeys(r["temperature"] for r in rows):
        at = [r for r in rows if r["temperature"] == temp and r["config"] != "target-only"]
        theirs = [r for r in at if r["engine"] == "llama.cpp"]
        auto = [r for r in at if r["engine"] == "specdec" and r["config"] == "auto"]
        if theirs and auto:
            best = max(theirs, key=lambda r: r["speedup"])
            lines.append(
                f"T={temp:g}: specdec auto {auto[0]['speedup']:.2f}x, llama.cpp best "
                f"({best['config']}) {best['speedup']:.2f}x: "
                f"{auto[0]['speedup'] / best['speedup']:.2f}x of it"
            )
    if report.ngram:
        lines.append("specdec " + ngram_line(report.ngram))
    return "\n".join(lines)


def plot(report: Comparison, out: Path) -> None:
    plt = pyplot()
    rows = summary(report)
    temps = list(dict.fromkeys(r["temperature"] for r in rows))
    fig, axes = plt.subplots(1, len(temps), figsize=(6 * len(temps), 4), squeeze=False)
    for ax, temp in zip(axes[0], temps):
        at = [r for r in rows if r["temperature"] == temp]
        colours = ["tab:blue" if r["engine"] == "specdec" else "tab:orange" for r in at]
        ax.barh(
            [f"{r['engine']} {r['config']}" for r in at], [r["speedup"] for r in at], color=colours
        )
        ax.axvline(1.0, color="grey", linewidth=0.8)
        ax.set_xlabel("speed-up over target-only")
        ax.set_title(f"T = {temp:g}")
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)

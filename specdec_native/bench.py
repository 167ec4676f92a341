"""The measurement behind `specdec-cli bench`: target-only vs speculative decoding, same prompts,
same process, K sweep, medians over repeats."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, TypeVar, cast

from specdec_native import comparison as cmp
from specdec_native.decoder import NGRAM_MODES, SpeculativeDecoder, Stats

T = TypeVar("T")

# A varied built-in set: code, prose, grounded copying, structured output, chat.
BUILTIN_PROMPTS: dict[str, str] = {
    "code": 'def merge_sort(items):\n    """Sort a list with merge sort."""\n',
    "prose": "The history of the printing press begins",
    "copying": (
        "Repeat the following text exactly.\nText: The quick brown fox jumps over the lazy dog. "
        "A journey of a thousand miles begins with a single step.\nRepeated:"
    ),
    "json": 'Return a JSON list of three users with fields "name", "age" and "email":\n[',
    "chat": "<|im_start|>user\nGive me three tips for learning a language.<|im_end|>\n"
    "<|im_start|>assistant\n",
}


# The seed of round 0 unless told otherwise (every report before `--seed` used it).
DEFAULT_SEED = 1234


@dataclass
class RunResult:
    """Medians over repeats for one configuration on one prompt."""

    prompt: str
    n_draft: int | str  # K, or "auto"
    temperature: float
    tokens_per_second: float
    acceptance_rate: float
    tokens_per_pass: float
    acceptance_by_position: list[float]
    t_draft_per_token: float  # seconds per drafted token
    t_verify_per_pass: float  # seconds per target pass (batch of n_draft + 1)
    share_draft: float
    share_verify: float
    share_other: float
    speedup: float = 0.0  # median over repeats of the speed over that round's target-only run
    speedup_by_repeat: list[float] = field(default_factory=list)
    expected_tokens_per_second: float = 0.0
    efficiency: float = 0.0


@dataclass
class BenchReport:
    target: str
    draft: str | None
    machine: dict[str, Any]
    max_tokens: int
    repeats: int
    runs: list[RunResult] = field(default_factory=list)
    # Round r samples with seed + r: at T > 0, runs of the same seed sample the same texts.
    # None: a pool of several runs (bench-pool), whose rounds came from several seeds.
    seed: int | None = DEFAULT_SEED
    # The decoder's n-gram mode (SpeculativeDecoder.ngram_mode): "auto" (under `auto`, copies
    # of the request's own text weighed against the draft model), "on", "off"; None: not
    # recorded.
    ngram: str | None = None

    def best_k(self, temperature: float) -> int:
        """The fixed K with the best mean speedup at this temperature."""
        means: dict[int, list[float]] = {}
        for r in self.runs:
            if r.temperature == temperature and isinstance(r.n_draft, int) and r.n_draft > 0:
                means.setdefault(r.n_draft, []).append(r.speedup)
        return max(means, key=lambda k: statistics.mean(means[k])) if means else 0

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        temps = sorted({r.temperature for r in self.runs})
        d["best_k"] = {str(t): self.best_k(t) for t in temps}
        d["adaptive_vs_best_fixed"] = adaptive_vs_best_fixed(self)
        return d


def adaptive_vs_best_fixed(report: BenchReport) -> list[dict[str, Any]]:
    """Per temperature and prompt: `auto` against the fixed K (K = 0, target only, included)
    that was fastest on that prompt, two ways (comparison.py):

    - after the fact: the K with the best median speed-up, against `auto`'s median;
    - held out (2+ rounds): each round scores the K that was fastest on the other rounds; the
      ratio of `auto`'s mean speed-up to that, with a bootstrap 95 % interval over rounds."""
    rows = []
    for temp in sorted({r.temperature for r in report.runs}):
        for prompt in dict.fromkeys(r.prompt for r in report.runs if r.temperature == temp):
            rs = [r for r in report.runs if r.temperature == temp and r.prompt == prompt]
            auto = next((r for r in rs if r.n_draft == "auto"), None)
            fixed = [r for r in rs if isinstance(r.n_draft, int)]
            if auto is None or not fixed:
                continue
            best = max(fixed, key=lambda r: r.speedup)
            row: dict[str, Any] = {
                "temperature": temp,
                "prompt": prompt,
                "best_k": best.n_draft,
                "best_speedup": best.speedup,
                "auto_speedup": auto.speedup,
                "auto_over_best": auto.speedup / best.speedup if best.speedup else 0.0,
                "auto_range": [min(auto.speedup_by_repeat), max(auto.speedup_by_repeat)],
                "best_range": [min(best.speedup_by_repeat), max(best.speedup_by_repeat)],
            }
            if len(auto.speedup_by_repeat) >= 2:
                held = cmp.held_out_best({r.n_draft: r.speedup_by_repeat for r in fixed})
                row.update(
                    held_out_k=held.picked,
                    held_out_speedup=statistics.mean(held.speedups),
                    auto_mean_speedup=statistics.mean(auto.speedup_by_repeat),
                    auto_over_held_out=cmp.ratio_of_means(auto.speedup_by_repeat, held.speedups),
                    auto_over_held_out_ci=list(
                        cmp.ratio_interval(auto.speedup_by_repeat, held.speedups)
                    ),
                )
            rows.append(row)
    return rows


ADAPTIVE_TITLE = (
    "auto vs the fixed K (0 = target only) that was fastest on each prompt: after the fact, and"
    " held out (each round scores the K fastest on the other rounds):"
)


def format_adaptive(report: BenchReport) -> str:
    rows = adaptive_vs_best_fixed(report)
    if not rows:
        return ""
    held = all("held_out_speedup" in r for r in rows)
    head = (
        f"{'T':>4} {'prompt':<12} {'best K':>6} {'speedup (range)':>20} "
        f"{'auto (range)':>20} {'auto/best':>9}"
    )
    if held:
        head += f"  {'held-out K':>10} {'mean':>6} {'auto':>6} {'auto/held-out':>13} {'95% CI':>11}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lo, hi = r["best_range"]
        alo, ahi = r["auto_range"]
        line = (
            f"{r['temperature']:>4g} {r['prompt'][:12]:<12} {r['best_k']:>6} "
            f"{r['best_speedup']:>6.2f}x ({lo:.2f}-{hi:.2f}) "
            f"{r['auto_speedup']:>6.2f}x ({alo:.2f}-{ahi:.2f}) {100 * r['auto_over_best']:>8.0f}%"
        )
        if held:
            picked = "/".join(str(k) for k in dict.fromkeys(r["held_out_k"]))
            clo, chi = r["auto_over_held_out_ci"]
            ci = f"[{100 * clo:.0f}-{100 * chi:.0f}%]"
            line += (
                f"  {picked:>10} {r['held_out_speedup']:>5.2f}x {r['auto_mean_speedup']:>5.2f}x "
                f"{100 * r['auto_over_held_out']:>12.0f}% {ci:>11}"
            )
        lines.append(line)
    return "\n".join(lines)


def machine_info() -> dict[str, Any]:
    import os

    from specdec_native import _core
    from specdec_native.calibration import cpu_model

    return {"cpu": cpu_model(), "cores": os.cpu_count(), "system": _core.system_info().strip()}


def _k_order(k: int | str) -> int:
    return k if isinstance(k, int) else 10_000


def _summarise(prompt: str, k: int | str, temp: float, runs: Sequence[Stats]) -> RunResult:
    def med(f: Callable[[Stats], float]) -> float:
        return statistics.median(f(s) for s in runs)

    def safe(a: float, b: float) -> float:
        return a / b if b else 0.0

    n_pos = max((len(s.proposed_at) for s in runs), default=0)
    by_pos = [
        statistics.median(
            (s.acceptance_by_position[i] if i < len(s.proposed_at) else 0.0) for s in runs
        )
        for i in range(n_pos)
    ]
    return RunResult(
        prompt=prompt,
        n_draft=k,
        temperature=temp,
        tokens_per_second=med(lambda s: s.tokens_per_second),
        acceptance_rate=med(lambda s: s.acceptance_rate),
        tokens_per_pass=med(lambda s: s.tokens_per_pass),
        acceptance_by_position=by_pos,
        t_draft_per_token=med(lambda s: safe(s.t_draft, s.n_drafted)),
        t_verify_per_pass=med(lambda s: safe(s.t_verify, s.n_target_passes)),
        share_draft=med(lambda s: safe(s.t_draft, s.t_generation)),
        share_verify=med(lambda s: safe(s.t_verify, s.t_generation)),
        share_other=med(lambda s: safe(s.t_generation - s.t_draft - s.t_verify, s.t_generation)),
    )


def _expected_speed(r: RunResult, mean_k: float) -> float:
    """Tokens/s if the step cost only its measured draft and verify times: the loop's ceiling."""
    step = mean_k * r.t_draft_per_token + r.t_verify_per_pass
    return r.tokens_per_pass / step if step > 0 else 0.0


def _prefixed(progress: Callable[[str], None], prefix: str) -> Callable[[str], None]:
    return lambda msg: progress(prefix + msg)


def rotated(configs: Sequence[T], round_index: int) -> list[T]:
    """The order of round `round_index`: every configuration once, rotated each round, so that
    a slow spell on a shared machine lands on all of them rather than on whichever ran then."""
    shift = round_index % len(configs)
    return [*configs[shift:], *configs[:shift]]


def pyplot() -> Any:
    """matplotlib's pyplot, drawing to files (no display needed)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError("--plot needs matplotlib: pip install 'specdec[plot]'") from e
    return plt


def _interleaved_runs(
    dec: SpeculativeDecoder,
    text: str,
    configs: Sequence[int | str],
    temp: float,
    max_tokens: int,
    repeats: int,
    seed: int,
    progress: Callable[[str], None],
) -> dict[int | str, list[Stats]]:
    """Every configuration once per round, in rotated order."""
    runs: dict[int | str, list[Stats]] = {k: [] for k in configs}
    for rep in range(repeats):
        progress(f"round {rep + 1}/{repeats}")
        for k in rotated(configs, rep):
            r = dec.generate(text, max_tokens, n_draft=k, temperature=temp, seed=seed + rep)
            runs[k].append(r.stats)
    return runs


def run_bench(
    target: Path,
    draft: Path | None,
    *,
    prompts: dict[str, str],
    ks: Sequence[int | str] = (1, 2, 3, 4, 6, 8),
    temperatures: Sequence[float] = (0.0,),
    max_tokens: int = 96,
    repeats: int = 3,
    n_ctx: int = 2048,
    n_threads: int | None = None,
    n_gpu_layers: int = 0,
    seed: int = DEFAULT_SEED,
    ngram: bool | None = None,
    progress: Callable[[str], None] = lambda _: None,
) -> BenchReport:
    report = BenchReport(
        str(target), str(draft) if draft else None, machine_info(), max_tokens, repeats, seed=seed
    )
    with SpeculativeDecoder(
        target, draft, n_ctx=n_ctx, n_threads=n_threads, n_gpu_layers=n_gpu_layers, ngram=ngram
    ) as dec:
        report.ngram = dec.ngram_mode
        progress("warm-up")
        dec.generate(next(iter(prompts.values())), 16, n_draft=0)
        if draft:
            dec.generate(next(iter(prompts.values())), 16, n_draft=2)
            if "auto" in ks:
                dec.calibrate(next(iter(prompts.values())))
        configs: list[int | str] = [0]
        if draft:
            configs += [k for k in ks if k != 0]
        for temp in temperatures:
            for name, text in prompts.items():
                runs = _interleaved_runs(
                    dec,
                    text,
                    configs,
                    temp,
                    max_tokens,
                    repeats,
                    seed,
                    _prefixed(progress, f"T={temp:g} {name}: "),
                )
                for k in configs:
                    res = _summarise(name, k, temp, runs[k])
                    # Each repeat's speed over the target-only run of the same round: rounds
                    # share whatever else the machine was doing at the time.
                    res.speedup_by_repeat = [
                        s.tokens_per_second / b.tokens_per_second if b.tokens_per_second else 0.0
                        for s, b in zip(runs[k], runs[0])
                    ]
                    res.speedup = statistics.median(res.speedup_by_repeat)
                    mean_k = statistics.median(
                        s.n_drafted / max(s.n_target_passes, 1) for s in runs[k]
                    )
                    res.expected_tokens_per_second = _expected_speed(res, mean_k)
                    res.efficiency = (
                        res.tokens_per_second / res.expected_tokens_per_second
                        if res.expected_tokens_per_second
                        else 0.0
                    )
                    report.runs.append(res)
                    progress(
                        f"T={temp:g} {name:<8} K={k}: {res.tokens_per_second:6.1f} tok/s "
                        f"x{res.speedup:.2f} acc={res.acceptance_rate:.2f}"
                    )
    return report


def aggregate(report: BenchReport) -> list[dict[str, Any]]:
    """Per (temperature, K): means over prompts."""
    rows = []
    keys = sorted(
        {(r.temperature, r.n_draft) for r in report.runs}, key=lambda t: (t[0], _k_order(t[1]))
    )
    for temp, k in keys:
        rs = [r for r in report.runs if r.temperature == temp and r.n_draft == k]
        rows.append(
            {
                "temperature": temp,
                "n_draft": k,
                "tokens_per_second": statistics.mean(r.tokens_per_second for r in rs),
                "speedup": statistics.mean(r.speedup for r in rs),
                "acceptance_rate": statistics.mean(r.acceptance_rate for r in rs),
                "tokens_per_pass": statistics.mean(r.tokens_per_pass for r in rs),
                "share_draft": statistics.mean(r.share_draft for r in rs),
                "share_verify": statistics.mean(r.share_verify for r in rs),
                "share_other": statistics.mean(r.share_other for r in rs),
                "t_verify_per_pass_ms": 1000 * statistics.mean(r.t_verify_per_pass for r in rs),
                "efficiency": statistics.mean(r.efficiency for r in rs),
            }
        )
    return rows


def format_table(report: BenchReport) -> str:
    head = (
        f"{'T':>4} {'K':>3} {'tok/s':>7} {'speedup':>8} {'accept':>7} {'tok/pass':>9} "
        f"{'draft%':>7} {'verify%':>8} {'other%':>7} {'t_v(K+1)':>9} {'effic.':>7}"
    )
    lines = [head, "-" * len(head)]
    for row in aggregate(report):
        lines.append(
            f"{row['temperature']:>4g} {row['n_draft']:>3} {row['tokens_per_second']:>7.1f} "
            f"{row['speedup']:>7.2f}x {row['acceptance_rate']:>7.2f} {row['tokens_per_pass']:>9.2f} "
            f"{100 * row['share_draft']:>6.0f}% {100 * row['share_verify']:>7.0f}% "
            f"{100 * row['share_other']:>6.0f}% {row['t_verify_per_pass_ms']:>7.1f}ms "
            f"{row['efficiency']:>7.2f}"
        )
    temps = sorted({r.temperature for r in report.runs})
    lines.append("best K: " + ", ".join(f"T={t:g}: {_best_label(report, t)}" for t in temps))
    if report.ngram and report.draft:
        lines.append(ngram_line(report.ngram))
    return "\n".join(lines)


def ngram_line(mode: str) -> str:
    """What a report's n-gram mode meant for its rows."""
    return {
        "auto": "n-gram copies: weighed against the draft model under auto (--no-ngram: never)",
        "on": "n-gram copies: at every K",
        "off": "n-gram copies: none",
    }[mode]


def _best_label(report: BenchReport, temperature: float) -> str:
    k = report.best_k(temperature)
    speedups = [r.speedup for r in report.runs if r.temperature == temperature and r.n_draft == k]
    if k == 0 or statistics.mean(speedups) <= 1.0:
        return "K=0 (no K beat target-only)"
    return f"K={k}"


def load_report(path: Path) -> BenchReport:
    """A report that `bench --json` wrote."""
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
        _check_numbers(d)
        if not isinstance(d.get("machine"), dict):
            raise TypeError("'machine' is not an object")
        for name in ("max_tokens", "repeats"):
            if not (type(d.get(name)) is int and d[name] >= 1):
                raise ValueError(f"{name!r} is not a count >= 1")
        names = {f.name for f in fields(RunResult)}
        runs = [
            _checked_run(RunResult(**{k: v for k, v in r.items() if k in names})) for r in d["runs"]
        ]
        return BenchReport(
            d["target"],
            d["draft"],
            d["machine"],
            d["max_tokens"],
            d["repeats"],
            runs,
            seed=_seed_of(d),
            ngram=_ngram_of(d),
        )
    except (
        json.JSONDecodeError,
        UnicodeDecodeError,
        KeyError,
        TypeError,
        AttributeError,
        ValueError,
        OverflowError,
    ) as e:
        raise ValueError(
            f"{path}: not a report of `bench --json` ({type(e).__name__}: {e})"
        ) from None


def _checked_run(run: RunResult) -> RunResult:
    """A run's fields of the types it holds (what a report's reader indexes and sums)."""
    numbers = (int, float)
    for f in fields(RunResult):
        v = getattr(run, f.name)
        if f.name == "prompt":
            ok = isinstance(v, str)
        elif f.name == "n_draft":
            ok = v == "auto" or (isinstance(v, int) and not isinstance(v, bool))
        elif f.name in ("acceptance_by_position", "speedup_by_repeat"):
            ok = isinstance(v, list) and all(
                isinstance(x, numbers) and not isinstance(x, bool) for x in v
            )
        else:
            ok = isinstance(v, numbers) and not isinstance(v, bool)
        if not ok:
            raise TypeError(f"run field {f.name!r} holds {v!r}")
    return run


def _check_numbers(value: Any) -> None:
    """Every number in a report is finite and within a double's exact integers."""
    if isinstance(value, dict):
        for v in value.values():
            _check_numbers(v)
    elif isinstance(value, list):
        for v in value:
            _check_numbers(v)
    elif isinstance(value, bool):
        return
    elif isinstance(value, int) and abs(value) > 2**53:
        raise ValueError(f"the number {value:.3g} is out of range")
    elif isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"the number {value} is not finite")


def _seed_of(d: dict[str, Any]) -> int | None:
    # Reports written before `--seed` all used the default.
    seed = d.get("seed", DEFAULT_SEED)
    return None if seed is None else int(seed)


def _ngram_of(d: dict[str, Any]) -> str | None:
    mode = d.get("ngram")
    if mode is not None and mode not in NGRAM_MODES:
        raise ValueError(f"'ngram' is not one of {', '.join(NGRAM_MODES)}")
    return cast(str | None, mode)


def pool_reports(reports: Sequence[BenchReport]) -> BenchReport:
    """One report holding every round of these reports, for the configurations (temperature,
    prompt, K) all of them ran: more rounds than one run holds, for a steadier comparison (on a
    shared CPU a cell moves by 5-10 points between runs of the same decisions). Each round
    stays paired with its own target-only run, so runs on different days or machines pool as
    speed-ups. The reports must be of the same pair (by file name), max_tokens and n-gram mode."""
    if not reports:
        raise ValueError("no reports to pool")

    def setup(r: BenchReport) -> tuple[str, str | None, int, str | None]:
        return Path(r.target).name, Path(r.draft).name if r.draft else None, r.max_tokens, r.ngram

    for r in reports[1:]:
        if setup(r) != setup(reports[0]):
            raise ValueError(
                "cannot pool runs of different pairs, lengths or n-gram modes (None: not "
                f"recorded): {setup(reports[0])} and {setup(r)}"
            )
    by_key = [{(x.temperature, x.prompt, x.n_draft): x for x in r.runs} for r in reports]
    shared = [key for key in by_key[0] if all(key in runs for runs in by_key[1:])]
    if not shared:
        raise ValueError("the reports have no configuration in common")
    first = reports[0]
    pooled = BenchReport(
        first.target,
        first.draft,
        first.machine,
        first.max_tokens,
        sum(r.repeats for r in reports),
        seed=None,
        ngram=first.ngram,
    )
    pooled.runs = [_pooled_run([runs[key] for runs in by_key]) for key in shared]
    return pooled


def repeated_texts(reports: Sequence[BenchReport]) -> list[int]:
    """The seeds that more than one of these reports sampled with, where they sampled (T > 0):
    their rounds repeat the same texts, so pooling them averages the timing, not the texts."""
    seeds = [
        r.seed for r in reports if r.seed is not None and any(x.temperature > 0 for x in r.runs)
    ]
    return sorted({s for s in seeds if seeds.count(s) > 1})


def _pooled_run(parts: Sequence[RunResult]) -> RunResult:
    """The rounds' speed-ups concatenated; the other figures (each run's medians) averaged,
    weighted by rounds."""
    rounds = [s for p in parts for s in p.speedup_by_repeat]
    weights = [len(p.speedup_by_repeat) for p in parts]

    def mean(values: Sequence[float], w: Sequence[int]) -> float:
        return sum(v * n for v, n in zip(values, w)) / sum(w) if sum(w) else 0.0

    # Measured figures only: temperature names the configuration, and speed-up is recomputed.
    scalars: dict[str, Any] = {
        f.name: mean([getattr(p, f.name) for p in parts], weights)
        for f in fields(RunResult)
        if isinstance(getattr(parts[0], f.name), float) and f.name not in ("temperature", "speedup")
    }
    depth = max(len(p.acceptance_by_position) for p in parts)
    by_position = [
        mean(
            [p.acceptance_by_position[i] for p in parts if i < len(p.acceptance_by_position)],
            [n for p, n in zip(parts, weights) if i < len(p.acceptance_by_position)],
        )
        for i in range(depth)
    ]
    return replace(
        parts[0],
        **scalars,
        acceptance_by_position=by_position,
        speedup_by_repeat=rounds,
        speedup=statistics.median(rounds) if rounds else 0.0,
    )


def load_prompts(path: Path) -> dict[str, str]:
    """A text file (one prompt) or JSONL ({"name":..., "prompt":...} or {"prompt":...})."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not valid UTF-8 text") from None
    if path.suffix == ".jsonl":
        out: dict[str, str] = {}
        for i, line in enumerate(text.splitlines()):
            if not line.strip():
                continue
            where = f"{path}: line {i + 1}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where} is not JSON ({e.msg})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                raise ValueError(f"{where} needs an object with a string 'prompt'")
            if not obj["prompt"].strip():
                raise ValueError(f"{where} has an empty prompt")
            name = str(obj.get("name", f"p{len(out)}"))
            if name in out:
                raise ValueError(f"{where} repeats the prompt name {name!r}")
            out[name] = obj["prompt"]
        if not out:
            raise ValueError(f"{path} has no prompts")
        return out
    if not text.strip():
        raise ValueError(f"{path} is empty")
    return {path.stem: text}


def plot(report: BenchReport, out: Path) -> None:
    plt = pyplot()
    rows = aggregate(report)
    temps = sorted({r["temperature"] for r in rows})
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for t in temps:
        rs = [
            r
            for r in rows
            if r["temperature"] == t and isinstance(r["n_draft"], int) and r["n_draft"] > 0
        ]
        ks = [r["n_draft"] for r in rs]
        line = axes[0].plot(ks, [r["speedup"] for r in rs], "o-", label=f"T={t:g}")[0]
        for r in rows:
            if r["temperature"] == t and r["n_draft"] == "auto":
                axes[0].axhline(
                    r["speedup"], ls="--", color=line.get_color(), label=f"T={t:g}, K=auto"
                )
        axes[1].plot(ks, [r["acceptance_rate"] for r in rs], "o-", label=f"T={t:g}")
        best = report.best_k(t)
        pos = [
            r.acceptance_by_position
            for r in report.runs
            if r.temperature == t and r.n_draft == best
        ]
        if pos:
            n = max(len(p) for p in pos)
            mean_pos = [statistics.mean(p[i] for p in pos if i < len(p)) for i in range(n)]
            axes[2].bar(
                [i + 1 + 0.2 * temps.index(t) for i in range(n)],
                mean_pos,
                width=0.2,
                label=f"T={t:g}, K={best}",
            )
    axes[2].xaxis.get_major_locator().set_params(integer=True)
    axes[0].axhline(1.0, color="gray", lw=0.8)
    axes[0].set(
        xlabel="K (draft tokens per step)", ylabel="speedup over target-only", title="Speedup"
    )
    axes[1].set(xlabel="K", ylabel="accepted / drafted", title="Acceptance rate", ylim=(0, 1))
    axes[2].set(
        xlabel="draft position",
        ylabel="P(accepted | proposed)",
        title="Acceptance by position (best K)",
        ylim=(0, 1),
    )
    for ax in axes:
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(f"{Path(report.target).name} / {Path(report.draft or '-').name}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)

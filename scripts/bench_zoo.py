"""The pair zoo's benchmark: `auto` against every fixed K (K = 0 included) on each pair of a zoo
(docs/zoo.md), at 1 and 4 concurrent streams, greedy and T = 0.8, side by side in one run.

    .venv/bin/python scripts/bench_zoo.py --seed 1 --split heldout [--count 3] [--rounds 2]
        [-n 48] [--streams 1,4] [--temps 0,0.8] [--llama-cpp] [--out docs/bench/zoo-seed1]

Per pair and cell (streams x temperature), a round runs every configuration once over all the
split's prompts, the configurations in a rotated order; with 4 streams the prompts go to 4
threads sharing one decoder with 4 slots (each thread its share of the prompts, one after
another). A cell's number per configuration is its tokens over its wall time, the median over
rounds; `auto / best` is the median over rounds of auto's rate over the best fixed
configuration's in that round. The Gemma 3 n-gram member drafts by n-gram lookup, on the
split's grounded prompts, with K in 0, 2, 4, 8, 16. With --llama-cpp, the 1-stream cells also
run llama.cpp's llama-speculative-simple per K (model pairs; its n-gram types for the n-gram
member), from scripts/build_llama_cpp_tools.sh. Its rate is its own, generation only (its
prompt excluded), so it is compared with specdec's generation-only rate (the requests' decode
time, the prompt's excluded: `gen_median` in OUT.json), not with the wall-time rates.
Writes OUT.json (every number) and OUT.md (the tables).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import specdec_native as sd
from specdec_native import bench, models
from specdec_native import vs_llama_cpp as lcpp

ROOT = Path(__file__).parent.parent
PROMPTS = ROOT / "docs" / "bench" / "zoo-prompts.jsonl"
MODEL_KS: list[int | str] = ["auto", 0, 1, 2, 3, 4, 5]
NGRAM_KS: list[int | str] = ["auto", 0, 2, 4, 8, 16]
# Variants of `auto` for an A/B (--ab): the rate check (csrc/rate_check.h) on steps of one
# sequence too (check; `auto` checks steps of several only), or on none (unchecked).
VARIANTS = {"check": "auto+check", "unchecked": "auto-unchecked"}
RATE_CHECK = {"auto": (False, True), "auto+check": (True, True), "auto-unchecked": (False, False)}
NGRAM_TYPES = ["ngram-simple", "ngram-map-k", "ngram-mod"]
SEED = 1234


def load_prompts(split: str, kinds: set[str] | None) -> dict[str, str]:
    return {name: prompt for name, (_, prompt) in load_prompt_kinds(split, kinds).items()}


def load_prompt_kinds(split: str, kinds: set[str] | None = None) -> dict[str, tuple[str, str]]:
    """The split's prompts (of these kinds), by name: (kind, prompt)."""
    out = {}
    for line in PROMPTS.read_text().splitlines():
        row = json.loads(line)
        if row["split"] == split and (kinds is None or row["kind"] in kinds):
            out[row["name"]] = (row["kind"], row["prompt"])
    return out


def run_config(
    dec: sd.SpeculativeDecoder,
    prompts: list[str],
    streams: int,
    k: int | str,
    temp: float,
    n: int,
    seed: int,
) -> tuple[int, float, dict[str, float]]:
    """(tokens, seconds, the requests' summed counters) of every prompt, `streams` at a time."""
    tokens = [0]
    counts: list[sd.Stats] = []
    lock = threading.Lock()

    one, several = RATE_CHECK.get(str(k), RATE_CHECK["auto"])
    dec._live().set_rate_check(one, under_load=several)
    n_draft = "auto" if str(k) in RATE_CHECK else k

    def worker(mine: list[tuple[int, str]]) -> None:
        for i, prompt in mine:
            out = dec.generate(prompt, n, n_draft=n_draft, temperature=temp, seed=seed + i)
            with lock:
                tokens[0] += len(out.tokens)
                counts.append(out.stats)

    jobs = list(enumerate(prompts))
    threads = [threading.Thread(target=worker, args=(jobs[s::streams],)) for s in range(streams)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.monotonic() - start
    return tokens[0], seconds, summed(counts)


def summed(stats: list[sd.Stats]) -> dict[str, float]:
    """What the drafting cost in reading and steps, summed over requests; and the tokens made
    after the prompt's decode over the time it took (as llama.cpp rates a generation)."""
    keys = ("n_prompt", "n_draft_read", "n_target_passes", "n_speculative_steps")
    out: dict[str, float] = {k: sum(getattr(s, k) for s in stats) for k in keys}
    out["n_decoded"] = sum(max(s.n_generated - s.first_from_prompt, 0) for s in stats)
    out["t_generation"] = sum(s.t_generation for s in stats)
    return out


def run_cell(
    dec: sd.SpeculativeDecoder,
    prompts: list[str],
    configs: list[int | str],
    streams: int,
    temp: float,
    args: argparse.Namespace,
) -> dict[str, Any]:
    rates: dict[str, list[float]] = {str(k): [] for k in configs}
    counts: dict[str, list[dict[str, float]]] = {str(k): [] for k in configs}
    for r in range(args.rounds):
        for k in bench.rotated(configs, r):
            tokens, seconds, c = run_config(dec, prompts, streams, k, temp, args.n, SEED + 100 * r)
            rates[str(k)].append(tokens / seconds)
            counts[str(k)].append(c)
            print(f"    round {r + 1} K={k}: {tokens / seconds:6.1f} tok/s", file=sys.stderr)
    fixed = [str(k) for k in configs if str(k) not in RATE_CHECK]
    variant = next((str(k) for k in configs if str(k) in VARIANTS.values()), "auto")
    best_per_round = [max(rates[k][r] for k in fixed) for r in range(args.rounds)]
    median = {k: statistics.median(v) for k, v in rates.items()}
    best = max(fixed, key=lambda k: median[k])
    cell = {
        "streams": streams,
        "temperature": temp,
        "rates": rates,
        "counts": counts,
        "median": median,
        "best_fixed": best,
        "auto_over_best": statistics.median(a / b for a, b in zip(rates["auto"], best_per_round)),
        "auto_over_k0": statistics.median(a / b for a, b in zip(rates["auto"], rates["0"])),
        "variant": variant,
        "variant_over_auto": statistics.median(
            a / b for a, b in zip(rates[variant], rates["auto"])
        ),
    }
    if streams == 1:  # a request's decode time is the run's only when requests go one by one
        cell["gen_median"] = {
            k: statistics.median(c["n_decoded"] / c["t_generation"] for c in cs)
            for k, cs in counts.items()
        }
    return cell


def llama_cpp_cell(
    tools: Path,
    member: models.ZooPair,
    files: tuple[Path, Path | None],
    prompts: list[str],
    temp: float,
    args: argparse.Namespace,
) -> dict[str, float]:
    """llama-speculative-simple's rate per configuration over the prompts (one round)."""
    target, draft = files
    specs = NGRAM_TYPES if member.ngram else lcpp.model_draft_specs(range(1, 6))
    out = {}
    for spec in specs:
        tokens = 0
        seconds = 0.0
        for i, prompt in enumerate(prompts):
            run = lcpp.run_llama_cpp(
                lcpp.llama_cpp_args(
                    tools,
                    target,
                    draft,
                    spec,
                    prompt=prompt,
                    max_tokens=args.n,
                    temperature=temp,
                    seed=SEED + i,
                    n_ctx=2048,
                    n_threads=args.threads,
                    n_gpu_layers=args.n_gpu_layers,
                )
            )
            # Its own rate over what it decoded (it overshoots -n by up to a draft).
            tokens += run.n_generated
            seconds += run.n_generated / run.tokens_per_second if run.tokens_per_second else 0.0
        out[spec] = tokens / seconds if seconds else 0.0
        print(f"    llama.cpp {spec}: {out[spec]:6.1f} tok/s", file=sys.stderr)
    return out


@contextlib.contextmanager
def ready_decoder(
    member: models.ZooPair,
    files: tuple[Path, Path | None],
    prompts: list[str],
    streams: int,
    threads: int | None,
    gpu_layers: int = 0,
) -> Iterator[sd.SpeculativeDecoder]:
    """The member's decoder for `streams` streams, every prompt read once and calibrated."""
    target, draft = files
    with sd.SpeculativeDecoder(
        target,
        "ngram" if member.ngram or draft is None else draft,
        n_ctx=2048 * streams,
        n_parallel=streams,
        n_threads=threads,
        n_gpu_layers=gpu_layers,
    ) as dec:
        # Where the prompts fit the slots, later configurations find them cached: read first,
        # none of them pays for the prompts cold.
        for prompt in prompts:
            dec.generate(prompt, 2, n_draft=0)
        dec.calibrate(prompts[0])
        yield dec


def bench_member(
    member: models.ZooPair, args: argparse.Namespace, tools: Path | None
) -> dict[str, Any]:
    target, draft = models.build_zoo_member(member, progress=lambda m: print(m, file=sys.stderr))
    kinds = {"grounded"} if member.ngram else None
    prompts = list(load_prompts(args.split, kinds).values())
    ks = NGRAM_KS if member.ngram else MODEL_KS
    if args.ks is not None:
        ks = ["auto", *args.ks]
    configs = ks + ([VARIANTS[args.ab]] if args.ab else [])
    result: dict[str, Any] = {"member": member.__dict__, "prompts": len(prompts), "cells": []}
    for streams in args.streams:
        with ready_decoder(
            member, (target, draft), prompts, streams, args.threads, args.n_gpu_layers
        ) as dec:
            for temp in args.temps:
                print(f"{member.name}: {streams} stream(s), T={temp:g}", file=sys.stderr)
                cell = run_cell(dec, prompts, configs, streams, temp, args)
                if tools is not None and streams == 1:
                    files = (target, draft)
                    cell["llama_cpp"] = llama_cpp_cell(tools, member, files, prompts, temp, args)
                result["cells"].append(cell)
    return result


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| pair | streams | T | K = 0 | `auto` | best fixed | auto / best | auto / K = 0 "
        "| variant / auto | llama.cpp best; `auto` over it (both generation only) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for res in results:
        for c in res["cells"]:
            best = c["best_fixed"]
            lc = c.get("llama_cpp")
            lc_text = "—"
            if lc:
                name = max(lc, key=lambda k: lc[k])
                auto = c["gen_median"]["auto"]  # generation only, as llama.cpp's
                lc_text = f"{lc[name]:.1f} ({name}); `auto` {auto:.1f}: {auto / lc[name]:.2f}x"
            lines.append(
                f"| {res['member']['name']} | {c['streams']} | {c['temperature']:g} "
                f"| {c['median']['0']:.1f} | {c['median']['auto']:.1f} "
                f"| K={best} {c['median'][best]:.1f} | {c['auto_over_best']:.2f} "
                f"| {c['auto_over_k0']:.2f} | {c['variant']} {c['variant_over_auto']:.2f} "
                f"| {lc_text} |"
            )
    ratios = [c["auto_over_best"] for res in results for c in res["cells"]]
    if ratios:
        lines.append("")
        lines.append(
            f"auto / best fixed: mean {statistics.mean(ratios):.3f}, lowest {min(ratios):.2f} "
            f"over {len(ratios)} cells"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--seed", type=int, required=True, help="the zoo's seed (docs/zoo.md)")
    ap.add_argument("--count", type=int, default=3, help="deep-target pairs in the zoo")
    ap.add_argument("--split", choices=["dev", "heldout"], required=True)
    ap.add_argument("--only", help="only the members whose name contains this")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("-n", type=int, default=48, help="tokens per request")
    ap.add_argument("--streams", default="1,4")
    ap.add_argument("--temps", default="0,0.8")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "-ngl", "--n-gpu-layers", type=int, default=0, help="layers of both models on the GPU"
    )
    ap.add_argument("--llama-cpp", action="store_true", help="llama.cpp beside the 1-stream cells")
    ap.add_argument(
        "--ab",
        choices=sorted(VARIANTS),
        help="also `auto` with the rate check on all steps (check) or on none (unchecked)",
    )
    ap.add_argument("--ks", help="the fixed K's to run (default: all), e.g. 0 or 0,2")
    ap.add_argument("--out", type=Path, required=True, help="OUT.json and OUT.md are written")
    args = ap.parse_args()
    args.streams = [int(s) for s in args.streams.split(",")]
    args.temps = [float(t) for t in args.temps.split(",")]
    args.ks = None if args.ks is None else [int(k) for k in args.ks.split(",")]
    tools = None
    if args.llama_cpp:
        built = subprocess.run(
            ["bash", str(ROOT / "scripts" / "build_llama_cpp_tools.sh")],
            capture_output=True,
            text=True,
            check=True,
        )
        tools = Path(built.stdout.strip().splitlines()[-1])
        args.threads = args.threads or bench.machine_info().get("cores") or 2
    results = []
    for member in models.zoo_members(args.seed, args.count):
        if args.only and args.only not in member.name:
            continue
        results.append(bench_member(member, args, tools))
        report = {
            "seed": args.seed,
            "split": args.split,
            "n": args.n,
            "rounds": args.rounds,
            "machine": bench.machine_info(),
            "results": results,
        }
        args.out.with_suffix(".json").write_text(json.dumps(report, indent=1))
        args.out.with_suffix(".md").write_text(table(results) + "\n")
    print(table(results))


if __name__ == "__main__":
    main()

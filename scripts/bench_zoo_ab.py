#!/usr/bin/env python3
"""Two builds of specdec side by side on zoo pairs: `auto` against K = 0 in each.

    scripts/bench_zoo_ab.py OLD NEW --seed 8 --split heldout --only x4-eps,x8-eps \\
        --temps 0 0.8 --streams 4 --rounds 4 --out OUT.json

OLD and NEW are folders that each hold a built `specdec_native` package (the Python files
and its `_core` module), e.g. copies of the repository's package with a build's module beside
them. Each round runs every build in a fresh process, in rotated order; inside a process every
zoo member's prompts are read once, then `auto` and K = 0 run in rotated order per temperature
(bench_zoo.run_config: 48 tokens per prompt, `streams` at a time). Prints per cell the median
over rounds of `auto` / K = 0 for each build, and of the new build's `auto` over the old's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

SCRIPTS = Path(__file__).resolve().parent


def one_round(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """This process's build (first on sys.path): every selected member's cells."""
    # The repository's editable install would win over the build asked for.
    sys.meta_path = [f for f in sys.meta_path if "editable" not in repr(f)]
    sys.path[:0] = [str(args.round_of), str(SCRIPTS)]
    from bench_zoo import SEED, load_prompts, ready_decoder, run_config

    from specdec_native import models

    out: dict[str, dict[str, float]] = {}
    for member in models.zoo_members(args.seed, 3):
        if args.only and not any(o in member.name for o in args.only.split(",")):
            continue
        files = models.build_zoo_member(member)
        prompts = list(load_prompts(args.split, {"grounded"} if member.ngram else None).values())
        with ready_decoder(member, files, prompts, args.streams, None) as dec:
            for temp in args.temps:
                rates = {}
                order: list[int | str] = ["auto", 0] if args.round % 2 == 0 else [0, "auto"]
                for k in order:
                    seed = SEED + 100 * args.round
                    tokens, seconds, _ = run_config(dec, prompts, args.streams, k, temp, 48, seed)
                    rates[str(k)] = tokens / seconds
                out[f"{member.name} streams={args.streams} T={temp:g}"] = rates
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("old", type=Path, nargs="?")
    ap.add_argument("new", type=Path, nargs="?")
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--split", choices=["dev", "heldout"], default="heldout")
    ap.add_argument("--only", default="", help="comma-separated parts of member names")
    ap.add_argument("--temps", type=float, nargs="+", default=[0.0])
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--round-of", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.round_of is not None:
        print(json.dumps(one_round(args)))
        return
    if args.old is None or args.new is None:
        ap.error("give the OLD and NEW package folders")
    builds = {"old": args.old, "new": args.new}
    results: dict[str, list[dict[str, dict[str, float]]]] = {"old": [], "new": []}
    for r in range(args.rounds):
        for name in ["old", "new"] if r % 2 == 0 else ["new", "old"]:
            cmd = [sys.executable, __file__, "--seed", str(args.seed), "--split", args.split]
            cmd += ["--only", args.only, "--streams", str(args.streams), "--round", str(r)]
            cmd += ["--temps", *map(str, args.temps), "--round-of", str(builds[name])]
            run = subprocess.run(cmd, capture_output=True, text=True)
            if run.returncode:
                sys.exit(run.stderr[-3000:])
            results[name].append(json.loads(run.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1} {name}: {results[name][-1]}", file=sys.stderr, flush=True)
    summary = summarise(results)
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.write_text(json.dumps({"command": " ".join(sys.argv), **results}, indent=1))


def summarise(results: dict[str, list[dict[str, dict[str, float]]]]) -> dict[str, Any]:
    """Per cell: the medians over rounds of auto / K = 0 per build and of new auto / old auto."""
    cells = {}
    for cell in results["old"][0]:
        old = [r[cell]["auto"] / r[cell]["0"] for r in results["old"]]
        new = [r[cell]["auto"] / r[cell]["0"] for r in results["new"]]
        gain = [n[cell]["auto"] / o[cell]["auto"] for o, n in zip(results["old"], results["new"])]
        cells[cell] = {
            "old_auto_over_k0": statistics.median(old),
            "new_auto_over_k0": statistics.median(new),
            "new_auto_over_old_auto": statistics.median(gain),
        }
    return cells


if __name__ == "__main__":
    main()

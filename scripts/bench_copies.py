"""N-gram copies beside a draft model under `auto`: the model alone against the model with copies.

    .venv/bin/python scripts/bench_copies.py --seed 21 [--split heldout] [--only x4-eps]
        [--rounds 2] [-n 64] [--temps 0 0.8] [--out OUT.json]
    .venv/bin/python scripts/bench_copies.py --pair TARGET DRAFT [...]

One process, two decoders on each pair (zoo members of --seed, or --pair): `ngram=False` (the
draft model alone) and the default (requests under `auto` also weigh copies of their own text's
n-gram matches). Every prompt of the split runs on both, the order alternating per prompt and
round, so a slow spell of the machine falls on both, with a pause before each request (the
other decoder's idle threads would slow its first steps). Prints per pair and temperature each
round's rates (generated tokens over generation time, the prompt excluded) and their ratio, then
per prompt kind; OUT.json holds every request's numbers.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from bench_args import let_other_decoders_settle
from bench_zoo import load_prompt_kinds

import specdec_native as sd
from specdec_native import models

CONFIGS = {"model": False, "model+copies": None}  # the decoders' ngram= argument


def pairs(args: argparse.Namespace) -> list[tuple[str, Path, Path]]:
    if args.pair:
        target, draft = map(Path, args.pair)
        return [(f"{target.name} + {draft.name}", target, draft)]
    out = []
    for member in models.zoo_members(args.seed, 3):
        if member.ngram or (args.only and not any(o in member.name for o in args.only.split(","))):
            continue
        built, maybe = models.build_zoo_member(member)
        assert maybe is not None
        out.append((member.name, built, maybe))
    return out


def run_pair(
    name: str, target: Path, draft: Path, prompts: dict[str, tuple[str, str]], args: Any
) -> list[dict[str, Any]]:
    decoders = {
        c: sd.SpeculativeDecoder(target, draft, n_ctx=2048, ngram=n) for c, n in CONFIGS.items()
    }
    rows = []
    try:
        for dec in decoders.values():  # every prompt cached, the costs measured
            for _, text in prompts.values():
                dec.generate(text, 2, n_draft=0)
            dec.calibrate(next(iter(prompts.values()))[1])
        for r in range(args.rounds):
            for temp in args.temps:
                for i, (prompt, (kind, text)) in enumerate(prompts.items()):
                    order = list(decoders) if (i + r) % 2 == 0 else list(decoders)[::-1]
                    for config in order:
                        let_other_decoders_settle()
                        out = decoders[config].generate(
                            text, args.n, n_draft="auto", temperature=temp, seed=1000 * r + i
                        )
                        s = out.stats
                        rows.append(
                            {"pair": name, "round": r, "temp": temp, "prompt": prompt,
                             "kind": kind, "config": config, "tokens": s.n_generated,
                             "seconds": s.t_generation, "passes": s.n_target_passes,
                             "drafted_by_ngram": s.drafted_by_ngram,
                             "accepted_by_ngram": s.accepted_by_ngram}
                        )  # fmt: skip
                print_round(rows, name, r, temp)
    finally:
        for dec in decoders.values():
            dec.close()
    return rows


def rate(rows: list[dict[str, Any]], config: str) -> float:
    mine = [x for x in rows if x["config"] == config]
    tokens: float = sum(x["tokens"] for x in mine)
    seconds: float = sum(x["seconds"] for x in mine)
    return tokens / seconds


def print_round(rows: list[dict[str, Any]], name: str, r: int, temp: float) -> None:
    cell = [x for x in rows if x["pair"] == name and x["round"] == r and x["temp"] == temp]
    alone, both = rate(cell, "model"), rate(cell, "model+copies")
    print(f"{name} round {r + 1} T={temp:g}: model {alone:.1f}, model+copies {both:.1f} tok/s, "
          f"{both / alone:.3f}", flush=True)  # fmt: skip


def print_kinds(rows: list[dict[str, Any]]) -> None:
    cells: dict[tuple[str, float, str], list[dict[str, Any]]] = defaultdict(list)
    for x in rows:
        cells[(x["pair"], x["temp"], x["kind"])].append(x)
    for (name, temp, kind), cell in sorted(cells.items()):
        alone, both = rate(cell, "model"), rate(cell, "model+copies")
        print(f"{name} T={temp:g} {kind}: {alone:.1f} -> {both:.1f} tok/s, {both / alone:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, help="zoo seed (docs/zoo.md)")
    ap.add_argument("--pair", nargs=2, metavar=("TARGET", "DRAFT"))
    ap.add_argument("--only", default="", help="comma-separated parts of member names")
    ap.add_argument("--split", choices=["dev", "heldout"], default="heldout")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("-n", type=int, default=64, help="tokens per request")
    ap.add_argument("--temps", type=float, nargs="+", default=[0.0, 0.8])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if (args.seed is None) == (args.pair is None):
        ap.error("give --seed or --pair")
    prompts = load_prompt_kinds(args.split)
    rows = []
    for name, target, draft in pairs(args):
        rows += run_pair(name, target, draft, prompts, args)
    print_kinds(rows)
    if args.out:
        args.out.write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=0))


if __name__ == "__main__":
    main()

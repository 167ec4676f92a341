"""What the bench scripts share: the command line (a pair, the embedded default pair when none
is given; rounds; tokens per request; each script adds its own options), and a pause between
decoders of one process."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from specdec_native import models


def pair_parser(
    doc: str | None, *, rounds: int, n: int, n_help: str = "tokens per request"
) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc.splitlines()[0] if doc else None)
    ap.add_argument("target", nargs="?", type=Path, help="target GGUF (default: the default pair)")
    ap.add_argument("draft", nargs="?", type=Path, help="draft GGUF")
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("-n", type=int, default=n, help=n_help)
    return ap


def parse_pair(ap: argparse.ArgumentParser) -> argparse.Namespace:
    """The arguments, with the default pair's files where no target was given."""
    args = ap.parse_args()
    if args.target is None:
        pair = models.default_pair()
        args.target, args.draft = pair.target, pair.draft
    return args


def let_other_decoders_settle() -> None:
    """Before a decoder's request when other decoders of this process ran just before: on a CPU
    their idle OpenMP workers spin for a moment and would slow its first steps (README)."""
    time.sleep(0.2)

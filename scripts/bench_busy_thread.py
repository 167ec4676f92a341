"""Generation speed with and without a busy Python thread in the same process.

A server's event loop is such a thread. The decode loop must not take the GIL, or each decode
waits for the busy thread to let go of it (up to Python's 5 ms switch interval).

    .venv/bin/python scripts/bench_busy_thread.py [--rounds 5] [-n 64] [TARGET DRAFT]

Without TARGET/DRAFT it runs the default pair (also with the text going to an on_text callback,
as stream() does) and the tiny pair, K = 3, one llama thread. Each
round runs both conditions back to back (alternating which goes first), so a slow spell of the
machine lands on both.
"""

from __future__ import annotations

import statistics
import tempfile
import threading
from pathlib import Path

from bench_args import pair_parser

import specdec_native as sd
from specdec_native import models


def tokens_per_second(
    dec: sd.SpeculativeDecoder, prompt: str, n: int, busy: bool, stream: bool
) -> float:
    stop = threading.Event()

    def spin() -> None:
        x = 0
        while not stop.is_set():
            x += 1

    thread = threading.Thread(target=spin, daemon=True)
    if busy:
        thread.start()
    try:
        if stream:  # the text goes through a callback, which takes the GIL once per piece
            pieces: list[str] = []
            r = dec.generate(prompt, n, n_draft=3, on_text=pieces.append)
        else:
            r = dec.generate(prompt, n, n_draft=3)
    finally:
        stop.set()
        if busy:
            thread.join()
    return r.stats.tokens_per_second


def bench(name: str, target: Path, draft: Path, rounds: int, n: int, stream: bool = False) -> None:
    prompt = "Once upon a time, in a small village by the sea,"
    with sd.SpeculativeDecoder(target, draft, n_draft=3, n_ctx=2048, n_threads=1) as dec:
        dec.generate(prompt, 8)  # warm-up
        alone: list[float] = []
        busy: list[float] = []
        for r in range(rounds):
            order = [False, True] if r % 2 == 0 else [True, False]
            for is_busy in order:
                speed = tokens_per_second(dec, prompt, n, is_busy, stream)
                (busy if is_busy else alone).append(speed)
    a, b = statistics.median(alone), statistics.median(busy)
    ratios = [y / x for x, y in zip(alone, busy)]
    print(f"| {name} | {a:.1f} | {b:.1f} | {b / a:.2f} | {min(ratios):.2f}-{max(ratios):.2f} |")


def main() -> None:
    args = pair_parser(__doc__, rounds=5, n=64).parse_args()
    print("| pair | tok/s alone | tok/s beside a busy thread | ratio (medians) | ratio per round |")
    print("|---|---|---|---|---|")
    if args.target:
        bench(args.target.name, args.target, args.draft, args.rounds, args.n)
        return
    pair = models.default_pair()
    bench("default (deep) pair", pair.target, pair.draft, args.rounds, args.n)
    bench("default pair, text to a callback", pair.target, pair.draft, args.rounds, args.n, True)
    with tempfile.TemporaryDirectory() as tmp:
        tiny = models.build_tiny_pair(Path(tmp), draft_noise=0.5)
        bench("tiny pair", tiny.target, tiny.draft, args.rounds, 8 * args.n)


if __name__ == "__main__":
    main()

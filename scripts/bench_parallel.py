"""Concurrent requests on one decoder: batched slots against the same engine one request at a time,
on this machine, in one run.

    .venv/bin/python scripts/bench_parallel.py [--rounds 3] [-n 64] [-c 1,2,4,8] [TARGET DRAFT]

Decoders (loaded once, weights shared): "batched" has a slot per stream (n_parallel = the largest
concurrency), "one at a time" has one slot (the rest wait), "batched, target only" has the slots
but never drafts (n_draft = 0: whether speculation still pays under load). At each concurrency c,
2 x c greedy requests of `-n` tokens run c at a time, each on its own thread; a round runs every
decoder at every c, the decoders in a rotated order. Reported: aggregate generated tokens per
second (all tokens over the wall time), and the median and slowest request latency.

Then the worst gap between two pieces of text of a running stream, alone and while a request
with a long prompt joins (its prompt is read in chunks between the stream's steps); and the
resident memory of one decoder with 4 slots against 4 decoders (each in a fresh process).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench_args import let_other_decoders_settle, pair_parser, parse_pair

import specdec_native as sd

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "def merge_sort(xs):\n    ",
    "List the planets of the solar system with one fact about each:\n1.",
    "Explain how a bicycle stays upright, in plain words.",
    "The French Revolution began in 1789 when",
    "Here is a recipe for a simple tomato soup. Ingredients:",
    "Q: What is the capital of Australia?\nA:",
    "import numpy as np\n\ndef normalize(v):\n",
]


def run_batch(
    dec: sd.SpeculativeDecoder, concurrency: int, n: int, n_draft: int | str
) -> tuple[float, list[float]]:
    """(aggregate tok/s, latencies) of 2 x `concurrency` requests, `concurrency` at a time."""
    jobs = [PROMPTS[i % len(PROMPTS)] for i in range(2 * concurrency)]
    latencies: list[float] = []
    tokens = [0]
    lock = threading.Lock()

    def worker(mine: list[str]) -> None:
        for prompt in mine:
            start = time.monotonic()
            out = dec.generate(prompt, n, n_draft=n_draft)
            with lock:
                latencies.append(time.monotonic() - start)
                tokens[0] += len(out.tokens)

    threads = [
        threading.Thread(target=worker, args=(jobs[i::concurrency],)) for i in range(concurrency)
    ]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return tokens[0] / (time.monotonic() - start), latencies


def worst_gap(dec: sd.SpeculativeDecoder, long_prompt: str | None) -> tuple[float, float]:
    """The longest wait between two text pieces of a 96-token stream, with a long prompt sent
    to the same decoder once the stream has produced 8 pieces; and that request's time to its
    first token (0 without one)."""
    times: list[float] = []
    ttft = [0.0]
    joined = threading.Event()

    def on_text(_: str) -> None:
        times.append(time.monotonic())
        if len(times) == 8:
            joined.set()

    def join_later() -> None:
        joined.wait()
        if long_prompt is not None:
            ttft[0] = dec.generate(long_prompt, 4, n_draft=0).stats.t_first_token

    other = threading.Thread(target=join_later)
    other.start()
    dec.generate(PROMPTS[0], 96, n_draft=3, on_text=on_text)
    joined.set()
    other.join()
    return max(b - a for a, b in zip(times[8:], times[9:])), ttft[0]


RSS_CHILD = """
import sys, specdec_native as sd
n, slots = int(sys.argv[3]), int(sys.argv[4])
decs = [sd.SpeculativeDecoder(sys.argv[1], sys.argv[2], n_draft=3, n_parallel=slots)
        for _ in range(n)]
for d in decs:
    d.generate("Hello", 4)
print([l for l in open("/proc/self/status") if l.startswith("VmRSS")][0].split()[1])
"""


def rss_mib(target: Path, draft: Path, decoders: int, slots: int) -> float:
    out = subprocess.run(
        [sys.executable, "-c", RSS_CHILD, str(target), str(draft), str(decoders), str(slots)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return int(out.split()[-1]) / 1024


def main() -> None:
    ap = pair_parser(__doc__, rounds=3, n=64)
    ap.add_argument("-c", "--concurrency", default="1,2,4,8")
    args = parse_pair(ap)
    levels = [int(c) for c in args.concurrency.split(",")]
    slots = max(levels)
    batched = sd.SpeculativeDecoder(args.target, args.draft, n_parallel=slots)
    single = sd.SpeculativeDecoder(args.target, args.draft, n_parallel=1)
    configs: dict[str, tuple[sd.SpeculativeDecoder, int | str]] = {
        f"batched (n_parallel={slots}), auto": (batched, "auto"),
        "one at a time (n_parallel=1), auto": (single, "auto"),
        f"batched (n_parallel={slots}), target only": (batched, 0),
    }
    for dec, k in configs.values():
        dec.generate("Hello", 8, n_draft=k)  # warm-up and calibration
    results: dict[tuple[str, int], list[tuple[float, list[float]]]] = {}
    for r in range(args.rounds):
        names = list(configs)
        names = names[r % len(names) :] + names[: r % len(names)]
        for c in levels:
            for name in names:
                dec, k = configs[name]
                let_other_decoders_settle()
                results.setdefault((name, c), []).append(run_batch(dec, c, args.n, k))
    print(f"{args.target.name} + {args.draft.name}, {args.n} tokens per request, greedy")
    print("| decoder | streams | aggregate tok/s | latency p50 / max (s) | rounds (tok/s) |")
    print("|---|---|---|---|---|")
    for (name, c), rows in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        speeds = [s for s, _ in rows]
        lat = [x for _, xs in rows for x in xs]
        print(
            f"| {name} | {c} | {statistics.median(speeds):.1f} "
            f"| {statistics.median(lat):.2f} / {max(lat):.2f} "
            f"| {', '.join(f'{s:.1f}' for s in speeds)} |"
        )

    # A different prompt each round, so that none is in a slot's cache already.
    numbers = ", ".join(str(i) for i in range(700))
    longs = [f"Round {r}. Numbers, one after another: {numbers}" for r in range(args.rounds + 1)]
    n_long = len(batched.tokenize(longs[0]))
    gaps = [(worst_gap(batched, None), worst_gap(batched, longs[r])) for r in range(args.rounds)]
    alone = batched.generate(longs[-1], 4, n_draft=0).stats.t_first_token
    print(f"\nworst inter-token gap of a stream (K=3), {args.rounds} rounds:")
    print(f"  alone: {', '.join(f'{a[0]:.2f}' for a, _ in gaps)} s")
    print(f"  while a {n_long}-token prompt joins: {', '.join(f'{b[0]:.2f}' for _, b in gaps)} s")
    print(f"  that prompt's time to first token: {', '.join(f'{b[1]:.1f}' for _, b in gaps)} s")
    print(f"  (alone, with nothing else running: {alone:.1f} s)")
    batched.close()
    single.close()

    one = rss_mib(args.target, args.draft, 1, 4)
    four = rss_mib(args.target, args.draft, 4, 1)
    print(
        f"\nresident memory: 1 decoder x 4 slots {one:.0f} MiB, 4 decoders x 1 slot {four:.0f} MiB"
    )


if __name__ == "__main__":
    main()

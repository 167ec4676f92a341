"""How fast `auto` recovers from a calibration taken on a busy machine.

Each round calibrates twice, in a rotated order: once on the idle machine ("clean") and once while
two processes spin on both cores ("busy"; stopped before generating), and after each runs the same
few `auto` requests. A calibration that disagrees with what the first steps see is measured again
after that request (stats.recalibrated), so the request after it should run at the clean speed.

    .venv/bin/python scripts/bench_recovery.py [--rounds 3] [-n 96] [--requests 3] [TARGET DRAFT]

Without TARGET/DRAFT it runs the default pair, greedy, on a held-out prompt.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics

from bench_args import pair_parser, parse_pair

import specdec_native as sd

PROMPT = (
    "Answer the question using only the passage.\n\nPassage: The pump is rated for continuous "
    "operation at 40 litres per minute. It must be installed at least 30 centimetres above the "
    "floor. Its filter should be cleaned every three months.\n\nQuestion: How often should the "
    "filter be cleaned?\n\nAnswer:"
)


def spin() -> None:
    while True:
        pass


def calibrate(dec: sd.SpeculativeDecoder, busy: bool) -> None:
    spinners = [mp.Process(target=spin, daemon=True) for _ in range(os.cpu_count() or 2)]
    if busy:
        for p in spinners:
            p.start()
    try:
        dec.calibrate(PROMPT)
    finally:
        for p in spinners:
            if p.is_alive():
                p.terminate()
                p.join()


def main() -> None:
    ap = pair_parser(__doc__, rounds=3, n=96)
    ap.add_argument("--requests", type=int, default=3)
    args = parse_pair(ap)
    speeds: dict[str, list[list[float]]] = {"clean": [], "busy": []}
    healed: list[int] = []
    with sd.SpeculativeDecoder(
        args.target, args.draft, n_draft="auto", n_ctx=2048, calibration_cache=False
    ) as dec:
        dec.generate(PROMPT, 8, n_draft=0)  # warm-up
        for rnd in range(args.rounds):
            order = ["clean", "busy"] if rnd % 2 == 0 else ["busy", "clean"]
            for mode in order:
                calibrate(dec, busy=mode == "busy")
                costs = dec.policy_state()["verify_costs"]
                row = []
                for i in range(args.requests):
                    r = dec.generate(PROMPT, args.n)
                    row.append(r.stats.tokens_per_second)
                    if mode == "busy" and r.stats.recalibrated:
                        healed.append(i + 1)
                speeds[mode].append(row)
                print(
                    f"round {rnd + 1} {mode:>5}: t_verify(1) {1000 * costs[0]:.1f} ms, "
                    + ", ".join(f"{s:.1f}" for s in row)
                    + " tok/s",
                    flush=True,
                )
    print("\nrequest  clean tok/s  busy-calibrated tok/s  ratio (per round)")
    for i in range(args.requests):
        clean = [row[i] for row in speeds["clean"]]
        busy = [row[i] for row in speeds["busy"]]
        ratios = [b / c for b, c in zip(busy, clean)]
        print(
            f"{i + 1:>7}  {statistics.mean(clean):>11.1f}  {statistics.mean(busy):>21.1f}  "
            f"{statistics.mean(ratios):.2f} ({', '.join(f'{x:.2f}' for x in ratios)})"
        )
    print(f"recalibrated after request(s): {healed or 'none'}")


if __name__ == "__main__":
    main()

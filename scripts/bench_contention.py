"""One request's time on a machine the engine does not own: idle, and with busy processes on
its cores, for several thread settings.

    .venv/bin/python scripts/bench_contention.py [--rounds 2] [-n 16] [--busy 2] [TARGET DRAFT]

Each setting runs in a fresh process (OpenMP reads its environment once, at load): the models
load, one untimed generation warms up, then one greedy generation of -n tokens at K = 3 is
timed (capped at --cap seconds). Each round runs every setting idle and busy, in a rotated
order. "busy" is --busy processes spinning in pure Python beside it, as other tenants of a node
or the other programs of a desktop are.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

from bench_args import pair_parser, parse_pair

CORES = os.cpu_count() or 1
# name -> (threads, extra environment); threads None: the engine's default, governed by load
SETTINGS: dict[str, tuple[int | None, dict[str, str]]] = {
    "default (threads follow the load)": (None, {}),
    f"fixed at all cores (-t {CORES})": (CORES, {}),
    "fixed at 1 thread (-t 1)": (1, {}),
    f"-t {CORES}, OMP_WAIT_POLICY=passive": (CORES, {"OMP_WAIT_POLICY": "passive"}),
}

CHILD = """
import json, sys, time
import specdec_native as sd
target, draft, n, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
dec = sd.SpeculativeDecoder(target, draft, n_draft=3, n_threads=None if threads == "None" else int(threads))
prompt = "Write a short story about a robot who learns to paint."
dec.generate(prompt, 4, temperature=0.0)
time.sleep(1.5)  # the load of the last second, as a server that has been running sees it
t = time.perf_counter()
r = dec.generate(prompt, n, temperature=0.0)
print(json.dumps({"seconds": time.perf_counter() - t, "tokens": len(r.tokens)}))
"""


def one(args: object, threads: int | None, env: dict[str, str], cap: float) -> float:
    child_env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    child_env.update({k: v for k, v in env.items() if v})
    cmd = [sys.executable, "-c", CHILD, str(args.target), str(args.draft), str(args.n)]  # type: ignore[attr-defined]
    try:
        out = subprocess.run(
            [*cmd, str(threads)], env=child_env, capture_output=True, text=True, timeout=cap + 60
        )
    except subprocess.TimeoutExpired:
        return float("inf")
    if out.returncode != 0:
        raise SystemExit(out.stderr[-2000:])
    seconds = float(json.loads(out.stdout.strip().splitlines()[-1])["seconds"])
    return seconds if seconds <= cap else float("inf")


def main() -> None:
    ap = pair_parser(__doc__, rounds=2, n=16)
    ap.add_argument("--busy", type=int, default=2, help="busy processes beside it")
    ap.add_argument("--cap", type=float, default=120.0, help="seconds a timed generation may take")
    args = parse_pair(ap)
    names = list(SETTINGS)
    times: dict[tuple[str, bool], list[float]] = {(n, b): [] for n in names for b in (False, True)}
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for busy in (False, True) if r % 2 == 0 else (True, False):
            hogs = [
                subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(args.busy if busy else 0)
            ]
            try:
                time.sleep(0.5 if busy else 0)
                for name in order:
                    threads, env = SETTINGS[name]
                    seconds = one(args, threads, env, args.cap)
                    times[(name, busy)].append(seconds)
                    state = f"{args.busy} busy" if busy else "idle"
                    print(f"round {r + 1} {state:7} {name}: {seconds:.2f} s", flush=True)
            finally:
                for h in hogs:
                    h.kill()
                    h.wait()
    print(f"\n{args.n} tokens, K = 3, median of {args.rounds} rounds (inf: over {args.cap} s)")
    print(f"| setting | idle (s) | {args.busy} busy processes (s) |")
    print("|---|---|---|")
    for name in names:
        idle = statistics.median(times[(name, False)])
        busy_t = statistics.median(times[(name, True)])
        print(f"| {name} | {idle:.2f} | {busy_t:.2f} |")


if __name__ == "__main__":
    main()

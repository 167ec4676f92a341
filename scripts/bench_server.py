"""End-to-end speed of OpenAI-compatible servers: specdec's against llama.cpp's llama-server,
on the same pair, on this machine, in one run.

    .venv/bin/python scripts/bench_server.py [--rounds 2] [-n 64] [-c 1,2,4,8] [--warm]
        [--baselines] [TARGET DRAFT]

Each server is started on a loopback port, warmed up (one short request; with --warm also one
untimed batch of other prompts at each concurrency, as a server that has been serving for a
while: specdec's `auto` has then learnt the pair's acceptance), and sent the same streamed
completion requests at each concurrency (greedy, `max_tokens` each; 2 x concurrency requests,
concurrency at a time). A round runs every server and concurrency once, the servers in a rotated order.
Servers: specdec with one slot per concurrent stream (batched), specdec with one slot (requests
one at a time, the same engine), and llama-server with as many slots, each slot with the same
context. Reported: aggregate generated tokens per second (all requests' tokens over the wall
time of the batch), the median time to first token, and the median and slowest request
latency. With --baselines, also both servers without drafting (specdec `-k 0`, llama-server
without `-md`), the batched ones only. llama-server comes from scripts/build_llama_cpp_tools.sh.
"""

from __future__ import annotations

import json
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from bench_args import pair_parser, parse_pair

ROOT = Path(__file__).parent.parent
PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "def merge_sort(xs):\n    ",
    "List the planets of the solar system with one fact about each:\n1.",
    "Explain how a bicycle stays upright, in plain words.",
]
# What a server has served before the timed batches (--warm): other prompts, so that the timed
# ones are not in its prompt cache.
WARM_PROMPTS = [
    "The French Revolution began in 1789 when",
    "Here is a recipe for a simple tomato soup. Ingredients:",
    "Q: What is the capital of Australia?\nA:",
    "import numpy as np\n\ndef normalize(v):\n",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def llama_cpp_tools() -> str:
    """The directory of llama.cpp's own tools, built once by build_llama_cpp_tools.sh."""
    return subprocess.run(
        ["bash", str(ROOT / "scripts/build_llama_cpp_tools.sh")],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


def wait_ready(url: str, proc: subprocess.Popen[bytes], seconds: float = 600) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise SystemExit("server did not become ready")


def counted_end(finish_reason: str | None, timings: dict[str, Any]) -> int:
    """1 where an answer's `predicted_n` includes its end-of-generation token, else 0:
    llama-server counts that token, specdec does not (neither decodes it). Subtracted, the same
    text counts the same on both. (An answer ended by a stop string would count one token
    short: the benchmarks send none.)"""
    ended = finish_reason in ("stop", "tool_calls")
    return int(ended and "draft_n_by_source" not in timings)


def one_request(url: str, prompt: str, n: int) -> tuple[float, int, float]:
    """(seconds to the first text, tokens generated, seconds in all) of one streamed
    completion."""
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True}
    start = time.monotonic()
    first = None
    tokens = 0
    finish = None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if first is None and any(c.get("text") for c in event.get("choices", [])):
                first = time.monotonic() - start
            for choice in event.get("choices", []):
                finish = choice.get("finish_reason") or finish
            if "timings" in event:
                timings = event["timings"]
                tokens = int(timings["predicted_n"]) - counted_end(finish, timings)
    total = time.monotonic() - start
    return (first if first is not None else total), tokens, total


def run_batch(
    url: str, concurrency: int, n: int, prompts: list[str] = PROMPTS
) -> tuple[float, list[float], list[float]]:
    """(aggregate tok/s, TTFTs, latencies) of 2 x `concurrency` requests, `concurrency` at a
    time."""
    jobs = [prompts[i % len(prompts)] for i in range(2 * concurrency)]
    start = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda p: one_request(url, p, n), jobs))
    wall = time.monotonic() - start
    return (
        sum(t for _, t, _ in results) / wall,
        [f for f, _, _ in results],
        [s for *_, s in results],
    )


def main() -> None:
    ap = pair_parser(__doc__, rounds=2, n=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-c", "--concurrency", default="1,2,4,8")
    ap.add_argument(
        "--warm",
        action="store_true",
        help="before the timed batches, serve one untimed batch of other prompts at each "
        "concurrency: a server that has been running, against one just started",
    )
    ap.add_argument(
        "--baselines", action="store_true", help="also both batched servers without drafting"
    )
    args = parse_pair(ap)
    levels = [int(c) for c in args.concurrency.split(",")]
    slots = str(max(levels))
    tools = llama_cpp_tools()
    t = str(args.threads)
    specdec = [
        sys.executable,
        "-m",
        "cli.main",
        "serve",
        str(args.target),
        "--draft",
        str(args.draft),
        "-c",
        "4096",
        "-t",
        t,
    ]
    servers = {
        f"specdec serve -np {slots} (auto)": lambda port: [
            *specdec, "-np", slots, "--port", str(port),
        ],
        "specdec serve -np 1 (auto)": lambda port: [*specdec, "-np", "1", "--port", str(port)],
        f"llama-server -np {slots} -md (its defaults)": lambda port: [
            f"{tools}/llama-server", "-m", str(args.target), "-md", str(args.draft),
            "-c", str(4096 * int(slots)), "-t", t, "-td", t, "--port", str(port),
            "--host", "127.0.0.1", "-np", slots,
        ],
    }  # fmt: skip
    if args.baselines:
        servers[f"specdec serve -np {slots} -k 0"] = lambda port: [
            *specdec, "-np", slots, "-k", "0", "--port", str(port),
        ]  # fmt: skip
        servers[f"llama-server -np {slots} (no draft)"] = lambda port: [
            f"{tools}/llama-server", "-m", str(args.target), "-c", str(4096 * int(slots)),
            "-t", t, "--port", str(port), "--host", "127.0.0.1", "-np", slots,
        ]  # fmt: skip
    results: dict[tuple[str, int], list[tuple[float, list[float], list[float]]]] = {}
    for r in range(args.rounds):
        order = list(servers) if r % 2 == 0 else list(reversed(servers))
        for name in order:
            port = free_port()
            proc = subprocess.Popen(
                servers[name](port), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            url = f"http://127.0.0.1:{port}"
            try:
                wait_ready(url, proc)
                one_request(url, "Hello", 8)  # warm-up
                for c in levels if args.warm else []:
                    run_batch(url, c, args.n, WARM_PROMPTS)
                for c in levels:
                    results.setdefault((name, c), []).append(run_batch(url, c, args.n))
            finally:
                proc.terminate()
                proc.wait(timeout=60)
    state = "after one untimed batch at each concurrency" if args.warm else "just started"
    print(f"{args.target.name} + {args.draft.name}, {args.n} tokens per request, greedy, {state}")
    print(
        "| server | concurrency | aggregate tok/s | median TTFT (s) | latency p50 / max (s) "
        "| rounds (tok/s) |"
    )
    print("|---|---|---|---|---|---|")
    for (name, c), rows in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        speeds = [s for s, _, _ in rows]
        ttfts = [f for _, fs, _ in rows for f in fs]
        latencies = [x for *_, xs in rows for x in xs]
        print(
            f"| {name} | {c} | {statistics.median(speeds):.1f} | {statistics.median(ttfts):.2f} "
            f"| {statistics.median(latencies):.2f} / {max(latencies):.2f} "
            f"| {', '.join(f'{s:.1f}' for s in speeds)} |"
        )


if __name__ == "__main__":
    main()

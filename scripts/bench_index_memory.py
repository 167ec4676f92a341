"""The shared n-gram index's memory through the server: RSS after many requests, index on at a
few budgets and off.

    .venv/bin/python scripts/bench_index_memory.py [--requests 2000] [--budgets 0,1,8]

A tiny synthetic model (fast: the requests, not the model, are what is measured) served with
`--draft ngram -np 1`; each request a different prompt of random words, 48 tokens generated at
temperature 1, so every output is new to the index. Reported per budget (MiB): the server's RSS
after the first 100 requests and after all of them, and the index's own estimate
(specdec:ngram_index_bytes, specdec:ngram_index_tokens).
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
from bench_server import free_port, wait_ready

from specdec_native import models

ROOT = Path(__file__).parent.parent
WORDS = "the a of sea ship sail wind harbour rope deck mast storm calm light north".split()


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def run(target: Path, budget: str, n: int) -> dict[str, float]:
    port = free_port()
    cmd = [sys.executable, "-m", "cli.main", "serve", str(target), "--draft", "ngram"]
    cmd += ["-np", "1", "-c", "256", "--ngram-index-mb", budget, "--port", str(port)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    rng = random.Random(0)
    out: dict[str, float] = {}
    try:
        wait_ready(url, proc)
        with httpx.Client(timeout=60) as client:
            for i in range(n):
                prompt = " ".join(rng.choice(WORDS) for _ in range(12))
                body = {"prompt": prompt, "max_tokens": 48, "temperature": 1.0, "seed": i}
                client.post(url + "/v1/completions", json=body).raise_for_status()
                if i + 1 == 100:
                    out["rss_100"] = rss_mib(proc.pid)
        out["rss_end"] = rss_mib(proc.pid)
        out["index_bytes"] = metric(url, "specdec:ngram_index_bytes")
        out["index_tokens"] = metric(url, "specdec:ngram_index_tokens")
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--budgets", default="0,1,8")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        target = models.build_tiny_pair(Path(d)).target
        print(f"{args.requests} requests, 48 tokens each, tiny model, --draft ngram")
        print("| --ngram-index-mb | RSS after 100 (MiB) | RSS at the end (MiB) | index bytes | "
              "index tokens |")  # fmt: skip
        print("|---|---|---|---|---|")
        for budget in args.budgets.split(","):
            r = run(target, budget, args.requests)
            print(
                f"| {budget} | {r['rss_100']:.1f} | {r['rss_end']:.1f} "
                f"| {r['index_bytes']:.0f} | {r['index_tokens']:.0f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()

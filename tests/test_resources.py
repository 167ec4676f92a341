"""Memory stays flat over many generations and many engines (measured in a fresh process)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from specdec_native import models

# Resident anonymous memory in KiB: what a leak grows. Total RSS also counts the pages of the
# memory-mapped model files, which the kernel maps in and out as it likes (a CI run once saw
# total RSS grow 13 MiB between engine 5 and 50; reruns showed 0.1-0.4 MiB).
RSS = "next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('RssAnon:'))"


def run_script(script: str, *args: str) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_rss_flat_over_1000_generations(tiny_pair: models.ModelPair) -> None:
    out = run_script(
        f"""
        import json, sys, specdec_native as sd
        dec = sd.SpeculativeDecoder(sys.argv[1], sys.argv[2], n_ctx=128, n_threads=1)
        rss = lambda: {RSS}
        for i in range(1000):
            dec.generate("the cat and the", 8, temperature=0.0 if i % 2 else 0.9, seed=i,
                         stop=["zz"], on_text=lambda t: None)
            if i == 49:
                after_50 = rss()
        print(json.dumps({{"after_50": after_50, "after_1000": rss()}}))
        """,
        str(tiny_pair.target),
        str(tiny_pair.draft),
    )
    growth = out["after_1000"] - out["after_50"]
    assert growth < 2048, f"RSS grew {growth} KiB between generation 50 and 1000"


def test_rss_flat_over_50_engines(smollm2_q40: Path) -> None:
    # Growth over each of three stretches of 15 engines: a leak grows every stretch, while a
    # one-off step (glibc keeping a new arena's memory, say) shows in one. A CI run once saw
    # 11.8 MiB between engine 5 and 50; six reruns of the same script, 0.3 MiB each.
    out = run_script(
        f"""
        import json, sys, specdec_native as sd
        rss = lambda: {RSS}
        marks = []
        for i in range(50):
            with sd.SpeculativeDecoder(sys.argv[1], sys.argv[1], n_ctx=256) as dec:
                dec.generate("Hello", 2)
            if i in (4, 19, 34, 49):
                marks.append(rss())
        print(json.dumps({{"marks": marks}}))
        """,
        str(smollm2_q40),
    )
    marks = out["marks"]
    growth = [b - a for a, b in zip(marks, marks[1:])]
    assert min(growth) < 2048, f"RSS grew by {growth} KiB over engines 5-20, 20-35 and 35-50"

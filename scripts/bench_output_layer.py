"""What a model's output layer costs in a decode: n rows with logits on every row against logits
on the last row only (llama.cpp then skips the output layer for the others), as a verify of
tokens the grammar forces pays it or not.

    .venv/bin/python scripts/bench_output_layer.py [--rows 8] [--decodes 40] MODEL [MODEL ...]

Each decode is of `rows` tokens after a 100-token context, the cache rolled back after it; the
two kinds alternate, in rotated order, and the first 5 of each are left out. Prints the median
milliseconds of each kind and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import llama_cpp


def decode_times(model_path: Path, rows: int, decodes: int, threads: int) -> dict[bool, float]:
    """Median seconds of a decode of `rows` tokens, by whether every row asks for logits."""
    model_params = llama_cpp.llama_model_default_params()
    model = llama_cpp.llama_model_load_from_file(str(model_path).encode(), model_params)
    if not model:
        raise SystemExit(f"cannot load {model_path}")
    params = llama_cpp.llama_context_default_params()
    params.n_ctx, params.n_batch = 512, 64
    params.n_threads = params.n_threads_batch = threads
    ctx = llama_cpp.llama_init_from_model(model, params)
    batch = llama_cpp.llama_batch_init(64, 0, 1)
    memory = llama_cpp.llama_get_memory(ctx)
    times: dict[bool, list[float]] = {True: [], False: []}
    try:
        for r in range(decodes):
            for every_row in (True, False) if r % 2 else (False, True):
                batch.n_tokens = rows
                for i in range(rows):
                    batch.token[i], batch.pos[i] = 100 + i, 100 + i
                    batch.n_seq_id[i], batch.seq_id[i][0] = 1, 0
                    batch.logits[i] = every_row or i == rows - 1
                start = time.perf_counter()
                if llama_cpp.llama_decode(ctx, batch) != 0:
                    raise SystemExit("llama_decode failed")
                times[every_row].append(time.perf_counter() - start)
                llama_cpp.llama_memory_seq_rm(memory, 0, 100, -1)
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)
    return {kind: statistics.median(t[5:]) for kind, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("models", nargs="+", type=Path)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--decodes", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    llama_cpp.llama_backend_init()
    print(f"| model | {args.rows} rows, logits on all (ms) | on the last only (ms) | ratio |")
    print("|---|---|---|---|")
    for path in args.models:
        t = decode_times(path, args.rows, args.decodes, args.threads)
        print(
            f"| {path.name} | {t[True] * 1e3:.1f} | {t[False] * 1e3:.1f} | {t[False] / t[True]:.2f} |"
        )


if __name__ == "__main__":
    main()

"""JSON-schema extraction: specdec against llama-server on the same pair, same machine, one run.

    .venv/bin/python scripts/bench_structured.py [--rounds 2] [-n 160] [--out FILE] [TARGET DRAFT]
    .venv/bin/python scripts/bench_structured.py --ngram [...] TARGET

The workload: 8 passages (invoices, events, people, products), each to be extracted into one of
two schemas (nested objects, arrays of objects, enums, integers, booleans), greedy, up to -n
tokens. specdec runs in-process (its Python API: the engine the server runs): target-only under
the grammar (K = 0), `auto` with drafts that know the grammar (its forced tokens drafted, the
draft model's q masked by it), `auto` with drafts that ignore it (cut at their first invalid
token, as llama-server's; to measure what knowing it brings), and K = 3. llama-server runs the
same requests (`json_schema`, its GBNF grammar) with the draft model (`-md`, its defaults: K = 3,
p-min 0) and without it. With `--ngram` the target drafts alone (the grammar's forced tokens and
n-gram copies, no draft model), and llama-server runs without a draft and with its n-gram types
(`--spec-type ngram-mod`, `ngram-map-k`). Reported per configuration: generated tokens per
second of generation time (prompt excluded: specdec's stats.t_generation, llama-server's
timings.predicted_ms), summed over the prompts; each round runs every configuration once, in a
rotated order; whether every output parsed and matched its schema. llama-server comes from
scripts/build_llama_cpp_tools.sh.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import jsonschema  # type: ignore[import-untyped]
from bench_args import let_other_decoders_settle, pair_parser, parse_pair
from bench_server import counted_end, free_port, llama_cpp_tools, wait_ready

import specdec_native as sd

ROOT = Path(__file__).parent.parent

INVOICE = {
    "type": "object",
    "properties": {
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 40},
                "city": {"type": "string", "maxLength": 30},
            },
            "required": ["name", "city"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "product": {"type": "string", "maxLength": 30},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 1000},
                    "unit": {"enum": ["piece", "box", "pallet"]},
                },
                "required": ["product", "quantity", "unit"],
                "additionalProperties": False,
            },
            "minItems": 1,
            "maxItems": 4,
        },
        "status": {"enum": ["draft", "sent", "paid"]},
    },
    "required": ["customer", "items", "status"],
    "additionalProperties": False,
}
EVENT = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 60},
        "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        "online": {"type": "boolean"},
        "attendees": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 30},
                    "role": {"enum": ["speaker", "organizer", "guest"]},
                },
                "required": ["name", "role"],
                "additionalProperties": False,
            },
            "maxItems": 4,
        },
    },
    "required": ["title", "date", "online", "attendees"],
    "additionalProperties": False,
}
PASSAGES: list[tuple[str, dict[str, Any]]] = [
    (
        "Invoice for Maria Keller, Zurich. She ordered 3 boxes of green tea and 12 pieces of "
        "ceramic cups. The invoice has been sent.",
        INVOICE,
    ),
    (
        "Billed to: Tom Baker (Leeds). 1 pallet of printer paper. Paid in full on delivery.",
        INVOICE,
    ),
    (
        "Draft invoice - customer Ana Lima from Porto: 40 pieces of cotton towels, 2 boxes of "
        "soap bars, 5 boxes of candles.",
        INVOICE,
    ),
    (
        "Order summary for Kenji Sato, Osaka: 100 pieces of steel bolts and 4 boxes of washers. "
        "Status: sent to customer.",
        INVOICE,
    ),
    (
        "The Rust meetup on 2026-03-14 is held online. Alice Chen gives the talk; Bob Diaz "
        "organises it.",
        EVENT,
    ),
    (
        "Annual garden party, 2026-07-01, at the town hall (not online). Guests: Clara Wu and "
        "Dan Ortiz; organiser Eva Novak.",
        EVENT,
    ),
    (
        "Webinar 'Intro to GGUF' on 2026-11-20, online. Speakers: Farid Haddad and Grace Lee.",
        EVENT,
    ),
    (
        "Board meeting 2026-02-09 in the main office. Organizer Hana Kim; guest Ivan Petrov.",
        EVENT,
    ),
]


def prompt_of(passage: str, schema: dict[str, Any]) -> str:
    return (
        f"Extract the data from the text as JSON matching this schema:\n{json.dumps(schema)}\n"
        f"Text: {passage}\nJSON: "
    )


# tokens, generation seconds, valid output, target passes (specdec's; 0 for llama-server)
Outcome = tuple[int, float, bool, int]


def _valid(text: str, schema: dict[str, Any]) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False


def specdec_run(dec: sd.SpeculativeDecoder, n: int, k: int | str, aware: bool) -> list[Outcome]:
    engine = dec._engine
    assert engine is not None
    engine.set_grammar_drafts(aware)
    let_other_decoders_settle()
    out = []
    for passage, schema in PASSAGES:
        r = dec.generate(prompt_of(passage, schema), n, n_draft=k, json_schema=schema)
        s = r.stats
        out.append((s.n_generated, s.t_generation, _valid(r.text, schema), s.n_target_passes))
    engine.set_grammar_drafts(True)
    return out


def server_run(url: str, n: int) -> list[Outcome]:
    out = []
    for passage, schema in PASSAGES:
        body = {
            "prompt": prompt_of(passage, schema),
            "max_tokens": n,
            "temperature": 0,
            "json_schema": schema,
            "cache_prompt": False,
        }
        r = httpx.post(url + "/v1/completions", json=body, timeout=600).json()
        t = r["timings"]
        text = r["choices"][0]["text"]
        seconds = float(t["predicted_ms"]) / 1e3
        tokens = int(t["predicted_n"]) - counted_end(r["choices"][0]["finish_reason"], t)
        out.append((tokens, seconds, _valid(text, schema), 0))
    return out


class LlamaServer:
    def __init__(self, args: list[str]) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            [*args, "--port", str(self.port), "--host", "127.0.0.1"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.url = f"http://127.0.0.1:{self.port}"
        wait_ready(self.url, self.proc)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


def main() -> None:
    ap = pair_parser(__doc__, rounds=2, n=160)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, help="write every round's numbers here (JSON)")
    ap.add_argument(
        "--ngram",
        action="store_true",
        help="the target alone with n-gram drafts (no draft model); llama-server's n-gram types",
    )
    args = parse_pair(ap)
    tools = llama_cpp_tools()
    t = str(args.threads)
    base = [f"{tools}/llama-server", "-m", str(args.target), "-c", "2048", "-t", t, "-np", "1"]
    servers = {"llama-server (no draft)": base}
    if args.ngram:
        args.draft = None
        for kind in ("ngram-mod", "ngram-map-k"):
            servers[f"llama-server --spec-type {kind}"] = [*base, "--spec-type", kind]
    else:
        with_model = [*base, "-md", str(args.draft), "-td", t]
        servers["llama-server -md (K=3, its default)"] = with_model
        servers["llama-server -md, ngram-mod first"] = [
            *with_model, "--spec-type", "ngram-mod,draft-simple"
        ]  # fmt: skip
    dec = sd.SpeculativeDecoder(
        args.target, args.draft, n_ctx=2048, n_threads=args.threads, ngram=args.ngram or None
    )
    n = args.n
    runs: dict[str, Callable[[], list[Outcome]]] = {
        "specdec K=0 (target only)": lambda: specdec_run(dec, n, 0, True),
        "specdec auto, drafts know the grammar": lambda: specdec_run(dec, n, "auto", True),
        "specdec auto, drafts ignore the grammar": lambda: specdec_run(dec, n, "auto", False),
        "specdec K=3, drafts know the grammar": lambda: specdec_run(dec, n, 3, True),
    }
    decoders = [dec]
    if not args.ngram:  # the same, its draft model alone (no n-gram copies beside it)
        alone = sd.SpeculativeDecoder(
            args.target, args.draft, n_ctx=2048, n_threads=args.threads, ngram=False
        )
        decoders.append(alone)
        runs["specdec auto, the model alone (--no-ngram)"] = lambda: specdec_run(
            alone, n, "auto", True
        )
    for name, cmd in servers.items():
        runs[name] = lambda cmd=cmd: _with_server(cmd, n)  # type: ignore[misc]
    for d in decoders:
        specdec_run(d, 16, "auto", True)  # warm-up: the calibration, the grammar's tokenizer
    results: dict[str, list[list[Outcome]]] = {name: [] for name in runs}
    for r in range(args.rounds):
        names = list(runs)
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            started = time.monotonic()
            results[name].append(runs[name]())
            print(f"round {r + 1} {name}: {time.monotonic() - started:.0f} s", file=sys.stderr)
    for d in decoders:
        d.close()
    report(args, results)


def _with_server(cmd: list[str], n: int) -> list[Outcome]:
    server = LlamaServer(cmd)
    try:
        server_run(server.url, 8)  # warm-up
        return server_run(server.url, n)
    finally:
        server.close()


def report(args: Any, results: dict[str, list[list[Outcome]]]) -> None:
    rates = {
        name: [sum(o[0] for o in run) / sum(o[1] for o in run) for run in runs]
        for name, runs in results.items()
    }
    base = statistics.median(rates["specdec K=0 (target only)"])
    server = max(statistics.median(v) for k, v in rates.items() if k.startswith("llama-server"))
    drafts = "n-gram drafts" if args.draft is None else args.draft.name
    print(f"{args.target.name} + {drafts}, {len(PASSAGES)} prompts, greedy, -n {args.n}")
    print("| configuration | tok/s (median of rounds) | vs specdec K=0 | vs best llama-server "
          "| valid outputs | tokens | target passes | rounds (tok/s) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for name, runs in results.items():
        rate = statistics.median(rates[name])
        valid = sum(o[2] for run in runs for o in run)
        total = sum(len(run) for run in runs)
        tokens = sum(o[0] for o in runs[0])
        passes = sum(o[3] for o in runs[0]) or "—"
        print(
            f"| {name} | {rate:.1f} | {rate / base:.2f}x | {rate / server:.2f}x "
            f"| {valid}/{total} | {tokens} | {passes} "
            f"| {', '.join(f'{x:.1f}' for x in rates[name])} |"
        )
    if args.out:
        args.out.write_text(json.dumps({"rates": rates, "runs": results}, indent=1))


if __name__ == "__main__":
    main()

"""What a JSON-schema constraint costs per token, by engine: llguidance (its PyPI wheel) against
llama.cpp's own GBNF grammar sampler, on a 49k vocabulary (SmolLM2) and a 262k one (Gemma 3).

    .venv/bin/python scripts/bench_constraints.py [--rounds 3]

For each vocabulary and schema: the time to build the engine's tokenizer (once per model), to
compile the schema (once per request), then, along a valid JSON document's tokens, the time per
token to compute the mask of allowed tokens (llguidance: a bitmask over the vocabulary; GBNF:
llama_sampler_apply on every candidate, which is what masking the full distribution costs) and
to advance past the token; and llguidance's rollback of 4 tokens (what a rejected draft needs).
Medians over the document's tokens, then over rounds. Needs `pip install llguidance`.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time
from pathlib import Path
from typing import Any

import llama_cpp
import llguidance
import llguidance.llamacpp
import llguidance.numpy
import numpy as np
from llama_cpp import llama_grammar

from specdec_native import models

SCHEMAS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "invoice (nested objects, array, enum)": (
        {
            "type": "object",
            "properties": {
                "customer": {
                    "type": "object",
                    "properties": {"name": {"type": "string"}, "city": {"type": "string"}},
                    "required": ["name", "city"],
                },
                "items": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "sku": {"type": "string"},
                            "quantity": {"type": "integer"},
                            "unit": {"enum": ["piece", "box", "pallet"]},
                        },
                        "required": ["sku", "quantity", "unit"],
                    },
                },
                "status": {"enum": ["draft", "sent", "paid"]},
            },
            "required": ["customer", "items", "status"],
        },
        {
            "customer": {"name": "Ada Lovelace", "city": "London"},
            "items": [
                {"sku": "AB-1", "quantity": 3, "unit": "box"},
                {"sku": "ZX-42", "quantity": 12, "unit": "piece"},
            ],
            "status": "sent",
        },
    ),
    "event (strings, numbers, booleans)": (
        {
            "type": "object",
            "properties": {
                "title": {"type": "string"},
                "attendees": {"type": "integer"},
                "online": {"type": "boolean"},
                "tags": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["title", "attendees", "online", "tags"],
        },
        {"title": "Quarterly review", "attendees": 14, "online": True, "tags": ["finance", "q3"]},
    ),
}


def vocab_of(path: Path) -> tuple[Any, Any]:
    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    return llm, llama_cpp.llama_model_get_vocab(llm.model)


def tokens_of(llm: Any, text: str) -> list[int]:
    return [int(t) for t in llm.tokenize(text.encode(), add_bos=False, special=False)]


def llguidance_costs(tok: Any, schema: dict[str, Any], tokens: list[int]) -> dict[str, float]:
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    t = time.perf_counter()
    matcher = llguidance.LLMatcher(tok, grammar)
    compile_s = time.perf_counter() - t
    assert not matcher.is_error(), matcher.get_error()
    bitmask = llguidance.numpy.allocate_token_bitmask(1, tok.vocab_size)
    masks, steps = [], []
    for token in tokens:
        t = time.perf_counter()
        llguidance.numpy.fill_next_token_bitmask(matcher, bitmask)
        masks.append(time.perf_counter() - t)
        assert (bitmask[0, token // 32] >> (token % 32)) & 1, "the document left the schema"
        t = time.perf_counter()
        assert matcher.consume_token(token), matcher.get_error()
        steps.append(time.perf_counter() - t)
    rollbacks = []
    for _ in range(20):
        t = time.perf_counter()
        matcher.rollback(4)
        rollbacks.append(time.perf_counter() - t)
        matcher.consume_tokens(tokens[len(tokens) - 4 :])
    return {
        "compile_ms": compile_s * 1e3,
        "mask_ms": statistics.median(masks) * 1e3,
        "mask_p90_ms": sorted(masks)[int(0.9 * len(masks))] * 1e3,
        "advance_ms": statistics.median(steps) * 1e3,
        "rollback4_ms": statistics.median(rollbacks) * 1e3,
    }


def gbnf_costs(vocab: Any, schema: dict[str, Any], tokens: list[int]) -> dict[str, float]:
    gbnf = llama_grammar.json_schema_to_gbnf(json.dumps(schema))
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
    t = time.perf_counter()
    sampler = llama_cpp.llama_sampler_init_grammar(vocab, gbnf.encode(), b"root")
    compile_s = time.perf_counter() - t
    # llama_token_data {id, logit, p} for every token, refilled before each apply.
    fresh = np.zeros(n_vocab, dtype=[("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])
    fresh["id"] = np.arange(n_vocab)
    fresh["logit"] = np.random.default_rng(0).standard_normal(n_vocab)
    data = fresh.copy()
    pointer = ctypes.cast(data.ctypes.data, ctypes.POINTER(llama_cpp.llama_token_data))
    masks, steps = [], []
    try:
        for token in tokens:
            np.copyto(data, fresh)
            array = llama_cpp.llama_token_data_array(pointer, n_vocab, -1, False)
            t = time.perf_counter()
            llama_cpp.llama_sampler_apply(sampler, ctypes.byref(array))
            masks.append(time.perf_counter() - t)
            assert data["logit"][token] != -np.inf, "the document left the grammar"
            t = time.perf_counter()
            llama_cpp.llama_sampler_accept(sampler, token)
            steps.append(time.perf_counter() - t)
    finally:
        llama_cpp.llama_sampler_free(sampler)
    return {
        "compile_ms": compile_s * 1e3,
        "mask_ms": statistics.median(masks) * 1e3,
        "mask_p90_ms": sorted(masks)[int(0.9 * len(masks))] * 1e3,
        "advance_ms": statistics.median(steps) * 1e3,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    vocabs = {
        "SmolLM2 (49k)": models.cache_dir() / "SmolLM2-135M-Instruct.Q4_1.Q4_0.gguf",
        "Gemma 3 (262k)": models.fetch_gemma3(),
    }
    if not vocabs["SmolLM2 (49k)"].exists():
        vocabs["SmolLM2 (49k)"] = models.default_pair().draft
    rows: dict[tuple[str, str, str], list[dict[str, float]]] = {}
    for vocab_name, path in vocabs.items():
        llm, vocab = vocab_of(path)
        t = time.perf_counter()
        tok = llguidance.llamacpp.lltokenizer_from_vocab(vocab)
        print(f"{vocab_name}: llguidance tokenizer built in {time.perf_counter() - t:.2f} s")
        for schema_name, (schema, doc) in SCHEMAS.items():
            tokens = tokens_of(llm, json.dumps(doc))
            for _ in range(args.rounds):
                for engine in ("llguidance", "GBNF"):
                    costs = (
                        llguidance_costs(tok, schema, tokens)
                        if engine == "llguidance"
                        else gbnf_costs(vocab, schema, tokens)
                    )
                    rows.setdefault((vocab_name, schema_name, engine), []).append(costs)
            print(f"  {schema_name}: {len(tokens)} tokens", flush=True)
    print(f"\nmedians over {args.rounds} rounds (ms)")
    print("| vocabulary | schema | engine | compile | mask / token (p90) | advance | rollback 4 |")
    print("|---|---|---|---|---|---|---|")
    for (vocab_name, schema_name, engine), runs in rows.items():

        def med(key: str, runs: list[dict[str, float]] = runs) -> str:
            values = [r[key] for r in runs if key in r]
            return f"{statistics.median(values):.3f}" if values else "-"

        print(
            f"| {vocab_name} | {schema_name} | {engine} | {med('compile_ms')} "
            f"| {med('mask_ms')} ({med('mask_p90_ms')}) | {med('advance_ms')} "
            f"| {med('rollback4_ms')} |"
        )


if __name__ == "__main__":
    main()

"""Generation on real models: sampling, stops, streaming, threads, interrupts."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import NEAR_TIE_GAP, PROMPTS
from helpers import assert_same_or_near_tie, assert_stats_add_up

import specdec_native as sd


def test_same_seed_same_output(deep_decoder: sd.SpeculativeDecoder) -> None:
    a = deep_decoder.generate(PROMPTS[0], 30, temperature=0.8, seed=42)
    b = deep_decoder.generate(PROMPTS[0], 30, temperature=0.8, seed=42)
    assert a.tokens == b.tokens
    assert_stats_add_up(a.stats, len(a.tokens))


def test_different_seeds_differ(deep_decoder: sd.SpeculativeDecoder) -> None:
    outs = {
        tuple(deep_decoder.generate(PROMPTS[4], 30, temperature=1.0, seed=s).tokens)
        for s in range(4)
    }
    assert len(outs) > 1


def allowed_tokens(
    logits: list[float], t: float, top_k: int, top_p: float, min_p: float
) -> set[int]:
    """The tokens temperature -> top-k -> top-p -> min-p leave, computed here independently."""
    x = np.asarray(logits, dtype=np.float64) / t
    order = np.argsort(-x)[:top_k]
    p = np.exp(x[order] - x[order[0]])
    p /= p.sum()
    keep = int(np.searchsorted(np.cumsum(p), top_p) + 1)
    order, p = order[:keep], p[:keep] / p[:keep].sum()
    return {int(i) for i, pi in zip(order, p) if pi >= min_p * p[0]}


def test_transforms_shape_the_first_token(deep_decoder: sd.SpeculativeDecoder) -> None:
    # Every sampled first token, drafted and accepted or drawn by the target, lies where the
    # transforms leave mass (5 tokens here). Ignoring them would put half the draws outside.
    t, top_k, top_p, min_p = 1.0, 40, 0.6, 0.05
    prompt = deep_decoder.tokenize(PROMPTS[2], add_special=True, parse_special=True)
    allowed = allowed_tokens(deep_decoder.next_token_logits(prompt), t, top_k, top_p, min_p)
    assert 1 < len(allowed) < top_k
    firsts = [
        deep_decoder.generate(
            prompt, 4, n_draft=3, temperature=t, top_k=top_k, top_p=top_p, min_p=min_p, seed=s
        ).tokens[0]
        for s in range(60)
    ]
    assert set(firsts) <= allowed
    assert len(set(firsts)) > 1


@pytest.mark.parametrize(
    "transform", [{"top_k": 1}, {"top_p": 1e-6}, {"top_p": 0.0}, {"min_p": 1.0}]
)
def test_a_transform_that_keeps_only_the_best_token_samples_greedily(
    tiny_decoder: sd.SpeculativeDecoder, transform: dict[str, Any]
) -> None:
    greedy = tiny_decoder.generate([1, 300, 270], 40)
    r = tiny_decoder.generate([1, 300, 270], 40, temperature=1.5, seed=7, **transform)
    assert r.tokens == greedy.tokens


def test_repeat_penalty_is_llama_cpps_and_speculation_keeps_it(
    deep_decoder: sd.SpeculativeDecoder,
) -> None:
    prompt = deep_decoder.tokenize(
        "The cat sat on the mat. The cat sat on the", add_special=True, parse_special=True
    )
    penalty, last_n = 3.0, 16
    logits = np.asarray(deep_decoder.next_token_logits(prompt), dtype=np.float32)
    expected = logits.copy()
    for t in set(prompt[-last_n:]):
        expected[t] = expected[t] / penalty if expected[t] > 0 else expected[t] * penalty
    assert int(np.argmax(expected)) != int(np.argmax(logits))  # the penalty decides here
    kw: dict[str, Any] = {"repeat_penalty": penalty, "repeat_last_n": last_n}
    first = deep_decoder.generate(prompt, 1, n_draft=0, **kw)
    assert first.tokens == [int(np.argmax(expected))]
    base = deep_decoder.generate(prompt, 24, n_draft=0, **kw)
    spec = deep_decoder.generate(prompt, 24, n_draft=4, **kw)
    assert spec.stats.n_drafted > 0
    assert_same_or_near_tie(spec, base, NEAR_TIE_GAP)
    assert deep_decoder.generate(prompt, 24, n_draft=4).tokens != spec.tokens


def test_ignore_eos_runs_to_max_tokens_and_speculation_keeps_it(
    deep_decoder: sd.SpeculativeDecoder,
) -> None:
    prompt = deep_decoder.tokenize("Once upon a time", add_special=True, parse_special=True)
    eos = deep_decoder.info()["target"]["eos"]
    ends: dict[str, Any] = {"logit_bias": {eos: 100}}  # the end token first, wherever it comes
    assert deep_decoder.generate(prompt, 24, n_draft=0, **ends).finish_reason == "stop"
    base = deep_decoder.generate(prompt, 24, n_draft=0, ignore_eos=True, **ends)
    assert base.finish_reason == "length" and len(base.tokens) == 24 and eos not in base.tokens
    spec = deep_decoder.generate(prompt, 24, n_draft=4, ignore_eos=True, **ends)
    assert spec.stats.n_drafted > 0 and spec.finish_reason == "length"
    assert_same_or_near_tie(spec, base, NEAR_TIE_GAP)
    for seed in range(4):  # sampled: never the end token, whatever the draft proposes
        r = deep_decoder.generate(
            prompt, 16, temperature=1.0, seed=seed, n_draft=3, ignore_eos=True, **ends
        )
        assert r.finish_reason == "length" and eos not in r.tokens
    with pytest.raises(ValueError, match="ignore_eos cannot be combined with structured"):
        deep_decoder.generate(prompt, 8, ignore_eos=True, regex="[a-z]+")
    with pytest.raises(TypeError, match="ignore_eos must be"):
        deep_decoder.generate(prompt, 8, ignore_eos="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs,error",
    [
        ({"repeat_penalty": 0}, "repeat_penalty must be a finite number > 0"),
        ({"repeat_penalty": float("inf")}, "repeat_penalty must be a finite number > 0"),
        ({"repeat_last_n": -2}, "repeat_last_n must be >= -1"),
        ({"repeat_last_n": 1.5}, "repeat_last_n must be an integer"),
    ],
)
def test_bad_repeat_penalties_are_refused(
    tiny_decoder: sd.SpeculativeDecoder, kwargs: dict[str, Any], error: str
) -> None:
    with pytest.raises((ValueError, TypeError), match=error):
        tiny_decoder.generate("the", 3, **kwargs)


def test_max_tokens_is_exact(deep_decoder: sd.SpeculativeDecoder) -> None:
    for n in (1, 2, 7):
        r = deep_decoder.generate(PROMPTS[0], n)
        assert len(r.tokens) == n and r.finish_reason == "length"
        assert_stats_add_up(r.stats, n)


def test_stop_string_cuts_text(deep_decoder: sd.SpeculativeDecoder) -> None:
    full = deep_decoder.generate(PROMPTS[1], 40)
    word = full.text.strip().split()[2]
    r = deep_decoder.generate(PROMPTS[1], 40, stop=[word])
    assert r.finish_reason == "stop"
    assert word not in r.text
    assert full.text.startswith(r.text)
    assert_stats_add_up(r.stats, len(r.tokens))


def test_chat_template_wraps_the_message(deep_decoder: sd.SpeculativeDecoder) -> None:
    chat = deep_decoder.apply_chat_template([{"role": "user", "content": "Say hi."}])
    assert "Say hi." in chat and len(chat) > len("Say hi.")


def test_eog_stops_generation(tiny_decoder: sd.SpeculativeDecoder) -> None:
    # The tiny model samples its end-of-sequence token (id 2) now and then.
    eos = 2
    for seed in range(1, 50):
        r = tiny_decoder.generate([1, 300, 270], 200, temperature=1.0, seed=seed)
        if r.finish_reason == "stop":
            break
    assert r.finish_reason == "stop" and len(r.tokens) < 200
    assert eos not in r.tokens  # the end token ends the text; it is not part of it
    assert_stats_add_up(r.stats, len(r.tokens))


def test_context_full(deep_pair) -> None:  # type: ignore[no-untyped-def]
    with sd.SpeculativeDecoder(deep_pair.target, deep_pair.draft, n_ctx=64) as dec:
        r = dec.generate(PROMPTS[0], 500)
        assert r.finish_reason == "context"
        # llama.cpp rounds the context up; the decoder reports the real size.
        assert len(r.prompt_tokens) + len(r.tokens) == dec.n_ctx + 1
        with pytest.raises(sd.ContextOverflowError):
            dec.generate("word " * (dec.n_ctx + 10), 5)


def test_streaming_matches_result(deep_decoder: sd.SpeculativeDecoder) -> None:
    pieces: list[str] = []
    r = deep_decoder.generate(PROMPTS[3], 30, on_text=pieces.append)
    assert "".join(pieces) == r.text
    streamed = "".join(deep_decoder.stream(PROMPTS[3], 30))
    assert streamed == r.text


def test_callback_exception_propagates_and_engine_survives(
    deep_decoder: sd.SpeculativeDecoder,
) -> None:
    def boom(_: str) -> None:
        raise KeyError("stop here")

    with pytest.raises(KeyError):
        deep_decoder.generate(PROMPTS[0], 50, on_text=boom)
    assert len(deep_decoder.generate(PROMPTS[0], 5).tokens) == 5


def test_stream_closed_early_cancels(deep_decoder: sd.SpeculativeDecoder) -> None:
    it = deep_decoder.stream(PROMPTS[0], 400)
    next(it)
    start = time.monotonic()
    it.close()  # returns once the generation has stopped
    # The other 399 tokens take the deep pair well over 5 s on any CPU it runs on.
    assert time.monotonic() - start < 2.0
    assert len(deep_decoder.generate(PROMPTS[0], 3).tokens) == 3


def test_threads_are_serialized(deep_decoder: sd.SpeculativeDecoder) -> None:
    expected = deep_decoder.generate(PROMPTS[5], 20).tokens
    results: list[list[int]] = []

    def work() -> None:
        results.append(deep_decoder.generate(PROMPTS[5], 20).tokens)

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [expected] * 3


def test_tokenize_roundtrip(deep_decoder: sd.SpeculativeDecoder) -> None:
    text = "Hello, world! Ünïcödé ✓"
    ids = deep_decoder.tokenize(text, add_special=False)
    assert deep_decoder.detokenize(ids) == text


def test_the_prompts_time_holds_both_models_reading_it(smollm2_q40: Path) -> None:
    # A model drafting for itself reads a long prompt in as long as the target does: leaving
    # its read out of t_prompt would leave close to half of such a request's time unaccounted.
    prompt = " ".join(f"item {i} is on shelf {i % 7}." for i in range(60))
    with sd.SpeculativeDecoder(smollm2_q40, smollm2_q40, n_ctx=1024) as dec:
        r = dec.generate(prompt, 3, n_draft=1)
    s = r.stats
    assert s.n_prompt > 400
    assert_stats_add_up(s, len(r.tokens))
    accounted = s.t_prompt + s.t_draft + s.t_verify
    assert 0.8 * s.t_total <= accounted <= s.t_total * 1.001, s

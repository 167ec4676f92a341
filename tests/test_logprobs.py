"""logprobs: each emitted token's log-probability under the target, read from the verify pass
that chose it, agrees with a fresh read of the target at that position, with and without
speculation, and under a grammar covers only tokens the grammar allows."""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import BATCHED_NEAR_TIE_GAP

import specdec_native as sd

PROMPT = "The three largest cities of France are"


def _log_softmax(logits: list[float]) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64)
    out: np.ndarray = x - (x.max() + np.log(np.exp(x - x.max()).sum()))
    return out


@pytest.mark.parametrize("k", [0, 3])
def test_logprobs_are_the_targets_at_each_position(
    deep_decoder: sd.SpeculativeDecoder, k: int
) -> None:
    out = deep_decoder.generate(PROMPT, 12, n_draft=k, logprobs=5)
    assert out.logprobs is not None and len(out.logprobs) == len(out.tokens)
    context = list(out.prompt_tokens)
    for entry, token in zip(out.logprobs, out.tokens):
        assert entry.token == token and len(entry.top) == 5
        values = [lp for _, lp in entry.top]
        assert values == sorted(values, reverse=True) and sum(map(math.exp, values)) <= 1 + 1e-4
        fresh = _log_softmax(deep_decoder.next_token_logits(context))
        # A batched verify row and a fresh read differ by a little float noise.
        assert entry.logprob == pytest.approx(fresh[token], abs=0.05)
        for t, lp in entry.top:
            assert lp == pytest.approx(fresh[t], abs=0.05)
        # Greedy chooses the likeliest token (up to a near-tie).
        assert entry.top[0][0] == token or entry.top[0][1] - entry.logprob < 0.05
        context.append(token)


def test_no_logprobs_unless_asked_and_bad_counts_refused(
    deep_decoder: sd.SpeculativeDecoder,
) -> None:
    assert deep_decoder.generate(PROMPT, 4).logprobs is None
    out = deep_decoder.generate(PROMPT, 4, logprobs=0, temperature=0.8, seed=1)
    assert out.logprobs is not None and all(e.top == [] for e in out.logprobs)
    assert all(e.logprob <= 0 for e in out.logprobs)
    for bad in (-1, 21):
        with pytest.raises(ValueError, match="logprobs"):
            deep_decoder.generate(PROMPT, 4, logprobs=bad)


def test_under_a_grammar_only_allowed_tokens_have_probability(
    deep_decoder: sd.SpeculativeDecoder,
) -> None:
    pytest.importorskip("llguidance")
    out = deep_decoder.generate(PROMPT, 8, regex="[0-9]{8}", logprobs=20, n_draft=3)
    assert out.logprobs is not None and len(out.logprobs) == 8
    for entry in out.logprobs:
        # Masked and renormalised: the allowed tokens hold all the probability.
        texts = [deep_decoder.detokenize([t]) for t, _ in entry.top]
        assert all(t.isdigit() for t in texts), texts
        assert sum(math.exp(lp) for _, lp in entry.top) == pytest.approx(1.0, abs=0.02)


def test_streamed_logprobs_come_with_their_text(deep_decoder: sd.SpeculativeDecoder) -> None:
    """run(on_logprobs=) hands each piece's tokens' logprobs just before the piece: in order,
    all of the result's; a token held back (a possible start of a stop string) comes with the
    text that releases it. (How many pieces there are depends on how often the caller woke.)"""
    events: list[tuple[str, object]] = []
    settings = sd.GenerationSettings.checked(max_tokens=16, n_draft=3, logprobs=1, stop=["\n\n\n"])
    out = deep_decoder.run(
        PROMPT,
        settings,
        on_text=lambda text: events.append(("text", text)),
        on_logprobs=lambda entries: events.append(("logprobs", entries)),
    )
    assert out.logprobs is not None
    streamed = [e for kind, batch in events if kind == "logprobs" for e in batch]  # type: ignore[attr-defined]
    assert out.finish_reason == "length" and streamed == out.logprobs
    for (kind, _), (next_kind, _) in zip(events, events[1:]):
        assert kind == "text" or next_kind == "text"  # logprobs always lead a piece of text
    assert events[-1][0] == "text"


def test_a_stop_strings_tokens_have_no_logprobs(deep_decoder: sd.SpeculativeDecoder) -> None:
    """The text leaves a stop string out, and so do the logprobs, streamed or not: each entry
    is a token whose text begins in the output (the last may run on into the stop string).
    The first token whose text it cut whole gives `stop_logprob`."""
    streamed: list[sd.TokenLogprob] = []
    settings = sd.GenerationSettings.checked(max_tokens=40, n_draft=3, logprobs=1, stop=["8"])
    out = deep_decoder.run("Count: 1, 2, 3, 4, 5,", settings, on_logprobs=streamed.extend)
    assert out.finish_reason == "stop" and out.logprobs is not None
    assert out.logprobs == streamed
    assert [e.token for e in out.logprobs] == out.tokens[: len(out.logprobs)]
    assert len(out.logprobs) < len(out.tokens)  # "8" and what came with it
    # As an end token's: for a scorer reading past an echo.
    assert out.stop_logprob is not None
    assert out.stop_logprob.token == out.tokens[len(out.logprobs)]
    pieces = deep_decoder.token_bytes([e.token for e in out.logprobs])
    spelled, text = b"".join(pieces), out.text.encode()
    assert spelled.startswith(text) and len(spelled) - len(text) < len(pieces[-1])


def test_prompt_logprobs_score_every_prompt_token_but_the_first(
    deep_decoder: sd.SpeculativeDecoder,
) -> None:
    sentence = "The quick brown fox jumps over the lazy dog."
    prompt = deep_decoder.tokenize(" ".join([sentence] * 8), add_special=True, parse_special=True)
    assert len(prompt) > 64  # more than one scored chunk
    deep_decoder.generate(prompt, 2)  # the prompt cached: a scored prompt is read afresh
    out = deep_decoder.generate(prompt, 3, n_draft=3, prompt_logprobs=2, logit_bias={0: -100})
    scored = out.prompt_logprobs
    assert scored is not None and [e.token for e in scored] == prompt[1:]
    assert out.stats.n_prompt_cached == 0 and len(out.tokens) == 3
    for i in (0, 1, 30, 63, 64, 65, len(prompt) - 2):  # either side of a chunk's end
        fresh = _log_softmax(deep_decoder.next_token_logits(prompt[: i + 1]))
        # The model's own distribution (not the request's logit_bias), read from a batch of up
        # to 64 prompt rows: a fresh one-token read differs by batched decodes' float noise.
        assert scored[i].logprob == pytest.approx(fresh[prompt[i + 1]], abs=BATCHED_NEAR_TIE_GAP)
        values = [lp for _, lp in scored[i].top]
        assert len(values) == 2 and values == sorted(values, reverse=True)
        assert scored[i].logprob <= values[0] + 1e-6
    # A text the model has read once is likelier the second time: a perplexity's raw material.
    per_sentence = len(scored) // 8
    first, last = scored[:per_sentence], scored[-per_sentence:]
    assert sum(e.logprob for e in last) > sum(e.logprob for e in first) + 10
    assert deep_decoder.generate(prompt, 2).prompt_logprobs is None
    cut = deep_decoder.generate(prompt, 2, prompt_logprobs=0, timeout=1e-6)
    assert cut.finish_reason == "timeout" and len(cut.prompt_logprobs or []) < len(prompt) - 1
    eos = deep_decoder.info()["target"]["eos"]
    ended = deep_decoder.generate(prompt, 4, logprobs=1, logit_bias={eos: 100})
    assert ended.finish_reason == "stop" and ended.tokens == []  # the end token is not text
    assert ended.stop_logprob is not None and ended.stop_logprob.token == eos
    with pytest.raises(ValueError, match="prompt_logprobs"):
        deep_decoder.generate(prompt, 2, prompt_logprobs=21)

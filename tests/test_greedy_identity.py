"""Greedy speculative decoding produces the target's own greedy output (up to float near-ties)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import prompts
import pytest
from conftest import NEAR_TIE_GAP, PROMPTS
from helpers import assert_same_or_near_tie, assert_stats_add_up

import specdec_native as sd
from specdec_native import models


def check_pair(
    target: Path, draft: Path, n_draft: int, max_tokens: int = 40, texts: list[str] = PROMPTS
) -> float:
    accepted = drafted = 0
    margins: list[float] = []
    with sd.SpeculativeDecoder(target, draft, n_draft=n_draft, n_ctx=1024) as dec:
        for prompt in texts:
            base = dec.generate(prompt, max_tokens, n_draft=0)
            spec = dec.generate(prompt, max_tokens)
            assert base.stats.n_drafted == 0
            assert len(spec.margins) == len(spec.tokens) and len(base.margins) == len(base.tokens)
            margins.extend(spec.margins)
            assert_same_or_near_tie(spec, base, NEAR_TIE_GAP)
            assert_stats_add_up(spec.stats, len(spec.tokens))
            assert_stats_add_up(base.stats, len(base.tokens))
            accepted += spec.stats.n_accepted
            drafted += spec.stats.n_drafted
    # The near-tie gap must be small next to the typical decision margin (measured medians:
    # 1.5 deep pair, 1.3 SmolLM2 quant pair, 2.0 Gemma 3 quant pair).
    median = sorted(margins)[len(margins) // 2]
    assert NEAR_TIE_GAP < median / 2
    return accepted / drafted


def test_deep_pair(deep_pair: models.ModelPair) -> None:
    assert len(prompts.ALL) >= 30
    rate = check_pair(deep_pair.target, deep_pair.draft, n_draft=4, texts=prompts.ALL)
    assert 0.2 < rate < 1.0  # a real pair: the draft is often right, never always


def test_smollm2_q41_target_q40_draft(smollm2: Path, smollm2_q40: Path) -> None:
    rate = check_pair(smollm2, smollm2_q40, n_draft=5, texts=prompts.ALL)
    assert rate > 0.3  # per-token agreement is about 0.71; K=5 dilutes it


def test_gemma3_q4km_target_q40_draft(gemma3: Path, gemma3_q40: Path) -> None:
    rate = check_pair(gemma3, gemma3_q40, n_draft=3, max_tokens=24)
    assert rate > 0.3


@pytest.mark.parametrize("k", [1, 2, 3, 8])
def test_any_draft_length(deep_decoder: sd.SpeculativeDecoder, k: int) -> None:
    prompt = PROMPTS[1]
    base = deep_decoder.generate(prompt, 32, n_draft=0)
    spec = deep_decoder.generate(prompt, 32, n_draft=k)
    assert_same_or_near_tie(spec, base, NEAR_TIE_GAP)
    assert len(spec.stats.proposed_at) <= k


def test_self_pair_accepts_everything(smollm2: Path) -> None:
    with sd.SpeculativeDecoder(smollm2, smollm2, n_draft=4, n_ctx=512) as dec:
        r = dec.generate(PROMPTS[0], 30)
    assert r.stats.n_drafted > 0
    assert r.stats.acceptance_rate > 0.95


def test_an_output_that_stops_where_the_other_goes_on_is_judged_by_its_stop_margin(
    deep_decoder: sd.SpeculativeDecoder,
) -> None:
    eos = deep_decoder.info()["target"]["eos"]
    stopped = deep_decoder.generate("Once upon a time", 8, logit_bias={eos: 100})
    assert stopped.tokens == [] and stopped.finish_reason == "stop"
    assert stopped.stop_margin is not None and stopped.stop_margin > 10  # chosen by far
    went_on = deep_decoder.generate("Once upon a time", 8)
    assert went_on.stop_margin is None  # ended by length
    sampled = deep_decoder.generate("Once upon a time", 8, logit_bias={eos: 100}, temperature=1)
    assert sampled.stop_margin is None  # margins are greedy's
    with pytest.raises(AssertionError, match="diverge at token 0"):
        assert_same_or_near_tie(stopped, went_on, NEAR_TIE_GAP)
    # Where the end token and the other's token were nearly tied, it is a near-tie.
    close = dataclasses.replace(stopped, stop_margin=0.01)
    assert_same_or_near_tie(close, dataclasses.replace(went_on, margins=[0.02] * 8), NEAR_TIE_GAP)
    unexplained = dataclasses.replace(stopped, stop_margin=None)  # cut short by something else
    with pytest.raises(AssertionError, match="strict prefix"):
        assert_same_or_near_tie(unexplained, went_on, NEAR_TIE_GAP)

"""Predicted outputs: drafts copied from the output a caller expects, lossless whatever it is."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import NEAR_TIE_GAP
from helpers import assert_same_or_near_tie, assert_stats_add_up, engine_request
from test_distribution import homogeneity_pvalue

import specdec_native as sd
from specdec_native import models
from specdec_native._core import testing
from specdec_native.decoder import ArgumentTypeError

PLAN = "Write a Python function that returns the sum of a list of numbers.\n"
SOURCES = ("model", "ngram", "grammar", "index", "prediction")


def assert_sources_add_up(s: sd.Stats) -> None:
    assert sum(getattr(s, f"drafted_by_{x}") for x in SOURCES) == s.n_drafted
    assert sum(getattr(s, f"accepted_by_{x}") for x in SOURCES) == s.n_accepted


@pytest.fixture(scope="module")
def alone(deep_pair: models.ModelPair) -> Iterator[sd.SpeculativeDecoder]:
    """The target without a draft model or n-gram drafting: a request drafts only with its
    prediction (and then from its own text too)."""
    with sd.SpeculativeDecoder(deep_pair.target, None, n_ctx=1024) as dec:
        yield dec


def test_the_output_predicted_is_drafted_whole(alone: sd.SpeculativeDecoder) -> None:
    base = alone.generate(PLAN, 48, n_draft=0)
    for k in (4, "auto"):
        out = alone.generate(PLAN, 48, n_draft=k, prediction=base.tokens)
        assert_same_or_near_tie(out, base, NEAR_TIE_GAP)
        assert_stats_add_up(out.stats, len(out.tokens))
        assert_sources_add_up(out.stats)
        s = out.stats
        if out.tokens == base.tokens:
            assert s.accepted_by_prediction == s.drafted_by_prediction == s.n_drafted
        assert s.accepted_by_prediction >= 24 and s.n_target_passes <= 24, s


def test_a_prediction_the_output_leaves_is_found_again(alone: sd.SpeculativeDecoder) -> None:
    """An edited prediction (a line changed, a line the output does not have) and one that has
    nothing to do with the output: the output is the target's either way; the edited one is
    copied on past the changes."""
    base = alone.generate(PLAN, 64, n_draft=0)
    lines = base.text.splitlines(keepends=True)
    assert len(lines) >= 4, base.text
    edited = "".join([lines[0], "# a line the output does not have\n", *lines[2:]])
    for prediction in (edited, "lorem ipsum dolor sit amet " * 20):
        for k in (3, "auto"):
            out = alone.generate(PLAN, 64, n_draft=k, prediction=prediction)
            assert_same_or_near_tie(out, base, NEAR_TIE_GAP)
            assert_stats_add_up(out.stats, len(out.tokens))
            assert_sources_add_up(out.stats)
            if prediction == edited and out.tokens == base.tokens:
                # Copies go on after the changed line: most of the output is the prediction's.
                assert out.stats.accepted_by_prediction >= len(out.tokens) // 2, out.stats


def test_a_prediction_beside_a_draft_model_and_ngrams(deep_pair: models.ModelPair) -> None:
    with sd.SpeculativeDecoder(deep_pair.target, deep_pair.draft, ngram=True, n_ctx=1024) as dec:
        base = dec.generate(PLAN, 48, n_draft=0)
        for k in (3, "auto"):
            out = dec.generate(PLAN, 48, n_draft=k, prediction=base.text)
            assert_same_or_near_tie(out, base, NEAR_TIE_GAP)
            assert_sources_add_up(out.stats)
            assert out.stats.accepted_by_prediction > 0, out.stats


def test_predicted_drafts_keep_the_distribution(tiny_dir: Path) -> None:
    """Sampling: every request copies a prediction (point masses, sometimes accepted, sometimes
    not); the outputs' distribution is the target's, and a wrong rule is seen."""
    pair = models.build_tiny_pair(tiny_dir, seed=5, draft_noise=0.5)
    prompt = [1, 300, 270]  # its likeliest output: 260 289 189, the prediction
    n = 10_000
    counts: dict[str, Counter[tuple[int, ...]]] = {}
    drafted = accepted = 0
    with sd.SpeculativeDecoder(pair.target, None, n_ctx=64, n_threads=1) as dec:
        engine = dec._live()
        for arm, k in (("base", 0), ("predicted", 2), ("wrong", 2)):
            counts[arm] = Counter()
            testing.set_wrong_residual(arm == "wrong")
            try:
                for i in range(n):
                    request = engine_request(prompt, 3, 13 * n + i, k, prediction=[260, 289, 189])
                    out = engine.generate(request)
                    counts[arm][tuple(out["tokens"])] += 1
                    if arm == "predicted":
                        drafted += out["stats"]["drafted_by_prediction"]
                        accepted += out["stats"]["accepted_by_prediction"]
            finally:
                testing.set_wrong_residual(False)
    assert drafted >= n
    assert 0 < accepted < drafted
    assert homogeneity_pvalue(counts["base"], counts["predicted"]) > 1e-3
    # The test sees a wrong rule: resampling from p itself after a rejection.
    assert homogeneity_pvalue(counts["base"], counts["wrong"]) < 1e-6


def test_bad_predictions_are_refused(alone: sd.SpeculativeDecoder) -> None:
    with pytest.raises(ArgumentTypeError, match="prediction must be str or a list of token ids"):
        alone.generate(PLAN, 4, prediction=b"def f():")  # bytes: a sequence of ints, but text
    with pytest.raises(ArgumentTypeError, match="prediction must be str"):
        alone.generate(PLAN, 4, prediction=3)  # type: ignore[arg-type]
    with pytest.raises(ArgumentTypeError, match="prediction must be str"):
        alone.generate(PLAN, 4, prediction={"type": "content"})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="prediction is not valid Unicode"):
        alone.generate(PLAN, 4, prediction="x\ud800")
    with pytest.raises(ValueError, match="prediction token"):
        alone.generate(PLAN, 4, prediction=[-1])
    with pytest.raises(ValueError, match="token"):
        alone.generate(PLAN, 4, prediction=[10**8])  # past the vocabulary
    assert alone.generate(PLAN, 4, prediction="").stats.drafted_by_prediction == 0
    # A prediction longer than the context is used as far as the context goes.
    long = alone.generate(PLAN, 8, n_draft=3, prediction=[300] * 5000)
    assert len(long.tokens) == 8

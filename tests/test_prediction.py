"""Predicted outputs: drafts copied from the output a caller expects, lossless whatever it is."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import NEAR_TIE_GAP
from helpers import (
    assert_same_or_near_tie,
    assert_stats_add_up,
    engine_request,
    set_costs_where_drafting_pays,
)
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_distribution import assert_copies_keep_the_distribution

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


PROMPT = [50, 51]


def drafts_as_the_output_grows(prediction: list[int], output: list[int], k: int) -> list[list[int]]:
    """What a prediction drafts before each token of `output`, and after the last, one call a
    step as a generation makes them."""
    p = testing.Prediction(prediction, 1, 4)
    return [p.draft(PROMPT + output[:n], len(PROMPT), k) for n in range(len(output) + 1)]


def test_a_prediction_is_followed_at_the_output_s_own_place() -> None:
    # The second copy of a passage longer than the longest key goes on at its own place.
    prediction = [1, 2, 3, 4, 5, 9, 1, 2, 3, 4, 5, 8, 7]
    output = prediction[:11]
    drafts = drafts_as_the_output_grows(prediction, output, 3)
    assert drafts == [prediction[n : n + 3] for n in range(12)]
    # All of it written: nothing left to copy.
    assert drafts_as_the_output_grows(prediction, prediction, 3)[-1] == []


def test_where_the_output_leaves_a_prediction_its_last_tokens_find_it_again() -> None:
    prediction = [10, 11, 12, 13, 14, 15, 16]
    drafts = drafts_as_the_output_grows(prediction, [10, 11, 99, 13], 3)
    assert drafts == [[10, 11, 12], [11, 12, 13], [12, 13, 14], [], [14, 15, 16]]
    # The first place after where the output last kept to the prediction, not the first of all.
    prediction = [5, 1, 5, 2, 5, 3]
    assert drafts_as_the_output_grows(prediction, [5, 1, 77, 5], 3)[-1] == [2, 5, 3]
    # Where the only place is behind, it is taken.
    assert drafts_as_the_output_grows(prediction, [5, 1, 5, 2, 5, 3, 5], 3)[-1] == [1, 5, 2]
    # A token the prediction ends on has nothing after it to copy.
    assert drafts_as_the_output_grows([1, 2, 3], [7, 3], 3)[-1] == []


def _common_subsequence_by_table(a: list[int], b: list[int]) -> int:
    row = [0] * (len(b) + 1)
    for x in a:
        diagonal = 0
        for j, y in enumerate(b):
            diagonal, row[j + 1] = row[j + 1], (diagonal + 1 if x == y else max(row[j + 1], row[j]))
    return row[-1]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 5), max_size=200),
    st.lists(st.integers(0, 5), max_size=200),
)
@example([0] * 130, [0] * 130)  # every step carries across words
@example([1, 2] * 70, [2, 1] * 70)
@example(list(range(150)), list(range(0, 150, 3)) + list(range(149, 0, -7)))  # bits set one by one
def test_the_prediction_tokens_in_an_output_are_their_common_subsequence(
    a: list[int], b: list[int]
) -> None:
    # Up to 200 tokens: runs of words, so that carries cross them.
    assert testing.common_subsequence(a, b) == _common_subsequence_by_table(a, b)


def test_the_output_predicted_is_drafted_whole(deep_pair: models.ModelPair) -> None:
    with sd.SpeculativeDecoder(deep_pair.target, None, n_ctx=1024, calibration_cache=False) as dec:
        base = dec.generate(PLAN, 48, n_draft=0)
        set_costs_where_drafting_pays(dec, draft_share=0.0)
        outs = [dec.generate(PLAN, 48, n_draft=k, prediction=base.tokens) for k in (4, "auto")]
    for out in outs:
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
    with sd.SpeculativeDecoder(pair.target, None, n_ctx=64, n_threads=1) as dec:
        engine = dec._live()

        def generate(k: int, i: int) -> dict[str, Any]:
            request = engine_request(prompt, 3, 13 * n + i, k, prediction=[260, 289, 189])
            return engine.generate(request)

        assert_copies_keep_the_distribution(generate, "prediction", n)


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

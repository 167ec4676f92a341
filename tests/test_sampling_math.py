"""The sampling maths, tested directly through the bindings (no model)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as st

from specdec_native._core import testing


def softmax(x: np.ndarray, t: float) -> np.ndarray:
    z = np.exp((x - x.max()) / t)
    p: np.ndarray = z / z.sum()
    return p


LOGITS = np.random.default_rng(0).normal(size=500).astype(np.float32) * 3


def test_plain_distribution_is_softmax() -> None:
    p = np.asarray(testing.distribution(LOGITS.tolist(), 0.7, 0, 1.0, 0.0))
    assert p.sum() == pytest.approx(1.0, abs=1e-5)
    np.testing.assert_allclose(p, softmax(LOGITS.astype(np.float64), 0.7), rtol=1e-4, atol=1e-7)


def test_top_k_keeps_k_best() -> None:
    p = np.asarray(testing.distribution(LOGITS.tolist(), 1.0, 10, 1.0, 0.0))
    assert (p > 0).sum() == 10
    assert set(np.flatnonzero(p)) == set(np.argsort(LOGITS)[-10:])
    assert p.sum() == pytest.approx(1.0, abs=1e-5)


def test_top_p_keeps_smallest_prefix_reaching_mass() -> None:
    full = softmax(LOGITS.astype(np.float64), 1.0)
    p = np.asarray(testing.distribution(LOGITS.tolist(), 1.0, 0, 0.9, 0.0))
    kept = np.flatnonzero(p)
    order = np.argsort(-full)
    n = int(np.searchsorted(np.cumsum(full[order]), 0.9) + 1)
    assert set(kept) == set(order[:n])
    assert p.sum() == pytest.approx(1.0, abs=1e-5)


def test_min_p_threshold_is_relative_to_the_best() -> None:
    full = softmax(LOGITS.astype(np.float64), 1.0)
    p = np.asarray(testing.distribution(LOGITS.tolist(), 1.0, 0, 1.0, 0.2))
    assert set(np.flatnonzero(p)) == set(np.flatnonzero(full >= 0.2 * full.max()))


def test_acceptance_probability() -> None:
    assert testing.acceptance_probability(0.2, 0.4) == pytest.approx(0.5)
    assert testing.acceptance_probability(0.4, 0.2) == 1.0
    assert testing.acceptance_probability(0.3, 0.3) == 1.0  # p == q always accepts
    assert testing.acceptance_probability(0.3, 0.0) == 0.0  # never drafted: never accepted


def test_acceptance_chance_is_the_overlap_of_p_and_q() -> None:
    p = [0.5, 0.3, 0.2, 0.0]
    q = [0.2, 0.5, 0.1, 0.2]
    assert testing.acceptance_chance(p, q) == pytest.approx(0.2 + 0.3 + 0.1)
    assert testing.acceptance_chance(p, p) == pytest.approx(1.0)
    assert testing.acceptance_chance([1.0, 0.0], [0.0, 1.0]) == 0.0
    with pytest.raises(ValueError, match="same length"):
        testing.acceptance_chance(p, q[:3])


def test_residual_is_normalised_positive_part() -> None:
    p = np.array([0.5, 0.3, 0.2, 0.0])
    q = np.array([0.2, 0.5, 0.1, 0.2])
    counts = np.asarray(testing.sample_residual_counts(p.tolist(), q.tolist(), 40000, 7))
    residual = np.maximum(p - q, 0)
    residual /= residual.sum()  # [0.75, 0, 0.25, 0]
    assert counts[1] == 0 and counts[3] == 0
    chi2 = st.chisquare(counts[[0, 2]], residual[[0, 2]] * counts.sum())
    assert chi2.pvalue > 1e-3


def test_whole_rule_reproduces_p() -> None:
    """Draft from q, accept w.p. min(1, p/q), else residual: the result is distributed as p."""
    rng = np.random.default_rng(3)
    p = np.array([0.1, 0.4, 0.3, 0.2])
    q = np.array([0.4, 0.1, 0.1, 0.4])
    n = 40000
    drafts = rng.choice(4, size=n, p=q)
    u = rng.random(n)
    accepted = u < np.minimum(1, p[drafts] / q[drafts])
    n_rej = int((~accepted).sum())
    residual = np.asarray(testing.sample_residual_counts(p.tolist(), q.tolist(), n_rej, 11))
    out = np.bincount(drafts[accepted], minlength=4) + residual
    assert st.chisquare(out, p * n).pvalue > 1e-3
    assert math.isclose(
        accepted.mean(), testing.acceptance_chance(p.tolist(), q.tolist()), abs_tol=0.01
    )


@pytest.mark.parametrize(
    "bad",
    [
        (-1.0, 0, 1.0, 0.0),
        (1.0, -1, 1.0, 0.0),
        (1.0, 0, -0.1, 0.0),
        (1.0, 0, 1.5, 0.0),
        (1.0, 0, 1.0, 2.0),
        (float("nan"), 0, 1.0, 0.0),
    ],
)
def test_bad_transforms_rejected(bad: tuple[float, int, float, float]) -> None:
    with pytest.raises(ValueError):
        testing.distribution(LOGITS.tolist(), *bad)


def test_text_stream_holds_partial_utf8() -> None:
    euro = "€".encode()  # 3 bytes
    chunks, stopped = testing.utf8_stream([b"a", euro[:1], euro[1:2], euro[2:] + b"b"], [])
    assert chunks[:4] == [b"a", b"", b"", euro + b"b"]
    assert not stopped


def test_text_stream_stop_string_across_pieces() -> None:
    chunks, stopped = testing.utf8_stream([b"hello wo", b"rld", b" more"], ["world"])
    assert b"".join(chunks) == b"hello "
    assert stopped


def test_text_stream_releases_false_stop_prefix() -> None:
    chunks, stopped = testing.utf8_stream([b"hello wo", b"w!"], ["world"])
    assert b"".join(chunks) == b"hello wow!"
    assert not stopped

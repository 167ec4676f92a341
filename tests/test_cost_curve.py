"""The calibration's estimates from timed sweeps (csrc/cost_curve.h), on timings chosen to show
each rule; tests/test_adaptive.py measures real ones."""

from __future__ import annotations

import random

import pytest

from specdec_native._core import testing

TRUE_VERIFY = [0.010, 0.011, 0.012, 0.013]


def noisy_sweeps(
    true_verify: list[float], true_draft: list[float], n: int, seed: int
) -> tuple[list[list[float]], list[list[float]]]:
    """n sweeps on a busy machine: every timing slowed by 0-300 %, except one of each decode's
    (a moment when nothing else ran)."""
    rng = random.Random(seed)
    quiet = [rng.randrange(n) for _ in range(len(true_verify) + len(true_draft))]

    def timing(true: float, index: int, sweep: int) -> float:
        return true if quiet[index] == sweep else true * rng.uniform(1.0, 4.0)

    verify = [[timing(t, i, s) for i, t in enumerate(true_verify)] for s in range(n)]
    draft = [
        [timing(t, len(true_verify) + i, s) for i, t in enumerate(true_draft)] for s in range(n)
    ]
    return verify, draft


def test_a_busy_machine_scales_the_costs_but_not_how_they_compare() -> None:
    verify, draft = noisy_sweeps(TRUE_VERIFY, [0.002, 0.003], 6, seed=1)
    v, d, _ = testing.estimate_costs(verify, draft)
    scale = v[0] / TRUE_VERIFY[0]
    assert scale > 1.2  # typical costs on a busy machine
    assert v == pytest.approx([t * scale for t in TRUE_VERIFY])
    assert d == pytest.approx([0.002 * scale, 0.003 * scale])


def test_costs_are_typical_not_best_case() -> None:
    # Steps measure what decodes typically cost; the calibration must say the same.
    verify = [[t * f for t in TRUE_VERIFY] for f in (1.0, 1.1, 1.2)]
    v, _, _ = testing.estimate_costs(verify, [])
    assert v == pytest.approx([t * 1.1 for t in TRUE_VERIFY])


def test_a_model_drafting_for_itself_never_looks_cheaper_than_itself() -> None:
    for seed in range(20):
        verify, draft = noisy_sweeps(TRUE_VERIFY, TRUE_VERIFY[:2], 6, seed)
        v, d, _ = testing.estimate_costs(verify, draft)
        assert d == pytest.approx(v[:2])


def test_settled_once_the_last_sweep_is_no_faster() -> None:
    steady = [list(TRUE_VERIFY) for _ in range(3)]
    assert testing.estimate_costs(steady, [])[2]
    assert not testing.estimate_costs(steady[:1], [])[2]  # one sweep says nothing about noise
    slow = [t * 2 for t in TRUE_VERIFY]
    assert testing.estimate_costs([slow, list(TRUE_VERIFY), slow], [])[2]
    # The last sweep found the target faster than any before: there may be faster still.
    assert not testing.estimate_costs([slow, slow, list(TRUE_VERIFY)], [])[2]
    # Likewise for the draft.
    assert not testing.estimate_costs(steady, [[0.004, 0.006], [0.004, 0.006], [0.002, 0.006]])[2]


def test_without_draft_timings_drafting_costs_nothing() -> None:
    # An n-gram drafter: a few hash lookups next to a decode.
    _, d, _ = testing.estimate_costs([TRUE_VERIFY] * 3, [])
    assert d == [0.0, 0.0]


@pytest.mark.parametrize(
    "verify, draft",
    [
        ([], []),
        ([TRUE_VERIFY, TRUE_VERIFY[:2]], []),
        ([TRUE_VERIFY], [[0.001, 0.002], [0.001, 0.002]]),
        ([[0.01, 0.0]], []),
        ([[0.01, float("nan")]], []),
        ([TRUE_VERIFY], [[0.001, -1.0]]),
        ([TRUE_VERIFY], [[0.001]]),
        ([TRUE_VERIFY[:1]], [[0.001, 0.002]]),
    ],
)
def test_malformed_sweeps_are_rejected(verify: list[list[float]], draft: list[list[float]]) -> None:
    with pytest.raises(ValueError):
        testing.estimate_costs(verify, draft)

"""The statistics behind `bench`'s auto-vs-best-fixed-K table (specdec_native/comparison.py)."""

import pytest

from specdec_native import comparison as cmp


def test_held_out_picks_the_clear_winner_every_round() -> None:
    held = cmp.held_out_best({0: [1.0, 1.0, 1.0], 3: [1.3, 1.4, 1.35], 1: [1.1, 1.0, 1.05]})
    assert held.picked == [3, 3, 3]
    assert held.speedups == [1.3, 1.4, 1.35]


def test_held_out_does_not_let_a_round_pick_and_score_its_own_k() -> None:
    # K = 1's lucky round 1 makes it best after the fact (mean 1.133 against 1.067), but each
    # round, judged by the others, gets a K whose speed there is ordinary.
    by_k = {1: [1.0, 1.4, 1.0], 3: [1.1, 1.0, 1.1]}
    held = cmp.held_out_best(by_k)
    # round 0: others say K1 (1.2) over K3 (1.05); round 1: K3 (1.1) over K1 (1.0); round 2:
    # K1 (1.2) over K3 (1.05)
    assert held.picked == [1, 3, 1]
    assert held.speedups == [1.0, 1.0, 1.0]
    assert max(sum(v) / 3 for v in by_k.values()) > sum(held.speedups) / 3


def test_held_out_ties_go_to_the_first_k() -> None:
    assert cmp.held_out_best({0: [1.0, 1.0], 2: [1.0, 1.0]}).picked == [0, 0]


@pytest.mark.parametrize("by_k", [{1: [1.0]}, {1: [1.0, 1.1], 3: [1.0, 1.1, 1.2]}, {}])
def test_held_out_rejects_too_few_or_uneven_rounds(by_k: dict[int, list[float]]) -> None:
    with pytest.raises(ValueError, match="rounds"):
        cmp.held_out_best(by_k)


def test_ratio_interval_is_seeded_and_brackets_a_steady_ratio() -> None:
    auto = [0.95, 1.02, 0.99, 1.05, 0.97, 1.01]
    best = [1.0, 1.04, 1.0, 1.02, 1.01, 1.0]
    lo, hi = cmp.ratio_interval(auto, best)
    assert (lo, hi) == cmp.ratio_interval(auto, best)
    assert lo <= cmp.ratio_of_means(auto, best) <= hi
    assert 0.95 < lo < hi < 1.03


def test_ratio_interval_is_a_point_when_every_round_agrees() -> None:
    assert cmp.ratio_interval([0.9, 0.9, 0.9], [1.0, 1.0, 1.0]) == pytest.approx((0.9, 0.9))


def test_ratio_interval_widens_with_scatter() -> None:
    steady = cmp.ratio_interval([0.98, 1.0, 0.99, 1.01], [1.0] * 4)
    noisy = cmp.ratio_interval([0.8, 1.2, 0.9, 1.1], [1.0] * 4)
    assert noisy[1] - noisy[0] > 4 * (steady[1] - steady[0])


def test_ratio_interval_needs_pairs() -> None:
    with pytest.raises(ValueError, match="paired"):
        cmp.ratio_interval([1.0, 1.0], [1.0])
    with pytest.raises(ValueError, match="paired"):
        cmp.ratio_interval([], [])

"""The adaptive policy's rules, one by one, on this machine's kind of cost curve.

The policy is pure arithmetic on costs and step outcomes, so these tests drive it directly with
outcomes chosen to isolate each rule; tests/test_adaptive.py runs it inside the engine."""

from __future__ import annotations

import random

import pytest

from specdec_native import _core

# The deep pair's calibration on the 2-core test machine (docs/benchmarks.md), in seconds:
# t_verify(n) for n = 1..11, and the draft's cost per token.
VERIFY = [0.0364, 0.0500, 0.0641, 0.0615, 0.0726, 0.0889, 0.1051, 0.0950, 0.1260, 0.1427, 0.1433]
DRAFT = 0.0078


def policy() -> _core.AdaptivePolicy:
    p = _core.AdaptivePolicy()
    p.calibrate(VERIFY, DRAFT)
    p.begin_generation()
    return p


def run(
    p: _core.AdaptivePolicy,
    steps: int,
    accepted_run: int | None = None,
    rate: float = 1.0,
    rng: random.Random | None = None,
) -> list[int]:
    """Drives `steps` steps: each draft is accepted up to position `accepted_run` (a text where
    the draft is right that far each time), or position by position with probability `rate`."""
    chosen = []
    for _ in range(steps):
        k, _why = p.choose(10)
        if accepted_run is not None:
            n = min(k, accepted_run)
        else:
            assert rng is not None
            n = 0
            while n < k and rng.random() < rate:
                n += 1
        p.observe(k, n, k * DRAFT, VERIFY[k])
        chosen.append(k)
    return chosen


def test_keeps_drafting_where_the_draft_is_always_right() -> None:
    ks = run(policy(), 40, accepted_run=10)
    # K = 3 pays best at the prior (a 4-token verify is cheap on this CPU) and stays best.
    assert ks[0] == 3
    assert min(ks) >= 3


def test_falls_back_where_the_draft_is_always_wrong() -> None:
    p = policy()
    ks = run(p, 100, accepted_run=0)
    assert ks[0] == 3  # it tries first: at the prior, drafting pays
    # Then target-only, with a probe now and then, less often while probes keep failing.
    probes = [i for i, k in enumerate(ks) if i > 0 and k > 0]
    assert 1 <= len(probes) <= 6
    assert ks[-40:].count(0) >= 38
    assert p.choose(10) == (0, "low acceptance")


def test_settles_on_the_k_the_text_supports() -> None:
    # Position 1 always right, position 2 never (the chat case in docs/benchmarks.md).
    ks = run(policy(), 80, accepted_run=1)
    assert ks[-40:].count(1) >= 32


def test_a_probe_brings_drafting_back_when_the_text_gets_easier() -> None:
    p = policy()
    run(p, 40, accepted_run=0)
    ks = run(p, 60, accepted_run=10)
    assert max(ks[:40]) >= 3
    assert min(ks[-10:]) >= 3


def test_estimates_track_the_measured_rate() -> None:
    p = policy()
    run(p, 400, rate=0.9, rng=random.Random(1))
    a1 = p.acceptance()[0]
    assert 0.75 < a1 < 0.98  # evidence, not the prior (0.7), decides


def test_a_new_request_keeps_only_a_hint_of_the_last() -> None:
    def drop_after_one_rejection(new_request: bool) -> float:
        p = policy()
        run(p, 60, accepted_run=10)
        if new_request:
            p.begin_generation()
        before = p.acceptance()[0]
        p.observe(3, 0, 3 * DRAFT, VERIFY[3])
        return before - p.acceptance()[0]

    # Within a request one rejection is one of many; at the start of the next it weighs more.
    assert drop_after_one_rejection(True) > 2 * drop_after_one_rejection(False)


def test_rejects_bad_input() -> None:
    p = _core.AdaptivePolicy()
    with pytest.raises(ValueError, match="calibrate"):
        p.choose(4)
    with pytest.raises(ValueError, match="verify costs"):
        p.calibrate([0.01], 0.001)
    with pytest.raises(ValueError, match="> 0"):
        p.calibrate([0.01, -1.0], 0.001)
    p.calibrate(VERIFY, DRAFT)
    with pytest.raises(ValueError, match="n_accepted"):
        p.observe(3, 4, 0.0, 0.0)
    with pytest.raises(ValueError, match="n_accepted"):
        p.observe(11, 0, 0.0, 0.0)
    with pytest.raises(ValueError, match="max_k"):
        _core.AdaptivePolicy(0)

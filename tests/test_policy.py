"""The adaptive policy's rules, one by one, on this machine's kind of cost curve.

The policy is pure arithmetic on costs and step outcomes, so these tests drive it directly with
outcomes chosen to isolate each rule; tests/test_adaptive.py runs it inside the engine."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from specdec_native._core import testing

# The deep pair's calibration on the 2-core test machine (docs/benchmarks.md), in seconds:
# t_verify(n) for n = 1..11, and a draft decode of one token and of two.
VERIFY = [0.0364, 0.0500, 0.0641, 0.0615, 0.0726, 0.0889, 0.1051, 0.0950, 0.1260, 0.1427, 0.1433]
D1, D2 = 0.0078, 0.0108


def policy() -> testing.AdaptivePolicy:
    p = testing.AdaptivePolicy()
    p.calibrate(VERIFY, [D1, D2])
    p.begin_generation()
    return p


def observe(
    p: testing.AdaptivePolicy,
    k: int,
    n: int,
    after_whole_draft: bool = False,
    chance: float | None = None,
) -> None:
    """A step of K drafted, n accepted, costing what the calibration says. The draft's catch-up
    is two tokens after a step whose draft was accepted whole, else one. With `chance`, a
    sampled step: each position it reached had that chance of acceptance."""
    catch_up = (2, D2) if after_whole_draft else (1, D1)
    t_draft = catch_up[1] + (k - 1) * D1 if k > 0 else 0.0
    chances = None if chance is None else [chance] * min(k, n + 1)
    p.observe(k, n, t_draft, VERIFY[k], *(catch_up if k > 0 else (0, 0.0)), chances)


def run(
    p: testing.AdaptivePolicy,
    steps: int,
    accepted_run: int | None = None,
    rate: float = 1.0,
    rng: random.Random | None = None,
    outcome: Callable[[int], int] | None = None,
) -> list[int]:
    """Drives `steps` steps: each draft is accepted up to position `accepted_run` (a text where
    the draft is right that far each time), or position by position with probability `rate`,
    or as `outcome(k)` says for a draft of k > 0."""
    chosen = []
    whole = False
    for _ in range(steps):
        k, _why = p.choose(10)
        if outcome is not None:
            n = outcome(k) if k > 0 else 0
        elif accepted_run is not None:
            n = min(k, accepted_run)
        else:
            assert rng is not None
            n = 0
            while n < k and rng.random() < rate:
                n += 1
        observe(p, k, n, after_whole_draft=whole)
        whole = k > 0 and n == k
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
    assert p.choose(10) == (0, "low acceptance on earlier text")


def test_a_step_costs_k_draft_decodes_and_a_two_token_catch_up_when_all_pass() -> None:
    # Before any step every position is at the prior, 0.7: E[tokens](K) = 1 + 0.7 + .. + 0.7^K,
    # and the draft's cost is K one-token decodes plus, with probability 0.7^K (the whole draft
    # accepted), the extra cost of catching up on two tokens instead of one.
    p = policy()
    for k, rate in enumerate(p.expected_rates(4)):
        tokens = sum(0.7**i for i in range(k + 1))
        cost = VERIFY[k] + (k * D1 + 0.7**k * (D2 - D1) if k else 0.0)
        assert rate == pytest.approx(tokens / cost, rel=1e-9)


def test_draft_costs_are_tracked_per_decode_size() -> None:
    # K = 1 with every draft accepted: each step's catch-up is a two-token decode. That says what
    # a two-token decode costs and nothing about a one-token one (a single cost per draft token
    # would read 1.4x too high here and make longer drafts look dearer than they are).
    p = policy()
    for _ in range(100):
        p.observe(1, 1, 1.2 * D2, VERIFY[1], 2, 1.2 * D2)
    d1, d2 = p.draft_costs
    assert d1 == pytest.approx(D1)
    assert d2 == pytest.approx(1.2 * D2, rel=0.02)
    # A one-token catch-up and the draft tokens after it are one-token decodes.
    for _ in range(100):
        p.observe(3, 0, 3 * 0.9 * D1, VERIFY[3], 1, 0.9 * D1)
    assert p.draft_costs[0] == pytest.approx(0.9 * D1, rel=0.02)
    # A long catch-up (after steps without drafting) is no cost of drafting: ignored.
    p.observe(3, 0, 20 * D1 + 2 * D1, VERIFY[3], 20, 20 * D1)
    assert p.draft_costs[0] == pytest.approx(0.9 * D1, rel=0.03)


def test_probes_soon_after_falling_back_then_less_often() -> None:
    ks = run(policy(), 120, accepted_run=0)
    last_draft = ks.index(0) - 1
    probes = [i for i in range(last_draft + 1, 120) if ks[i] > 0]
    # A few unlucky steps are a common reason to fall back: the first probe comes soon.
    assert probes[0] - last_draft <= 4
    # Each probe that finds nothing makes the next one wait longer.
    gaps = [b - a for a, b in zip([last_draft, *probes], probes)]
    assert gaps == sorted(gaps) and gaps[-1] >= 4 * gaps[0]


def test_a_probe_with_a_token_accepted_is_followed_by_another() -> None:
    p = policy()
    run(p, 40, accepted_run=0)
    ks = run(p, 40, accepted_run=10)
    first = next(i for i, k in enumerate(ks) if k > 0)
    # No waiting between probes once one finds the text easier: it drafts from then on.
    assert all(k > 0 for k in ks[first:])


def test_after_a_probe_that_paid_probes_stay_frequent() -> None:
    # Fallen back on a text the draft gets wrong, long enough for the wait between probes to
    # have grown. Then a text with easier stretches: every other draft is accepted whole, the
    # rest not at all, starting with a whole one. Once a probe has paid, the policy never again
    # waits longer than the first interval (4 steps: 3 target-only steps between drafts),
    # instead of doubling the wait after each run of probes that ends in a failure.
    p = policy()
    ks = run(p, 60, accepted_run=0)
    assert max(_waits(ks)) >= 15
    whole = [False]

    def every_other(k: int) -> int:
        whole[0] = not whole[0]
        return k if whole[0] else 0

    ks = run(p, 120, outcome=every_other)
    first_probe = next(i for i, k in enumerate(ks) if k > 0)
    assert max(_waits(ks[first_probe:])) <= 3


def _waits(ks: list[int]) -> list[int]:
    """Lengths of the stretches of target-only steps between drafting steps."""
    waits, current = [], 0
    for k in ks:
        if k == 0:
            current += 1
        else:
            if current:
                waits.append(current)
            current = 0
    return waits or [0]


def _probe_after_fallback(p: testing.AdaptivePolicy) -> int:
    """Runs target-only steps until the policy probes; returns the probe's K."""
    for _ in range(300):
        k, _why = p.choose(10)
        if k > 0:
            return k
        observe(p, 0, 0)
    raise AssertionError("no probe in 300 steps")


@pytest.mark.parametrize("learn_from_chance", [False, True])
def test_a_sampled_probe_is_judged_by_its_chance_not_its_draw(learn_from_chance: bool) -> None:
    # Fallen back on a text the draft gets wrong, then a probe whose three tokens all happen to
    # be accepted although each had only a 0.3 chance. Judged by the draw it paid and calls for
    # another probe at once; judged by the chance (0.3 + 0.09 + 0.03 expected tokens) it did not.
    p = policy()
    run(p, 40, accepted_run=0)
    k = _probe_after_fallback(p)
    assert k == 3
    chances = [0.3, 0.3, 0.3] if learn_from_chance else None
    p.observe(3, 3, D1 + 2 * D1, VERIFY[3], 1, D1, chances)
    next_k, _why = p.choose(10)
    assert (next_k == 0) == learn_from_chance


@pytest.mark.parametrize("learn_from_chance", [False, True])
def test_a_sampled_probe_prefix_is_judged_by_its_chance_too(learn_from_chance: bool) -> None:
    # A K = 3 probe with its first token accepted (chance 0.55) and its second rejected. As a
    # draw, a whole accepted draft of one token would have paid, so a K = 1 probe follows. By
    # its chance it would not have: 1.55 expected tokens for a draft and a 2-token verify is
    # slower than the target alone. (Rounding the expectation to whole tokens made every K = 1
    # probe at chance 0.5 or more look paid.)
    p = policy()
    run(p, 40, accepted_run=0)
    assert _probe_after_fallback(p) == 3
    chances = [0.55, 0.4] if learn_from_chance else None
    p.observe(3, 1, D1 + 2 * D1, VERIFY[3], 1, D1, chances)
    next_k, _why = p.choose(10)
    assert next_k == (0 if learn_from_chance else 1)


def test_a_long_wait_between_probes_carries_over_to_the_next_request() -> None:
    # Probes have failed for long enough that the wait between them has grown past 16 steps.
    # A new request is probed at once (its text may be easier, and one losing request does not
    # start the back-off below); when that probe fails too, the next waits as long as before,
    # not 16 steps: each probe after a long fallback costs a catch-up of every skipped token.
    p = policy()
    ks = run(p, 200, accepted_run=0)
    assert max(_waits(ks)) >= 32
    p.end_generation()
    p.begin_generation()
    ks = run(p, 100, accepted_run=0)
    assert ks[0] > 0
    next_probe = next((i for i in range(1, len(ks)) if ks[i] > 0), len(ks))
    assert next_probe - 1 >= 32


def _opens_with_a_probe(p: testing.AdaptivePolicy, accepted_run: int) -> bool:
    """A request of 48 steps on a text whose drafts are accepted up to `accepted_run`, begun and
    ended; whether its first step drafted."""
    p.begin_generation()
    opened = run(p, 48, accepted_run=accepted_run)[0] > 0
    p.end_generation()
    return opened


def test_requests_open_without_a_probe_while_drafting_keeps_losing_time() -> None:
    # Short requests on text the draft never gets right: after n requests in a row whose
    # drafting lost time, the next 2^(n-1) - 1 (n at most 4) open without a probe, and a
    # request whose drafting saved time ends the back-off.
    p = policy()
    run(p, 48, accepted_run=0)  # falls back, probes now and then: time lost
    p.end_generation()
    opened = [_opens_with_a_probe(p, accepted_run=0) for _ in range(24)]
    assert opened == [True, False, True] + [False] * 3 + ([True] + [False] * 7) * 2 + [True, False]
    # A text the draft gets right, in the requests that come (one of them probes it): drafting
    # saves time and the back-off ends, so the hard text after it opens as at first.
    while not _opens_with_a_probe(p, accepted_run=10):
        pass
    opened = [_opens_with_a_probe(p, accepted_run=0) for _ in range(8)]
    assert opened == [True, True, False, True] + [False] * 3 + [True]


@pytest.mark.parametrize("counts", [True, False])
def test_a_request_cut_short_leaves_the_back_off_alone(counts: bool) -> None:
    # Cancelled or timed out, a request had no time to pay for its draft's read of the prompt:
    # its loss says nothing of the text (counted, two losing requests make the third open
    # without a probe).
    p = policy()
    opened = []
    for _ in range(3):
        opened.append(run(p, 48, accepted_run=0)[0] > 0)
        p.end_generation(counts)
        p.begin_generation()
    opened.append(run(p, 48, accepted_run=0)[0] > 0)
    assert opened == ([True, True, False, True] if counts else [True] * 4)


def test_settles_on_the_k_the_text_supports() -> None:
    # Position 1 always right, position 2 never (the chat case in docs/benchmarks.md).
    ks = run(policy(), 80, accepted_run=1)
    assert ks[-40:].count(1) >= 39


def test_positions_a_draft_never_reaches_do_not_drift_back() -> None:
    # After a request where long drafts paid, the chat case: position 2 is tried, always fails,
    # and while K = 1 drafts it keeps that record instead of fading back towards position 1's
    # (which used to bring K = 3 back for a few steps out of every eight).
    p = policy()
    run(p, 60, accepted_run=10)
    p.begin_generation()
    ks = run(p, 100, accepted_run=1)
    assert ks[-60:].count(1) >= 58


def test_a_probe_whose_accepted_prefix_would_have_paid_is_followed_by_that_length() -> None:
    # Fallen back on a text the draft gets wrong; then the text turns into one where position 1
    # is always right and position 2 never. A probe of the prior's K (3) never pays there, but
    # its accepted first token would have as a draft of one: the next step probes K = 1, and
    # drafting comes back at K = 1.
    p = policy()
    run(p, 40, accepted_run=0)
    ks = run(p, 60, accepted_run=1)
    first = next(i for i, k in enumerate(ks) if k > 0)
    assert ks[first] == 3 and ks[first + 1] == 1
    assert ks[-30:].count(1) >= 29


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


def run_sampled(
    p: testing.AdaptivePolicy,
    steps: int,
    chance: float,
    rng: random.Random,
    learn_from_chance: bool = True,
) -> tuple[list[int], list[float]]:
    """Drives `steps` steps of a sampled text where every position is accepted with `chance`,
    drawn from `rng`. Returns the K of each step and the position-1 estimate after it."""
    ks, estimates = [], []
    whole = False
    for _ in range(steps):
        k, _why = p.choose(10)
        n = 0
        while n < k and rng.random() < chance:
            n += 1
        observe(p, k, n, after_whole_draft=whole, chance=chance if learn_from_chance else None)
        whole = k > 0 and n == k
        ks.append(k)
        estimates.append(p.acceptance()[0])
    return ks, estimates


def sampled_close_call(seed: int, learn_from_chance: bool) -> tuple[int, float]:
    """300 steps on a sampled text where every position is accepted with chance 0.65, where
    K = 0, 1 and 3 are all within a few percent of each other. Returns how often K changed and
    the mean position-1 estimate after the first 50 steps."""
    p = policy()
    p.begin_generation()
    ks, estimates = run_sampled(p, 300, 0.65, random.Random(seed), learn_from_chance)
    return sum(a != b for a, b in zip(ks, ks[1:])), sum(estimates[50:]) / 250


def test_when_sampling_estimates_follow_the_chance_of_acceptance_not_the_draw() -> None:
    # Learning from each draw, the estimates follow its noise and K swings between drafting and
    # falling back; every switch back costs a catch-up and a probe.
    from_draws = [sampled_close_call(seed, False) for seed in range(5)]
    assert sum(switches for switches, _ in from_draws) >= 25
    # Learning from the chance the draw had (its mean, without the noise), K settles.
    for seed in range(5):
        switches, estimate = sampled_close_call(seed, True)
        assert switches <= 2
        assert estimate == pytest.approx(0.65, abs=0.02)


def test_drafting_stops_once_target_only_is_clearly_faster() -> None:
    # A text the draft gets right 90 % of the time, then one where each position has a 0.6
    # chance: there K = 3 is about 7 % slower than target-only (K = 1 2 %). The policy falls
    # back once the estimates have moved.
    p = policy()
    p.begin_generation()
    rng = random.Random(3)
    easy, _ = run_sampled(p, 40, 0.9, rng)
    assert easy[-10:] == [3] * 10
    hard, _ = run_sampled(p, 80, 0.6, rng)
    assert hard[-30:].count(0) >= 25


def test_a_new_request_keeps_only_a_hint_of_the_last() -> None:
    def drop_after_one_rejection(new_request: bool) -> float:
        p = policy()
        run(p, 60, accepted_run=10)
        if new_request:
            p.begin_generation()
        before = p.acceptance()[0]
        observe(p, 3, 0)
        return before - p.acceptance()[0]

    # Within a request one rejection is one of many; at the start of the next it weighs more.
    assert drop_after_one_rejection(True) > 2 * drop_after_one_rejection(False)


def test_a_draft_too_slow_at_calibration_stays_so_through_a_slow_spell() -> None:
    # The cannot-pay pair's calibration on the test machine (SmolLM2 Q4_1 target, its Q4_0
    # requant as draft): even a draft accepted whole reaches 0.74x of target-only.
    verify = [0.0110, 0.0173, 0.0225, 0.0275, 0.0347, 0.0403, 0.0455, 0.0493, 0.0554, 0.0619]
    p = testing.AdaptivePolicy()
    p.calibrate(verify, [0.0094, 0.0133])
    p.begin_generation()
    assert not p.can_ever_pay()
    # Target-only steps 70 % slower than calibrated: only their own cost is re-measured.
    for _ in range(100):
        k, why = p.choose(9)
        assert (k, why) == (0, "draft too slow for this target")
        p.observe(0, 0, 0.0, 1.7 * verify[0], 0, 0.0)
    assert p.verify_costs[0] > 1.5 * verify[0]
    assert not p.can_ever_pay()


def test_a_short_slow_spell_as_a_request_opens_does_not_contradict_the_costs() -> None:
    # Measuring again takes far longer than such a spell (another decoder's idle threads still
    # spinning, another process): the steps judge the costs over a window wider than the spell.
    p = policy()
    for slow in [True] * 10 + [False] * 30:
        p.observe(0, 0, 0.0, (2.0 if slow else 1.0) * VERIFY[0])
    assert p.cost_verdict() == "agree"
    p.begin_generation()
    for _ in range(40):
        p.observe(0, 0, 0.0, 2.0 * VERIFY[0])
    assert p.cost_verdict() == "disagree"
    p.begin_generation()
    for _ in range(11):
        p.observe(0, 0, 0.0, 2.0 * VERIFY[0])
    assert p.cost_verdict() == "unjudged"


def test_rejects_bad_input() -> None:
    p = testing.AdaptivePolicy()
    with pytest.raises(ValueError, match="calibrate"):
        p.choose(4)
    with pytest.raises(ValueError, match="verify costs"):
        p.calibrate([0.01], [D1, D2])
    with pytest.raises(ValueError, match="> 0"):
        p.calibrate([0.01, -1.0], [D1, D2])
    with pytest.raises(ValueError, match="1 and of 2 tokens"):
        p.calibrate(VERIFY, [D1])
    with pytest.raises(ValueError, match="finite"):
        p.calibrate(VERIFY, [D1, float("inf")])
    with pytest.raises(ValueError, match="calibrate"):
        p.observe(1, 1, D1, VERIFY[1])
    p.calibrate(VERIFY, [D1, D2])
    with pytest.raises(ValueError, match="n_accepted"):
        p.observe(3, 4, 0.0, 0.0)
    with pytest.raises(ValueError, match="n_accepted"):
        p.observe(11, 0, 0.0, 0.0)
    with pytest.raises(ValueError, match="t_catch_up"):
        p.observe(3, 0, D1, VERIFY[3], 1, 2 * D1)
    with pytest.raises(ValueError, match="one accept_chance per position reached, 2"):
        p.observe(3, 1, D1, VERIFY[3], 1, D1, [0.5])
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        p.observe(3, 0, D1, VERIFY[3], 1, D1, [1.5])
    with pytest.raises(ValueError, match="max_k"):
        testing.AdaptivePolicy(0)


# A batch's costs on this kind of CPU (ms): decodes of a multiple of 4 rows are cheap.
BATCH_VERIFY: list[tuple[int, float]] = [
    (1, 40), (2, 52), (3, 63), (4, 56), (5, 71), (6, 82), (7, 93), (8, 86), (9, 100),
    (10, 112), (11, 123), (12, 114), (16, 118), (20, 148),
]  # fmt: skip
BATCH_DRAFT: list[tuple[int, float]] = [(1, 8.2), (2, 10.9), (4, 11.8), (8, 17.7)]


def expected_tokens(acceptance: float, cap: int) -> list[float]:
    out, reached = [1.0], 1.0
    for _ in range(cap):
        reached *= acceptance
        out.append(out[-1] + reached)
    return out


def plan(acceptance: float, n: int) -> list[int]:
    return testing.plan_batch(
        [expected_tokens(acceptance, 4)] * n,
        [4] * n,
        0,
        [(r, t / 1000) for r, t in BATCH_VERIFY],
        [(r, t / 1000) for r, t in BATCH_DRAFT],
    )


def test_the_batch_plan_finds_drafting_that_pays_only_for_all_together() -> None:
    # One request drafting K = 3 alone decodes 7 rows (dear) for 2.3 more tokens: it does not
    # pay. All four drafting K = 3 decode 16 rows (cheap): 87 tok/s against target-only's 71.
    assert plan(0.88, 4) == [3, 3, 3, 3]
    assert plan(0.3, 4) == [0, 0, 0, 0]


def seconds(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    return [(r, t / 1000) for r, t in points]


def test_a_batch_size_never_measured_gets_the_cost_its_decodes_take() -> None:
    # Calibration measures 12 and 16 rows; 14 is interpolated (116 ms) until a decode of 14
    # rows says otherwise (150 ms on this CPU).
    after = testing.observe_batch_costs(seconds(BATCH_VERIFY), seconds(BATCH_DRAFT), [(14, 0.150)])
    assert (14, pytest.approx(0.150)) in after  # type: ignore[comparison-overlap]
    assert [r for r, _ in after] == sorted({r for r, _ in BATCH_VERIFY} | {14})


def test_a_measured_batch_size_moves_to_the_mean_of_its_decodes() -> None:
    after = dict(
        testing.observe_batch_costs(
            seconds(BATCH_VERIFY), seconds(BATCH_DRAFT), [(16, 0.124), (16, 0.130)]
        )
    )
    # Calibration's 118 ms counts as one decode: (118 + 124 + 130) / 3.
    assert after[16] == pytest.approx(0.124)
    # One decode slowed by a busy machine moves a cost by at most 1.5x of it, halfway.
    assert dict(
        testing.observe_batch_costs(seconds(BATCH_VERIFY), seconds(BATCH_DRAFT), [(4, 5.0)])
    )[4] == pytest.approx((0.056 + 1.5 * 0.056) / 2)


def test_the_plan_leaves_a_batch_size_its_decodes_found_dear() -> None:
    # Three sequences that accept well and one that does not: interpolated, 13 rows (three at
    # K = 3, one at K = 0) look as cheap as 12. Found dearer than 16, the plan drafts for all.
    expected = [expected_tokens(0.9, 4)] * 3 + [expected_tokens(0.1, 4)]
    verify = seconds(BATCH_VERIFY)
    draft = seconds(BATCH_DRAFT)
    assert testing.plan_batch(expected, [4] * 4, 0, verify, draft) == [3, 3, 3, 0]
    learnt = testing.observe_batch_costs(verify, draft, [(13, 0.136)] * 3)
    assert testing.plan_batch(expected, [4] * 4, 0, learnt, draft) == [3, 3, 3, 3]

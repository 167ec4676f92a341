"""The rate check (csrc/rate_check.h) on made-up step rates: `auto`'s steps are held at
target-only where they commit tokens more slowly than it, measured by the wall clock, and only
there; a hold is tried again, and what it costs is bounded."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

import specdec_native as sd
from specdec_native import models

testing = pytest.importorskip("specdec_native._core.testing", reason="needs the test build")

T0 = 0.05  # seconds for a target-only step of one sequence


@dataclass
class World:
    """Speculating commits 1 + Binomial-ish tokens per step at `spec_cost` seconds a step; a
    target-only step commits `n` tokens in T0 * n ** 0.5 seconds (a batch of n rows)."""

    spec_tokens: float  # mean tokens a speculating step commits, per sequence
    spec_cost: float  # seconds a speculating step costs
    seed: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def plain_cost(self, n: int) -> float:
        return float(T0 * n**0.5)

    def spec_step(self, n: int) -> int:
        # Each sequence commits 1..5 tokens, spread around the mean.
        total = 0
        for _ in range(n):
            extra = self.spec_tokens - 1.0
            total += 1 + sum(self.rng.random() < extra / 4 for _ in range(4))
        return total


def run(
    check: object, world: World, steps: int, n: int = 1, modelled: float = 0.0
) -> dict[str, float]:
    """Drives the check through `steps` steps of `world`; returns its rate and plain steps."""
    tokens = seconds = 0.0
    plain = 0
    for _ in range(steps):
        if check.hold_plain(n, modelled):  # type: ignore[attr-defined]
            t, s, drafted = n, world.plain_cost(n), False
            plain += 1
        else:
            t, s, drafted = world.spec_step(n), world.spec_cost, True
        check.observe(n, t, s, drafted)  # type: ignore[attr-defined]
        tokens += t
        seconds += s
    return {"rate": tokens / seconds, "plain": plain}


def plain_rate(world: World, n: int = 1) -> float:
    return n / world.plain_cost(n)


@pytest.mark.parametrize("n", [1, 4])
def test_holds_target_only_where_speculating_measures_slower(n: int) -> None:
    # The model says target-only runs at 1 token per T0 (it does), speculating commits 2.2
    # tokens a step at 2.5 times a plain step's cost: 0.88x of target-only.
    world = World(spec_tokens=2.2, spec_cost=2.5 * T0 * n**0.5)
    check = testing.RateCheck(4)
    out = run(check, world, 3000, n=n, modelled=plain_rate(world, n))
    assert out["plain"] > 0.9 * 3000
    assert out["rate"] >= 0.97 * plain_rate(world, n)
    speculating, target_only, _, last_hold = check.view(n)
    assert target_only == pytest.approx(plain_rate(world, n), rel=1e-6)
    assert last_hold == 256  # the tries after each hold kept losing: the holds doubled


def test_leaves_speculation_alone_where_it_is_clearly_ahead() -> None:
    # 2.6 tokens a step at 1.3 plain steps: 2x. Never a target-only step to measure.
    world = World(spec_tokens=2.6, spec_cost=1.3 * T0)
    check = testing.RateCheck(1)
    out = run(check, world, 2000, modelled=plain_rate(world))
    assert out["plain"] == 0
    assert check.view(1)[1] == 0.0  # target-only never measured


def test_measures_target_only_where_it_is_close_and_keeps_speculating_when_it_wins() -> None:
    # 1.8 tokens at 1.5 plain steps: 1.2x, within reach of the model's target-only rate, so
    # that is measured (a step in eight, until two samples), and then speculating goes on.
    world = World(spec_tokens=1.8, spec_cost=1.5 * T0, seed=3)
    check = testing.RateCheck(1)
    out = run(check, world, 2000, modelled=plain_rate(world))
    # Measured again every 256 steps; now and then a noisy stretch is held for 16 steps.
    assert 2 <= out["plain"] <= 0.03 * 2000
    assert out["rate"] >= 1.15 * plain_rate(world)
    assert check.view(1)[2] is False


def test_a_model_that_is_wrong_about_target_only_is_corrected_by_measuring_it() -> None:
    # The model believes target-only runs at a third of its real speed (a calibration taken on
    # a busy machine): speculating at 0.85x of the real target-only looks 2.5x ahead of the
    # model's, yet its measured rate is what decides: it is held back. No model at all does the
    # same.
    world = World(spec_tokens=2.0, spec_cost=2.35 * T0)
    for modelled in (plain_rate(world) / 3, 0.0):
        check = testing.RateCheck(1)
        out = run(check, world, 3000, modelled=modelled)
        if modelled:
            # Over kExploreBelow (1.3x) of the model's rate: it never looks.
            assert out["plain"] == 0
        else:
            assert out["rate"] >= 0.97 * plain_rate(world)


def test_a_text_that_turns_easy_is_speculated_on_again_within_a_bounded_time() -> None:
    check = testing.RateCheck(1)
    slow = World(spec_tokens=1.5, spec_cost=2.0 * T0)
    run(check, slow, 1500, modelled=plain_rate(slow))
    assert check.view(1)[3] == 256
    fast = World(spec_tokens=3.0, spec_cost=1.5 * T0)
    out = run(check, fast, 1500, modelled=plain_rate(fast))
    # At most one longest hold and a few judged tries spent at target-only.
    assert out["plain"] <= 256 + 32
    assert out["rate"] >= 0.8 * 2.0 * plain_rate(fast)


def test_under_load_drafting_starts_held_and_must_win_its_tries() -> None:
    # Four sequences speculating level with target-only are held: under load drafting must
    # win its tries, not only not lose them.
    level = World(spec_tokens=2.0, spec_cost=2.0 * T0 * 2, seed=4)
    check = testing.RateCheck(4)
    assert check.view(4)[2] is True  # held before its first step
    loaded = run(check, level, 2000, n=4, modelled=plain_rate(level, 4))
    assert loaded["plain"] > 0.9 * 2000
    assert check.view(4)[3] == 256
    # Clearly ahead (2x): after the first hold, never held again.
    ahead = World(spec_tokens=2.6, spec_cost=1.3 * T0 * 2, seed=5)
    check = testing.RateCheck(4)
    out = run(check, ahead, 2000, n=4, modelled=plain_rate(ahead, 4))
    assert 16 <= out["plain"] <= 16 + 0.03 * 2000
    assert out["rate"] >= 1.8 * plain_rate(ahead, 4)


def test_a_step_that_reads_a_prompt_drafts_only_where_drafting_has_won() -> None:
    # Such a step is not measured: the engine asks drafting_won instead of holding or trying.
    ahead = World(spec_tokens=2.6, spec_cost=1.3 * T0 * 2, seed=5)
    level = World(spec_tokens=2.0, spec_cost=2.0 * T0 * 2, seed=4)
    won, lost = testing.RateCheck(4), testing.RateCheck(4)
    for check in (won, lost):
        assert not check.drafting_won(4, plain_rate(ahead, 4))  # held before its first step
    run(won, ahead, 60, n=4, modelled=plain_rate(ahead, 4))
    run(lost, level, 60, n=4, modelled=plain_rate(level, 4))
    assert won.drafting_won(4, plain_rate(ahead, 4))
    assert not lost.drafting_won(4, plain_rate(level, 4))
    assert not won.drafting_won(2, plain_rate(ahead, 2))  # another count: not seen to win
    alone, one_ahead = testing.RateCheck(1), World(spec_tokens=2.6, spec_cost=1.3 * T0, seed=6)
    assert not alone.drafting_won(1, plain_rate(one_ahead))  # nothing measured yet
    run(alone, one_ahead, 60, modelled=plain_rate(one_ahead))
    assert alone.drafting_won(1, plain_rate(one_ahead))
    for n in (0, 2, -1):
        assert alone.drafting_won(n, 1.0) is False


def test_sequence_counts_are_judged_apart_and_out_of_range_is_ignored() -> None:
    check = testing.RateCheck(2)
    slow = World(spec_tokens=1.5, spec_cost=2.0 * T0)
    run(check, slow, 500, n=1, modelled=plain_rate(slow))
    assert check.view(1)[3] > 0
    assert check.view(2) == (0.0, 0.0, True, 16)  # untouched: held, as a lane under load starts
    for n in (0, 3, -1):
        assert check.hold_plain(n, 1.0) is False
        check.observe(n, 5, 1.0, True)
        assert check.view(n) == (0.0, 0.0, False, 0)


def test_an_engine_reports_what_it_measured(deep_pair: models.ModelPair) -> None:
    """The check is fed by real steps: after an `auto` request the engine knows its
    speculating rate for one sequence (whatever this machine makes of it); fixed-K requests
    and an engine with the check off for one sequence (the default) measure nothing."""
    with sd.SpeculativeDecoder(
        deep_pair.target, deep_pair.draft, n_draft="auto", calibration_cache=False
    ) as dec:
        dec._live().set_calibration([0.05] * 11, [0.005, 0.006])
        dec.generate("def fibonacci(n):\n", max_tokens=24)
        dec._live().set_rate_check(True)
        dec.generate("def fibonacci(n):\n", max_tokens=24, n_draft=3)
        assert dec.policy_state()["measured_rates"][0]["speculating"] == 0.0
        dec.generate("def fibonacci(n):\n", max_tokens=48)
        rates = dec.policy_state()["measured_rates"]
    assert len(rates) == 1
    assert rates[0]["speculating"] > 0
    assert set(rates[0]) == {"speculating", "target_only", "holding", "last_hold"}


def test_an_engine_checks_only_steps_of_several_sequences_when_asked(
    deep_pair: models.ModelPair,
) -> None:
    """With the check on under load only (the default), two requests decoding together start
    held (their target-only rate is measured) while a request alone is not checked."""
    import threading

    with sd.SpeculativeDecoder(
        deep_pair.target, deep_pair.draft, n_draft="auto", n_parallel=2, calibration_cache=False
    ) as dec:
        dec._live().set_calibration(
            [0.05] * 11, [0.005, 0.006], [(1, 0.05), (24, 0.1)], [(1, 0.005), (4, 0.006)]
        )
        dec.generate("def fibonacci(n):\n", max_tokens=24)
        prompts = ["def fibonacci(n):\n", "The capital of France is"]
        threads = [
            threading.Thread(target=dec.generate, args=(p,), kwargs={"max_tokens": 32})
            for p in prompts
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        alone, together = dec.policy_state()["measured_rates"]
    assert alone == {"speculating": 0.0, "target_only": 0.0, "holding": False, "last_hold": 0}
    assert together["target_only"] > 0 and together["last_hold"] >= 16

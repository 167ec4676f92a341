"""The adaptive draft length: lossless, visible in the stats, and knows when not to speculate."""

from __future__ import annotations

import json
import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from conftest import NEAR_TIE_GAP, PROMPTS
from helpers import assert_same_or_near_tie, assert_stats_add_up, set_costs_where_drafting_pays

import specdec_native as sd
from specdec_native import calibration, models
from specdec_native._core import testing

PRIOR_ACCEPTANCE = 0.7  # the policy's estimate at every position before it has evidence


def test_auto_is_lossless_and_reports_its_choices(deep_pair: models.ModelPair) -> None:
    # The draft model alone: what its policy learns of the model is asserted below.
    with sd.SpeculativeDecoder(
        deep_pair.target, deep_pair.draft, n_ctx=1024, calibration_cache=False, ngram=False
    ) as dec:
        set_costs_where_drafting_pays(dec)
        drafted = 0
        for prompt in PROMPTS[:3]:
            base = dec.generate(prompt, 40, n_draft=0)
            auto = dec.generate(prompt, 40, n_draft="auto")
            assert_same_or_near_tie(auto, base, NEAR_TIE_GAP)
            assert_stats_add_up(auto.stats, len(auto.tokens))
            s = auto.stats
            assert sum(s.steps_at_k) == s.n_target_passes
            assert sum(k * n for k, n in enumerate(s.steps_at_k)) == s.n_drafted
            drafted += s.n_drafted
        state = dec.policy_state()
    assert drafted > 0
    assert len(state["expected_rate"]) == 11
    assert all(math.isfinite(r) and r > 0 for r in state["expected_rate"])
    # What it learnt of the deep pair's draft: often right, never always, and not the prior.
    assert all(0.05 < a < 1.0 for a in state["acceptance"][:2]), state["acceptance"]
    assert state["acceptance"][0] != PRIOR_ACCEPTANCE


def test_short_request_skips_speculation(deep_decoder: sd.SpeculativeDecoder) -> None:
    r = deep_decoder.generate(PROMPTS[0], 2, n_draft="auto")
    assert r.stats.n_drafted == 0
    assert r.stats.fallback_reason == "short request"


def test_falls_back_where_speculation_cannot_pay(smollm2_q40: Path) -> None:
    # A model drafting for itself costs as much as the target: no K can win. The costs are
    # injected (as this machine measures them, smoothed): the decision follows from them, and a
    # calibration measured on a busy machine once made it otherwise. The model alone: copies
    # (free to draft) could still pay at these costs.
    with sd.SpeculativeDecoder(
        smollm2_q40, smollm2_q40, n_draft="auto", n_ctx=512, calibration_cache=False, ngram=False
    ) as dec:
        dec._live().set_calibration([0.005 + 0.003 * n for n in range(11)], [0.005, 0.008])
        r = dec.generate(PROMPTS[0], 60)
    assert r.stats.n_fallback_steps > 0
    assert r.stats.fallback_reason == "draft too slow for this target"
    assert r.stats.n_speculative_steps == 0  # no probes: they could never pay
    assert r.stats.n_draft_read == 0  # nor did the draft read the prompt for nothing


def test_what_the_draft_reads_is_counted(tiny_pair: models.ModelPair) -> None:
    prompt = "the cat sat on the mat and then the dog"
    with sd.SpeculativeDecoder(tiny_pair.target, tiny_pair.draft, n_ctx=256, n_threads=1) as dec:
        plain = dec.generate(prompt, 20, n_draft=0)
        drafted = dec.generate(prompt, 20, n_draft=3)
    assert drafted.tokens == plain.tokens
    assert plain.stats.n_draft_read == 0
    # The prompt (all but its last token, which the first step decodes), then each step's
    # catch-up: the tokens the step before committed.
    first = drafted.stats.n_prompt - 1
    assert first < drafted.stats.n_draft_read <= first + drafted.stats.n_generated


def test_auto_reads_the_prompt_into_the_draft_at_its_first_draft(
    tiny_pair: models.ModelPair,
) -> None:
    prompt = "the cat sat on the mat and then the dog"
    with sd.SpeculativeDecoder(
        tiny_pair.target, tiny_pair.draft, n_ctx=256, n_threads=1, ngram=False
    ) as dec:
        plain = dec.generate(prompt, 20, n_draft=0)
        # Drafting made nearly free: `auto` drafts, and its first draft catches up on the prompt.
        dec._live().set_calibration([0.01 + 0.001 * n for n in range(11)], [1e-5, 2e-5])
        drafted = dec.generate(prompt, 20)
    assert drafted.tokens == plain.tokens
    assert drafted.stats.n_speculative_steps > 0
    first = drafted.stats.n_prompt - 1
    assert first < drafted.stats.n_draft_read <= first + drafted.stats.n_generated


def test_sampling_with_auto_and_p_min(tiny_pair: models.ModelPair) -> None:
    with sd.SpeculativeDecoder(tiny_pair.target, tiny_pair.draft, n_ctx=256, n_threads=1) as dec:
        assert dec.n_draft == "auto"
        # K follows measured timings, so a seed fixes the output only at a fixed K (the
        # distribution is the target's either way; test_distribution.py checks that).
        a = dec.generate("the cat", 30, temperature=0.9, seed=3)
        assert len(a.tokens) == 30
        assert_stats_add_up(a.stats, len(a.tokens))
        r = dec.generate("the cat", 30, n_draft=8, draft_p_min=0.99)
        # With p_min near 1, drafts stop after their first token, each cut short there but
        # where the tokens left capped K at 1; without one, none is.
        assert r.stats.n_drafted == r.stats.n_speculative_steps
        assert r.stats.n_speculative_steps // 2 < r.stats.n_p_min_stops
        assert r.stats.n_p_min_stops <= r.stats.n_speculative_steps
        assert dec.generate("the cat", 30, n_draft=8).stats.n_p_min_stops == 0


# Costs where drafting loses at the policy's prior (PRIOR_ACCEPTANCE at each position) and
# pays only where the draft is nearly always right: a target decode costs 0.75 ms more per token
# in the batch, a draft decode 0.05 ms.
STEEP_VERIFY = [0.001 + 0.00075 * n for n in range(11)]
CHEAP_DRAFT = [0.00005, 0.00008]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_probe_at_text_the_draft_gets_right_brings_drafting_back(
    tiny_pair: models.ModelPair, temperature: float
) -> None:
    # The target drafting for itself is always right. At these costs the policy starts at
    # target-only; a new request probes at once, finds every token accepted, and drafting
    # resumes; the output stays the target's.
    with sd.SpeculativeDecoder(
        tiny_pair.target,
        tiny_pair.target,
        n_ctx=256,
        n_threads=1,
        calibration_cache=False,
        ngram=False,  # the model's probes (a copy can be rejected)
    ) as dec:
        dec._live().set_calibration(STEEP_VERIFY, CHEAP_DRAFT)
        assert dec.policy_state()["expected_rate"][0] == max(dec.policy_state()["expected_rate"])
        r = dec.generate("the cat", 60, temperature=temperature, seed=5)
        base = dec.generate("the cat", 60, n_draft=0, temperature=temperature, seed=5)
    assert_stats_add_up(r.stats, len(r.tokens))
    s = r.stats
    assert s.n_speculative_steps > 0
    assert s.n_accepted == s.n_drafted
    if temperature == 0.0:
        assert r.tokens == base.tokens


def _decoder(pair: models.ModelPair, calibration_cache: bool = True) -> sd.SpeculativeDecoder:
    # The model alone: a long copy's steps are past the curve the recalibration judges by.
    return sd.SpeculativeDecoder(
        pair.target,
        pair.draft,
        n_ctx=256,
        n_threads=1,
        calibration_cache=calibration_cache,
        ngram=False,
    )


def test_cost_curve_is_stored_and_reused(
    tiny_pair: models.ModelPair, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    # Whether the tiny pair's draft (as large as its target) can pay is noise: a first
    # measurement is trusted here either way.
    monkeypatch.setattr(calibration, "CANNOT_PAY_CONFIRMATIONS", 1)
    with _decoder(tiny_pair) as dec:
        assert dec.policy_state()["calibration"] is None
        dec.generate("the cat", 20)
        first = dec.policy_state()
    assert first["calibration"] == "measured" and first["calibration_seconds"] > 0
    stored = list((tmp_path / "calibration").glob("*.json"))
    assert len(stored) == 1
    with _decoder(tiny_pair) as dec:
        # Fewer steps than a request needs to judge the stored costs: the tiny pair's decodes
        # take microseconds, and their timings are noise that may find them wrong.
        dec.generate("the cat", 8)
        second = dec.policy_state()
    assert second["calibration"] == "cache" and second["calibration_seconds"] == 0
    assert len(second["verify_costs"]) == len(first["verify_costs"])
    # Without the cache (which it then leaves alone), or with other settings, the curve is
    # measured again.
    with _decoder(tiny_pair, calibration_cache=False) as dec:
        dec.generate("the cat", 20)
        assert dec.policy_state()["calibration"] == "measured"
    assert len(list((tmp_path / "calibration").glob("*.json"))) == 1
    with sd.SpeculativeDecoder(tiny_pair.target, tiny_pair.draft, n_ctx=256, n_threads=2) as dec:
        dec.generate("the cat", 20)
        assert dec.policy_state()["calibration"] == "measured"
    assert len(list((tmp_path / "calibration").glob("*.json"))) == 2
    # calibrate() always measures, and replaces what was stored.
    before = stored[0].stat().st_mtime_ns
    with _decoder(tiny_pair) as dec:
        dec.calibrate("the cat")
        assert dec.policy_state()["calibration"] == "measured"
    assert stored[0].stat().st_mtime_ns > before


def test_a_stored_curve_that_says_drafting_cannot_pay_is_measured_again_until_confirmed(
    tiny_pair: models.ModelPair, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # "Draft too slow" ends speculation for good, so one measurement taken on a busy moment
    # must not decide it: a stored curve by which drafting cannot pay is measured again, and
    # trusted once two measurements in a row said so.
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    with _decoder(tiny_pair) as dec:
        dec.generate("the cat", 8)
    (path,) = (tmp_path / "calibration").glob("*.json")
    record = json.loads(path.read_text())
    # As one measurement might say: a draft as slow as the target.
    verify = record["verify_costs"]
    record.update(draft_costs=[verify[0], 2 * verify[0]], cannot_pay=1)
    path.write_text(json.dumps(record))
    with _decoder(tiny_pair) as dec:
        dec.generate("the cat", 8)
        state = dec.policy_state()
    assert state["calibration"] == "measured"
    # The tiny pair's draft is as large as its target: whether it can pay is noise. Either
    # way the count follows the new measurement.
    expected = 0 if state["drafting_can_pay"] else 2
    assert json.loads(path.read_text())["cannot_pay"] == expected
    # Confirmed: trusted, and the request does not draft.
    record["cannot_pay"] = calibration.CANNOT_PAY_CONFIRMATIONS
    path.write_text(json.dumps(record))
    with _decoder(tiny_pair) as dec:
        r = dec.generate("the cat", 8)
        assert dec.policy_state()["calibration"] == "cache"
    assert r.stats.fallback_reason == "draft too slow for this target"


def test_damaged_or_stale_cost_curve_is_measured_again(
    tiny_pair: models.ModelPair, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setattr(calibration, "CANNOT_PAY_CONFIRMATIONS", 1)  # see the test above
    with _decoder(tiny_pair) as dec:
        dec.generate("the cat", 20)
    (path,) = (tmp_path / "calibration").glob("*.json")
    record = json.loads(path.read_text())
    for bad in ([-1.0, 0.002], [0.001], "x", None, [10**400, 0.002]):
        record["verify_costs"] = bad
        path.write_text(json.dumps(record))
        with _decoder(tiny_pair) as dec:
            r = dec.generate("the cat", 20)
            assert dec.policy_state()["calibration"] == "measured", bad
        assert len(r.tokens) == 20
    path.write_text("{not json")
    with _decoder(tiny_pair) as dec:
        dec.generate("the cat", 20)
        assert dec.policy_state()["calibration"] == "measured"
    # A model file that changed (here: touched) is a different model.
    path.unlink()
    with _decoder(tiny_pair) as dec:
        dec.generate("the cat", 20)
    os.utime(tiny_pair.draft, ns=(time.time_ns(), time.time_ns() + 10**9))
    with _decoder(tiny_pair) as dec:
        dec.generate("the cat", 20)
        assert dec.policy_state()["calibration"] == "measured"


def test_recalibration_backs_off_while_the_steps_keep_contradicting_it(
    tiny_pair: models.ModelPair,
) -> None:
    # A machine whose decodes time differently in a calibration than in use would otherwise
    # measure again after every request: after n recalibrations in a row, the next waits for
    # 2^n requests whose steps disagree.
    assert _recalibrations_while_the_costs_read_3x(tiny_pair, 7) == [
        True, False, True, False, False, False, True,
    ]  # fmt: skip


def test_on_a_gpu_steps_that_contradict_the_costs_measure_nothing_again(
    tiny_pair: models.ModelPair,
) -> None:
    # There a step whose K changed runs without a CUDA graph, slower than the calibration's
    # decodes by design: measuring again would contradict the steps as much, for seconds.
    testing.set_gpu_timing(True)
    try:
        assert _recalibrations_while_the_costs_read_3x(tiny_pair, 3) == [False] * 3
    finally:
        testing.set_gpu_timing(False)


def _recalibrations_while_the_costs_read_3x(pair: models.ModelPair, requests: int) -> list[bool]:
    """Which of `requests` requests measured the costs again, each begun with costs 3x too high."""
    with _decoder(pair, calibration_cache=False) as dec:
        dec.calibrate()
        engine = dec._live()
        recalibrated = []
        for _ in range(requests):
            state = engine.policy_state()
            engine.set_calibration(
                [3 * t for t in state["verify_costs"]], [3 * t for t in state["draft_costs"]]
            )
            recalibrated.append(dec.generate("the cat", 64).stats.recalibrated)
        return recalibrated


def test_a_stored_cost_curve_the_steps_contradict_is_measured_again(
    deep_pair: models.ModelPair, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    # One thread, not as many as the machine leaves free: costs that follow the load from one
    # decoder to the next would contradict each other.
    pair = (deep_pair.target, deep_pair.draft)
    with sd.SpeculativeDecoder(*pair, n_ctx=512, n_threads=1, ngram=False) as dec:
        dec.calibrate()
        clean = dec.policy_state()["verify_costs"]
    (path,) = (tmp_path / "calibration").glob("*.json")
    # As a calibration taken while the machine was busy would be: every cost 3x too high.
    record = json.loads(path.read_text())
    record["verify_costs"] = [3 * t for t in record["verify_costs"]]
    record["draft_costs"] = [3 * t for t in record["draft_costs"]]
    path.write_text(json.dumps(record))
    with sd.SpeculativeDecoder(*pair, n_ctx=512, n_threads=1, ngram=False) as dec:
        healed = dec.generate(PROMPTS[0], 48)
        state = dec.policy_state()
        assert healed.stats.recalibrated and state["calibration"] == "measured"
        assert state["verify_costs"][0] < 2 * clean[0]
        assert len(healed.tokens) == 48
    # What was stored is the new measurement: the next run trusts it.
    with sd.SpeculativeDecoder(*pair, n_ctx=512, n_threads=1, ngram=False) as dec:
        again = dec.generate(PROMPTS[0], 48)
        assert not again.stats.recalibrated and dec.policy_state()["calibration"] == "cache"


def test_a_decoder_of_several_slots_reuses_its_batch_costs(
    tiny_pair: models.ModelPair, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server restarting reads its costs, batch costs included, instead of measuring them for
    seconds; a different number of slots measures its own."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))

    def first_request(n_parallel: int) -> dict[str, Any]:
        with sd.SpeculativeDecoder(
            tiny_pair.target, tiny_pair.draft, n_ctx=128, n_parallel=n_parallel
        ) as dec:
            dec.generate("the cat", 8)
            return dec.policy_state()

    measured = first_request(3)
    assert measured["calibration"] == "measured" and measured["batch_verify_costs"]
    # A verdict that drafting can never pay is trusted only once measured twice in a row.
    reads = [first_request(3) for _ in range(calibration.CANNOT_PAY_CONFIRMATIONS)]
    read = next(state for state in reads if state["calibration"] == "cache")
    assert [rows for rows, _ in read["batch_verify_costs"]] == [
        rows for rows, _ in measured["batch_verify_costs"]
    ]
    assert first_request(2)["calibration"] == "measured"
    # A record whose batch costs do not fit this decoder is measured again, not trusted.
    for path in (tmp_path / "calibration").glob("*.json"):
        record = json.loads(path.read_text())
        record["batch_verify_costs"] = [[2, 0.1], [1, 0.1]]
        path.write_text(json.dumps(record))
    assert first_request(3)["calibration"] == "measured"


def test_a_stored_curve_is_read_without_waiting_for_running_requests(
    smollm2_q40: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With several slots, the first `auto` request reads the stored costs and shares the steps
    of a request already running, rather than wait for it to end (its timeout, cancel flag and
    Ctrl-C would not reach it meanwhile)."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))

    def decoder() -> sd.SpeculativeDecoder:
        return sd.SpeculativeDecoder(smollm2_q40, "ngram", n_parallel=2, n_ctx=1024)

    with decoder() as dec:
        key = dec._calibration_key
    assert key is not None
    verify = [0.01 * (1 + 0.2 * n) for n in range(11)]
    batch = [(1, 0.01), (2, 0.012), (4, 0.016), (8, 0.026), (16, 0.045), (22, 0.06)]
    calibration.save(key, calibration.Stored(verify, [0.0, 0.0], 0, batch, [(1, 0.0)]))
    started = threading.Event()
    with decoder() as dec, ThreadPoolExecutor(1) as pool:
        running = pool.submit(
            dec.generate, "Once upon a time", 300, n_draft=3, temperature=0.0,
            ignore_eos=True, on_start=started.set,
        )  # fmt: skip
        assert started.wait(60)
        short = dec.generate("Hello", 4, temperature=0.0, timeout=30)
        assert not running.done(), "the stored curve waited for the running request"
        state = dec.policy_state()
        assert state["calibration"] == "cache"
        # The stored sizes, moved by the decodes since (and sizes they added).
        assert {rows for rows, _ in batch} <= {rows for rows, _ in state["batch_verify_costs"]}
        running.result()
    assert short.finish_reason == "length" and short.stats.n_shared_steps > 0


def test_batch_costs_are_checked(tiny_pair: models.ModelPair) -> None:
    verify, draft = [0.01 * n for n in range(1, 12)], [0.001, 0.002]
    with sd.SpeculativeDecoder(
        tiny_pair.target, tiny_pair.draft, n_ctx=64, n_parallel=2, calibration_cache=False
    ) as dec:
        engine = dec._live()
        with pytest.raises(ValueError, match="needs its batch costs too"):
            engine.set_calibration(verify, draft)
        with pytest.raises(ValueError, match="rows increasing from 1"):
            engine.set_calibration(verify, draft, [(2, 0.1), (1, 0.1)], [(1, 0.01)])
        assert not dec.policy_state()["calibrated"]  # nothing half set
        engine.set_calibration(verify, draft, [(1, 0.01), (8, 0.05)], [(1, 0.001)])
        state = dec.policy_state()
        assert state["batch_verify_costs"] == [(1, 0.01), (8, 0.05)]
        assert state["verify_costs"] == pytest.approx(verify)
    with (
        sd.SpeculativeDecoder(
            tiny_pair.target, tiny_pair.draft, n_ctx=64, calibration_cache=False
        ) as alone,
        pytest.raises(ValueError, match="apply to an engine of several slots"),
    ):
        alone._live().set_calibration(verify, draft, [(1, 0.01)], [])


def test_on_a_gpu_each_shape_is_timed_after_two_decodes_of_it(
    tiny_decoder: sd.SpeculativeDecoder,
) -> None:
    # llama.cpp's CUDA graphs replay a shape from its third decode in a row; the test hook times
    # as on a GPU, so that the CPU runs (and the sanitizer build checks) what only a GPU would.
    def decodes_of(draft: bool = False) -> tuple[int, list[float]]:
        before = testing.decodes()
        costs = tiny_decoder.measure_decode_cost("the", 4, repeats=1, draft=draft)
        return testing.decodes() - before, costs

    plain, _ = decodes_of()
    testing.set_gpu_timing(True)
    try:
        primed, costs = decodes_of()
        primed_draft, _ = decodes_of(draft=True)
    finally:
        testing.set_gpu_timing(False)
    assert primed - plain == 2 * 4  # two untimed decodes before each of the 4 timed shapes
    assert primed_draft == primed
    assert len(costs) == 4 and all(c > 0 for c in costs)

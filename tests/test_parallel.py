"""Requests that generate at once: each in its own slot of one decoder, every step of all of them
batched into one target decode. Each must get what it gets alone (greedy: up to near-ties, since
a batched decode may round differently), keep its own cancel flag, and find its prompt cache."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import SHARED_DECODE_NEAR_TIE_GAP as NEAR_TIE_GAP
from helpers import (
    assert_each_token_near_the_targets_choice,
    assert_same_or_near_tie,
    assert_stats_add_up,
)

import specdec_native as sd
from specdec_native import models

PROMPTS = [
    "The history of the Roman empire",
    "def fibonacci(n):",
    "Once upon a time, in a quiet village,",
    "The three laws of robotics are",
]


@pytest.fixture(scope="module")
def parallel(deep_pair: models.ModelPair) -> Iterator[sd.SpeculativeDecoder]:
    with sd.SpeculativeDecoder(
        deep_pair.target, deep_pair.draft, n_draft=3, n_ctx=1024, n_parallel=4
    ) as dec:
        yield dec


@pytest.fixture(scope="module")
def target_only(deep_pair: models.ModelPair) -> Iterator[sd.SpeculativeDecoder]:
    """The target alone, one sequence: decodes no other request's rows and reads no cache that a
    batched decode wrote."""
    with sd.SpeculativeDecoder(deep_pair.target, n_draft=0, n_ctx=1024) as dec:
        yield dec


def run_together(
    dec: sd.SpeculativeDecoder, calls: list[dict[str, Any]]
) -> list[sd.GenerationResult]:
    """generate(**call) for every call, each on its own thread, all started together."""
    results: list[sd.GenerationResult | None] = [None] * len(calls)
    errors: list[BaseException] = []
    start = threading.Barrier(len(calls))

    def work(i: int) -> None:
        try:
            start.wait()
            results[i] = dec.generate(**calls[i])
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert all(r is not None for r in results)
    return [r for r in results if r is not None]


def test_concurrent_greedy_requests_give_what_each_gives_alone(
    parallel: sd.SpeculativeDecoder, target_only: sd.SpeculativeDecoder
) -> None:
    calls: list[dict[str, Any]] = [{"prompt": p, "max_tokens": 40} for p in PROMPTS]
    alone = [parallel.generate(**c) for c in calls]
    together = run_together(parallel, calls)
    for a, t in zip(alone, together):
        assert_same_or_near_tie(t, a, NEAR_TIE_GAP)
        assert_each_token_near_the_targets_choice(target_only, t, NEAR_TIE_GAP)
        assert_stats_add_up(t.stats, len(t.tokens))
        assert a.stats.n_shared_steps == 0
    # They did share the target's decodes.
    assert all(t.stats.n_shared_steps > 0 for t in together)


def test_requests_of_every_kind_share_a_step(parallel: sd.SpeculativeDecoder) -> None:
    calls: list[dict[str, Any]] = [
        {"prompt": PROMPTS[0], "max_tokens": 32},  # greedy, K = 3
        {"prompt": PROMPTS[1], "max_tokens": 32, "n_draft": 0},  # target only
        {"prompt": PROMPTS[2], "max_tokens": 32, "n_draft": "auto"},
        {"prompt": PROMPTS[3], "max_tokens": 32, "temperature": 0.8, "seed": 7},
    ]
    alone = [parallel.generate(**c) for c in calls]
    together = run_together(parallel, calls)
    for a, t in zip(alone[:3], together[:3]):
        assert_same_or_near_tie(t, a, NEAR_TIE_GAP)
    assert together[1].stats.n_drafted == 0
    assert together[3].finish_reason in ("length", "stop")
    assert sum(t.stats.n_shared_steps for t in together) > 0
    for t in together:
        assert_stats_add_up(t.stats, len(t.tokens))


def test_cancelling_one_of_four_streams_leaves_the_others_intact(
    parallel: sd.SpeculativeDecoder, target_only: sd.SpeculativeDecoder
) -> None:
    n = 48
    alone = [parallel.generate(p, n) for p in PROMPTS]
    flags = [sd.CancelFlag() for _ in PROMPTS]
    pieces = [0] * len(PROMPTS)

    def on_text(i: int) -> Any:
        def count(_: str) -> None:
            pieces[i] += 1
            if i == 1 and pieces[i] == 3:
                flags[1].cancel()

        return count

    calls = [
        {"prompt": p, "max_tokens": n, "cancel": flags[i], "on_text": on_text(i)}
        for i, p in enumerate(PROMPTS)
    ]
    results = run_together(parallel, calls)
    assert results[1].finish_reason == "cancelled"
    assert len(results[1].tokens) < n
    for i in (0, 2, 3):
        assert results[i].finish_reason == alone[i].finish_reason
        assert_same_or_near_tie(results[i], alone[i], NEAR_TIE_GAP)
        assert_each_token_near_the_targets_choice(target_only, results[i], NEAR_TIE_GAP)


def test_a_request_finds_its_prompt_cache_in_its_own_slot(
    parallel: sd.SpeculativeDecoder,
) -> None:
    history = "A long conversation about the sea, its ships and their sailors. " * 10
    first = parallel.generate(history, 8)
    # Other requests come and go in other slots meanwhile.
    run_together(parallel, [{"prompt": p, "max_tokens": 8} for p in PROMPTS[:3]])
    follow_up = history + first.text + " And then?"
    cached = parallel.generate(follow_up, 16)
    assert cached.stats.n_prompt_cached >= len(first.prompt_tokens) - 1
    with sd.SpeculativeDecoder(parallel.target_path, parallel.draft_path, n_draft=3) as cold:
        assert_same_or_near_tie(cached, cold.generate(follow_up, 16), NEAR_TIE_GAP)


def test_a_cached_prefix_whose_window_was_given_away_is_read_again(gemma3: Path) -> None:
    """Gemma 3 attends over a sliding window of 512 in most layers, and llama.cpp gives the
    cells of positions outside a sequence's window to other sequences' tokens. A later request
    that shares only an early prefix with that sequence must not attend over the missing cells
    (it read nothing there and answered differently from its first token)."""
    words = "river stone market lantern harbour winter copper garden signal orchard".split()

    def text(n: int, seed: int) -> str:
        rng = random.Random(seed)
        return " ".join(rng.choice(words) for _ in range(n))

    instructions = "Summarise the notes below in one sentence. " + text(70, 0) + "\n\n"
    follow_up = instructions + "Notes: the keeper logged every ship that passed the cape. Summary:"
    with sd.SpeculativeDecoder(gemma3, n_draft=0, n_ctx=2048, n_parallel=2) as dec:
        # A short request in one slot; a long one that starts while it runs, in the other.
        running = threading.Event()
        short = threading.Thread(
            target=lambda: dec.generate(text(480, 2), 30, on_text=lambda _: running.set())
        )
        short.start()
        assert running.wait(120)
        dec.generate(instructions + text(1100, 1), 4)
        short.join(120)
        # Into the short one's slot: more tokens than it freed, so they take the long one's
        # cells outside its window.
        dec.generate(text(900, 3), 4)
        shared = dec.generate(follow_up, 24)
    with sd.SpeculativeDecoder(gemma3, n_draft=0, n_ctx=2048) as fresh:
        alone = fresh.generate(follow_up, 24)
    assert_same_or_near_tie(shared, alone, NEAR_TIE_GAP)


def test_more_requests_than_slots_wait_their_turn(deep_pair: models.ModelPair) -> None:
    with sd.SpeculativeDecoder(
        deep_pair.target, deep_pair.draft, n_draft=2, n_ctx=512, n_parallel=2
    ) as dec:
        calls = [{"prompt": PROMPTS[i % 4], "max_tokens": 12} for i in range(6)]
        results = run_together(dec, calls)
    assert all(r.finish_reason == "length" and len(r.tokens) == 12 for r in results)
    # Two at a time: the last ones waited for a slot.
    assert max(r.stats.t_queue for r in results) > min(r.stats.t_total for r in results)


def test_a_long_prompt_joins_running_streams_in_chunks(parallel: sd.SpeculativeDecoder) -> None:
    long_prompt = "Numbers, one after another: " + ", ".join(str(i) for i in range(150))
    calls: list[dict[str, Any]] = [{"prompt": p, "max_tokens": 40} for p in PROMPTS[:2]]
    calls.append({"prompt": long_prompt, "max_tokens": 8})
    # Together first, while the caches hold none of it.
    together = run_together(parallel, calls)
    alone = [parallel.generate(**c) for c in calls]
    # Longer than one step can carry beside running streams (n_batch / 2 = 256): read in
    # several chunks, each riding in a step of the streams already running.
    assert together[2].stats.n_prompt > 256
    assert together[2].stats.n_prompt_chunks > 1
    assert together[0].stats.n_shared_steps > 0
    for a, t in zip(alone, together):
        assert_same_or_near_tie(t, a, NEAR_TIE_GAP)


def test_short_prompts_join_running_streams_whole(parallel: sd.SpeculativeDecoder) -> None:
    # Three prompts of over 20 tokens arrive together while a stream runs: more than one chunk
    # (32 tokens) in all, but each is read in one decode, its first token with it.
    prompts = [
        f"Question {i}: what do the old ships of the cold northern sea carry home in the long winter?"
        for i in range(3)
    ]
    running = threading.Event()
    streams: list[sd.GenerationResult] = []
    first = threading.Thread(
        target=lambda: streams.append(
            parallel.generate(PROMPTS[0], 60, on_text=lambda _: running.set())
        )
    )
    first.start()
    assert running.wait(60)
    joined = run_together(parallel, [{"prompt": p, "max_tokens": 4} for p in prompts])
    first.join()
    assert streams[0].stats.n_shared_steps > 0
    for r in joined:
        assert 20 < r.stats.n_prompt <= 32
        assert r.stats.n_prompt_chunks == 1


def test_ngram_drafting_in_parallel(deep_pair: models.ModelPair) -> None:
    text = "one two three four five six seven eight nine ten. " * 4
    with sd.SpeculativeDecoder(deep_pair.target, "ngram", n_draft=4, n_parallel=3) as dec:
        calls: list[dict[str, Any]] = [{"prompt": text + p, "max_tokens": 24} for p in PROMPTS[:3]]
        alone = [dec.generate(**c) for c in calls]
        together = run_together(dec, calls)
    for a, t in zip(alone, together):
        assert_same_or_near_tie(t, a, NEAR_TIE_GAP)
        assert t.stats.drafted_by_model == 0


@pytest.mark.parametrize("n", [0, -1, 65, 1.5, True])
def test_n_parallel_out_of_range(deep_pair: models.ModelPair, n: Any) -> None:
    with pytest.raises((ValueError, TypeError), match="n_parallel"):
        sd.SpeculativeDecoder(deep_pair.target, deep_pair.draft, n_parallel=n)


def test_more_slots_than_one_decode_holds_is_refused(deep_pair: models.ModelPair) -> None:
    with pytest.raises(ValueError, match="n_batch"):
        sd.SpeculativeDecoder(deep_pair.target, deep_pair.draft, n_parallel=8, n_batch=4)


def test_predictions_in_parallel(deep_pair: models.ModelPair) -> None:
    """Each slot follows its own prediction while the slots share the target's decodes."""
    with sd.SpeculativeDecoder(deep_pair.target, None, n_ctx=1024, n_parallel=3) as dec:
        alone = [dec.generate(p, 32, n_draft=0) for p in PROMPTS[:3]]
        calls: list[dict[str, Any]] = [
            {"prompt": p, "max_tokens": 32, "prediction": a.tokens, "n_draft": k}
            for p, a, k in zip(PROMPTS[:3], alone, ("auto", 4, "auto"))
        ]
        together = run_together(dec, calls)
    for a, t in zip(alone, together):
        assert_same_or_near_tie(t, a, NEAR_TIE_GAP)
        assert_stats_add_up(t.stats, len(t.tokens))
        assert t.stats.accepted_by_prediction > 0, t.stats
    assert any(t.stats.n_shared_steps > 0 for t in together)

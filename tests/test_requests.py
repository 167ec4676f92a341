"""What a request brings beyond its prompt: a prompt cache shared with the request before it,
its own cancel flag and timeout, async use, and weights shared between decoders."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import weakref
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import NEAR_TIE_GAP
from helpers import assert_same_or_near_tie

import specdec_native as sd
from specdec_native import models
from specdec_native.decoder import ArgumentTypeError

HISTORY = "A long conversation about the sea, its ships and their sailors. " * 12


@pytest.fixture
def deep(deep_pair: models.ModelPair) -> Iterator[sd.SpeculativeDecoder]:
    with sd.SpeculativeDecoder(deep_pair.target, deep_pair.draft, n_draft=3, n_ctx=1024) as dec:
        yield dec


def test_a_follow_up_prompt_decodes_only_what_is_new(deep: sd.SpeculativeDecoder) -> None:
    first = deep.generate(HISTORY, 8)
    assert first.stats.n_prompt_cached == 0
    follow_up = HISTORY + first.text + " And then?"
    r = deep.generate(follow_up, 8)
    # Everything of the first request but the text after its common prefix is reused.
    assert r.stats.n_prompt_cached >= first.stats.n_prompt - 1
    assert r.stats.n_prompt_cached < r.stats.n_prompt


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_cache_hit_gives_what_a_cold_run_gives(
    deep_pair: models.ModelPair, deep: sd.SpeculativeDecoder, temperature: float
) -> None:
    prompt = HISTORY + " The captain said"
    deep.generate(HISTORY + " Something else entirely", 6, temperature=temperature, seed=1)
    warm = deep.generate(prompt, 24, temperature=temperature, seed=5)
    assert warm.stats.n_prompt_cached > 0
    with sd.SpeculativeDecoder(deep_pair.target, deep_pair.draft, n_draft=3, n_ctx=1024) as cold:
        base = cold.generate(prompt, 24, temperature=temperature, seed=5)
    assert base.stats.n_prompt_cached == 0
    if temperature == 0.0:
        assert_same_or_near_tie(warm, base, NEAR_TIE_GAP)
    else:
        # Same seed, same K, same cache contents: the same draws, unless a near-tie in the
        # logits moved one.
        assert len(warm.tokens) == len(base.tokens) == 24


def test_a_cold_prompt_brings_the_first_token_with_its_decode(deep: sd.SpeculativeDecoder) -> None:
    # Two tokens wanted at K = 3: the first comes with the prompt's decode, so the one step
    # left has no room for a draft.
    cold = deep.generate(HISTORY, 2)
    assert cold.stats.n_prompt_cached == 0
    assert cold.stats.first_from_prompt
    assert cold.stats.steps_at_k == [1] and cold.stats.n_target_passes == 1
    # Its rate counts the one token the generation's time made, as llama.cpp's eval rate.
    assert cold.stats.tokens_per_second == pytest.approx(1 / cold.stats.t_generation)
    # The whole prompt cached, there is no prompt decode: the first step drafts.
    cached = deep.generate(HISTORY, 2)
    assert cached.stats.n_prompt_cached == cached.stats.n_prompt - 1
    assert not cached.stats.first_from_prompt
    assert cached.stats.steps_at_k[1] == 1
    assert cached.tokens == cold.tokens


def test_a_shorter_prompt_after_a_longer_one(deep: sd.SpeculativeDecoder) -> None:
    deep.generate(HISTORY, 4)
    r = deep.generate(HISTORY[:40], 4)
    assert 0 < r.stats.n_prompt_cached < r.stats.n_prompt
    assert len(r.tokens) == 4


def test_a_timeout_ends_the_request(deep: sd.SpeculativeDecoder) -> None:
    r = deep.generate("Once upon a time", 1000, timeout=0.5)
    assert r.finish_reason == "timeout"
    assert 0 < len(r.tokens) < 1000
    assert r.stats.t_total < 5.0
    assert deep.generate("Hi", 3).finish_reason == "length"
    # A timeout beyond what a clock counts in nanoseconds is no timeout, not one already past.
    for far in (1e10, 1e30):
        assert deep.generate("Hi", 3, timeout=far).finish_reason == "length", far
    assert deep.generate("Hi", 3, deadline=time.monotonic() + 1e10).finish_reason == "length"


def test_a_timeout_while_waiting_for_the_decoder(deep: sd.SpeculativeDecoder) -> None:
    busy = threading.Thread(target=lambda: deep.generate("Once upon a time", 60))
    busy.start()
    time.sleep(0.2)
    r = deep.generate("Hi", 3, timeout=0.3)
    busy.join()
    assert r.finish_reason == "timeout" and r.tokens == []
    assert r.stats.t_queue >= 0.29


def test_cancelling_one_request_leaves_the_other(deep: sd.SpeculativeDecoder) -> None:
    flag = sd.CancelFlag()
    results: dict[str, sd.GenerationResult] = {}
    a = threading.Thread(target=lambda: results.update(a=deep.generate("Once upon a time", 30)))
    b = threading.Thread(target=lambda: results.update(b=deep.generate("Hello", 30, cancel=flag)))
    a.start()
    time.sleep(0.1)
    b.start()  # waits for a
    time.sleep(0.1)
    flag.cancel()
    a.join()
    b.join()
    assert results["a"].finish_reason == "length" and len(results["a"].tokens) == 30
    assert results["b"].finish_reason == "cancelled"


def test_breaking_out_of_a_waiting_stream_does_not_cancel_the_running_request(
    deep: sd.SpeculativeDecoder,
) -> None:
    results: dict[str, sd.GenerationResult] = {}
    a = threading.Thread(target=lambda: results.update(a=deep.generate("Once upon a time", 30)))
    a.start()
    time.sleep(0.1)
    stream = deep.stream("Hello", 30)
    consumer = threading.Thread(target=lambda: next(stream, None))
    consumer.start()
    time.sleep(0.2)
    a.join()
    consumer.join()
    stream.close()
    assert results["a"].finish_reason == "length"


def test_async_generate_and_stream(deep: sd.SpeculativeDecoder) -> None:
    async def main() -> tuple[sd.GenerationResult, list[str], int]:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.create_task(tick())
        r = await deep.agenerate("Once upon a time", 12)
        pieces = [p async for p in deep.astream("Once upon a time", 12)]
        ticker.cancel()
        return r, pieces, ticks

    r, pieces, ticks = asyncio.run(main())
    assert len(r.tokens) == 12
    assert "".join(pieces) == r.text  # greedy, same K: the same text
    assert ticks > 5  # the event loop kept running while the engine worked


def test_cancelling_an_async_task_stops_its_generation(deep: sd.SpeculativeDecoder) -> None:
    async def main() -> sd.GenerationResult:
        task = asyncio.create_task(deep.agenerate("Once upon a time", 1000))
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await deep.agenerate("Hi", 3)

    t0 = time.monotonic()
    after = asyncio.run(main())
    assert after.finish_reason == "length"
    # The cancelled generation did not run its 1000 tokens first.
    assert after.stats.t_queue < 2.0 and time.monotonic() - t0 < 10


def test_async_calls_have_threads_of_their_own(
    tiny_pair: models.ModelPair, smollm2_q40: Path
) -> None:
    """Every slot of a decoder serves an async call at once, however few threads asyncio's
    shared pool has (cores + 4: 6 on 2 cores); and a timeout counts from the call, a wait for
    a thread included."""
    slots = 12
    with sd.SpeculativeDecoder(
        tiny_pair.target, n_draft=0, n_ctx=64 * slots, n_parallel=slots, n_threads=1
    ) as dec:
        together = threading.Barrier(slots, timeout=30)
        met: list[int] = []

        def meet(_: str) -> None:
            if len(met) < slots:  # each call once, on its first piece
                met.append(1)
                together.wait()

        async def all_at_once() -> list[sd.GenerationResult]:
            calls = [dec.agenerate(f"the cat {i}", 4, on_text=meet) for i in range(slots)]
            return list(await asyncio.gather(*calls))

        assert all(len(r.tokens) == 4 for r in asyncio.run(all_at_once()))
    # More calls than threads, each longer than its timeout: the last to get a thread are
    # past their deadline already.
    with sd.SpeculativeDecoder(smollm2_q40, n_draft=0, n_ctx=512, n_parallel=2) as dec:

        async def timed(i: int) -> tuple[float, sd.GenerationResult]:
            t0 = time.monotonic()
            r = await dec.agenerate(f"Story {i}:", 400, timeout=1.5, logit_bias={2: -100})
            return time.monotonic() - t0, r

        async def more_than_threads() -> list[tuple[float, sd.GenerationResult]]:
            return list(await asyncio.gather(*(timed(i) for i in range(80))))

        timings = asyncio.run(more_than_threads())
    assert all(r.finish_reason == "timeout" for _, r in timings)
    assert max(seconds for seconds, _ in timings) < 2.5  # not 1.5 s after a thread came


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_two_decoders_on_the_same_files_share_the_weights(smollm2_q40: Path) -> None:
    size_mib = smollm2_q40.stat().st_size / 2**20
    with sd.SpeculativeDecoder(smollm2_q40, n_ctx=256) as a:
        a.generate("Hi", 2)
        before = rss_mib()
        with sd.SpeculativeDecoder(smollm2_q40, n_ctx=256) as b:
            b.generate("Hi", 2)
            grew = rss_mib() - before
    assert grew < size_mib / 4, (
        f"a second decoder took {grew:.0f} MiB of a {size_mib:.0f} MiB model"
    )


def test_from_llama_uses_the_weights_a_llama_already_loaded(smollm2_q40: Path) -> None:
    import llama_cpp

    llm = llama_cpp.Llama(str(smollm2_q40), n_ctx=512, verbose=False)
    before = rss_mib()
    with sd.SpeculativeDecoder.from_llama(llm, draft="ngram", n_draft=3) as dec:
        r = dec.generate("Once upon a time", 12)
        grew = rss_mib() - before
    assert grew < smollm2_q40.stat().st_size / 2**20 / 4, f"{grew:.0f} MiB: loaded again?"
    with sd.SpeculativeDecoder(smollm2_q40, draft="ngram", n_draft=3, n_ctx=512) as own:
        assert own.generate("Once upon a time", 12).tokens == r.tokens
    llm.close()


def test_from_llama_with_a_draft_llama_and_after_close(smollm2: Path, smollm2_q40: Path) -> None:
    import llama_cpp

    target = llama_cpp.Llama(str(smollm2), n_ctx=512, verbose=False)
    draft = llama_cpp.Llama(str(smollm2_q40), n_ctx=512, verbose=False)
    dec = sd.SpeculativeDecoder.from_llama(target, draft, n_draft=3)
    r = dec.generate("The capital of France is", 16)
    assert r.stats.n_drafted > 0 and r.stats.n_accepted > 0
    draft.close()
    with pytest.raises(sd.EngineClosedError, match="Llama"):
        dec.generate("Hi", 2)
    dec.close()
    target.close()
    # A Llama closed while a generation runs on its weights: the generation ends first.
    target = llama_cpp.Llama(str(smollm2), n_ctx=512, verbose=False)
    dec = sd.SpeculativeDecoder.from_llama(target, "ngram", n_draft=3)
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(dec.generate, "Once upon a time", 400, logit_bias={2: -100})
        time.sleep(0.5)
        target.close()
        assert running.result(timeout=60).finish_reason == "cancelled"
    assert dec.closed
    with pytest.raises(ValueError, match="no loaded model"):
        sd.SpeculativeDecoder.from_llama(target)
    with pytest.raises(ArgumentTypeError, match="target must be a llama_cpp.Llama, got str"):
        sd.SpeculativeDecoder.from_llama(str(smollm2))
    with pytest.raises(ArgumentTypeError, match="draft must be a llama_cpp.Llama"):
        sd.SpeculativeDecoder.from_llama(target, 5)


def test_decoders_from_one_llama_free_their_contexts_when_closed(smollm2_q40: Path) -> None:
    # Each holds contexts of its own (here 8192 positions, about 180 MiB): a long-lived Llama
    # must not keep them after close() or once the decoder is gone.
    import llama_cpp

    llm = llama_cpp.Llama(str(smollm2_q40), n_ctx=256, verbose=False)
    engines = []
    for close in (True, True, False):
        dec = sd.SpeculativeDecoder.from_llama(llm, n_draft=0, n_ctx=8192)
        dec.generate("Hi", 2)
        engines.append(weakref.ref(dec._live()))
        if close:
            dec.close()
        del dec
    gc.collect()
    assert [e() for e in engines] == [None, None, None]
    llm.close()

"""What an on_text callback may do: calling back into the decoder that runs it is refused at
once (it would wait for itself forever); raising stops the generation and propagates."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any, Callable

import pytest

import specdec_native as sd
from specdec_native import models

REENTRY: dict[str, Callable[[sd.SpeculativeDecoder], Any]] = {
    "generate": lambda d: d.generate("the", 2),
    "stream": lambda d: list(d.stream("the", 2)),
    "calibrate": lambda d: d.calibrate("the"),
    "measure_decode_cost": lambda d: d.measure_decode_cost("the", 2, repeats=1),
}


@pytest.fixture
def fresh(tiny_pair: models.ModelPair) -> Iterator[sd.SpeculativeDecoder]:
    # Its own decoder: a test that did hang would hold it, not the shared one.
    with sd.SpeculativeDecoder(
        tiny_pair.target, tiny_pair.draft, n_draft=2, n_threads=1, calibration_cache=False
    ) as dec:
        yield dec


def run_with_timeout(fn: Callable[[], Any], seconds: float = 30.0) -> Any:
    """fn() on a worker thread; fails the test instead of hanging it."""
    out: dict[str, Any] = {}

    def work() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # handed back to the test thread
            out["error"] = e

    t = threading.Thread(target=work, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"no answer within {seconds} s: a deadlock"
    if "error" in out:
        raise out["error"]
    return out.get("value")


@pytest.mark.parametrize("call", list(REENTRY))
def test_calling_back_into_the_decoder_from_its_callback_raises(
    fresh: sd.SpeculativeDecoder, call: str
) -> None:
    seen: list[BaseException] = []

    def callback(_: str) -> None:
        try:
            REENTRY[call](fresh)
        except BaseException as e:
            seen.append(e)
            raise

    with pytest.raises(sd.ReentrantCallError, match="already running on this thread"):
        run_with_timeout(lambda: fresh.generate("the cat", 8, on_text=callback))
    assert len(seen) == 1 and isinstance(seen[0], RuntimeError)
    # The decoder is free again.
    assert len(run_with_timeout(lambda: fresh.generate("the", 3)).tokens) == 3


def test_the_stream_consumer_may_call_the_decoder(fresh: sd.SpeculativeDecoder) -> None:
    # The consumer is not the generating thread: its calls wait their turn, they do not deadlock.
    def consume() -> list[int]:
        lengths = []
        for _ in fresh.stream("the cat", 4):
            lengths.append(len(fresh.tokenize("the")))
        return lengths

    assert run_with_timeout(consume)


def test_an_exception_in_the_callback_propagates(fresh: sd.SpeculativeDecoder) -> None:
    def boom(_: str) -> None:
        raise KeyError("from the callback")

    with pytest.raises(KeyError, match="from the callback"):
        fresh.generate("the cat", 8, on_text=boom)
    assert len(fresh.generate("the", 3).tokens) == 3
    # It ends its own call only: the caller's flag, which other calls may share, stays unset.
    flag = sd.CancelFlag()
    with pytest.raises(KeyError):
        fresh.generate("the cat", 8, on_text=boom, cancel=flag)
    assert not flag.cancelled
    assert fresh.generate("the", 3, cancel=flag).finish_reason == "length"


def test_another_decoder_may_run_inside_a_callback(
    fresh: sd.SpeculativeDecoder, tiny_decoder: sd.SpeculativeDecoder
) -> None:
    inner: list[int] = []
    fresh.generate(
        "the cat", 4, on_text=lambda _: inner.append(len(tiny_decoder.generate("a", 2).tokens))
    )
    assert inner and all(n == 2 for n in inner)

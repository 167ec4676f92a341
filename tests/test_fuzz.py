"""Random settings through the real engine: whatever n_ctx, n_batch, K, prompt length,
max_tokens and sampling settings a user picks, a call returns or raises a documented exception;
never a signal, never a hang. The engine runs in a worker process, so a crash fails the example
(and hypothesis shrinks it) instead of taking the test run down."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdec_native import models

ANSWER_SECONDS = 60.0  # a case that takes longer is a hang
TINY_VOCAB = 319


class Worker:
    """tests/fuzz_worker.py in a subprocess, restarted after it dies."""

    def __init__(self, cache: Path) -> None:
        self.env = {**os.environ, "SPECDEC_CACHE": str(cache)}
        self.proc: subprocess.Popen[str] | None = None

    def ask(self, case: dict[str, Any]) -> dict[str, Any]:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen(
                [sys.executable, str(Path(__file__).parent / "fuzz_worker.py")],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=self.env,
            )
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(json.dumps(case) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], ANSWER_SECONDS)
        if not ready:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"no answer in {ANSWER_SECONDS} s (a hang) for {case}")
        line = self.proc.stdout.readline()
        if not line:
            rc = self.proc.wait()
            err = self.proc.stderr.read() if self.proc.stderr else ""
            asserts = [x for x in err.splitlines() if "ASSERT" in x or "error" in x.lower()]
            pytest.fail(f"the engine died (exit {rc}) on {case}:\n" + "\n".join(asserts[:5]))
        return dict(json.loads(line))

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    w = Worker(tmp_path_factory.mktemp("fuzz-cache"))
    yield w
    w.close()


# Which drafter: a model, n-gram lookup, both, or none.
DRAFTERS = ["model", "model-only", "ngram", "model+ngram", "none"]


@st.composite
def cases(draw: st.DrawFn, pair: models.ModelPair) -> dict[str, Any]:
    drafter = draw(st.sampled_from(DRAFTERS))
    n_ctx = draw(st.integers(16, 640))
    decoder: dict[str, Any] = {
        "target": str(pair.target),
        "draft": {"ngram": "ngram", "none": None}.get(drafter, str(pair.draft)),
        # model: the default (copies beside the model under auto); model-only: none
        "ngram": {"model+ngram": True, "model-only": False}.get(drafter),
        "n_draft": draw(st.one_of(st.integers(0, 64), st.just("auto"))),
        "n_ctx": n_ctx,
        "n_batch": draw(st.one_of(st.integers(1, 64), st.integers(1, 1024))),
        "n_threads": 1,
    }
    prompt_len = draw(st.one_of(st.integers(1, 40), st.integers(1, 700)))
    generate: dict[str, Any] = {
        "prompt": draw(
            st.lists(st.integers(3, TINY_VOCAB - 1), min_size=prompt_len, max_size=prompt_len)
        ),
        "max_tokens": draw(st.one_of(st.integers(1, 16), st.integers(1, 700))),
        "temperature": draw(st.sampled_from([0.0, 0.0, 0.3, 1.0, 2.5])),
        "top_k": draw(st.sampled_from([0, 1, 5, 400])),
        "top_p": draw(st.sampled_from([1.0, 0.9, 0.05])),
        "min_p": draw(st.sampled_from([0.0, 0.1, 1.0])),
        "seed": draw(st.integers(0, 2**64 - 1)),
        "n_draft": draw(st.one_of(st.none(), st.integers(0, 64), st.just("auto"))),
        "draft_p_min": draw(st.sampled_from([0.0, 0.5, 1.0])),
        "ignore_eos": draw(st.booleans()),
        "prompt_logprobs": draw(st.sampled_from([None, None, 0, 3])),
    }
    if draw(st.booleans()):
        generate["stop"] = draw(st.lists(st.text("abcthe ", min_size=1, max_size=3), max_size=2))
    return {"decoder": decoder, "generate": generate}


@pytest.fixture(scope="module")
def pair(tiny_pair: models.ModelPair) -> models.ModelPair:
    return tiny_pair


@settings(
    max_examples=int(os.environ.get("SPECDEC_FUZZ_EXAMPLES", "150")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_any_settings_return_or_raise_a_documented_error(
    worker: Worker, pair: models.ModelPair, data: st.DataObject
) -> None:
    case = data.draw(cases(pair))
    out = worker.ask(case)
    gen = case["generate"]
    if "raised" in out:
        # The one error these well-typed settings can meet: a prompt the context cannot hold.
        assert out["raised"] == "ContextOverflowError", out
        assert len(gen["prompt"]) >= case["decoder"]["n_ctx"]
        return
    assert len(gen["prompt"]) < case["decoder"]["n_ctx"], "an overflowing prompt was accepted"
    assert out["finish_reason"] in ("stop", "length", "context"), out
    assert out["n_tokens"] == out["n_generated"] <= gen["max_tokens"]
    if out["finish_reason"] == "length":
        assert out["n_tokens"] == gen["max_tokens"]
    if out["finish_reason"] == "context":
        assert out["n_prompt"] + out["n_tokens"] >= case["decoder"]["n_ctx"]
    assert out["max_k"] <= min(case["decoder"]["n_batch"] - 1, 64)
    if gen["prompt_logprobs"] is not None:  # every prompt token but the first, in any chunks
        assert out["n_prompt_scored"] == len(gen["prompt"]) - 1
    if gen["ignore_eos"] and not gen.get("stop"):
        assert out["finish_reason"] != "stop"

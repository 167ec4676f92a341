"""Sampling is lossless: speculative output has the target's distribution.

On the tiny-vocab pair, N = 20,000 generations of 3 tokens each with K = 2 (so one step covers
acceptance, the residual and the bonus token) are compared with N target-only generations by a
chi-squared test of homogeneity, per setting. A test of the test runs the same comparison against
a deliberately wrong rule (resampling from p after a rejection) and must see it fail. The same
holds for requests that share a batch: four threads generating at once in four slots.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
from helpers import engine_request
from scipy.stats import chi2_contingency

import specdec_native as sd
from specdec_native import models
from specdec_native._core import testing

N = 20_000
PROMPT = [1, 300, 270]  # BOS and two word tokens of the tiny vocabulary
SETTINGS = {
    "temperature": {"temperature": 1.0},
    "low-temperature+top-k": {"temperature": 0.7, "top_k": 5},
    "top-p": {"temperature": 1.0, "top_p": 0.8},
    "min-p": {"temperature": 1.0, "min_p": 0.1},
}


@pytest.fixture(scope="module")
def near(tiny_dir: Path) -> Iterator[sd.SpeculativeDecoder]:
    pair = models.build_tiny_pair(tiny_dir, seed=5, draft_noise=0.5)
    with sd.SpeculativeDecoder(pair.target, pair.draft, n_ctx=64, n_threads=1) as dec:
        yield dec


@pytest.fixture(scope="module")
def far(tiny_dir: Path) -> Iterator[sd.SpeculativeDecoder]:
    pair = models.build_tiny_pair(tiny_dir, seed=6, draft_noise=1.5)
    with sd.SpeculativeDecoder(pair.target, pair.draft, n_ctx=64, n_threads=1) as dec:
        yield dec


def sample(
    dec: sd.SpeculativeDecoder, k: int, seed0: int, **kw: Any
) -> tuple[Counter[tuple[int, ...]], float]:
    """Counts of the generated 3-token sequences, and the acceptance rate."""
    engine = dec._live()
    rule = kw.get("draft_rule", "auto")
    counts: Counter[tuple[int, ...]] = Counter()
    accepted = drafted = 0
    for i in range(N):
        out = engine.generate(engine_request(PROMPT, 3, seed0 + i, k, **kw))
        counts[tuple(out["tokens"])] += 1
        accepted += out["stats"]["n_accepted"]
        drafted += out["stats"]["n_drafted"]
        if rule == "argmax":
            assert out["stats"]["n_argmax_drafted"] == out["stats"]["n_drafted"]
    return counts, (accepted / drafted if drafted else 0.0)


def sample_together(
    dec: sd.SpeculativeDecoder, k: int, seed0: int, n_threads: int
) -> tuple[Counter[tuple[int, ...]], int]:
    """sample() at temperature 1 split over threads that generate at once; also the number of
    steps that shared the target's decode with another request."""
    engine = dec._live()
    counts: list[Counter[tuple[int, ...]]] = [Counter() for _ in range(n_threads)]
    shared = [0] * n_threads

    def work(t: int) -> None:
        for i in range(t, N, n_threads):
            out = engine.generate(engine_request(PROMPT, 3, seed0 + i, k))
            counts[t][tuple(out["tokens"])] += 1
            shared[t] += out["stats"]["n_shared_steps"]

    threads = [threading.Thread(target=work, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return sum(counts, Counter()), sum(shared)


def homogeneity_pvalue(a: Counter[Any], b: Counter[Any]) -> float:
    """Chi-squared test that two samples come from one distribution; sparse cells pooled."""
    keys = sorted(set(a) | set(b))
    table = np.array([[a[k] for k in keys], [b[k] for k in keys]], dtype=float)
    expected_small = table.sum(axis=0) < 10
    pooled = table[:, ~expected_small]
    rest = table[:, expected_small].sum(axis=1, keepdims=True)
    if rest.sum() > 0:
        pooled = np.hstack([pooled, rest])
    return float(chi2_contingency(pooled)[1])


def assert_copies_keep_the_distribution(
    generate: Callable[[int, int], dict[str, Any]], source: str, n: int = 10_000
) -> None:
    """Point-mass drafts copied from `source` ("index", "prediction"), sometimes accepted and
    sometimes not: n sampled outputs with K = 2 have the distribution of n from the target
    alone (K = 0), and n under a deliberately wrong rule (resampling from p itself after a
    rejection) do not. `generate(k, i)` runs an arm's i-th request with K = k."""
    counts: dict[str, Counter[tuple[int, ...]]] = {}
    drafted = accepted = 0
    for arm, k in (("base", 0), ("copied", 2), ("wrong", 2)):
        counts[arm] = Counter()
        testing.set_wrong_residual(arm == "wrong")
        try:
            for i in range(n):
                out = generate(k, i)
                counts[arm][tuple(out["tokens"])] += 1
                if arm == "copied":
                    drafted += out["stats"][f"drafted_by_{source}"]
                    accepted += out["stats"][f"accepted_by_{source}"]
        finally:
            testing.set_wrong_residual(False)
    assert drafted >= n
    assert 0 < accepted < drafted
    assert homogeneity_pvalue(counts["base"], counts["copied"]) > 1e-3
    assert homogeneity_pvalue(counts["base"], counts["wrong"]) < 1e-6


def first_tokens(c: Counter[tuple[int, ...]], n: int) -> Counter[tuple[int, ...]]:
    out: Counter[tuple[int, ...]] = Counter()
    for seq, k in c.items():
        out[seq[:n]] += k
    return out


@pytest.mark.parametrize("name", list(SETTINGS))
def test_matches_target_distribution(near: sd.SpeculativeDecoder, name: str) -> None:
    kw = SETTINGS[name]
    base, _ = sample(near, 0, 10_000_000, **kw)
    spec, rate = sample(near, 2, 20_000_000, **kw)
    assert 0.05 < rate < 0.95  # both acceptance and rejection are exercised
    for n in (1, 2, 3):
        p = homogeneity_pvalue(first_tokens(base, n), first_tokens(spec, n))
        assert p > 1e-3, f"{name}: first {n} tokens differ from target-only sampling (p={p:.2e})"


@pytest.mark.parametrize("dec_name", ["near", "far"])
def test_argmax_drafts_match_the_target_distribution(
    dec_name: str, request: pytest.FixtureRequest
) -> None:
    # The draft model's argmax as a point mass, accepted with p(x), else a draw from p without x.
    dec: sd.SpeculativeDecoder = request.getfixturevalue(dec_name)
    base, _ = sample(dec, 0, 60_000_000)
    spec, rate = sample(dec, 2, 70_000_000, draft_rule="argmax")
    # Near: both acceptance and rejection; far: nearly all from the residual p without x.
    assert (0.05 < rate < 0.95) if dec_name == "near" else rate < 0.05
    for n in (1, 2, 3):
        p = homogeneity_pvalue(first_tokens(base, n), first_tokens(spec, n))
        assert p > 1e-3, f"{dec_name}: first {n} tokens differ from target-only (p={p:.2e})"


def test_requests_sharing_a_batch_match_the_target_distribution(
    near: sd.SpeculativeDecoder,
) -> None:
    base, _ = sample(near, 0, 10_000_000)
    with sd.SpeculativeDecoder(
        near.target_path, near.draft_path, n_ctx=64, n_threads=1, n_parallel=4
    ) as together:
        spec, shared = sample_together(together, 2, 50_000_000, n_threads=4)
    assert shared > N // 2  # most steps had company
    for n in (1, 2, 3):
        p = homogeneity_pvalue(first_tokens(base, n), first_tokens(spec, n))
        assert p > 1e-3, f"first {n} tokens differ from target-only sampling (p={p:.2e})"


def test_far_draft_still_exact(far: sd.SpeculativeDecoder) -> None:
    base, _ = sample(far, 0, 30_000_000)
    spec, rate = sample(far, 2, 40_000_000)
    assert rate < 0.4  # a draft far from the target: most tokens come from the residual
    for n in (1, 2, 3):
        assert homogeneity_pvalue(first_tokens(base, n), first_tokens(spec, n)) > 1e-3


def test_the_test_catches_a_wrong_residual(far: sd.SpeculativeDecoder) -> None:
    base, _ = sample(far, 0, 30_000_000)
    testing.set_wrong_residual(True)
    try:
        wrong, _ = sample(far, 2, 40_000_000)
    finally:
        testing.set_wrong_residual(False)
    p = homogeneity_pvalue(first_tokens(base, 1), first_tokens(wrong, 1))
    assert p < 1e-6, f"resampling from p after a rejection went unnoticed (p={p:.2e})"


# Penalties that favour repeats strongly, so a rule that missed a step's own verdicts (the third
# token's penalties without the second, drafted in the same step) would show at once: OpenAI's
# (negative), and llama.cpp's repetition penalty below 1 over a window of 2, which the prompt
# leaves as the sequence grows.
PENALTIES: dict[str, dict[str, Any]] = {
    "openai": {"presence_penalty": -2.0, "frequency_penalty": -1.0, "logit_bias": [(270, 2.0)]},
    "repeat": {"repeat_penalty": 0.4, "repeat_last_n": 2},
}


@pytest.mark.parametrize("kind", PENALTIES)
def test_penalties_and_logit_bias_keep_the_target_distribution(
    near: sd.SpeculativeDecoder, kind: str
) -> None:
    penalties = PENALTIES[kind]
    base, _ = sample(near, 0, 80_000_000, **penalties)
    plain, _ = sample(near, 0, 80_000_000)
    p = homogeneity_pvalue(first_tokens(base, 3), first_tokens(plain, 3))
    assert p < 1e-6, f"the penalties changed nothing (p={p:.2e})"
    spec, rate = sample(near, 2, 90_000_000, **penalties)
    assert 0.05 < rate < 0.95
    for n in (1, 2, 3):
        p = homogeneity_pvalue(first_tokens(base, n), first_tokens(spec, n))
        assert p > 1e-3, f"first {n} tokens differ from target-only under penalties (p={p:.2e})"
    testing.set_stale_penalties(True)
    try:
        stale, _ = sample(near, 2, 90_000_000, **penalties)
    finally:
        testing.set_stale_penalties(False)
    p = homogeneity_pvalue(first_tokens(base, 3), first_tokens(stale, 3))
    assert p < 1e-6, f"penalties blind to the step's own verdicts went unnoticed (p={p:.2e})"

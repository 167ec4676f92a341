"""Assertions shared by the test modules."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

import specdec_native as sd


def top2_gap(dec: sd.SpeculativeDecoder, context: Sequence[int]) -> float:
    logits = np.asarray(dec.next_token_logits(context))
    top = np.sort(logits)[-2:]
    return float(top[1] - top[0])


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return -1 if len(a) == len(b) else min(len(a), len(b))


def assert_same_or_near_tie(
    dec: sd.SpeculativeDecoder,
    prompt: Sequence[int],
    spec: Sequence[int],
    base: Sequence[int],
    gap: float,
) -> None:
    """Speculative greedy output equals target-only output, or first differs at a near-tie."""
    i = first_divergence(spec, base)
    if i < 0:
        return
    assert i < min(len(spec), len(base)), "one output is a strict prefix of the other"
    measured = top2_gap(dec, list(prompt) + list(base[:i]))
    assert measured < gap, (
        f"greedy outputs diverge at token {i} where the target's top-2 logit gap is {measured:.4f}, "
        f"not a near-tie (< {gap})"
    )


def assert_stats_add_up(stats: sd.Stats, n_tokens: int) -> None:
    assert 0 <= stats.n_accepted <= stats.n_drafted
    assert stats.n_generated == n_tokens
    assert stats.n_generated == stats.n_accepted + stats.n_target_passes - stats.n_cut
    assert sum(stats.accepted_at) == stats.n_accepted
    assert sum(stats.proposed_at) == stats.n_drafted
    for a, p in zip(stats.accepted_at, stats.proposed_at):
        assert 0 <= a <= p
    # Acceptance at position i needs acceptance at every position before it.
    assert all(x >= y for x, y in zip(stats.accepted_at, stats.accepted_at[1:]))
    assert stats.t_total >= stats.t_prompt + stats.t_draft

"""Assertions shared by the test modules."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable

import numpy as np

import specdec_native as sd
from specdec_native import _core


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return -1 if len(a) == len(b) else min(len(a), len(b))


def assert_same_or_near_tie(
    spec: sd.GenerationResult, base: sd.GenerationResult, gap: float
) -> None:
    """Speculative greedy output equals target-only output, or first differs at a near-tie.

    Measured both ways: at the first differing position, the target's top-1 minus top-2 logit
    must be below ``gap`` in the speculative run (its batched verify row) *and* in the
    target-only run (its one-token decode). Anything else is a real divergence.
    """
    i = first_divergence(spec.tokens, base.tokens)
    if i < 0:
        return
    # One output stops where the other goes on: it chose the end token there (its margin is
    # stop_margin), the other a token of text.
    m_spec, m_base = (r.margins[i] if i < len(r.tokens) else r.stop_margin for r in (spec, base))
    assert m_spec is not None and m_base is not None, (
        f"one output is a strict prefix of the other at token {i}, not ended by the end token"
    )
    chose = [r.tokens[i] if i < len(r.tokens) else "the end" for r in (base, spec)]
    assert m_spec < gap and m_base < gap, (
        f"greedy outputs diverge at token {i} ({chose[0]} vs {chose[1]}) where the "
        f"target's top-2 margins are {m_spec:.4f} (speculative) and {m_base:.4f} (target-only), "
        f"not both below the near-tie gap {gap}"
    )


def assert_each_token_near_the_targets_choice(
    target_only: sd.SpeculativeDecoder, result: sd.GenerationResult, gap: float
) -> None:
    """Every token of a greedy ``result`` is, given the tokens before it, the target's choice in a
    fresh one-token decode, or within ``gap`` of it in logits (the rounding of another decode).

    Unlike a comparison of two outputs, which sees only where they first differ, this reads
    every position of the one output: a damaged cache shows wherever it moves a choice.
    """
    history = list(result.prompt_tokens)
    for i, token in enumerate(result.tokens):
        fresh = target_only.generate(history + result.tokens[:i], 1, n_draft=0, logprobs=5)
        assert fresh.logprobs is not None
        top = dict(fresh.logprobs[0].top)
        best = fresh.tokens[0]
        behind = top[best] - top[token] if token in top else float("inf")
        assert behind < gap, (
            f"token {i} ({token}) is {behind:.4f} below the target's choice {best} in a fresh "
            f"decode of the same history; a rounding difference stays below {gap}"
        )


def assert_stats_add_up(stats: sd.Stats, n_tokens: int) -> None:
    assert 0 <= stats.n_accepted <= stats.n_drafted
    assert stats.n_generated == n_tokens
    made = stats.n_accepted + stats.n_target_passes + stats.first_from_prompt
    assert stats.n_generated == made - stats.n_cut
    assert sum(stats.accepted_at) == stats.n_accepted
    assert sum(stats.proposed_at) == stats.n_drafted
    for a, p in zip(stats.accepted_at, stats.proposed_at):
        assert 0 <= a <= p
    # Acceptance at position i needs acceptance at every position before it.
    assert all(x >= y for x, y in zip(stats.accepted_at, stats.accepted_at[1:]))
    assert stats.t_total >= stats.t_prompt + stats.t_draft


def set_costs_where_drafting_pays(
    dec: sd.SpeculativeDecoder, per_row: float = 0.15, draft_share: float = 0.1
) -> None:
    """Costs of a shape where drafting pays, at this machine's scale: the target's one-token
    decode as measured here, each further row `per_row` of it more, a draft decode `draft_share`
    of it (0 for copies: no draft model). A test of `auto` then asserts what follows from its
    rules, not from how this machine's costs happened to measure (nor how busy it was). The
    steps' timings still move the costs (a few % per step), and a request whose steps disagree
    with them by the heal factor has them measured again after it: the scale stays measured so
    that the usual steps agree. One slot only (several need batch costs too)."""
    dec.calibrate()
    one = dec.policy_state()["verify_costs"][0]
    verify = [one * (1.0 + per_row * n) for n in range(11)]
    dec._live().set_calibration(verify, [draft_share * one, 1.5 * draft_share * one])


def rewrite_gguf(
    src: Path,
    dst: Path,
    *,
    metadata: dict[str, Any] | None = None,
    tensors: Callable[[str, np.ndarray], np.ndarray] | None = None,
) -> Path:
    """A copy of the f32 GGUF ``src`` with some metadata values replaced (each keeps its type)
    and each tensor passed through ``tensors(name, array)``: a model damaged on purpose."""
    import gguf

    from specdec_native.models import _as_float, _copy_metadata

    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    metadata = dict(metadata or {})
    new = {k: metadata.pop(k) for k in list(metadata) if k not in reader.fields}
    _copy_metadata(reader, writer, metadata)
    for key, value in new.items():  # keys the source lacks: typed by their Python value
        vtype = gguf.GGUFValueType.STRING if isinstance(value, str) else gguf.GGUFValueType.UINT32
        writer.add_key_value(key, value, vtype)
    for t in reader.tensors:
        arr = _as_float(t)
        writer.add_tensor(t.name, tensors(t.name, arr) if tensors else arr)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def engine_request(
    prompt: Sequence[int], max_tokens: int, seed: int, n_draft: int, **kw: Any
) -> _core.Request:
    """A request for the engine itself, without the Python API's checks and result objects (for
    tests that run tens of thousands of short generations). Sampling at temperature 1 unless
    told otherwise."""
    r = _core.Request()
    r.prompt = list(prompt)
    r.max_tokens = max_tokens
    r.seed = seed
    r.n_draft = n_draft
    r.temperature = kw.pop("temperature", 1.0)
    for name, value in kw.items():
        setattr(r, name, value)
    return r

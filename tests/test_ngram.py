"""The n-gram (prompt lookup) drafter: alone, in front of a draft model, lossless both ways."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from conftest import BATCHED_NEAR_TIE_GAP, NEAR_TIE_GAP
from helpers import (
    assert_same_or_near_tie,
    assert_stats_add_up,
    engine_request,
    set_costs_where_drafting_pays,
)
from test_distribution import assert_copies_keep_the_distribution, homogeneity_pvalue

import specdec_native as sd
from specdec_native import _core, models
from specdec_native._core import testing

CODE_EDIT = (
    "Rename the variable `total` to `acc` in this function:\n\n"
    "def sum_list(values):\n    total = 0\n    for v in values:\n        total += v\n"
    "    return total\n\nRenamed:\n\ndef sum_list(values):\n"
)


def test_ngram_alone_is_lossless_and_drafts(deep_pair: models.ModelPair) -> None:
    with sd.SpeculativeDecoder(deep_pair.target, "ngram", n_draft=4, n_ctx=1024) as dec:
        assert dec.has_draft is False
        base = dec.generate(CODE_EDIT, 40, n_draft=0)
        spec = dec.generate(CODE_EDIT, 40)
        assert_same_or_near_tie(spec, base, NEAR_TIE_GAP)
        assert_stats_add_up(spec.stats, len(spec.tokens))
        s = spec.stats
        assert s.drafted_by_ngram == s.n_drafted > 0
        assert s.accepted_by_ngram == s.n_accepted > 0
        assert s.drafted_by_model == 0


def test_ngram_then_model(deep_pair: models.ModelPair) -> None:
    with sd.SpeculativeDecoder(
        deep_pair.target, deep_pair.draft, ngram=True, n_draft=3, n_ctx=1024
    ) as dec:
        base = dec.generate(CODE_EDIT, 40, n_draft=0)
        spec = dec.generate(CODE_EDIT, 40)
        assert_same_or_near_tie(spec, base, NEAR_TIE_GAP)
        s = spec.stats
        assert s.drafted_by_ngram > 0 and s.drafted_by_model > 0
        assert s.drafted_by_ngram + s.drafted_by_model == s.n_drafted
        assert s.accepted_by_ngram + s.accepted_by_model == s.n_accepted


# The longest K the draft model's policy may choose.
MODEL_MAX_K = 10  # AdaptivePolicy::Config::max_k

PASSAGE = (
    "The committee met on Tuesday to review the budget. It approved a ten percent increase in "
    "funding for public libraries, rejected the proposal to close the north branch, and agreed "
    "that the next meeting will be held on the first Monday of March in the town hall."
)


def test_auto_copies_spans_longer_than_a_model_draft(gemma3: Path) -> None:
    # A text copied out of the prompt: `auto` drafts by the length of the match, beyond any K
    # it would give a draft model, and the copy stays lossless.
    prompt = (
        "<start_of_turn>user\nCopy this text exactly.\n\n"
        f"{PASSAGE}<end_of_turn>\n<start_of_turn>model\n"
    )
    # Each on a decoder of its own: the first token comes with the prompt's decode in both.
    with sd.SpeculativeDecoder(gemma3, "ngram", n_ctx=1024) as dec:
        base = dec.generate(prompt, 64, n_draft=0)
    with sd.SpeculativeDecoder(gemma3, "ngram", n_ctx=1024, calibration_cache=False) as dec:
        # Costs as this machine measures them, smoothed: a measured curve is noisy enough
        # (8 rows once timed 35 % below 7) that a long copy sometimes looked not to pay.
        verify = [0.014, 0.033, 0.038, 0.043, 0.060, 0.066, 0.072, 0.076, 0.080, 0.084, 0.088]
        dec._live().set_calibration(verify, [0.0, 0.0])
        spec = dec.generate(prompt, 64, n_draft="auto")
    assert PASSAGE[:60] in base.text
    assert_same_or_near_tie(spec, base, BATCHED_NEAR_TIE_GAP)
    assert_stats_add_up(spec.stats, len(spec.tokens))
    s = spec.stats
    assert len(s.proposed_at) > MODEL_MAX_K
    assert s.accepted_by_ngram == s.n_accepted > 0
    assert s.n_target_passes * 3 < len(spec.tokens)


def test_auto_chooses_between_ngram_and_model_by_default(deep_pair: models.ModelPair) -> None:
    # Under auto each step drafts from whichever source promises more: a repeating text makes
    # both pay (at costs where a model's draft pays too). A fixed K drafts with the model alone
    # unless copies were asked for (ngram=True), and ngram=False never copies.
    with sd.SpeculativeDecoder(
        deep_pair.target, deep_pair.draft, n_ctx=1024, calibration_cache=False
    ) as dec:
        base = dec.generate(CODE_EDIT, 60, n_draft=0)
        set_costs_where_drafting_pays(dec)
        spec = dec.generate(CODE_EDIT, 60, n_draft="auto")
        fixed = dec.generate(CODE_EDIT, 30, n_draft=3).stats
    assert_same_or_near_tie(spec, base, NEAR_TIE_GAP)
    assert_stats_add_up(spec.stats, len(spec.tokens))
    s = spec.stats
    assert s.drafted_by_ngram > 0 and s.drafted_by_model > 0
    assert s.drafted_by_ngram + s.drafted_by_model == s.n_drafted
    assert s.accepted_by_ngram > 0.5 * s.drafted_by_ngram
    assert fixed.drafted_by_ngram == 0 and fixed.drafted_by_model == fixed.n_drafted > 0
    with sd.SpeculativeDecoder(
        deep_pair.target, deep_pair.draft, ngram=False, n_ctx=1024, calibration_cache=False
    ) as dec:
        set_costs_where_drafting_pays(dec)
        off = dec.generate(CODE_EDIT, 60, n_draft="auto").stats
    assert off.drafted_by_ngram == 0 and off.drafted_by_model == off.n_drafted > 0


def test_point_mass_drafts_keep_the_distribution(tiny_dir: Path) -> None:
    pair = models.build_tiny_pair(tiny_dir, seed=5, draft_noise=0.5)
    prompt = [1, 300, 270, 300]  # "... 300 270 300": the lookup proposes 270, 300, ...
    n = 20_000
    with sd.SpeculativeDecoder(pair.target, "ngram", n_draft=2, n_ctx=64, n_threads=1) as dec:
        engine = dec._live()
        counts: dict[int, Counter[tuple[int, ...]]] = {0: Counter(), 2: Counter()}
        drafted = accepted = 0
        for k in (0, 2):
            for i in range(n):
                out = engine.generate(engine_request(prompt, 2, 7 * n + i, k))
                counts[k][tuple(out["tokens"])] += 1
                if k:
                    drafted += out["stats"]["n_drafted"]
                    accepted += out["stats"]["n_accepted"]
    assert drafted >= n  # every generation drafted from the lookup
    assert 0 < accepted < drafted  # point masses are both accepted and rejected
    assert homogeneity_pvalue(counts[0], counts[2]) > 1e-3


PLAN = "Write a Python function that returns the sum of a list of numbers.\n"


def test_earlier_outputs_are_copied_exactly(deep_pair: models.ModelPair) -> None:
    """A request that writes what an earlier one wrote copies it from the shared index (its own
    text holds none of it), under a fixed K and under auto, and decodes the target's tokens."""
    with sd.SpeculativeDecoder(
        deep_pair.target, "ngram", n_ctx=1024, ngram_index_mb=4, calibration_cache=False
    ) as dec:
        base = dec.generate(PLAN, 40, n_draft=0)
        set_costs_where_drafting_pays(dec, draft_share=0.0)
        for k in (4, "auto"):
            out = dec.generate(PLAN, 40, n_draft=k)
            assert_same_or_near_tie(out, base, NEAR_TIE_GAP)
            assert_stats_add_up(out.stats, len(out.tokens))
            s = out.stats
            assert s.accepted_by_index > 0.8 * s.drafted_by_index > 10, (k, s)
            assert s.drafted_by_ngram + s.drafted_by_index == s.n_drafted
        held = dec.ngram_index["tokens"]
        assert held > 3 * 40
        # A call kept out of the index copies nothing from it and adds nothing to it.
        for k in (4, "auto"):
            out = dec.generate(PLAN, 40, n_draft=k, ngram_index=False)
            assert_same_or_near_tie(out, base, NEAR_TIE_GAP)
            assert out.stats.drafted_by_index == 0
        assert dec.ngram_index["tokens"] == held
    with sd.SpeculativeDecoder(deep_pair.target, "ngram", n_ctx=1024) as dec:
        dec.generate(PLAN, 40, n_draft=0)
        assert dec.generate(PLAN, 40, n_draft=4).stats.drafted_by_index == 0
        assert dec.ngram_index == {"tokens": 0, "bytes": 0}


def test_a_copy_from_the_index_stops_where_earlier_outputs_went_different_ways() -> None:
    """Tool calls share a shell and differ in their arguments; an edited file keeps most of its
    lines. A copy runs through what stayed the same and stops before what kept changing."""
    index = testing.SharedNgramIndex(1, 4, 1 << 20)
    tail = [1, 2, 3, 4]  # every prompt ends alike (a chat's "assistant" marker)
    shell = list(range(100, 120))  # 20 tokens of a call's fixed JSON
    index.add(tail, [*shell, 500, 9])
    # Once: nothing says the argument varies, so the copy takes it.
    assert index.draft([*tail, *shell], 4) == [500, 9]
    index.add(tail, [*shell, 501, 9])
    # The shell's end went on with 500, then 501: no argument is copied.
    assert index.draft([*tail, *shell], 4) == []
    assert index.draft([*tail, *shell[:10]], 8) == shell[10:18]
    index.add(tail, [*shell, 502, 9])
    assert index.draft([*tail, *shell], 4) == []

    edited = testing.SharedNgramIndex(1, 4, 1 << 20)
    text = list(range(200, 240))
    for version in range(4):  # a line (token 220) changed once, at the third version
        edited.add(tail, [*text[:20], 600 if version < 2 else 601, *text[21:]])
    # Changed once in four: the latest version is copied through it.
    assert edited.draft([*tail, *text[:20]], 4) == [601, *text[21:24]]
    edited.add(tail, [*text[:20], 602, *text[21:]])
    edited.add(tail, [*text[:20], 603, *text[21:]])
    # Changed at 3 of its 5 turns: more often than not; the copy stops before it.
    assert edited.draft([*tail, *text[:20]], 4) == []
    assert edited.draft([*tail, *text[:16]], 8) == text[16:20]


def test_a_context_steady_for_long_can_stop_being_so() -> None:
    """Continuation counts that fill their type are halved, not frozen."""
    index = testing.SharedNgramIndex(1, 1, 1 << 26)
    index.add([1], [5, 6] * 65_536)  # "5" went on with 6 as often as its count can say
    assert index.draft([9, 5], 1) == [6]
    index.add([1], [5, 7, 5, 8] * 20_000)  # then with 7 and 8 by turns
    assert index.draft([9, 5], 1) == []


def test_the_shared_index_keeps_to_its_budget(tiny_pair: models.ModelPair) -> None:
    budget_mb = 0.2
    with sd.SpeculativeDecoder(
        tiny_pair.target, "ngram", n_draft=3, n_ctx=128, ngram_index_mb=budget_mb
    ) as dec:
        engine = dec._live()
        held = []
        for i in range(400):
            engine.generate(engine_request([1, 2 + i % 300], 24, i, 3))
            held.append(dec.ngram_index["tokens"])
            assert dec.ngram_index["bytes"] <= budget_mb * (1 << 20)
    assert min(held[200:]) > 300  # it forgot the older half, not everything
    assert max(held) > 2 * min(held[200:])


def test_an_index_file_larger_than_the_budget_loads_within_it(
    tiny_pair: models.ModelPair, tmp_path: Path
) -> None:
    """A file saved under a larger budget (here 2M tokens, 8 MB, against a budget of 1 MB) is
    read from its newest tokens, as many as could fit in every n-gram length's map (16 here):
    no maps are built for the rest first."""
    script = f"""
import struct, sys
import numpy as np
import specdec_native as sd
with sd.SpeculativeDecoder({str(tiny_pair.target)!r}, "ngram", n_ctx=128, ngram_index_mb=1,
                           ngram_min=1, ngram_max=16) as dec:
    dec.generate("Hello", 4)
    dec.save_ngram_index({str(tmp_path / "small.bin")!r})
    saved = open({str(tmp_path / "small.bin")!r}, "rb").read()
    held = struct.unpack_from("<Q", saved, 24)[0]
    evidence = saved[32 : len(saved) - 4 * held]
    n_vocab = struct.unpack_from("<i", saved, 8)[0]
    tokens = np.random.default_rng(0).integers(0, n_vocab, 2_000_000, dtype=np.int32)
    big = saved[:24] + struct.pack("<Q", len(tokens)) + evidence + tokens.tobytes()
    open({str(tmp_path / "big.bin")!r}, "wb").write(big)
    del tokens, big
    def status(key):
        line = next(l for l in open("/proc/self/status") if l.startswith(key))
        return int(line.split()[1])
    open("/proc/self/clear_refs", "w").write("5")  # the peak starts again from here
    before = status("VmRSS:")
    dec.load_ngram_index({str(tmp_path / "big.bin")!r})
    grown = status("VmHWM:") - before
    index = dec.ngram_index
    print(grown // 1024, index["tokens"], index["bytes"])
"""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True
    )
    grown_mib, tokens, held_bytes = (int(x) for x in out.stdout.split())
    assert 0 < tokens and held_bytes <= 1 << 20
    # Building maps for all 2M tokens first took ~270 MiB; for as many tokens as one map of
    # the budget holds, then 16 maps of them, 17.
    assert grown_mib < 10, out.stdout


def test_index_drafts_keep_the_distribution(tiny_dir: Path, tmp_path: Path) -> None:
    """Sampling: every request drafts one earlier output from the shared index (point masses,
    sometimes accepted, sometimes not); the outputs' distribution is the target's. (The index
    is loaded afresh before each request: sampled outputs that all differ would teach it that
    nothing here repeats, and it would stop drafting.)"""
    pair = models.build_tiny_pair(tiny_dir, seed=5, draft_noise=0.5)
    prompt = [1, 300, 270]  # nothing repeats: the request's own text has no match at first
    n = 10_000
    saved = tmp_path / "index.bin"
    with sd.SpeculativeDecoder(
        pair.target, "ngram", n_draft=2, n_ctx=64, n_threads=1, ngram_index_mb=0.5
    ) as dec:
        engine = dec._live()
        engine.generate(engine_request(prompt, 3, 0, 0, temperature=0.0))
        dec.save_ngram_index(saved)

        def generate(k: int, i: int) -> dict[str, Any]:
            dec.load_ngram_index(saved)
            return engine.generate(engine_request(prompt, 3, 11 * n + i, k))

        assert_copies_keep_the_distribution(generate, "index", n)


def test_a_seed_repeats_sampled_text_whatever_the_index_holds(
    tiny_pair: models.ModelPair,
) -> None:
    prompt = [1, 300, 270]
    with sd.SpeculativeDecoder(
        tiny_pair.target, "ngram", n_draft=3, n_ctx=128, n_threads=1, ngram_index_mb=1
    ) as dec:
        first = dec.generate(prompt, 24, temperature=0.8, seed=7)
        unseeded = [dec.generate(prompt, 24, temperature=0.8) for _ in range(4)]
        assert sum(r.stats.drafted_by_index for r in unseeded) > 0  # the index is in play
        again = dec.generate(prompt, 24, temperature=0.8, seed=7)
    assert again.tokens == first.tokens
    assert first.stats.drafted_by_index == again.stats.drafted_by_index == 0


def test_the_shared_index_is_saved_and_loaded(tiny_pair: models.ModelPair, tmp_path: Path) -> None:
    """A later decoder starts from a saved index: its first request copies what the first
    decoder's requests wrote. Files that are no index of this model are refused."""
    path = tmp_path / "index.bin"
    prompt = [1, 300, 270]
    with sd.SpeculativeDecoder(
        tiny_pair.target, "ngram", n_draft=3, n_ctx=128, ngram_index_mb=1
    ) as dec:
        with pytest.raises(OSError, match="cannot read"):
            dec.load_ngram_index(tmp_path / "missing.bin")
        os.mkfifo(tmp_path / "pipe")  # opening it would wait for a writer
        with pytest.raises(OSError, match="not a regular file"):
            dec.load_ngram_index(tmp_path / "pipe")
        engine = dec._live()
        first = engine.generate(engine_request(prompt, 24, 0, 3, temperature=0.0))
        dec.save_ngram_index(path)
        held = dec.ngram_index["tokens"]
        with pytest.raises(sd.FileError, match="cannot write"):
            dec.save_ngram_index(tmp_path / "no-such-dir" / "index.bin")
        (tmp_path / "a-dir" / "inside").mkdir(parents=True)  # written, but not renamed over
        with pytest.raises(OSError, match="cannot write"):
            dec.save_ngram_index(tmp_path / "a-dir")
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith("a-dir.")] == []
        with pytest.raises(ValueError, match="NUL"):  # not a save to the path's first part
            dec.save_ngram_index(f"{path}\0.bak")
        # Its temporary file is its own: a link put beside the path is not written through.
        victim = tmp_path / "victim"
        victim.write_text("precious")
        (tmp_path / "index.bin.tmp").symlink_to(victim)
        dec.save_ngram_index(path)
        assert victim.read_text() == "precious"
    with sd.SpeculativeDecoder(
        tiny_pair.target, "ngram", n_draft=3, n_ctx=128, ngram_index_mb=1
    ) as dec:
        dec.load_ngram_index(path)
        assert dec.ngram_index["tokens"] == held
        again = dec._live().generate(engine_request(prompt, 24, 0, 3, temperature=0.0))
        assert again["tokens"] == first["tokens"]
        assert again["stats"]["accepted_by_index"] > 10
        held = dec.ngram_index["tokens"]
        saved = path.read_bytes()
        header = 40  # magic, n_vocab, ngram_min, ngram_max, (padding), n_tokens, vocab's hash
        forged_count = saved[:24] + (1 << 31).to_bytes(8, "little") + saved[32:]
        older = saved[:7] + b"1" + saved[8:32]  # an older header, shorter than this one's
        other_vocab = saved[:8] + (12345).to_bytes(4, "little") + saved[12:]
        lengths = saved[:12] + (9).to_bytes(4, "little") + (2).to_bytes(4, "little") + saved[20:]
        # Tries past 2**53: a new try would add nothing, the evidence fixed for good.
        pinned = saved[:header] + struct.pack("<d", 1e17) * 2 + saved[header + 16 :]
        for content, why in (
            (b"not an index at all", "no index header"),
            (older, "format is another version's"),
            (saved[:-4], "length"),
            (forged_count, "length"),  # refused before anything is allocated for it
            (other_vocab, "vocabulary"),
            (lengths, "n-gram lengths"),
            (pinned, "copy evidence"),
        ):
            bad = tmp_path / "bad.bin"
            bad.write_bytes(content)
            with pytest.raises(ValueError, match=why):
                dec.load_ngram_index(bad)
        assert dec.ngram_index["tokens"] == held  # a refused file changes nothing
    # The same number of tokens (past the size check), other tokens: its ids would draft nonsense.
    other = models.write_tiny_model(tmp_path / "other.gguf", n_extra_tokens=59, user_tokens=["<x>"])
    with sd.SpeculativeDecoder(other, "ngram", n_draft=3, n_ctx=128, ngram_index_mb=1) as dec:
        with pytest.raises(ValueError, match="its vocabulary has other tokens"):
            dec.load_ngram_index(path)
    with sd.SpeculativeDecoder(tiny_pair.target, "ngram", n_ctx=128) as dec:
        with pytest.raises(ValueError, match="no shared n-gram index"):
            dec.save_ngram_index(path)


def test_the_ngram_argument_is_checked(tiny_pair: models.ModelPair) -> None:
    with pytest.raises(ValueError, match='ngram=False contradicts draft="ngram"'):
        sd.SpeculativeDecoder(tiny_pair.target, "ngram", ngram=False)
    with pytest.raises(sd.ArgumentTypeError, match="ngram must be None, True or False"):
        sd.SpeculativeDecoder(tiny_pair.target, tiny_pair.draft, ngram=1)  # type: ignore[arg-type]
    # The engine's "auto" mode weighs copies against a draft model: without one it is refused.
    with pytest.raises(ValueError, match="ngram 'auto' weighs copies against a draft model"):
        _core.Engine(str(tiny_pair.target), None, ngram="auto")

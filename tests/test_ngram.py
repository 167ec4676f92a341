"""The n-gram (prompt lookup) drafter: alone, in front of a draft model, lossless both ways."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from conftest import NEAR_TIE_GAP
from helpers import assert_same_or_near_tie, assert_stats_add_up
from test_distribution import homogeneity_pvalue

import specdec_native as sd
from specdec_native import models

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
                out = engine.generate(prompt, 2, 1.0, 0, 1.0, 0.0, 7 * n + i, [], k, None)
                counts[k][tuple(out["tokens"])] += 1
                if k:
                    drafted += out["stats"]["n_drafted"]
                    accepted += out["stats"]["n_accepted"]
    assert drafted >= n  # every generation drafted from the lookup
    assert 0 < accepted < drafted  # point masses are both accepted and rejected
    assert homogeneity_pvalue(counts[0], counts[2]) > 1e-3

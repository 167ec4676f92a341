"""The statistics behind `bench`'s auto-vs-best-fixed-K table (specdec_native/comparison.py), and
the pooling of several runs' rounds (`bench-pool`)."""

import dataclasses
import json
import statistics
from pathlib import Path

import pytest

from specdec_native import bench
from specdec_native import comparison as cmp


def test_held_out_picks_the_clear_winner_every_round() -> None:
    held = cmp.held_out_best({0: [1.0, 1.0, 1.0], 3: [1.3, 1.4, 1.35], 1: [1.1, 1.0, 1.05]})
    assert held.picked == [3, 3, 3]
    assert held.speedups == [1.3, 1.4, 1.35]


def test_held_out_does_not_let_a_round_pick_and_score_its_own_k() -> None:
    # K = 1's lucky round 1 makes it best after the fact (mean 1.133 against 1.067), but each
    # round, judged by the others, gets a K whose speed there is ordinary.
    by_k = {1: [1.0, 1.4, 1.0], 3: [1.1, 1.0, 1.1]}
    held = cmp.held_out_best(by_k)
    # round 0: others say K1 (1.2) over K3 (1.05); round 1: K3 (1.1) over K1 (1.0); round 2:
    # K1 (1.2) over K3 (1.05)
    assert held.picked == [1, 3, 1]
    assert held.speedups == [1.0, 1.0, 1.0]
    assert max(sum(v) / 3 for v in by_k.values()) > sum(held.speedups) / 3


def test_held_out_ties_go_to_the_first_k() -> None:
    assert cmp.held_out_best({0: [1.0, 1.0], 2: [1.0, 1.0]}).picked == [0, 0]


@pytest.mark.parametrize("by_k", [{1: [1.0]}, {1: [1.0, 1.1], 3: [1.0, 1.1, 1.2]}, {}])
def test_held_out_rejects_too_few_or_uneven_rounds(by_k: dict[int, list[float]]) -> None:
    with pytest.raises(ValueError, match="rounds"):
        cmp.held_out_best(by_k)


def test_ratio_interval_is_seeded_and_brackets_a_steady_ratio() -> None:
    auto = [0.95, 1.02, 0.99, 1.05, 0.97, 1.01]
    best = [1.0, 1.04, 1.0, 1.02, 1.01, 1.0]
    lo, hi = cmp.ratio_interval(auto, best)
    assert (lo, hi) == cmp.ratio_interval(auto, best)
    assert lo <= cmp.ratio_of_means(auto, best) <= hi
    assert 0.95 < lo < hi < 1.03


def test_ratio_interval_is_a_point_when_every_round_agrees() -> None:
    assert cmp.ratio_interval([0.9, 0.9, 0.9], [1.0, 1.0, 1.0]) == pytest.approx((0.9, 0.9))


def test_ratio_interval_widens_with_scatter() -> None:
    steady = cmp.ratio_interval([0.98, 1.0, 0.99, 1.01], [1.0] * 4)
    noisy = cmp.ratio_interval([0.8, 1.2, 0.9, 1.1], [1.0] * 4)
    assert noisy[1] - noisy[0] > 4 * (steady[1] - steady[0])


def test_ratio_interval_needs_pairs() -> None:
    with pytest.raises(ValueError, match="paired"):
        cmp.ratio_interval([1.0, 1.0], [1.0])
    with pytest.raises(ValueError, match="paired"):
        cmp.ratio_interval([], [])


def _report(target: str, cells: dict[tuple[str, int | str], list[float]]) -> bench.BenchReport:
    """A report with these per-round speed-ups (T = 0.8), its other figures made up."""
    rounds = {len(v) for v in cells.values()}.pop()
    runs = [
        bench.RunResult(
            prompt=prompt,
            n_draft=k,
            temperature=0.8,
            tokens_per_second=20.0 * statistics.median(v),
            acceptance_rate=0.5,
            tokens_per_pass=2.0,
            acceptance_by_position=[0.8, 0.6][: 0 if k == 0 else 1 if k == 1 else 2],
            t_draft_per_token=0.01,
            t_verify_per_pass=0.05,
            share_draft=0.2,
            share_verify=0.8,
            share_other=0.0,
            speedup=statistics.median(v),
            speedup_by_repeat=v,
        )
        for (prompt, k), v in cells.items()
    ]
    return bench.BenchReport(
        f"/models/{target}", "/models/draft.gguf", {"cpu": "x"}, 96, rounds, runs
    )


def test_pooled_reports_hold_every_round_of_the_configurations_all_ran() -> None:
    a = _report(
        "t.gguf", {("code", 0): [1.0, 1.0], ("code", 3): [1.3, 1.2], ("code", "auto"): [1.1, 1.3]}
    )
    b = _report(
        "t.gguf",
        {
            ("code", 0): [1.0] * 3,
            ("code", 3): [1.4, 1.1, 1.3],
            ("code", 1): [1.0] * 3,
            ("code", "auto"): [1.2] * 3,
        },
    )
    pooled = bench.pool_reports([a, b])
    assert pooled.repeats == 5
    assert pooled.seed is None  # its rounds come from two runs' seeds
    # K = 1 ran in one report only: left out
    assert [(r.prompt, r.n_draft) for r in pooled.runs] == [
        ("code", 0),
        ("code", 3),
        ("code", "auto"),
    ]
    k3 = pooled.runs[1]
    assert k3.temperature == 0.8 and k3.n_draft == 3
    assert k3.speedup_by_repeat == [1.3, 1.2, 1.4, 1.1, 1.3]
    assert k3.speedup == 1.3
    assert k3.tokens_per_second == pytest.approx((2 * 20 * 1.25 + 3 * 20 * 1.3) / 5)
    assert k3.acceptance_by_position == pytest.approx([0.8, 0.6])
    (row,) = bench.adaptive_vs_best_fixed(pooled)
    assert row["held_out_k"] == [3] * 5
    assert row["auto_over_held_out"] == pytest.approx(
        (1.1 + 1.3 + 3.6) / (1.3 + 1.2 + 1.4 + 1.1 + 1.3)
    )


def test_only_runs_of_one_pair_and_length_pool() -> None:
    a = _report("t.gguf", {("code", 0): [1.0, 1.0], ("code", "auto"): [1.1, 1.3]})
    with pytest.raises(ValueError, match="different pairs"):
        bench.pool_reports([a, _report("other.gguf", {("code", 0): [1.0, 1.0]})])
    with pytest.raises(ValueError, match="no configuration in common"):
        bench.pool_reports([a, _report("t.gguf", {("prose", 0): [1.0, 1.0]})])
    with pytest.raises(ValueError, match="no reports"):
        bench.pool_reports([])
    # `auto` with copies and the model alone are different decoders.
    copies = dataclasses.replace(a, ngram="auto")
    with pytest.raises(ValueError, match="n-gram modes"):
        bench.pool_reports([copies, dataclasses.replace(a, ngram="off")])
    assert bench.pool_reports([copies, copies]).ngram == "auto"


def test_a_report_is_read_back_as_written(tmp_path: Path) -> None:
    a = _report(
        "t.gguf", {("code", 0): [1.0, 1.0], ("code", 3): [1.3, 1.2], ("code", "auto"): [1.1, 1.3]}
    )
    path = tmp_path / "r.json"
    path.write_text(json.dumps(a.as_dict()))
    assert bench.load_report(path) == a
    # Reports written before `--seed` all used the default.
    old = a.as_dict()
    del old["seed"]
    path.write_text(json.dumps(old))
    assert bench.load_report(path).seed == bench.DEFAULT_SEED
    # A pool's report (several seeds) reads back as one, and pools again.
    path.write_text(json.dumps(bench.pool_reports([a, a]).as_dict()))
    assert bench.load_report(path).seed is None
    assert bench.pool_reports([bench.load_report(path), a]).repeats == 3 * a.repeats
    path.write_text('{"runs": [{"prompt": "code"}]}')
    with pytest.raises(ValueError, match="not a report"):
        bench.load_report(path)
    # The n-gram mode reads back; one that is none of them is no report.
    path.write_text(json.dumps(dataclasses.replace(a, ngram="off").as_dict()))
    assert bench.load_report(path).ngram == "off"
    path.write_text(json.dumps({**a.as_dict(), "ngram": "ON"}))
    with pytest.raises(ValueError, match="not a report"):
        bench.load_report(path)


def test_pooling_says_which_reports_sampled_the_same_texts() -> None:
    def run(seed: int, temperature: float = 0.8) -> bench.BenchReport:
        r = _report("t.gguf", {("code", 0): [1.0, 1.0], ("code", "auto"): [1.1, 1.3]})
        r.seed = seed
        for x in r.runs:
            x.temperature = temperature
        return r

    assert bench.repeated_texts([run(1234), run(1234), run(99), run(7), run(7)]) == [7, 1234]
    assert bench.repeated_texts([run(1234), run(1300)]) == []
    # greedy rounds repeat their text whatever the seed: nothing sampled, nothing to say
    assert bench.repeated_texts([run(1234, 0.0), run(1234, 0.0)]) == []

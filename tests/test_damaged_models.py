"""Damaged models: a malformed header is a ModelLoadError naming the key, and non-finite logits
are never accepted: a broken draft is dropped (the output stays the target's), a broken target
is an error."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers import rewrite_gguf

import specdec_native as sd
from specdec_native import models

ARCH = "llama"  # the tiny models' architecture


@pytest.mark.parametrize(
    "key,value",
    [
        ("block_count", 0),
        ("block_count", 0xFFFFFFFF),
        ("attention.layer_norm_rms_epsilon", float("nan")),
        ("attention.layer_norm_rms_epsilon", -1e-5),
        ("attention.layer_norm_rms_epsilon", float("inf")),
        ("embedding_length", 0),
        ("attention.head_count", 0),
        ("context_length", 0),
    ],
)
def test_malformed_hyperparameter_is_a_load_error(
    tiny_pair: models.ModelPair, tmp_path: Path, key: str, value: float
) -> None:
    bad = rewrite_gguf(tiny_pair.target, tmp_path / "bad.gguf", metadata={f"{ARCH}.{key}": value})
    with pytest.raises(sd.ModelLoadError, match=rf"{ARCH}\.{key}"):
        sd.SpeculativeDecoder(bad)
    with pytest.raises(sd.ModelLoadError, match=rf"{ARCH}\.{key}"):
        sd.SpeculativeDecoder(tiny_pair.target, bad)


@pytest.mark.parametrize(
    "metadata,match",
    [
        ({f"{ARCH}.expert_used_count": 2}, "expert_used_count is 2"),
        ({f"{ARCH}.expert_count": 4, f"{ARCH}.expert_used_count": 0}, "expert_used_count must"),
        ({f"{ARCH}.expert_count": 4, f"{ARCH}.expert_used_count": 8}, "expert_used_count is 8"),
        ({f"{ARCH}.rope.scaling.type": "bogus"}, "rope.scaling.type is 'bogus'"),
        ({"tokenizer.ggml.model": "none"}, "no tokenizer"),
        ({"tokenizer.ggml.model": "bert"}, "WordPiece"),
        ({"tokenizer.ggml.tokens": ["a"] * 319}, "repeats an earlier token"),
        ({"tokenizer.ggml.tokens": [""] * 319}, "repeats an earlier token"),
    ],
)
def test_metadata_llama_cpp_would_abort_on_is_a_load_error(
    tiny_pair: models.ModelPair, tmp_path: Path, metadata: dict[str, object], match: str
) -> None:
    bad = rewrite_gguf(tiny_pair.target, tmp_path / "bad.gguf", metadata=metadata)
    with pytest.raises(sd.ModelLoadError, match=match):
        sd.SpeculativeDecoder(bad)


def broken_head(how: str):  # type: ignore[no-untyped-def]
    """Maps the output head so that every logit is NaN, or one token's is +inf."""

    def edit(name: str, arr: np.ndarray) -> np.ndarray:
        if name != "output.weight":
            return arr
        out = arr.copy()
        if how == "nan":
            out[:] = np.nan
        else:
            out[300, :] = np.inf  # one row: that token's logit is +-inf or NaN
        return out

    return edit


@pytest.fixture(scope="module", params=["nan", "inf"])
def broken(request: pytest.FixtureRequest, tiny_pair: models.ModelPair, tiny_dir: Path) -> Path:
    return rewrite_gguf(
        tiny_pair.target,
        tiny_dir / f"broken-{request.param}.gguf",
        tensors=broken_head(request.param),
    )


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_draft_with_non_finite_logits_is_dropped_and_the_output_is_the_targets(
    tiny_pair: models.ModelPair, broken: Path, temperature: float
) -> None:
    with sd.SpeculativeDecoder(tiny_pair.target, n_threads=1) as alone:
        base = alone.generate([1, 300, 270], 24, temperature=temperature, seed=3)
    with sd.SpeculativeDecoder(tiny_pair.target, broken, n_draft=3, n_threads=1) as dec:
        with pytest.warns(RuntimeWarning, match="not finite"):
            r = dec.generate([1, 300, 270], 24, temperature=temperature, seed=3)
    assert "not finite" in r.stats.draft_error
    assert r.stats.n_accepted == 0
    assert len(r.tokens) == 24
    # No draft token was ever verified, so each token came from the target with the same seed.
    assert r.tokens == base.tokens


def test_each_request_tries_the_draft_afresh(tiny_pair: models.ModelPair, tiny_dir: Path) -> None:
    broken = rewrite_gguf(tiny_pair.target, tiny_dir / "nan2.gguf", tensors=broken_head("nan"))
    with sd.SpeculativeDecoder(tiny_pair.target, broken, n_draft=3, n_threads=1) as dec:
        for prompt in ([1, 300], [1, 280, 290]):
            with pytest.warns(RuntimeWarning, match="not finite"):
                r = dec.generate(prompt, 8)
            assert r.stats.draft_error and r.stats.n_drafted == 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("n_draft", [0, 3])
def test_a_target_with_non_finite_logits_raises(
    tiny_pair: models.ModelPair, broken: Path, temperature: float, n_draft: int
) -> None:
    with sd.SpeculativeDecoder(broken, tiny_pair.draft, n_draft=n_draft, n_threads=1) as dec:
        with pytest.raises(sd.NonFiniteLogitsError, match="non-finite logits"):
            dec.generate([1, 300, 270], 16, temperature=temperature, seed=1)
        # The decoder stays usable: the error is the request's, not the engine's.
        with pytest.raises(sd.NonFiniteLogitsError):
            dec.generate([1, 5], 4, temperature=temperature)

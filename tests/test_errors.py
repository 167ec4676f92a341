"""Bad input: a clear exception, never a crash."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import specdec_native as sd
from specdec_native import _core, models


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not found"):
        sd.SpeculativeDecoder(tmp_path / "nope.gguf")


def test_empty_file(tmp_path: Path) -> None:
    f = tmp_path / "empty.gguf"
    f.write_bytes(b"")
    with pytest.raises(sd.ModelLoadError, match="empty"):
        sd.SpeculativeDecoder(f)


def test_not_gguf(tmp_path: Path) -> None:
    f = tmp_path / "text.gguf"
    f.write_text("hello, I am not a model")
    with pytest.raises(sd.ModelLoadError, match="not a GGUF"):
        sd.SpeculativeDecoder(f)


def test_truncated_gguf(tmp_path: Path, tiny_pair: models.ModelPair) -> None:
    data = tiny_pair.target.read_bytes()
    for cut in (8, 100, len(data) // 2, len(data) - 10):
        f = tmp_path / f"cut{cut}.gguf"
        f.write_bytes(data[:cut])
        with pytest.raises(sd.ModelLoadError):
            sd.SpeculativeDecoder(f)


def test_directory_as_model(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a file"):
        sd.SpeculativeDecoder(tmp_path)


def test_vocab_mismatch(smollm2: Path, tiny_pair: models.ModelPair) -> None:
    with pytest.raises(sd.VocabMismatchError, match="vocabulary"):
        sd.SpeculativeDecoder(smollm2, tiny_pair.target)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": 0},
        {"max_tokens": -3},
        {"temperature": -0.1},
        {"temperature": float("nan")},
        {"temperature": float("inf")},
        {"top_p": -0.01},
        {"top_p": 1.01},
        {"top_k": -1},
        {"min_p": -0.5},
        {"n_draft": -1},
        {"n_draft": 10_000},
        {"stop": [""]},
        {"stop": [3]},
        {"seed": -1},
        {"draft_rule": "greedy"},
    ],
)
def test_bad_generate_arguments(
    tiny_decoder: sd.SpeculativeDecoder, kwargs: dict[str, Any]
) -> None:
    args = {"max_tokens": 5, **kwargs}
    with pytest.raises(ValueError):
        tiny_decoder.generate("the", **args)


def test_bad_prompts(tiny_decoder: sd.SpeculativeDecoder) -> None:
    with pytest.raises(ValueError, match="empty"):
        tiny_decoder.generate("", 5)
    with pytest.raises(ValueError):
        tiny_decoder.generate([], 5)
    with pytest.raises(ValueError, match="vocabulary"):
        tiny_decoder.generate([1, 10_000_000], 5)
    with pytest.raises(ValueError):
        tiny_decoder.generate([1, -4], 5)
    with pytest.raises(sd.ContextOverflowError):
        tiny_decoder.generate([1] * 5000, 5)


def test_invalid_utf8_surrogates(tiny_decoder: sd.SpeculativeDecoder) -> None:
    with pytest.raises((ValueError, UnicodeError)):
        tiny_decoder.generate("bad \udcff text", 3)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"n_draft": -1},
        {"n_draft": 65},
        {"n_ctx": 0},
        {"n_batch": 0},
        {"n_threads": 0},
        {"ngram_index_mb": -1},
        {"ngram_index_mb": float("nan")},
        {"ngram_index_mb": 1e9},
        {"ngram_index_mb": 1e-5},
    ],
)
def test_bad_constructor_arguments(tiny_pair: models.ModelPair, kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        sd.SpeculativeDecoder(tiny_pair.target, tiny_pair.draft, **kwargs)


@pytest.mark.parametrize("ngram", [None, False])
def test_a_shared_index_without_copies_at_every_k_is_refused(
    tiny_pair: models.ModelPair, ngram: bool | None
) -> None:
    # It would be built for requests that never copy from it: an option silently without effect.
    with pytest.raises(ValueError, match="ngram_index_mb needs ngram=True"):
        sd.SpeculativeDecoder(tiny_pair.target, tiny_pair.draft, ngram=ngram, ngram_index_mb=1)
    with pytest.raises(ValueError, match="ngram_index_mb needs ngram=True"):
        sd.SpeculativeDecoder(tiny_pair.target, ngram=ngram, ngram_index_mb=1)
    with sd.SpeculativeDecoder(tiny_pair.target, tiny_pair.draft, ngram=True, ngram_index_mb=1):
        pass


def test_use_after_close(tiny_pair: models.ModelPair) -> None:
    dec = sd.SpeculativeDecoder(tiny_pair.target, tiny_pair.draft)
    dec.close()
    dec.close()  # idempotent
    with pytest.raises(sd.EngineClosedError):
        dec.generate("the", 3)
    with pytest.raises(sd.EngineClosedError):
        dec.tokenize("the")

    async def streamed() -> None:
        async for _ in dec.astream("the", 3):
            pass

    # The async variants too, whose threads closed with it.
    with pytest.raises(sd.EngineClosedError):
        asyncio.run(dec.agenerate("the", 3))
    with pytest.raises(sd.EngineClosedError):
        asyncio.run(streamed())


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": 2**31},
        {"top_k": 2**31},
        {"max_tokens": 10**30},
        {"n_draft": 2**40},
        {"seed": 2**64},
    ],
)
def test_integers_beyond_the_engines_range(
    tiny_decoder: sd.SpeculativeDecoder, kwargs: dict[str, Any]
) -> None:
    with pytest.raises(ValueError, match="must be in"):
        tiny_decoder.generate("the", **{"max_tokens": 3, **kwargs})


def test_prompt_token_beyond_int32(tiny_decoder: sd.SpeculativeDecoder) -> None:
    with pytest.raises(ValueError, match="prompt token"):
        tiny_decoder.generate([1, 2**40], 3)
    with pytest.raises(ValueError, match="token"):
        tiny_decoder.detokenize([2**40])


@pytest.mark.parametrize("kwargs", [{"n_gpu_layers": 10**12}, {"draft_n_gpu_layers": 2**31}])
def test_constructor_integers_beyond_int32(
    tiny_pair: models.ModelPair, kwargs: dict[str, Any]
) -> None:
    with pytest.raises(ValueError, match="must be in"):
        sd.SpeculativeDecoder(tiny_pair.target, tiny_pair.draft, **kwargs)


@pytest.mark.parametrize("prompt", [b"Hello", bytearray(b"Hi"), memoryview(b"Hi")])
def test_bytes_are_not_token_ids(tiny_decoder: sd.SpeculativeDecoder, prompt: object) -> None:
    with pytest.raises(TypeError, match="not bytes"):
        tiny_decoder.generate(prompt, 3)  # type: ignore[arg-type]


def test_a_prompt_of_another_type(tiny_decoder: sd.SpeculativeDecoder) -> None:
    with pytest.raises(TypeError, match="got int"):
        tiny_decoder.generate(42, 3)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"stop": 5}, "stop must be a str or a list of str, got int"),
        ({"json_object": 1}, "json_object must be True or False"),
    ],
)
def test_arguments_of_another_type(
    tiny_decoder: sd.SpeculativeDecoder, kwargs: dict[str, Any], match: str
) -> None:
    with pytest.raises(TypeError, match=match):
        tiny_decoder.generate("the", 3, **kwargs)


@pytest.mark.parametrize("messages", ["hi", {"role": "user", "content": "hi"}, 5])
def test_chat_messages_of_another_type(tiny_decoder: sd.SpeculativeDecoder, messages: Any) -> None:
    with pytest.raises(TypeError, match="messages must be a list of message dicts"):
        tiny_decoder.apply_chat_template(messages)


@pytest.mark.skipif(_core.supports_gpu_offload(), reason="this build offloads layers")
def test_gpu_layers_on_a_build_without_gpu_offload_are_a_warning(
    tiny_pair: models.ModelPair,
) -> None:
    with pytest.warns(RuntimeWarning, match="no GPU offload"):
        sd.SpeculativeDecoder(tiny_pair.target, n_gpu_layers=-1, n_ctx=64).close()


def test_a_path_too_long_for_the_file_system(tmp_path: Path) -> None:
    with pytest.raises((FileNotFoundError, ValueError)):
        sd.SpeculativeDecoder(tmp_path / ("x" * 300 + ".gguf"))


def test_a_model_path_of_the_wrong_type() -> None:
    with pytest.raises(TypeError, match="must be a path"):
        sd.SpeculativeDecoder(3)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "message,error,match",
    [
        ({"role": "user", "content": None}, TypeError, "content must be a string"),
        ({"role": None, "content": "hi"}, TypeError, "role must be a string"),
        ({"role": "user", "content": 5}, TypeError, "content must be a string"),
        ({"role": "user", "content": "a\0b"}, ValueError, "NUL"),
    ],
)
def test_bad_chat_messages(
    smollm2_q40: Path,
    message: dict[str, Any],
    error: type,
    match: str,
) -> None:
    with sd.SpeculativeDecoder(smollm2_q40, n_ctx=256) as dec:
        with pytest.raises(error, match=match):
            dec.apply_chat_template([message])


def test_noise_must_be_finite(tmp_path: Path) -> None:
    for noise in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ValueError, match="draft_noise"):
            models.build_tiny_pair(tmp_path, draft_noise=noise)
    assert not list(tmp_path.glob("*.gguf"))


def test_a_deep_target_over_llamas_layer_limit(smollm2: Path) -> None:
    with pytest.raises(ValueError, match="over llama.cpp's 512"):
        models.build_deep_pair(smollm2, extra_copies=100)


def test_numpy_numbers_are_numbers(tiny_decoder: sd.SpeculativeDecoder) -> None:
    import numpy as np

    # generate() takes numpy's numbers, and says so (no type: ignore here: mypy checks it).
    r = tiny_decoder.generate(
        [np.int64(1), np.int32(300)],
        np.int64(4),
        n_draft=np.int64(2),
        seed=np.uint64(5),
        temperature=np.float32(0.5),
    )
    assert len(r.tokens) == 4
    assert tiny_decoder.generate(np.array([1, 300]), 2).tokens  # an array of ids, too


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"temperature": 1e-50}, "32-bit"),
        ({"temperature": 1e39}, "32-bit"),
        ({"temperature": 10**400}, "too large"),
        ({"top_p": 1e-50}, "32-bit"),
        ({"draft_p_min": 10**400}, "too large"),
    ],
)
def test_floats_the_engine_cannot_hold(
    tiny_decoder: sd.SpeculativeDecoder, kwargs: dict[str, Any], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        tiny_decoder.generate("the", 3, **kwargs)


@pytest.mark.parametrize(
    "call,error,match",
    [
        (lambda d: d.generate("the", 3, stop=b"q"), TypeError, "not bytes"),
        (lambda d: d.generate("the", 3, stop=["\udcff"]), ValueError, "surrogate"),
        (lambda d: d.tokenize("the", add_special="no"), TypeError, "add_special"),
        (lambda d: d.measure_decode_cost("the", 2, draft="yes"), TypeError, "draft"),
        (lambda d: d.measure_decode_cost([10**6], 2), ValueError, "outside the vocabulary"),
        (lambda d: d.calibrate([10**6]), ValueError, "outside the vocabulary"),
        (lambda d: d.next_token_logits([2**31]), ValueError, "prompt token"),
        (lambda d: d.next_token_logits([1.0]), TypeError, "integer"),
        (lambda d: d.generate("the", 2.5), TypeError, "integer"),
    ],
)
def test_bad_arguments_of_every_method(
    tiny_decoder: sd.SpeculativeDecoder, call: Any, error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        call(tiny_decoder)


def test_bad_chat_arguments(smollm2_q40: Path) -> None:
    with sd.SpeculativeDecoder(smollm2_q40, n_ctx=256) as dec:
        with pytest.raises(ValueError, match="surrogate"):
            dec.apply_chat_template([{"role": "user", "content": "a\udcffb"}])
        with pytest.raises(TypeError, match="add_generation_prompt"):
            dec.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt="x")  # type: ignore[arg-type]


def test_every_property_after_close(tiny_pair: models.ModelPair) -> None:
    dec = sd.SpeculativeDecoder(tiny_pair.target, tiny_pair.draft)
    dec.close()
    for name in ("n_draft", "has_draft", "n_ctx"):
        with pytest.raises(sd.EngineClosedError):
            getattr(dec, name)


def test_one_settings_definition_checks_and_maps_once(tiny_decoder: sd.SpeculativeDecoder) -> None:
    # generate() is GenerationSettings.checked() then run(): the same checks, the same result.
    settings = sd.GenerationSettings.checked(
        max_tokens=np.int64(6), temperature=np.float32(0.0), stop=("zz",), n_draft="auto"
    )
    assert settings.max_tokens == 6 and type(settings.max_tokens) is int
    assert settings.stop == ("zz",) and settings.n_draft == "auto"
    a = tiny_decoder.run([1, 300], settings)
    b = tiny_decoder.generate([1, 300], 6, temperature=0.0, stop="zz", n_draft="auto")
    assert a.tokens == b.tokens
    with pytest.raises(TypeError, match="unknown generation settings: temp"):
        sd.GenerationSettings.checked(temp=0.5)
    with pytest.raises(ValueError, match="n_draft"):
        sd.GenerationSettings.checked(n_draft="fast")
    with pytest.raises(TypeError, match="GenerationSettings"):
        tiny_decoder.run([1, 300], {"max_tokens": 4})  # type: ignore[arg-type]


DEEP_IFS = "{% if true %}" * 120 + "x" + "{% endif %}" * 120


@pytest.mark.parametrize(
    "template,why",
    [
        ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "2 s"),
        ("{{ 'x' * 200000000 }}", "1,000,000 items"),
        (
            "{% set ns = namespace(s='x') %}{% for i in range(40) %}"
            "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
            "MiB",
        ),
        (DEEP_IFS, "not a usable Jinja template"),  # past what Python compiles
    ],
)
def test_a_chat_template_is_bounded_in_time_and_memory(
    tiny_pair: models.ModelPair, template: str, why: str
) -> None:
    # A model file's template is not trusted: a loop of loops or a doubled string is refused.
    with pytest.raises(ValueError, match=why):
        with sd.SpeculativeDecoder(tiny_pair.target, n_ctx=64, chat_template=template) as dec:
            dec.apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(
    "batch", [[["1", 0.1]], [[True, 0.1]], [[2**40, 0.1]], [[0, 0.1]], [[1, 0.1, 2]], 3, [[1, "x"]]]
)
def test_a_calibration_file_with_damaged_batch_costs_is_measured_again(
    batch: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from specdec_native import calibration

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    inputs = {"model": "m"}
    calibration.save(inputs, calibration.Stored([1.0, 2.0], [1.0, 1.0], 0, [(1, 0.1)], []))
    assert calibration.load(inputs) == calibration.Stored([1.0, 2.0], [1.0, 1.0], 0, [(1, 0.1)])
    path = calibration._path(inputs)
    record = json.loads(path.read_text())
    record["batch_verify_costs"] = batch
    path.write_text(json.dumps(record))
    assert calibration.load(inputs) is None


def test_a_calibration_file_nested_past_parsing_is_measured_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from specdec_native import calibration

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    inputs = {"model": "m"}
    path = calibration._path(inputs)
    path.parent.mkdir(parents=True)
    path.write_text("[" * 200_000 + "]" * 200_000)
    assert calibration.load(inputs) is None
    path.unlink()
    path.mkdir()  # a save that cannot be renamed into place leaves no part file
    calibration.save(inputs, calibration.Stored([1.0], [1.0], 0))
    assert [p.name for p in path.parent.iterdir()] == [path.name]

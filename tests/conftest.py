"""Shared fixtures: real models, fetched or built once per test run (cached across runs in
$SPECDEC_CACHE, default ~/.cache/specdec)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from hypothesis import settings
from server_process import Server, start

import specdec_native as sd
from specdec_native import models
from specdec_native._paths import cache_base

# No deadline per example: a busy 2-core machine that deschedules one for 200 ms is no fault.
settings.register_profile("specdec", deadline=None)
settings.load_profile("specdec")

# Target top-1 minus top-2 logit below which a greedy divergence is a float near-tie: batched
# verification and one-token decoding use different kernels and accumulate different rounding
# in the KV cache (measured on Gemma 3 Q4_K_M: the two reads of one position differ by up to 0.3).
NEAR_TIE_GAP = 0.35
# The same for a verify of many rows (a long copy): a decode of 100+ rows takes other matrix
# kernels than one of a few, and rounding moves further.
BATCHED_NEAR_TIE_GAP = 0.5
# Where other requests' rows share the decode, how far rounding moves depends on which rows those
# are. Measured on the deep pair, 4 streams started at random offsets, every token read again in a
# fresh one-token decode: over 11,000 positions the logit gap between two tokens moved by 0.03 at
# the median, by more than 0.5 at 13 and by at most 0.65, whether or not one stream was cancelled.
# Still far below the median decision margin (1.3-2.0, see test_greedy_identity).
SHARED_DECODE_NEAR_TIE_GAP = 0.75


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--n-gpu-layers",
        type=int,
        default=None,
        help="Decoders the tests build put this many layers of each model on the GPU (-1: all), "
        "for a build with a GPU backend; they run on the CPU by default.",
    )


def pytest_configure(config: pytest.Config) -> None:
    # Every decoder a test builds takes its default from here, so the same tests check a GPU build.
    layers = config.getoption("--n-gpu-layers")
    if layers is not None:
        defaults = sd.SpeculativeDecoder.__init__.__kwdefaults__
        assert defaults is not None
        defaults["n_gpu_layers"] = layers
    _cache_of_its_own()


def _cache_of_its_own() -> None:
    """The tests (and the servers and commands they start) keep what they measure in a cache
    of their own, sharing only the built models: costs measured while the suite loads the
    machine must not become what `auto` reads afterwards."""
    shared = cache_base()
    (shared / "models").mkdir(parents=True, exist_ok=True)
    own = Path(tempfile.mkdtemp(prefix="specdec-tests-"))
    (own / "models").symlink_to(shared / "models", target_is_directory=True)
    os.environ["SPECDEC_CACHE"] = str(own)
    atexit.register(shutil.rmtree, own, ignore_errors=True)


PROMPTS = [
    "The history of the Roman Empire",
    "def fibonacci(n):\n    ",
    "Ingredients for pancakes:\n1.",
    '{"name": "Alice", "age": 30, "city":',
    "Once upon a time, there was a little girl who",
    "Q: What is the capital of France?\nA:",
]


@pytest.fixture(scope="session")
def smollm2() -> Path:
    return models.fetch_smollm2()


@pytest.fixture(scope="session")
def smollm2_q40(smollm2: Path) -> Path:
    return models.build_deep_pair(smollm2).draft


@pytest.fixture(scope="session")
def deep_pair() -> models.ModelPair:
    return models.default_pair()


@pytest.fixture(scope="session")
def gemma3() -> Path:
    return models.fetch_gemma3()


@pytest.fixture(scope="session")
def gemma3_q40(gemma3: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = models.cache_dir() / "gemma-3-270m.Q4_0.gguf"
    if not out.exists():
        models.quantize(gemma3, out, "Q4_0")
    return out


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="session")
def tiny_pair(tiny_dir: Path) -> models.ModelPair:
    return models.build_tiny_pair(tiny_dir, seed=0, draft_noise=0.5)


@pytest.fixture(scope="session")
def deep_decoder(deep_pair: models.ModelPair) -> Iterator[sd.SpeculativeDecoder]:
    with sd.SpeculativeDecoder(deep_pair.target, deep_pair.draft, n_draft=4, n_ctx=1024) as dec:
        yield dec


@pytest.fixture(scope="session")
def tiny_decoder(tiny_pair: models.ModelPair) -> Iterator[sd.SpeculativeDecoder]:
    with sd.SpeculativeDecoder(
        tiny_pair.target, tiny_pair.draft, n_draft=3, n_ctx=256, n_threads=1
    ) as dec:
        yield dec


@pytest.fixture(scope="module")
def chat_server(smollm2_q40: Path) -> Iterator[Server]:
    """SmolLM2 served with n-gram drafting as "smol" (a server per test module)."""
    server = start(smollm2_q40, "--draft", "ngram", "-c", "1024", "--model-alias", "smol")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(chat_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=chat_server.url + "/v1", api_key="none", max_retries=0)

"""specdec: speculative decoding for GGUF models on llama.cpp.

from specdec_native import SpeculativeDecoder
with SpeculativeDecoder("target.gguf", draft="draft.gguf", n_draft=4) as sd:
    print(sd.generate("Once upon a time", max_tokens=64).text)
"""

from specdec_native._libllama import load_shared_libllama

load_shared_libllama()

from specdec_native._core import (  # noqa: E402
    CancelFlag,
    ContextOverflowError,
    FileError,
    ModelLoadError,
    NonFiniteLogitsError,
    ReentrantCallError,
    UnsupportedModelError,
    VocabMismatchError,
)
from specdec_native.decoder import (  # noqa: E402
    ArgumentTypeError,
    EngineClosedError,
    FinishReason,
    GenerationResult,
    GenerationSettings,
    SpeculativeDecoder,
    Stats,
    TokenLogprob,
)

__all__ = [
    "ArgumentTypeError",
    "CancelFlag",
    "ContextOverflowError",
    "EngineClosedError",
    "FileError",
    "FinishReason",
    "GenerationResult",
    "GenerationSettings",
    "TokenLogprob",
    "ModelLoadError",
    "NonFiniteLogitsError",
    "ReentrantCallError",
    "SpeculativeDecoder",
    "Stats",
    "UnsupportedModelError",
    "VocabMismatchError",
]
__version__ = "0.1.0"

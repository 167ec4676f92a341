"""One libllama per process, whichever of llama_cpp and specdec_native is imported first.

llama-cpp-python ships its libraries as copies (libllama.so, libllama.so.0, ...) and loads
``libllama.so`` by path. Our extension links against the soname ``libllama.so.0``; if it were
loaded first, the dynamic loader would map that file, and llama_cpp's later load of the other copy
would map a second libllama with its own global state. Loading llama_cpp's file first, by the same
path, makes the loader resolve our soname to it, and llama_cpp's later load to the same file.

Both load libllama into the process's global scope, with its GPU backend. A CUDA build's
libggml-cuda exports its own copies of C++ standard-library templates (std::ostream's number
output among them); where the C++ runtime was loaded before, privately (numpy, imported first,
loads it), libllama would bind to those copies while the runtime uses its own, and crash printing
a number while loading a model. Such a runtime is made global first, so that every library binds
to its copies.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
from pathlib import Path


def libllama_path() -> Path:
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        raise ImportError("llama-cpp-python is not installed; run scripts/setup.sh")
    name = {"darwin": "libllama.dylib", "win32": "llama.dll"}.get(sys.platform, "libllama.so")
    return Path(spec.origin).parent / "lib" / name


def load_cxx_runtime_globally() -> None:
    """Makes a C++ runtime that is already loaded privately global; loads none itself (libllama
    brings the one its own search path finds)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libstdc++.so.6", mode=ctypes.RTLD_GLOBAL | os.RTLD_NOLOAD)
    except OSError:
        pass  # not loaded yet: nothing to order


def load_shared_libllama() -> None:
    path = libllama_path()
    if not path.exists():
        raise ImportError(f"llama-cpp-python's library is missing: {path}")
    load_cxx_runtime_globally()
    ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)

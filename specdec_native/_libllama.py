"""One libllama per process, whichever of llama_cpp and specdec_native is imported first.

llama-cpp-python ships its libraries as copies (libllama.so, libllama.so.0, ...) and loads
``libllama.so`` by path. Our extension links against the soname ``libllama.so.0``; if it were
loaded first, the dynamic loader would map that file, and llama_cpp's later load of the other copy
would map a second libllama with its own global state. Loading llama_cpp's file first, by the same
path, makes the loader resolve our soname to it, and llama_cpp's later load to the same file.
"""

from __future__ import annotations

import ctypes
import importlib.util
import sys
from pathlib import Path


def libllama_path() -> Path:
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        raise ImportError("llama-cpp-python is not installed; run scripts/setup.sh")
    name = {"darwin": "libllama.dylib", "win32": "llama.dll"}.get(sys.platform, "libllama.so")
    return Path(spec.origin).parent / "lib" / name


def load_shared_libllama() -> None:
    path = libllama_path()
    if not path.exists():
        raise ImportError(f"llama-cpp-python's library is missing: {path}")
    ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)

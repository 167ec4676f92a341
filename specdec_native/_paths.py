"""Where specdec keeps what it builds, fetches and measures, and how it writes files whole."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path


def cache_base() -> Path:
    """$SPECDEC_CACHE, default $XDG_CACHE_HOME/specdec or ~/.cache/specdec."""
    base = os.environ.get("SPECDEC_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "specdec"
    )
    return Path(base)


def write_whole(path: Path, write: Callable[[Path], object]) -> None:
    """Writes path through a part file beside it, moved into place once complete: a failure or
    a kill leaves the path as it was, never half a file, and two writers of the same path (two
    processes, two threads) do not share a part file."""
    writer = f"{os.getpid()}.{threading.get_ident()}"
    part = path.with_name(f"{path.stem}.{writer}.part{path.suffix}")  # suffix: the format
    try:
        write(part)
        os.replace(part, path)
    except BaseException:
        part.unlink(missing_ok=True)
        raise

"""Where specdec keeps what it builds, fetches and measures."""

from __future__ import annotations

import os
from pathlib import Path


def cache_base() -> Path:
    """$SPECDEC_CACHE, default $XDG_CACHE_HOME/specdec or ~/.cache/specdec."""
    base = os.environ.get("SPECDEC_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "specdec"
    )
    return Path(base)

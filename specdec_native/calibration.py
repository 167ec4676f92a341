"""The adaptive policy's cost curve, kept on disk between runs.

Measuring t_verify(n) takes a few seconds, which a one-shot `specdec-cli run` would pay every
time. The curve depends only on the two models, the settings that change decode speed, and the
machine, so it is stored under a key made of exactly those; any change measures it afresh. The
policy keeps updating the costs of the K it uses while it runs, so a curve measured on a busy
moment corrects itself where it matters.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

from specdec_native import _core
from specdec_native._paths import cache_base

# 2: the draft cost became two, a decode of one token and of two.
# 3: fastest timings from interleaved sweeps (csrc/cost_curve.h): curves stored before, from
#    medians, may have been measured on a busy machine and are measured again.
FORMAT = 3


def _file_identity(path: Path) -> list[Any]:
    st = path.stat()
    return [str(path.resolve()), st.st_size, st.st_mtime_ns]


def cpu_model() -> str:
    """The CPU's model name (what the cost curve and the benchmarks were measured on)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def inputs(target: Path, draft: Path | None, settings: dict[str, Any]) -> dict[str, Any]:
    """Everything the cost curve depends on."""
    return {
        "format": FORMAT,
        "target": _file_identity(target),
        "draft": _file_identity(draft) if draft else "ngram",
        "settings": settings,
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "backend": _core.system_info().strip(),
        "host": platform.node(),
    }


def _path(key_inputs: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key_inputs, sort_keys=True).encode()).hexdigest()
    return cache_base() / "calibration" / f"{digest[:24]}.json"


def load(key_inputs: dict[str, Any]) -> tuple[list[float], list[float]] | None:
    """The stored (verify costs, draft costs), or None when there are none that fit."""
    try:
        data = json.loads(_path(key_inputs).read_text())
        if data["inputs"] != key_inputs:
            return None
        return [float(t) for t in data["verify_costs"]], [float(t) for t in data["draft_costs"]]
    except (OSError, ValueError, KeyError, TypeError, OverflowError, RecursionError):
        return None  # measured again, and stored over it


def save(key_inputs: dict[str, Any], verify_costs: list[float], draft_costs: list[float]) -> None:
    """Stores the curve; a cache that cannot be written is not an error (it is measured again
    next time)."""
    path = _path(key_inputs)
    record = {
        "inputs": key_inputs,
        "verify_costs": verify_costs,
        "draft_costs": draft_costs,
        "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    tmp = path.with_suffix(f".{os.getpid()}.part")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(record, indent=1))
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)

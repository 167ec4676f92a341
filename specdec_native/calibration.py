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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from specdec_native import _core
from specdec_native._paths import cache_base, write_whole

# 2: the draft cost became two, a decode of one token and of two.
# 3: fastest timings from interleaved sweeps (csrc/cost_curve.h): curves stored before, from
#    medians, may have been measured on a busy machine and are measured again.
# 4: whether drafting can pay at these costs, and how many measurements in a row said it cannot.
# 5: the batch costs of an engine of several slots (keyed by their number).
FORMAT = 5
# A curve by which drafting can never pay ends speculation for good ("draft too slow"): it is
# trusted once this many measurements in a row have said so, so that one measurement on a busy
# moment does not decide it.
CANNOT_PAY_CONFIRMATIONS = 2


@dataclass(frozen=True)
class Stored:
    verify_costs: list[float]
    draft_costs: list[float]
    cannot_pay: int  # measurements in a row by which drafting could never pay; 0: it can
    # With several slots: (rows, seconds) of the target's and the draft's batched decodes.
    batch_verify_costs: list[tuple[int, float]] = field(default_factory=list)
    batch_draft_costs: list[tuple[int, float]] = field(default_factory=list)

    @property
    def trusted(self) -> bool:
        return self.cannot_pay == 0 or self.cannot_pay >= CANNOT_PAY_CONFIRMATIONS


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


def inputs(
    target: Path, draft: Path | Literal["ngram"] | None, settings: dict[str, Any]
) -> dict[str, Any]:
    """Everything the cost curve depends on. ``draft``: the draft model's file, "ngram", or
    None for a target alone (which drafts forced tokens and predictions)."""
    return {
        "format": FORMAT,
        "target": _file_identity(target),
        "draft": _file_identity(draft) if isinstance(draft, Path) else (draft or "none"),
        "settings": settings,
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "backend": _core.system_info().strip(),
        "host": platform.node(),
    }


def _path(key_inputs: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key_inputs, sort_keys=True).encode()).hexdigest()
    return cache_base() / "calibration" / f"{digest[:24]}.json"


def load(key_inputs: dict[str, Any]) -> Stored | None:
    """The stored curve, or None when there is none that fits."""
    try:
        data = json.loads(_path(key_inputs).read_text())
        if data["inputs"] != key_inputs:
            return None
        cannot_pay = data["cannot_pay"]
        if type(cannot_pay) is not int or cannot_pay < 0:
            return None
        return Stored(
            [float(t) for t in data["verify_costs"]],
            [float(t) for t in data["draft_costs"]],
            cannot_pay,
            _points(data["batch_verify_costs"]),
            _points(data["batch_draft_costs"]),
        )
    except (OSError, ValueError, KeyError, TypeError, OverflowError, RecursionError):
        return None  # measured again, and stored over it


def _points(data: Any) -> list[tuple[int, float]]:
    points = [(rows, float(seconds)) for rows, seconds in data]
    if any(type(rows) is not int or not 0 < rows < 2**31 for rows, _ in points):
        raise ValueError("batch rows must be positive integers")
    return points


def save(key_inputs: dict[str, Any], curve: Stored) -> None:
    """Stores the curve; a cache that cannot be written is not an error (it is measured again
    next time)."""
    path = _path(key_inputs)
    record = {
        "inputs": key_inputs,
        "verify_costs": curve.verify_costs,
        "draft_costs": curve.draft_costs,
        "cannot_pay": curve.cannot_pay,
        "batch_verify_costs": curve.batch_verify_costs,
        "batch_draft_costs": curve.batch_draft_costs,
        "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        write_whole(path, lambda part: part.write_text(json.dumps(record, indent=1)))

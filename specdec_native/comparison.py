"""`auto` against the best fixed K, per prompt, from per-round speed-ups.

Picking the fastest fixed K after the fact favours it: it is the largest of several noisy
measurements, so it reads high by about as much as they scatter, while `auto` is one measurement.
Held out, each round's best fixed K is the one that was fastest on the *other* rounds, and its
speed is the one this round measured (cross-fitting): no round both picks and scores a K. Where
one K is clearly fastest it is picked every time and the two agree; where several are close the
held-out figure reads a little low instead of high, by at most how far apart they are.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class HeldOut:
    speedups: list[float]  # per round: the speed-up of the K picked on the other rounds
    picked: list[object]  # per round: that K


def held_out_best(by_config: Mapping[K, Sequence[float]]) -> HeldOut:
    """For each round r, the fixed K with the best mean speed-up over the rounds other than r,
    and its speed-up in round r. Ties go to the first K in `by_config`. Needs 2+ rounds, the
    same number for every K."""
    counts = {len(v) for v in by_config.values()}
    if len(counts) != 1 or min(counts) < 2:
        raise ValueError("held-out comparison needs the same number (2+) of rounds for each K")
    totals = {k: sum(v) for k, v in by_config.items()}
    speedups: list[float] = []
    picked: list[object] = []
    for r in range(counts.pop()):
        # Every K has the same number of other rounds: their sum ranks them as their mean would.
        best = max(by_config, key=lambda k: totals[k] - by_config[k][r])
        speedups.append(by_config[best][r])
        picked.append(best)
    return HeldOut(speedups, picked)


def ratio_of_means(num: Sequence[float], den: Sequence[float]) -> float:
    d = statistics.mean(den)
    return statistics.mean(num) / d if d else 0.0


def ratio_interval(
    num: Sequence[float],
    den: Sequence[float],
    *,
    level: float = 0.95,
    resamples: int = 2000,
    seed: int = 0,
) -> tuple[float, float]:
    """A bootstrap interval for mean(num) / mean(den), resampling rounds (pairs) with
    replacement. Seeded: the same numbers give the same interval."""
    if len(num) != len(den) or not num:
        raise ValueError("need paired, non-empty samples")
    rng = random.Random(seed)
    n = len(num)
    ratios = []
    for _ in range(resamples):
        idx = [rng.randrange(n) for _ in range(n)]
        ratios.append(ratio_of_means([num[i] for i in idx], [den[i] for i in idx]))
    ratios.sort()
    tail = (1.0 - level) / 2.0
    lo = ratios[int(tail * (resamples - 1))]
    hi = ratios[int(round((1.0 - tail) * (resamples - 1)))]
    return lo, hi

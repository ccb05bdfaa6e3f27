"""Percentiles and bootstrap intervals: the one definition every suite's figures use.

A percentile is linearly interpolated between the two nearest ranks (numpy's default, ``method="linear"``):
the p50 of an even count is the mean of the middle two (what ``statistics.median`` gives), and a p99 of
100 values lies 1 % of the way from the 99th to the 100th. Every table of every suite uses this one, so
a p99 in the overhead table and one in the routing table mean the same thing.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

__all__ = [
    "BOOTSTRAP_CONFIDENCE",
    "BOOTSTRAP_RESAMPLES",
    "bootstrap_intervals",
    "distribution",
    "percentile",
    "sorted_percentile",
]

BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_CONFIDENCE = 0.95


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (``q`` in [0, 100]) of ``values``, linearly interpolated; NaN for no values."""
    if not values:
        return math.nan
    return sorted_percentile(sorted(values), q)


def sorted_percentile(data: Sequence[float], q: float) -> float:
    """``percentile`` of values already sorted (for callers that take several of one list)."""
    if not data:
        return math.nan
    pos = (len(data) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def distribution(values: Sequence[float]) -> dict[str, float]:
    """p50/p90/p99/mean of ``values`` (NaN when empty, so a failed run never looks fast)."""
    data = sorted(values)
    return {
        "p50": sorted_percentile(data, 50),
        "p90": sorted_percentile(data, 90),
        "p99": sorted_percentile(data, 99),
        "mean": sum(values) / len(values) if values else math.nan,  # summed in the order given
    }


def _nan_interval() -> list[float]:
    return [math.nan, math.nan]


def bootstrap_intervals(
    values: Sequence[float],
    resamples: int = BOOTSTRAP_RESAMPLES,
    confidence: float = BOOTSTRAP_CONFIDENCE,
    seed: int = 0,
) -> dict[str, list[float]]:
    """Percentile-bootstrap confidence intervals ``[low, high]`` of the p50, p99 and mean of ``values``.

    Why: one run's p99 of a few hundred requests rests on its handful of slowest requests, so two
    contenders' p99s are only told apart when their intervals say so. Each resample draws
    ``len(values)`` values with replacement (a fixed ``seed``: the same run prints the same
    interval); the interval is the resampled statistics' central ``confidence`` share. NaN
    intervals for fewer than two values (nothing to resample).
    """
    if len(values) < 2:
        return {"p50": _nan_interval(), "p99": _nan_interval(), "mean": _nan_interval()}
    rng = random.Random(seed)
    data = list(values)
    n = len(data)
    stats: dict[str, list[float]] = {"p50": [], "p99": [], "mean": []}
    for _ in range(resamples):
        sample = sorted(rng.choices(data, k=n))
        stats["p50"].append(sorted_percentile(sample, 50))
        stats["p99"].append(sorted_percentile(sample, 99))
        stats["mean"].append(sum(sample) / n)
    tail = (1.0 - confidence) / 2.0 * 100.0
    return {name: [percentile(xs, tail), percentile(xs, 100.0 - tail)] for name, xs in stats.items()}

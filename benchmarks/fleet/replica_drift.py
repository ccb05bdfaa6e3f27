"""How far apart replicas' views of the workers' caches are while they route the same load.

Every replica applies every worker's KV events itself, so each one's index lags the workers by its
own event delay; under load the replicas can disagree for a moment on which worker holds what.
This samples every replica's ``/metrics`` (``prefix_router_index_blocks``, GPU tier, the confirmed
blocks each replica holds per worker) at a fixed period during the run and reports, per sample,

    drift = sum over workers of (most - fewest blocks any replica holds for it)
            / sum over workers of the replicas' mean blocks for it

0 means every replica holds the same number of blocks for every worker. The replicas are scraped
one after the other (a few ms apart), so a busy fleet shows some drift from sampling alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import defaultdict
from collections.abc import Sequence

import aiohttp

__all__ = ["drift", "gpu_blocks", "sample_drift"]

_METRIC = "prefix_router_index_blocks{"


def gpu_blocks(text: str) -> dict[str, float]:
    """Confirmed GPU blocks per worker (its DP ranks summed) from one ``/metrics`` text."""
    out: dict[str, float] = defaultdict(float)
    for line in text.splitlines():
        if not line.startswith(_METRIC) or 'tier="gpu"' not in line:
            continue
        labels, _, value = line.rpartition(" ")
        worker = labels.split('worker="', 1)[1].split('"', 1)[0]
        out[worker] += float(value)
    return dict(out)


def drift(views: Sequence[dict[str, float]]) -> float:
    """The spread of the replicas' per-worker block counts relative to their mean (nan: nothing held)."""
    workers = set().union(*views)
    spread = total = 0.0
    for worker in workers:
        counts = [view.get(worker, 0.0) for view in views]
        spread += max(counts) - min(counts)
        total += sum(counts) / len(counts)
    return spread / total if total else math.nan


async def sample_drift(metrics_urls: Sequence[str], stop: asyncio.Event, period_s: float = 0.5) -> list[float]:
    """Drift of each sample taken every ``period_s`` until ``stop`` is set (samples with no blocks left out)."""
    samples: list[float] = []
    timeout = aiohttp.ClientTimeout(total=2)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while not stop.is_set():
            views: list[dict[str, float]] = []
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, OSError):
                for url in metrics_urls:
                    async with session.get(url) as response:
                        views.append(gpu_blocks(await response.text()))
            if len(views) == len(metrics_urls):
                value = drift(views)
                if not math.isnan(value):
                    samples.append(value)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), period_s)
    return samples

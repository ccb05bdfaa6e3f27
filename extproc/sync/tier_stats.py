"""What HiCache workers report about their tier transfers: load-back and storage-prefetch cost figures.

SGLang 0.5.23 exports them on ``/metrics`` (``observability/metrics_collector.py``):

- ``sglang:load_back_tokens_total{pool}``, ``sglang:load_back_bytes_total`` and the histogram
  ``sglang:load_back_duration_seconds`` (the GPU-stream span of each merged host-to-device copy): their
  ratio is the seconds a load-back spends per token, and the bytes a token of KV takes on this worker;
- ``sglang:prefetch_bandwidth`` (GB/s of each storage read operation) and
  ``sglang:prefetched_tokens_total``: with the bytes per token above, the seconds a storage prefetch
  spends per token;
- the storage prefetch threshold is a server arg (``prefetch_threshold`` in
  ``hicache_storage_backend_extra_config``, default 256 tokens) read from ``/server_info``.

Only workers whose ``/server_info`` says ``enable_hierarchical_cache`` are polled, every
``load.tier_poll_interval_s`` (never on the request path). Counters are cumulative, so the ratios
average over everything the worker has done; nothing here is simulator-specific.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from extproc.config import LoadConfig
from extproc.fleet.info import prefetch_threshold
from extproc.fleet.reports import TierReport
from extproc.fleet.workers import Worker, WorkerRegistry
from extproc.sync.http import Poller, WorkerHttp

__all__ = ["TierStatsTracker", "parse_tier_metrics"]

log = logging.getLogger(__name__)


_COUNTERS = {
    "sglang:load_back_tokens_total": "load_back_tokens",
    "sglang:load_back_bytes_total": "load_back_bytes",
    "sglang:load_back_duration_seconds_sum": "load_back_seconds",
    "sglang:load_back_duration_seconds_count": "load_back_ops",
    "sglang:prefetch_bandwidth_sum": "prefetch_gbps_sum",
    "sglang:prefetch_bandwidth_count": "prefetch_ops",
    "sglang:prefetched_tokens_total": "prefetched_tokens",
}


def parse_tier_metrics(text: str) -> TierReport | None:
    """The tier figures of a Prometheus page (summed over label sets); None if it has none."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("sglang:"):
            continue
        head, _, tail = line.rpartition("}") if "}" in line else line.partition(" ")
        name = head.split("{", 1)[0]
        field = _COUNTERS.get(name)
        if field is None:
            continue
        try:
            values[field] = values.get(field, 0.0) + float(tail.split()[0])
        except (ValueError, IndexError):
            continue
    if not values:
        return None
    report = TierReport()
    for name, value in values.items():
        setattr(report, name, value)
    return report


class TierStatsTracker:
    """Latest tier report per HiCache worker, refreshed by one background task."""

    def __init__(self, config: LoadConfig, registry: WorkerRegistry, http: WorkerHttp) -> None:
        self.config = config
        self.registry = registry
        self.http = http
        self._reports: dict[str, TierReport] = {}
        self._poller = Poller("tier-stats-poller", config.tier_poll_interval_s, self.poll_once)

    def get(self, worker: Worker) -> TierReport | None:
        return self._reports.get(worker.id)

    def set(self, worker: Worker, report: TierReport) -> None:
        self._reports[worker.id] = report

    async def start(self) -> None:
        if self.config.tier_poll_interval_s > 0:
            self._poller.start()

    async def stop(self) -> None:
        await self._poller.stop()

    async def poll_once(self) -> None:
        hicache = [w for w in self.registry.workers if w.info.get("enable_hierarchical_cache") is True]
        await asyncio.gather(*(self._poll(w) for w in hicache), return_exceptions=True)

    async def _poll(self, worker: Worker) -> None:
        try:
            async with self.http.get(worker.url + "/metrics", self.config.timeout_s) as resp:
                if resp.status != 200:
                    return
                report = parse_tier_metrics(await resp.text())
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return  # down or not exporting metrics: health checks and the priors cover it
        if report is not None:
            report.prefetch_threshold = prefetch_threshold(worker)
            self.set(worker, report)

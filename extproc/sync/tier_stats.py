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
import json
import logging
from dataclasses import dataclass

import aiohttp

from extproc.config import LoadConfig
from extproc.sync.http import Poller, WorkerHttp
from extproc.sync.workers import Worker, WorkerRegistry

__all__ = ["TierReport", "TierStatsTracker", "parse_tier_metrics", "prefetch_threshold"]

log = logging.getLogger(__name__)

DEFAULT_PREFETCH_THRESHOLD = 256  # SGLang's prefetch_threshold default (tokens)

_COUNTERS = {
    "sglang:load_back_tokens_total": "load_back_tokens",
    "sglang:load_back_bytes_total": "load_back_bytes",
    "sglang:load_back_duration_seconds_sum": "load_back_seconds",
    "sglang:load_back_duration_seconds_count": "load_back_ops",
    "sglang:prefetch_bandwidth_sum": "prefetch_gbps_sum",
    "sglang:prefetch_bandwidth_count": "prefetch_ops",
    "sglang:prefetched_tokens_total": "prefetched_tokens",
}


@dataclass
class TierReport:
    """A worker's cumulative tier-transfer figures (zeros: nothing reported yet)."""

    load_back_tokens: float = 0.0
    load_back_bytes: float = 0.0
    load_back_seconds: float = 0.0
    load_back_ops: float = 0.0
    prefetch_gbps_sum: float = 0.0
    prefetch_ops: float = 0.0
    prefetched_tokens: float = 0.0
    prefetch_threshold: int = DEFAULT_PREFETCH_THRESHOLD

    @property
    def load_back_s_per_token(self) -> float | None:
        """Seconds of host-to-device copy per token, as measured; None before the first load-back."""
        if self.load_back_tokens <= 0 or self.load_back_ops <= 0:
            return None
        return self.load_back_seconds / self.load_back_tokens

    @property
    def bytes_per_token(self) -> float | None:
        return self.load_back_bytes / self.load_back_tokens if self.load_back_tokens > 0 else None

    @property
    def prefetch_s_per_token(self) -> float | None:
        """Seconds of storage read per token (bytes per token over the mean read bandwidth), if known."""
        per_token = self.bytes_per_token
        if per_token is None or self.prefetch_ops <= 0 or self.prefetch_gbps_sum <= 0:
            return None
        return per_token / (self.prefetch_gbps_sum / self.prefetch_ops * 1e9)


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


def prefetch_threshold(worker: Worker) -> int:
    """The worker's storage prefetch threshold in tokens (its extra config, else SGLang's default)."""
    raw = worker.info.get("hicache_storage_backend_extra_config") if isinstance(worker.info, dict) else None
    if isinstance(raw, str) and raw.startswith("{"):
        try:
            value = json.loads(raw).get("prefetch_threshold")
        except (ValueError, AttributeError):
            value = None
        if isinstance(value, int) and value >= 0:
            return value
    return DEFAULT_PREFETCH_THRESHOLD


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

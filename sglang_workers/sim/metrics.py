"""The simulated worker's counters and histograms, counted as SGLang 0.5.23 counts them.

What ``/metrics`` (``prometheus``) and ``/v1/loads`` report: the scheduler's batching loop calls in here at the
moments SGLang records (a request admitted, a token out, a request finished) and owns one ``SchedulerStats`` per
DP rank; the HTTP server keeps an ``HttpStats``. The buckets are SGLang's own, so histograms line up with a real
worker's.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from .request import Request

__all__ = [
    "GRAPH_PHASES",
    "FinishedStats",
    "Histogram",
    "HttpStats",
    "SchedulerStats",
    "record_admission",
    "record_finished",
]

GRAPH_PHASES = ("prefill", "decode", "target_verify", "draft_prefill", "draft_decode", "draft_extend")
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    15.0,
    20.0,
    25.0,
    30.0,
    40.0,
    60.0,
    120.0,
    300.0,
)
ITL_BUCKETS = (
    0.002,
    0.004,
    0.006,
    0.008,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.035,
    0.04,
    0.06,
    0.08,
    0.1,
    0.2,
    0.4,
    0.6,
    0.8,
    1.0,
    2.0,
    4.0,
    6.0,
    8.0,
)
TOKEN_BUCKETS = (  # SGLang's prompt / generation length buckets
    100.0, 300.0, 500.0, 700.0, 1000.0, 1500.0, 2000.0, 3000.0, 4000.0, 5000.0, 6000.0, 7000.0, 8000.0, 9000.0,
    10000.0, 12500.0, 15000.0, 17500.0, 20000.0, 22500.0, 25000.0, 27500.0, 30000.0, 35000.0, 40000.0, 60000.0,
    80000.0, 100000.0, 200000.0, 300000.0, 400000.0, 600000.0, 800000.0, 1e6, 1.1e6,
)  # fmt: skip
EVICTION_BUCKETS = (
    0.001,
    0.002,
    0.003,
    0.004,
    0.005,
    0.006,
    0.007,
    0.008,
    0.009,
    0.01,
    0.02,
    0.03,
    0.04,
    0.05,
    0.1,
    0.2,
    0.5,
    1.0,
)
LOADS_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0)
LOAD_BACK_BUCKETS: tuple[float, ...] = (0.001, 0.002, 0.003, 0.004, 0.005, 0.006, 0.007, 0.008, 0.009, 0.01)
LOAD_BACK_BUCKETS += (0.02, 0.03, 0.04, 0.05, 0.1, 0.2, 0.5, 1.0)  # SGLang's load_back_duration_seconds
PREFETCH_PAGES_BUCKETS = (1, 5, 10, 50, 100)  # sglang:prefetch_pgs
PREFETCH_GBPS_BUCKETS = (0.1, 0.5, 1, 5, 10, 50, 100)  # sglang:prefetch_bandwidth (GB/s)
BACKUP_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
E2E_BUCKETS = (
    0.1,
    0.2,
    0.4,
    0.6,
    0.8,
    1.0,
    2.0,
    4.0,
    6.0,
    8.0,
    10.0,
    20.0,
    40.0,
    60.0,
    80.0,
    100.0,
    150.0,
    200.0,
    250.0,
    300.0,
    350.0,
    500.0,
    1000.0,
)


class Histogram:
    """Cumulative Prometheus histogram (buckets, sum, count)."""

    def __init__(self, buckets: Sequence[float]) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1


@dataclass
class FinishedStats:
    """SGLang's tokenizer-side request metrics, per ``is_streaming`` value (counted when a request finishes)."""

    num_requests: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    tpot: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))


@dataclass
class SchedulerStats:
    """Counters behind /metrics and /v1/loads."""

    num_requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generation_tokens: int = 0
    num_retractions: int = 0
    prefill_batches: int = 0
    decode_steps: int = 0
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    queue_time: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    finished: dict[bool, FinishedStats] = field(default_factory=lambda: {False: FinishedStats()})
    prompt_lengths: Histogram = field(default_factory=lambda: Histogram(TOKEN_BUCKETS))
    uncached_lengths: Histogram = field(default_factory=lambda: Histogram(TOKEN_BUCKETS))
    generation_lengths: Histogram = field(default_factory=lambda: Histogram(TOKEN_BUCKETS))
    prefill_forward: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))  # per request
    request_process: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))  # per request
    evicted_tokens: int = 0
    evictions: Histogram = field(default_factory=lambda: Histogram(EVICTION_BUCKETS))
    loads_served: Histogram = field(default_factory=lambda: Histogram(LOADS_BUCKETS))
    prefill_compute_tokens: int = 0
    prefill_cache_tokens: int = 0
    busy_s: float = 0.0  # wall seconds in steps
    idle_s: float = 0.0  # wall seconds waiting for work
    # By tier, at first admission (SGLang cached_tokens_total{cache_source}, prefill_effective_tokens_total).
    cached_device_tokens: int = 0
    cached_host_tokens: int = 0
    cached_storage_tokens: int = 0
    input_tokens: int = 0  # prompt tokens computed (not cached)
    # HiCache transfers (RadixCacheMetricsCollector).
    load_back_tokens: int = 0
    load_back_bytes: int = 0
    load_back_seconds: Histogram = field(default_factory=lambda: Histogram(LOAD_BACK_BUCKETS))
    backup_bytes: int = 0
    backup_seconds: Histogram = field(default_factory=lambda: Histogram(BACKUP_BUCKETS))
    prefetch_pages: Histogram = field(default_factory=lambda: Histogram(PREFETCH_PAGES_BUCKETS))
    prefetch_gbps: Histogram = field(default_factory=lambda: Histogram(PREFETCH_GBPS_BUCKETS))
    # Simulated GPU seconds spent (the fleet's compute cost; not an SGLang metric).
    busy_prefill_s: float = 0.0
    busy_decode_s: float = 0.0


class HttpStats:
    """Per endpoint and method: requests seen, in flight, and responses by status (SGLang's http_* metrics)."""

    def __init__(self) -> None:
        self.requests: dict[tuple[str, str], int] = {}
        self.active: dict[tuple[str, str], int] = {}
        self.responses: dict[tuple[str, str, int], int] = {}

    def started(self, endpoint: str, method: str) -> None:
        key = (endpoint, method)
        self.requests[key] = self.requests.get(key, 0) + 1
        self.active[key] = self.active.get(key, 0) + 1

    def finished(self, endpoint: str, method: str, status: int) -> None:
        key = (endpoint, method)
        self.active[key] = max(self.active.get(key, 1) - 1, 0)
        self.responses[(endpoint, method, status)] = self.responses.get((endpoint, method, status), 0) + 1


def record_finished(stats: SchedulerStats, req: Request, now: float) -> None:
    """The request metrics SGLang's tokenizer manager records when a request finishes."""
    stats.e2e.observe(now - req.arrival)
    by_stream = stats.finished.setdefault(req.stream, FinishedStats())
    by_stream.num_requests += 1
    by_stream.prompt_tokens += len(req.input_ids)
    by_stream.generation_tokens += len(req.output_ids)
    by_stream.e2e.observe(now - req.arrival)
    if req.first_token_at is not None:
        by_stream.ttft.observe(req.first_token_at - req.arrival)
        if len(req.output_ids) > 1:
            by_stream.tpot.observe((now - req.first_token_at) / (len(req.output_ids) - 1))
        if req.admitted_at is not None:
            stats.prefill_forward.observe(req.first_token_at - req.admitted_at)
            stats.request_process.observe(max(req.admitted_at - req.arrival, 0.0))
    stats.prompt_lengths.observe(len(req.input_ids))
    stats.uncached_lengths.observe(len(req.input_ids) - max(req.cached_tokens, 0))
    stats.generation_lengths.observe(len(req.output_ids))


def record_admission(stats: SchedulerStats, req: Request) -> None:
    """What SGLang counts when a request is first admitted: prompt and cached tokens by tier, its queue time."""
    stats.prompt_tokens += len(req.input_ids)
    stats.cached_tokens += req.cached_tokens
    stats.cached_device_tokens += req.cached_device
    stats.cached_host_tokens += req.cached_host
    stats.cached_storage_tokens += req.cached_storage
    stats.input_tokens += len(req.input_ids) - req.cached_tokens
    stats.queue_time.observe(time.monotonic() - req.arrival)

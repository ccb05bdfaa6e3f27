"""What workers report, as values: load (``/v1/loads``) and tier-transfer figures (HiCache ``/metrics``).

Filled by the sync path's pollers (``extproc.sync.load``, ``extproc.sync.tier_stats``) and read by the
policies; kept here so that the decision reads them without importing the code that polls.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from extproc.clock import MONOTONIC, Clock
from extproc.fleet.workers import Worker, disaggregation_role

__all__ = ["DEFAULT_PREFETCH_THRESHOLD", "LoadBook", "TierReport", "WorkerLoad", "poll_tick"]


@dataclass
class WorkerLoad:
    """Load a worker reported (``/v1/loads`` or ``/metrics``); ``None`` fields were not reported.

    Counts are summed over the worker's DP ranks (``ranks`` says how many reported).
    """

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_used_tokens: int = 0
    max_total_num_tokens: int | None = None
    token_usage: float = 0.0
    age_s: float = 0.0  # seconds since it was polled
    # SGLang 0.5.23 and later: prefill work queued, in uncached prompt tokens.
    num_waiting_uncached_tokens: int | None = None
    # Cumulative since the worker started: uncached tokens prefilled, and time spent in prefill steps.
    total_prefill_uncached_tokens: int | None = None
    total_prefill_busy_us: int | None = None
    # Cumulative prefill batches (forward passes) from /metrics (``parse_prefill_passes``), read beside /v1/loads.
    total_prefill_batches: int | None = None
    # SGLang's ``new_token_ratio`` at its last prefill batch (``sglang:new_token_ratio`` on /metrics, the largest
    # over ranks): the share of running requests' remaining outputs it reserves when admitting a request.
    new_token_ratio: float | None = None
    # Cumulative decode-step moments: (steps, sum batch, sum step_us, sum batch^2, sum batch*step_us).
    decode_moments: tuple[float, ...] | None = None
    # The rest of what 0.5.23 reports (None: not reported), so that nothing it says is lost on the way.
    num_total_tokens: int | None = None  # used + queued tokens
    num_active_tokens: int | None = None
    num_prealloc_ready_tokens: int | None = None
    max_running_requests: int | None = None
    gen_throughput: float | None = None  # tokens/s over the worker's last decode report (summed over ranks)
    cache_hit_rate: float | None = None  # of its last prefill batch (mean over ranks)
    utilization: float | None = None
    memory: list[dict[str, Any]] | None = None  # per rank: weight_gb, kv_cache_gb, graph_gb, token_capacity
    disaggregation: list[dict[str, Any]] | None = None
    queues: list[dict[str, Any]] | None = None  # per rank: waiting, grammar, paused, retracted, prealloc_ready
    reported_at: float | None = None  # the worker's own timestamp of its newest snapshot
    ranks: int = 1
    polled_at: float = 0.0  # the router's clock when the report arrived
    # Running + waiting requests of each data-parallel rank, by ``dp_rank`` (empty: not reported per rank).
    rank_requests: dict[int, int] = field(default_factory=dict)


DEFAULT_PREFETCH_THRESHOLD = 256  # SGLang's prefetch_threshold default (tokens)


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


def poll_tick(steady_s: float, startup_s: float) -> float:
    """How often the load poller wakes: ``startup_s`` where it is set and shorter than ``steady_s``."""
    return startup_s if 0 < startup_s < steady_s else steady_s


class LoadBook:
    """The last load each worker reported, stamped with the router's clock when it arrived.

    ``extproc.sync.load.LoadTracker`` fills one by polling; a harness that knows the loads itself (the
    virtual fleet, the decision benchmarks) sets them directly.
    """

    def __init__(self, clock: Clock = MONOTONIC) -> None:
        self.clock = clock
        # Called with each new report as it arrives (the policy learns from reports here, not when it decides).
        self.listeners: list[Callable[[Worker, WorkerLoad], None]] = []
        self._loads: dict[str, tuple[float, WorkerLoad]] = {}
        # Workers whose reports have shown prefill work between two polls (or carry no prefill counters):
        # the first window a cost model can learn from has been measured there.
        self._measured: set[str] = set()
        self._polled_at: dict[str, float] = {}  # worker id -> when ``due`` last named it
        self._next_round: float | None = None  # when ``due`` next names every worker

    def measuring(self, worker: Worker) -> bool:
        """The router has requests in flight on the worker and no report has yet measured its prefill work (a
        decode worker of a PD pair, which prefills nothing, never counts).

        Such a worker is polled every ``load.startup_poll_interval_s`` between the rounds of ``poll_interval_s``
        (``poll_every``): until a window between two reports shows prefill work, the router prices the worker
        on priors, and a burst in a fleet's first half second is routed on them (virtual fleet, 16 workers,
        hot-burst past the knee: a cold 2k-token prefill priced at 110 ms that took 66, and a hot prefix's
        first burst kept on its busy holder).
        """
        if worker.in_flight <= 0 or worker.id in self._measured:
            return False
        # A decode worker of a PD pair prefills nothing: its prefill work would never be measured.
        return disaggregation_role(worker) != "decode"

    def poll_every(self, worker: Worker, steady_s: float, startup_s: float) -> float:
        """Seconds between two polls of the worker: ``startup_s`` while it is being measured (0: never faster)."""
        if 0 < startup_s < steady_s and self.measuring(worker):
            return startup_s
        return steady_s

    def due(self, workers: Sequence[Worker], now: float, steady_s: float, startup_s: float) -> list[Worker]:
        """The workers to poll at this tick (one every ``poll_tick``): all of them every ``steady_s``, as one round,
        and between the rounds every ``startup_s`` those being measured. Judged at every tick, so a worker that
        has just been sent its first requests is polled sooner; half a tick early counts as on time."""
        slack = poll_tick(steady_s, startup_s) / 2
        if self._next_round is None or now >= self._next_round - slack:
            self._next_round = now + steady_s
            due = list(workers)
        else:
            due = [
                w
                for w in workers
                if self.poll_every(w, steady_s, startup_s) < steady_s
                and now - self._polled_at.get(w.id, -math.inf) >= startup_s - slack
            ]
        for worker in due:
            self._polled_at[worker.id] = now
        return due

    def get(self, worker: Worker) -> WorkerLoad | None:
        """The last report, with ``age_s`` filled; None if the worker never answered."""
        entry = self._loads.get(worker.id)
        if entry is None:
            return None
        stamp, load = entry
        load.age_s = self.clock() - stamp
        return load

    def peek(self, worker: Worker) -> WorkerLoad | None:
        """The last report as it is (``age_s`` not refreshed): for figures read once per worker per decision."""
        entry = self._loads.get(worker.id)
        return None if entry is None else entry[1]

    def set(self, worker: Worker, load: WorkerLoad) -> None:
        if worker.id not in self._measured:
            before = self.peek(worker)
            busy = load.total_prefill_busy_us
            was = before.total_prefill_busy_us if before is not None else None
            if busy is None or (was is not None and busy > was):
                self._measured.add(worker.id)
        load.polled_at = self.clock()
        self._loads[worker.id] = (load.polled_at, load)
        for listener in self.listeners:
            listener(worker, load)

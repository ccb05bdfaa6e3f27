"""What SGLang 0.5.23's scheduler counts for ``/v1/loads``, counted the same way on the simulated clock.

A router reads more from ``/v1/loads`` than queue lengths: ``total_prefill_uncached_tokens`` and
``total_prefill_busy_us`` are cumulative, so the deltas of two polls give the worker's measured prefill
speed; ``decode_moments`` are the sums a least-squares fit of decode step time against batch size needs;
``num_waiting_uncached_tokens`` is the prefill work still queued. This module keeps those counters exactly
as ``sglang.srt.managers.scheduler.Scheduler._record_step_counters`` and the metrics reporter do, with
the simulator's step durations in place of measured ones:

* every executed batch gets a forward iteration number; a batch made only of health-check requests
  counts nothing (and, having taken an iteration number, breaks contiguity);
* a prefill step adds its new (uncached) tokens and its duration in microseconds; a prefill that follows
  another prefill with no idle gap starts where that one ended;
* a decode step adds ``[1, b, t, b*b, b*t, generated]`` to the moments, where ``t`` is the time from the
  previous decode step's launch to this one's; the first decode step after a prefill or an idle gap has
  no such interval and adds nothing, nor does a gap of 2 s or more;
* ``gen_throughput`` is recomputed every ``decode_log_interval`` (40) decode steps from the tokens
  generated since the last time, held between reports, and zeroed when the worker goes idle;
* ``cache_hit_rate`` is the last prefill batch's hit rate; a 15 s window of hit rates estimates how much
  of the waiting queue is uncached when the queue order does not match prefixes (fcfs);
* ``utilization`` stays 0.0: 0.5.23 computes it from ``max_running_requests_under_SLO``, which nothing
  sets (the source says so), so a real worker always reports 0.0.

Everything is reported in wall-clock time, as a real worker reports it: a step the timing profile says
takes ``d`` seconds takes ``d / --speedup`` seconds here and counts that much busy time, throughputs are
per wall second, and the windows are wall seconds. A worker at ``--speedup 0.25`` is a GPU four times
slower than its profile, and reports exactly what SGLang on such a GPU would: a router that learns a
worker's speed from these counters (``extproc.decision.policies.prefix_aware.cost_model``) sees the speed its
requests get, without being told any simulator setting.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DECODE_LOG_INTERVAL", "NULL_DISAGGREGATION", "LoadCounters"]

DECODE_LOG_INTERVAL = 40  # SGLang --decode-log-interval default: decode steps between throughput reports
STEP_MAX_US = 2_000_000  # a decode interval this long is an outlier (SGLang's STEP_MAX_US)
CACHE_HIT_RATE_WINDOW_S = 15.0  # SGLANG_CACHE_HIT_RATE_WINDOW_SECONDS default
# The ``disaggregation`` block of an aggregated worker (a PD worker's side fills in its mode and queues).
NULL_DISAGGREGATION: dict[str, Any] = {
    "mode": "null",
    "prefill_bootstrap_queue_reqs": 0,
    "prefill_inflight_queue_reqs": 0,
    "decode_prealloc_queue_reqs": 0,
    "decode_transfer_queue_reqs": 0,
    "decode_retracted_queue_reqs": 0,
    "kv_transfer_speed_gb_s": 0.0,
    "kv_transfer_latency_ms": 0.0,
}
GEN_THROUGHPUT_STALENESS_S = 30.0  # a throughput older than this reads 0 at the next prefill report


def _monotonic() -> float:
    """``time.monotonic()`` looked up at each call: the virtual fleet points this module's ``time`` at its clock."""
    return time.monotonic()


@dataclass
class LoadCounters:
    """The scheduler-side load counters of one DP rank (see the module docstring for their rules)."""

    speedup: float = 1.0
    total_prefill_uncached_tokens: int = 0
    total_prefill_busy_us: int = 0
    decode_moments: list[float] = field(default_factory=lambda: [0.0] * 6)
    gen_throughput: float = 0.0
    cache_hit_rate: float = 0.0
    num_retracted_reqs: int = 0  # retractions since the last stats report (the ``queues.retracted`` value)
    _forward_ct: int = 0
    _prev_step: tuple[int, float, bool] | None = None  # (forward iteration, launch time, was prefill)
    _prev_prefill_end: float | None = None
    _idled: bool = False
    _decode_steps: int = 0
    _generated_since_report: int = 0
    _last_decode_report: float = field(default_factory=_monotonic)
    _last_throughput: float = 0.0
    _hit_window: deque[tuple[float, int, int]] = field(default_factory=deque)
    _window_hit: int = 0
    _window_total: int = 0
    _pending_retractions: int = 0

    # -- the clock -------------------------------------------------------------------------------
    def _now(self) -> float:
        return time.monotonic()

    # -- events from the scheduler loop ------------------------------------------------------------
    def on_idle(self) -> None:
        """The loop found no batch to run: the next batch starts after an idle gap; throughput reads 0."""
        self._idled = True
        self.gen_throughput = 0.0

    def on_retract(self, count: int) -> None:
        self._pending_retractions += count

    def on_prefill(
        self,
        launch: float,
        duration: float,
        new_tokens: int,
        effective_new: int,
        effective_hit: int,
        health_only: bool,
    ) -> None:
        """One prefill batch that started at simulated time ``launch`` and took ``duration`` simulated seconds.

        ``new_tokens`` counts every request's uncached tokens (health checks included, as SGLang's
        ``extend_num_tokens`` does); ``effective_new`` and ``effective_hit`` the new and cached tokens of
        the requests that count for the hit rate (not health checks, not re-prefilled retractions).
        """
        contiguous = self._advance(launch, prefill=True, health_only=health_only)
        if health_only:
            return
        self._report_prefill(effective_new, effective_hit)
        end = launch + duration
        start = launch
        if self._prev_prefill_end is not None:
            start = self._prev_prefill_end if contiguous else max(start, self._prev_prefill_end)
        self._prev_prefill_end = end
        step_us = int((end - start) / self.speedup * 1e6)  # wall time, as a real worker measures it
        if step_us <= 0:
            return
        self.total_prefill_busy_us += step_us
        self.total_prefill_uncached_tokens += new_tokens

    def on_decode(self, launch: float, batch_size: int, health_only: bool) -> None:
        """One decode step over ``batch_size`` sequences launched at simulated time ``launch``."""
        prev = self._prev_step
        contiguous = self._advance(launch, prefill=False, health_only=health_only)
        if health_only:
            return
        self._report_decode(batch_size)
        if not contiguous or prev is None:
            return
        step_us = int((launch - prev[1]) / self.speedup * 1e6)
        if step_us <= 0 or step_us >= STEP_MAX_US or batch_size <= 0:
            return
        b, t = float(batch_size), float(step_us)
        moments = self.decode_moments
        moments[0] += 1.0
        moments[1] += b
        moments[2] += t
        moments[3] += b * b
        moments[4] += b * t
        moments[5] += b  # one generated token per sequence (no speculative decoding)

    def _advance(self, launch: float, prefill: bool, health_only: bool) -> bool:
        """Number this batch; True if it directly follows a batch of the same kind with no idle gap."""
        self._forward_ct += 1
        after_idle_gap, self._idled = self._idled, False
        if health_only:
            return False
        prev = self._prev_step
        self._prev_step = (self._forward_ct, launch, prefill)
        return prev is not None and not after_idle_gap and prev[0] + 1 == self._forward_ct and prev[2] == prefill

    # -- the metrics reporter's side ---------------------------------------------------------------
    def _report_prefill(self, new_tokens: int, hit_tokens: int) -> None:
        now = self._now()
        total = new_tokens + hit_tokens
        self.cache_hit_rate = hit_tokens / total if total > 0 else 0.0
        if total > 0:
            self._hit_window.append((now, hit_tokens, total))
            self._window_hit += hit_tokens
            self._window_total += total
        self._expire_window(now)
        if now - self._last_decode_report > GEN_THROUGHPUT_STALENESS_S:
            self._last_throughput = 0.0
        self.gen_throughput = self._last_throughput
        self._take_retractions()

    def _report_decode(self, batch_size: int) -> None:
        self._decode_steps += 1
        self._generated_since_report += batch_size
        if self._decode_steps % DECODE_LOG_INTERVAL != 0:
            return
        now = self._now()
        gap = now - self._last_decode_report
        self._last_decode_report = now
        self._last_throughput = self._generated_since_report / gap if gap > 0 else 0.0
        self._generated_since_report = 0
        self.gen_throughput = self._last_throughput
        self._take_retractions()

    def _take_retractions(self) -> None:
        self.num_retracted_reqs, self._pending_retractions = self._pending_retractions, 0

    def _expire_window(self, now: float) -> None:
        cutoff = now - CACHE_HIT_RATE_WINDOW_S
        while self._hit_window and self._hit_window[0][0] <= cutoff:
            _, hit, total = self._hit_window.popleft()
            self._window_hit -= hit
            self._window_total -= total

    def recent_cache_hit_rate(self) -> float:
        """Hit rate over the last 15 s of prefills (what the fcfs waiting-queue estimate multiplies by)."""
        self._expire_window(self._now())
        return self._window_hit / self._window_total if self._window_total > 0 else 0.0

    def moments(self) -> list[float] | None:
        """``decode_moments`` as reported: None until one contiguous decode interval was measured."""
        return list(self.decode_moments) if self.decode_moments[0] > 0 else None

"""Flow control: past saturation, requests wait in the router in priority bands instead of piling onto workers.

A request is placed at once while some eligible worker has room (``saturated`` says none has) and
nobody waits before it. Otherwise it joins its band (the priority its ``x-gateway-inference-objective``
maps to); bands are served highest priority first, and within a band the fairness ids
(``x-gateway-inference-fairness-id``) take turns, so one tenant's burst cannot starve another's.
Each waiting request has a queue TTL: on expiry it is answered 429 with ``Retry-After``. A band
with a negative priority is *sheddable* (GIE's convention): while the fleet is saturated its
requests are answered 429 at once rather than queued.

Room is checked again whenever a request ends (``wake``), and every ``poll_interval_s`` while
anyone waits (workers come back, reported queues drain). One request is admitted per check: the
admitted one takes its slot when it is routed, then wakes the next, so a burst of admissions can
never overfill a worker that had room for one.

Pure asyncio, no gRPC; the router owns one instance and the servicer maps ``ShedError`` to 429.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from extproc.config import FlowControlConfig

__all__ = ["Admission", "FlowController", "ShedError"]


@dataclass(frozen=True)
class Admission:
    """Who a request is, for flow control: its band's priority, fairness id and objective name."""

    priority: int = 0
    fairness_id: str = ""
    objective: str = ""


class ShedError(Exception):
    """The request is dropped (answered 429 with ``Retry-After``): ``reason`` says why."""

    def __init__(self, message: str, reason: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s


@dataclass(eq=False)
class _Waiter:
    admission: Admission
    has_room: Callable[[], bool]
    admitted: asyncio.Future[None]
    since: float = field(default_factory=time.monotonic)


class _Band:
    """One priority's waiters, one FIFO per fairness id, served round-robin."""

    def __init__(self) -> None:
        self.queues: OrderedDict[str, deque[_Waiter]] = OrderedDict()
        self.size = 0

    def push(self, waiter: _Waiter) -> None:
        self.queues.setdefault(waiter.admission.fairness_id, deque()).append(waiter)
        self.size += 1

    def remove(self, waiter: _Waiter) -> None:
        queue = self.queues.get(waiter.admission.fairness_id)
        if queue is not None and waiter in queue:
            queue.remove(waiter)
            self.size -= 1
            if not queue:
                del self.queues[waiter.admission.fairness_id]

    def pop_admissible(self) -> _Waiter | None:
        """The next fairness id's oldest waiter that has room now (that id then goes to the back)."""
        for fairness_id in list(self.queues):
            queue = self.queues[fairness_id]
            head = queue[0]
            if head.has_room():
                queue.popleft()
                self.size -= 1
                del self.queues[fairness_id]
                if queue:
                    self.queues[fairness_id] = queue  # re-inserted last: the next turn is another id's
                return head
        return None


class FlowController:
    """Priority bands with fairness and queue TTLs in front of the routing decision."""

    def __init__(self, config: FlowControlConfig, metrics: CollectorRegistry | None = None) -> None:
        self.config = config
        self._bands: dict[int, _Band] = {}
        self._waiting = 0
        self._ticker: asyncio.Task[None] | None = None
        registry = metrics if metrics is not None else CollectorRegistry()
        self._depth = Gauge(
            "prefix_router_flow_queue_depth",
            "Requests waiting in the router, per priority band.",
            ["priority"],
            registry=registry,
        )
        self._wait = Histogram(
            "prefix_router_flow_wait_seconds",
            "Time requests waited in the router before being routed, per priority band.",
            ["priority"],
            buckets=(0.0, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
            registry=registry,
        )
        self._shed = Counter(
            "prefix_router_flow_shed",
            "Requests answered 429 by flow control, per priority band and reason.",
            ["priority", "reason"],
            registry=registry,
        )

    @property
    def waiting(self) -> int:
        """Requests waiting now, all bands together."""
        return self._waiting

    async def admit(
        self,
        admission: Admission,
        has_room: Callable[[], bool],
        on_queued: Callable[[float], Awaitable[None]] | None = None,
    ) -> float:
        """Wait until the request may be routed; returns seconds waited. Raises ``ShedError`` (429).

        ``has_room`` says whether some worker eligible for this request has room now. ``on_queued``
        is awaited with the longest wait ahead when the request joins a band (the servicer asks
        Envoy for that much more time). Cancelling the caller (the client went away) removes it
        from its band.
        """
        band_label = str(admission.priority)
        if self._waiting == 0 and has_room():
            self._wait.labels(band_label).observe(0.0)
            return 0.0
        if admission.priority < 0:
            raise self._shed_now(admission, "sheddable", "the fleet is saturated and this request is sheddable")
        if self._waiting >= self.config.max_queued:
            raise self._shed_now(admission, "queue-full", f"{self._waiting} requests already wait in the router")
        waiter = _Waiter(admission, has_room, asyncio.get_running_loop().create_future())
        band = self._bands.setdefault(admission.priority, _Band())
        band.push(waiter)
        self._waiting += 1
        self._depth.labels(band_label).set(band.size)
        self._start_ticker()
        self.wake()
        try:
            if on_queued is not None and not waiter.admitted.done():
                await on_queued(self.config.queue_ttl_s)
            await asyncio.wait_for(asyncio.shield(waiter.admitted), self.config.queue_ttl_s)
        except TimeoutError:
            if not waiter.admitted.done():
                self._leave(band, waiter)
                raise self._shed_now(
                    admission, "queue-ttl", f"waited {self.config.queue_ttl_s:g} s for a worker with room"
                ) from None
        except asyncio.CancelledError:
            if not waiter.admitted.done():
                self._leave(band, waiter)
            else:
                self.wake()  # admitted but gone: its room goes to the next one
            raise
        waited = time.monotonic() - waiter.since
        self._wait.labels(band_label).observe(waited)
        return waited

    def wake(self) -> None:
        """Room may have appeared (a request ended, a worker came back): admit the next waiter that fits."""
        for priority in sorted(self._bands, reverse=True):
            band = self._bands[priority]
            waiter = band.pop_admissible()
            if waiter is None:
                continue
            self._waiting -= 1
            self._depth.labels(str(priority)).set(band.size)
            if not waiter.admitted.done():
                waiter.admitted.set_result(None)
            return

    def stop(self) -> None:
        """Stop the ticker (the router shuts down)."""
        if self._ticker is not None:
            self._ticker.cancel()
            self._ticker = None

    def _leave(self, band: _Band, waiter: _Waiter) -> None:
        band.remove(waiter)
        self._waiting -= 1
        self._depth.labels(str(waiter.admission.priority)).set(band.size)

    def _shed_now(self, admission: Admission, reason: str, message: str) -> ShedError:
        self._shed.labels(str(admission.priority), reason).inc()
        return ShedError(f"request dropped: {message}", reason, self.config.retry_after_s)

    def _start_ticker(self) -> None:
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.get_running_loop().create_task(self._tick())

    async def _tick(self) -> None:
        while self._waiting:
            await asyncio.sleep(self.config.poll_interval_s)
            self.wake()

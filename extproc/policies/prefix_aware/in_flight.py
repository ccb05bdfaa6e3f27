"""The router's own, instantaneous account of what it has sent each worker and not yet seen finish.

Load reports arrive every half second; a burst routed in between is invisible to them. The router
itself knows every request it sent and when its stream ended, so per worker it keeps:

- the KV tokens its open requests hold (their uncached tokens, plus their longest shared prefix once:
  requests that share a prefix share its pages), and
- how long a request stays there (route to end of stream, exponentially averaged): its residence.

A worker's KV pool bounds how many requests it runs at once. A request whose tokens do not fit waits
in the worker's queue until running ones finish and free theirs: with ``excess`` tokens missing out of
``held``, about that share of the open requests must finish first, which takes that share of a
residence (finishes spread evenly over it). That wait is part of its time to first token, and no
prefill-queue figure shows it: on a memory-bound worker the queue waits for memory, not for prefill.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["InFlightBook"]

_RESIDENCE_SMOOTHING = 0.1  # weight of each finished request in the residence average
_FORGET_AFTER_S = 900.0  # a booking never released this long (its stream's end was lost) no longer counts


@dataclass
class _Open:
    new: float
    cached: float
    at: float


@dataclass
class _WorkerBook:
    open: dict[int, _Open] = field(default_factory=dict)  # id of the RoutingRequest -> what it holds
    residence_s: float | None = None  # mean route-to-finish time (None: nothing finished yet)

    def held_tokens(self) -> float:
        if not self.open:
            return 0.0
        return sum(o.new for o in self.open.values()) + max(o.cached for o in self.open.values())


class InFlightBook:
    """Open requests per worker (bookings made at routing, released at the end of the stream)."""

    def __init__(self) -> None:
        self._workers: dict[str, _WorkerBook] = {}

    def booked(self, worker_id: str, request_id: int, new_tokens: float, cached_tokens: float, now: float) -> None:
        book = self._workers.setdefault(worker_id, _WorkerBook())
        if book.open:
            oldest = next(iter(book.open))  # dicts keep insertion order: the oldest booking first
            if now - book.open[oldest].at > _FORGET_AFTER_S:
                del book.open[oldest]
        book.open[request_id] = _Open(new_tokens, cached_tokens, now)

    def released(self, worker_id: str, request_id: int, now: float) -> None:
        book = self._workers.get(worker_id)
        if book is None:
            return
        entry = book.open.pop(request_id, None)
        if entry is None:
            return
        stay = max(0.0, now - entry.at)
        book.residence_s = (
            stay if book.residence_s is None else book.residence_s + _RESIDENCE_SMOOTHING * (stay - book.residence_s)
        )

    def forget(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)

    def residence_s(self, worker_id: str) -> float | None:
        book = self._workers.get(worker_id)
        return book.residence_s if book is not None else None

    def held_tokens(self, worker_id: str) -> float:
        book = self._workers.get(worker_id)
        return book.held_tokens() if book is not None else 0.0

    def memory_wait_s(self, worker_id: str, new_tokens: float, cached_tokens: float, capacity: int | None) -> float:
        """Seconds a request of these tokens would wait for KV room on the worker (0: it fits now)."""
        book = self._workers.get(worker_id)
        if book is None or not book.open or not capacity:
            return 0.0
        residence = book.residence_s
        if residence is None:
            residence = self._fleet_residence()
            if residence is None:
                return 0.0
        held = book.held_tokens()
        shared = max(o.cached for o in book.open.values())
        need = new_tokens + max(0.0, cached_tokens - shared)  # a prefix open requests hold is locked already
        excess = held + need - capacity
        if excess <= 0:
            return 0.0
        return min(1.0, excess / held) * residence

    def _fleet_residence(self) -> float | None:
        known = [b.residence_s for b in self._workers.values() if b.residence_s is not None]
        return sum(known) / len(known) if known else None

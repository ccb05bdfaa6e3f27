"""The router's own, instantaneous account of what it has sent each worker and not yet seen finish.

Load reports arrive every half second; a burst routed in between is invisible to them. The router
itself knows every request it sent and when its stream ended, so per worker it keeps:

- the KV tokens its open requests hold: each request's prompt, with the pages several open requests
  share counted once (block keys chain, so two prompts share exactly the leading blocks whose keys
  they share; a worker running requests of ten different system prompts holds all ten), and
- how long a request stays there (route to end of stream, exponentially averaged): its residence.

A worker's KV pool bounds how many requests it runs at once. A request whose tokens do not fit waits
in the worker's queue until running ones finish and free theirs. The open requests finish oldest
first (a request that has stayed ``age`` has about ``residence - age`` left), so the wait is the time
until the oldest open requests that together free the missing tokens have finished. That wait is part
of its time to first token, and no prefill-queue figure shows it: on a memory-bound worker the queue
waits for memory, not for prefill.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["InFlightBook"]

_RESIDENCE_SMOOTHING = 0.1  # weight of each finished request in the residence average
_LATE_SHARE = 0.25  # what an open request older than the mean residence is taken to have left, in residences
_FORGET_AFTER_S = 900.0  # a booking never released this long (its stream's end was lost) no longer counts


@dataclass
class _Open:
    new: float
    cached: float
    at: float
    keys: Sequence[int]  # the prompt's block keys (the pages it holds while open)
    tokens: float  # its prompt tokens


@dataclass
class _WorkerBook:
    open: dict[int, _Open] = field(default_factory=dict)  # id of the RoutingRequest -> what it holds
    residence_s: float | None = None  # mean route-to-finish time (None: nothing finished yet)
    refs: dict[int, int] = field(default_factory=dict)  # block key -> open requests holding it
    block_size: int = 16
    prompt_tokens: float = 0.0  # sum of the open requests' prompt tokens
    key_refs: int = 0  # sum of refs.values()

    def add(self, request_id: int, entry: _Open) -> None:
        self.open[request_id] = entry
        self.prompt_tokens += entry.tokens
        refs = self.refs
        for key in entry.keys:
            refs[key] = refs.get(key, 0) + 1
        self.key_refs += len(entry.keys)

    def drop(self, request_id: int) -> _Open | None:
        entry = self.open.pop(request_id, None)
        if entry is None:
            return None
        self.prompt_tokens -= entry.tokens
        refs = self.refs
        for key in entry.keys:
            left = refs[key] - 1
            if left:
                refs[key] = left
            else:
                del refs[key]
        self.key_refs -= len(entry.keys)
        return entry

    def held_tokens(self) -> float:
        """Prompt tokens of the open requests, pages shared between them counted once."""
        return self.prompt_tokens - (self.key_refs - len(self.refs)) * self.block_size

    def locked_prefix(self, keys: Sequence[int]) -> int:
        """Leading blocks of ``keys`` an open request holds (keys chain: a held key's ancestors are held)."""
        lo, hi = 0, len(keys)
        refs = self.refs
        while lo < hi:  # the longest held prefix, by bisection
            mid = (lo + hi + 1) // 2
            if keys[mid - 1] in refs:
                lo = mid
            else:
                hi = mid - 1
        return lo


class InFlightBook:
    """Open requests per worker (bookings made at routing, released at the end of the stream)."""

    def __init__(self) -> None:
        self._workers: dict[str, _WorkerBook] = {}

    def booked(
        self,
        worker_id: str,
        request_id: int,
        new_tokens: float,
        cached_tokens: float,
        now: float,
        keys: Sequence[int] = (),
        block_size: int = 16,
    ) -> None:
        """A request was sent: it holds ``new + cached`` tokens there, the pages of ``keys`` among them."""
        book = self._workers.setdefault(worker_id, _WorkerBook())
        book.block_size = block_size
        if book.open:
            oldest = next(iter(book.open))  # dicts keep insertion order: the oldest booking first
            if now - book.open[oldest].at > _FORGET_AFTER_S:
                book.drop(oldest)
        book.add(request_id, _Open(new_tokens, cached_tokens, now, keys, new_tokens + cached_tokens))

    def released(self, worker_id: str, request_id: int, now: float) -> None:
        book = self._workers.get(worker_id)
        if book is None:
            return
        entry = book.drop(request_id)
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

    def memory_wait_s(
        self,
        worker_id: str,
        new_tokens: float,
        cached_tokens: float,
        capacity: int | None,
        now: float,
        keys: Sequence[int] = (),
    ) -> float:
        """Seconds a request of these tokens would wait for KV room on the worker (0: it fits now)."""
        book = self._workers.get(worker_id)
        if book is None or not book.open or not capacity:
            return 0.0
        # Until requests have finished there, the fleet's residence; and a request stays at least as long as
        # the oldest open one has (it has not finished): with nothing else known, about twice its age.
        oldest_age = now - next(iter(book.open.values())).at
        residence = max(book.residence_s or self._fleet_residence() or 2.0 * oldest_age, oldest_age)
        # What it adds: its prompt, less the leading pages open requests hold already (those are locked;
        # a cached page nobody holds is evictable, and admission locks it, so it needs room too).
        need = new_tokens + cached_tokens - book.locked_prefix(keys) * book.block_size
        excess = book.held_tokens() + max(need, 0.0) - capacity
        if excess <= 0:
            return 0.0
        freed = 0.0
        for entry in book.open.values():  # oldest first: they finish first
            freed += entry.new
            if freed >= excess:
                # One that has stayed longer than the mean is late (a slow decode, a stall): it still has a
                # share of a residence to go, not nothing.
                return max(residence - (now - entry.at), _LATE_SHARE * residence)
        return residence

    def _fleet_residence(self) -> float | None:
        known = [b.residence_s for b in self._workers.values() if b.residence_s is not None]
        return sum(known) / len(known) if known else None

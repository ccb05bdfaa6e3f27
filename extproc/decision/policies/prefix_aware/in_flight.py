"""The router's own, instantaneous account of what it has sent each worker and not yet seen finish.

Load reports arrive every half second; a burst routed in between is invisible to them. The router
itself knows every request it sent and when its stream ended, so per worker it keeps:

- the KV tokens its open requests hold: their prompts' pages, each page once however many open requests
  share it (a worker's radix cache stores a shared prefix once), plus each one's own pages (its prompt's
  tail past the last full block and the output it has written, in whole pages as the pool hands them
  out; written is the share of a residence it has been open, times its ``max_tokens`` clipped as SGLang
  clips its estimate) and what SGLang reserves for the rest of its output: that times the worker's
  ``new_token_ratio`` (it reports it on ``/metrics``; ``FLOOR_RESERVE_RATIO``, the ratio's floor, where
  it does not). A request is admitted when its new tokens and its whole clipped output fit beside that.
  Outputs count because a worker running many short prompts on a few hot prefixes fills its pool with
  decodes (virtual fleet, 4 workers, hot-burst, 0.5 x knee, seed 1: 150 requests running on the hot
  prefixes' holder, the next ones waited 0.8 s for room while the prompts alone were predicted to fit).
  The ratio counts too: SGLang sets it to 0.7 whenever the worker goes idle and after a retraction, and
  lowers it to its floor (0.098) only over 600 decode steps; at 0.61 a worker running ~180 short
  requests reserved 2,600 tokens where the floor counts 300, and its queue waited for room the router
  thought it had (the same cell, seed 8). So do whole pages: those ~180 requests' 85-token tails took
  6 pages each, 2,000 tokens more than their tokens. And
- how long a request stays there (route to end of stream, exponentially averaged): its residence.

A worker's KV pool bounds how many requests it runs at once. A request whose tokens do not fit waits
in the worker's queue until running ones finish and free theirs: with ``excess`` tokens missing out of
``held``, about that share of the open requests must finish first, the oldest, so the wait is what is
left of the residence of the youngest of them (that share of a residence where requests arrived evenly).
That wait is part of its time to first token, and no prefill-queue figure shows it: on a memory-bound
worker the queue waits for memory, not for prefill.

The residence is the longer of the measured one and the open requests' outputs at the worker's present
pace (``token_s``, seconds per output token: ``WorkerCostModel.token_seconds``). A finished request
measures the past; a worker that has just become a hot prefix's holder has finished none, and SGLang
runs a prefill batch whenever one forms, so its decodes advance only between the prefills. Virtual
fleet, 64 workers, docqa, 1.3 x knee, seed 2: the hottest document's holder ran 169 requests of
32-token outputs at 69 ms a step with prefills taking most of its time, none of them had finished after
1.3 s, the router judged its pool by the fleet's residence and sent on, and requests waited 1.8 s for
room it predicted at 50 ms.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["FLOOR_RESERVE_RATIO", "InFlightBook"]

_RESIDENCE_SMOOTHING = 0.1  # weight of each finished request in the residence average
_FORGET_AFTER_S = 900.0  # a booking never released this long (its stream's end was lost) no longer counts
# SGLang (0.5.23) reserves a running request's remaining output times ``new_token_ratio``, which decays while
# nothing is retracted to its floor, 0.7 x 0.14 (about 0.1) at the default schedule conservativeness: the
# ratio assumed of a worker that does not report its own.
FLOOR_RESERVE_RATIO = 0.098


@dataclass
class _Open:
    new: float
    cached: float
    at: float
    keys: Sequence[int] = ()  # its prompt's full blocks (pages shared with other open requests count once)
    tail: float = 0.0  # its prompt tokens past the last full block
    output: float = 0.0  # the output it may write (its clipped max_tokens)


@dataclass
class _WorkerBook:
    open: dict[int, _Open] = field(default_factory=dict)  # id of the RoutingRequest -> what it holds
    residence_s: float | None = None  # mean route-to-finish time (None: nothing finished yet)
    pages: dict[int, int] = field(default_factory=dict)  # block key -> open requests holding it
    block_size: int = 16
    # The new tokens and tails of requests booked without keys (their cached prefixes are taken as one
    # shared prefix, the longest).
    keyless: float = 0.0

    def hold(self, entry: _Open) -> None:
        if not entry.keys:
            self.keyless += entry.new + entry.tail
            return
        pages = self.pages
        for key in entry.keys:
            pages[key] = pages.get(key, 0) + 1

    def let_go(self, entry: _Open) -> None:
        if not entry.keys:
            self.keyless -= entry.new + entry.tail
            return
        pages = self.pages
        for key in entry.keys:
            count = pages.get(key, 0) - 1
            if count > 0:
                pages[key] = count
            else:
                pages.pop(key, None)

    def held_tokens(
        self, now: float | None = None, reserve_ratio: float = FLOOR_RESERVE_RATIO, residence: float | None = None
    ) -> float:
        """Prompt pages, plus each open request's own pages and SGLang's reserve for the output still to come.

        A request's own pages hold its prompt's tail past the last full block and the output it has
        written, in whole pages (the pool is handed out so: ~180 requests of 85-token tails on one prefix
        held 2,000 tokens more than their tokens). Written is taken as the share of a residence it has been
        open (``now``; all of it without a clock or a residence; ``residence``: the measured one unless
        given); the rest is reserved at ``reserve_ratio`` (the worker's ``new_token_ratio``).
        """
        if not self.open:
            return 0.0
        size = self.block_size
        unkeyed = max((o.cached for o in self.open.values() if not o.keys), default=0.0)
        held = len(self.pages) * size + max(self.keyless, 0.0) + unkeyed
        residence = self.residence_s if residence is None else residence
        for o in self.open.values():
            written = min(1.0, max(0.0, now - o.at) / residence) if now is not None and residence else 1.0
            out = o.output * written
            held += math.ceil((o.tail + out) / size) * size if o.keys else out
            held += o.output * (1.0 - written) * reserve_ratio
        return held


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
        output_tokens: float = 0.0,
    ) -> None:
        book = self._workers.setdefault(worker_id, _WorkerBook())
        book.block_size = block_size
        if book.open:
            oldest = next(iter(book.open))  # dicts keep insertion order: the oldest booking first
            if now - book.open[oldest].at > _FORGET_AFTER_S:
                book.let_go(book.open.pop(oldest))
        tail = max(0.0, new_tokens + cached_tokens - len(keys) * block_size) if keys else 0.0
        entry = _Open(new_tokens, cached_tokens, now, keys, tail, output_tokens)
        previous = book.open.pop(request_id, None)
        if previous is not None:
            book.let_go(previous)
        book.open[request_id] = entry
        book.hold(entry)

    def released(self, worker_id: str, request_id: int, now: float) -> None:
        book = self._workers.get(worker_id)
        if book is None:
            return
        entry = book.open.pop(request_id, None)
        if entry is None:
            return
        book.let_go(entry)
        stay = max(0.0, now - entry.at)
        book.residence_s = (
            stay if book.residence_s is None else book.residence_s + _RESIDENCE_SMOOTHING * (stay - book.residence_s)
        )

    def forget(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)

    def residence_s(self, worker_id: str) -> float | None:
        book = self._workers.get(worker_id)
        return book.residence_s if book is not None else None

    def held_tokens(
        self,
        worker_id: str,
        now: float | None = None,
        reserve_ratio: float = FLOOR_RESERVE_RATIO,
        residence: float | None = None,
    ) -> float:
        """KV tokens the router's open requests hold on the worker (outputs in full without ``now``)."""
        book = self._workers.get(worker_id)
        return book.held_tokens(now, reserve_ratio, residence) if book is not None else 0.0

    def memory_wait_s(
        self,
        worker_id: str,
        new_tokens: float,
        cached_tokens: float,
        capacity: int | None,
        output_tokens: float = 0.0,
        now: float | None = None,
        reserve_ratio: float = FLOOR_RESERVE_RATIO,
        token_s: float = 0.0,
    ) -> float:
        """Seconds a request of these tokens would wait for KV room on the worker (0: it fits now).

        SGLang admits a request when its new tokens and its whole (clipped) output fit beside what the
        running ones hold and the share ``reserve_ratio`` of their remaining outputs it reserves.
        ``token_s``: seconds per output token on the worker now (the residence is at least the open
        requests' mean output at that pace; 0: the measured residence alone).
        """
        book = self._workers.get(worker_id)
        if book is None or not book.open or not capacity:
            return 0.0
        residence = book.residence_s
        if residence is None:
            residence = self._fleet_residence()
        # The open requests' outputs at the worker's present pace: a residence no finished request may show yet.
        paced = token_s * sum(o.output for o in book.open.values()) / len(book.open)
        residence = max(residence or 0.0, paced)
        if residence <= 0:
            return 0.0
        held = book.held_tokens(now, reserve_ratio, residence)
        shared = max(o.cached for o in book.open.values())
        # A prefix open requests hold is locked already.
        need = new_tokens + output_tokens + max(0.0, cached_tokens - shared)
        excess = held + need - capacity
        if excess <= 0:
            return 0.0
        share = min(1.0, excess / held)
        wait = share * residence
        if now is not None:
            # The oldest open requests finish first: the wait is what is left of the residence of the last of
            # those that must (finishes spread evenly over a residence says the same where arrivals were even).
            opened = list(book.open.values())
            last = opened[min(len(opened), math.ceil(share * len(opened))) - 1]
            wait = max(wait, residence - (now - last.at))
        return wait

    def _fleet_residence(self) -> float | None:
        known = [b.residence_s for b in self._workers.values() if b.residence_s is not None]
        return sum(known) / len(known) if known else None

"""Candidate pruning: a large fleet is scored on a bounded shortlist, not on every worker.

A token-matching policy prices every candidate in full (its prefill, queue, eviction and tier
costs), so on a 256-worker fleet that scoring, not the index lookup, is what a decision costs. The
only workers such a policy can prefer are the ones holding the most of the prompt (a cache hit) and
the ones with the least work (a cold prompt, or a spill away from a busy holder); a worker that
holds less than the shortlisted holders and is busier than the shortlisted idle ones loses to both
on every term of the score. So before the policy runs the router keeps at most ``max_candidates``:

- the ``ceil(K / 2)`` workers that match the prompt longest (storage tier, then host memory, then
  GPU; ties: the least loaded);
- then the least loaded of the rest (the router's own in-flight count or the worker's reported
  running requests, whichever is larger, plus its reported queue), equal loads taken in a rotating
  order so that cold prompts on an idle fleet still spread over every worker.

The shortlist keeps the fleet's order, and a fleet of at most ``K`` workers is passed through
untouched: on small fleets every decision is what it was without pruning.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

from extproc.fleet.reports import WorkerLoad

__all__ = ["CandidatePruner", "Depth", "load_of"]

Depth = tuple[int, int, int]  # leading blocks matched: (storage tier, host memory, GPU), each cumulative


def load_of(in_flight: int, reported: WorkerLoad | None) -> int:
    """Requests on the worker: its in-flight count here or its reported running ones (the larger), plus its queue."""
    if reported is None:
        return in_flight
    return max(in_flight, reported.num_running_reqs) + reported.num_waiting_reqs


class CandidatePruner:
    """Keeps the longest-matching and least-loaded workers, at most ``max_candidates`` of them.

    It works on plain per-worker figures (no ``Candidate`` objects): the router builds a candidate
    only for the workers that survive, so what a decision spends on the rest of the fleet is one
    index lookup and one load figure each.
    """

    def __init__(self, max_candidates: int) -> None:
        if max_candidates < 2:
            raise ValueError("max_candidates must be at least 2 (one best match, one least loaded)")
        self.max_candidates = max_candidates
        self._turn = 0  # rotates the order among equally loaded workers from one decision to the next

    def shortlist(self, depths: Sequence[Depth], loads: Callable[[], Sequence[int]]) -> range | list[int]:
        """Positions of the workers kept, in fleet order; ``depths[i]`` is worker i's match.

        ``loads`` is called only when the fleet is larger than the shortlist (``load_of`` per worker).
        """
        count = len(depths)
        keep = self.max_candidates
        if count <= keep:
            return range(count)
        load = loads()
        # Usually few workers hold any of the prompt: only those are ranked by match.
        holders = [i for i, d in enumerate(depths) if d[0] or d[2]]
        best = heapq.nsmallest(
            (keep + 1) // 2,
            holders,
            key=lambda i: (-depths[i][0], -depths[i][1], -depths[i][2], load[i]),
        )
        chosen = set(best)
        self._turn = turn = (self._turn + 1) % count
        rest = (i for i in range(count) if i not in chosen)
        chosen.update(heapq.nsmallest(keep - len(chosen), rest, key=lambda i: (load[i], (i - turn) % count)))
        return sorted(chosen)

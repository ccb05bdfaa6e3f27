"""``least-load``: fewest in-flight requests (counted by the router), then reported queue, then KV usage."""

from __future__ import annotations

from extproc.decision.policies.base import Candidate, Decision, Policy, RoutingRequest
from extproc.fleet.reports import WorkerLoad

__all__ = ["LeastLoadPolicy"]


class LeastLoadPolicy(Policy):
    """Ranks by the router's in-flight count, then ``queue`` (what the worker reports waiting), then KV usage;
    exact ties rotate."""

    name = "least-load"

    _tiebreak = 0

    def queue(self, load: WorkerLoad | None) -> int:
        """Requests the worker reports waiting (0 when it reports nothing)."""
        return load.num_waiting_reqs if load else 0

    def scores(self, candidate: Candidate, queued: int) -> dict[str, float]:
        """What the span shows of one candidate."""
        return {"in_flight": candidate.in_flight}

    def select(self, request: RoutingRequest, candidates: list[Candidate]) -> Decision:
        # Rotate the starting point so exact ties spread instead of always hitting worker 0.
        self._tiebreak += 1
        return self._rank(candidates, self._tiebreak)

    def explain(self, request: RoutingRequest, candidates: list[Candidate]) -> Decision:
        """The next ``select``'s ranking, the rotation left where it is."""
        return self._rank(candidates, self._tiebreak + 1)

    def _rank(self, candidates: list[Candidate], tiebreak: int) -> Decision:
        n = len(candidates)
        queued = [self.queue(c.load) for c in candidates]

        def key(i: int) -> tuple[float, ...]:
            c = candidates[i]
            usage = c.load.token_usage if c.load else 0.0
            return (c.in_flight, queued[i], usage, (i - tiebreak) % n)

        order = sorted(range(n), key=key)
        return Decision(
            ranked=[candidates[i].worker for i in order],
            reason=self.name,
            scores={candidates[i].worker.id: self.scores(candidates[i], queued[i]) for i in order},
        )

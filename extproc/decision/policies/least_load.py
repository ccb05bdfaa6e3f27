"""``least-load``: fewest in-flight requests (counted by the router), then reported queue, then KV usage."""

from __future__ import annotations

from extproc.decision.policies.base import Candidate, Decision, Policy, RoutingRequest

__all__ = ["LeastLoadPolicy"]


class LeastLoadPolicy(Policy):
    name = "least-load"

    _tiebreak = 0

    def select(self, request: RoutingRequest, candidates: list[Candidate]) -> Decision:
        # Rotate the starting point so exact ties spread instead of always hitting worker 0.
        self._tiebreak += 1
        return self._rank(candidates, self._tiebreak)

    def explain(self, request: RoutingRequest, candidates: list[Candidate]) -> Decision:
        """The next ``select``'s ranking, the rotation left where it is."""
        return self._rank(candidates, self._tiebreak + 1)

    @staticmethod
    def _rank(candidates: list[Candidate], tiebreak: int) -> Decision:
        n = len(candidates)

        def key(item: tuple[int, Candidate]) -> tuple[float, ...]:
            i, c = item
            waiting = c.load.num_waiting_reqs if c.load else 0
            usage = c.load.token_usage if c.load else 0.0
            return (c.in_flight, waiting, usage, (i - tiebreak) % n)

        ordered = [c for _, c in sorted(enumerate(candidates), key=key)]
        return Decision(
            ranked=[c.worker for c in ordered],
            reason="least-load",
            scores={c.worker.id: {"in_flight": c.in_flight} for c in ordered},
        )

"""``round-robin``: the baseline every benchmark compares against."""

from __future__ import annotations

from extproc.decision.policies.base import Candidate, Decision, Policy, RoutingRequest

__all__ = ["RoundRobinPolicy"]


class RoundRobinPolicy(Policy):
    name = "round-robin"

    _next = 0

    def select(self, request: RoutingRequest, candidates: list[Candidate]) -> Decision:
        decision = self.explain(request, candidates)
        self._next += 1
        return decision

    def explain(self, request: RoutingRequest, candidates: list[Candidate]) -> Decision:
        """This turn's ranking; only ``select`` moves the turn on."""
        start = self._next % len(candidates)
        ordered = candidates[start:] + candidates[:start]
        return Decision(ranked=[c.worker for c in ordered], reason="round-robin")

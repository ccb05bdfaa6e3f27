"""The routing pipeline, wired in order: request -> tokens -> block keys -> index + load -> policy.

The ext_proc servicer calls ``route()`` once per generation request (after the buffered body is
parsed) and ``finish()`` when that request's ext_proc stream ends, which Envoy only does once the
response has been completely sent: that brackets the router's in-flight count per worker.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from extproc.config import RouterConfig
from extproc.policies import Candidate, Decision, RoutingRequest, create_policy
from extproc.request import ParsedRequest
from extproc.workers import Worker, WorkerRegistry

__all__ = ["NoWorkerError", "RouteOutcome", "Router"]


class NoWorkerError(Exception):
    """No healthy worker can take the request (answered with 503)."""


@dataclass
class RouteOutcome:
    """A decision in flight: what was chosen for which request."""

    request: RoutingRequest
    decision: Decision
    worker: Worker
    finished: bool = False
    # Headers the server must set on the upstream request (e.g. W3C ``traceparent`` of the decision span).
    upstream_headers: dict[str, str] = field(default_factory=dict)

    def endpoints(self, fallbacks: int) -> list[str]:
        """Primary ``ip:port`` first, then up to ``fallbacks`` others (Endpoint Picker convention)."""
        return [w.endpoint for w in self.decision.ranked[: 1 + fallbacks]]


class Router:
    """Owns the policy and the per-worker in-flight counts; knows nothing about gRPC or Envoy."""

    def __init__(self, config: RouterConfig, registry: WorkerRegistry) -> None:
        self.config = config
        self.registry = registry
        self.policy = create_policy(config.policy.name, config.policy.options)

    async def start(self) -> None:
        """Start background work (event subscriptions, load polling)."""

    async def stop(self) -> None:
        """Stop background work."""

    def route(self, parsed: ParsedRequest) -> RouteOutcome:
        """Choose a worker for ``parsed``; raises NoWorkerError when none is healthy."""
        model = parsed.model or ""
        workers = self.registry.candidates(parsed.model)
        if not workers:
            raise NoWorkerError(f"no healthy worker for model {model!r}" if model else "no healthy worker")
        request = RoutingRequest(model=model, path=parsed.path, headers=parsed.headers)
        candidates = [Candidate(worker=w, in_flight=w.in_flight) for w in workers]
        decision = self.policy.select(request, candidates)
        chosen = decision.ranked[0]
        chosen.in_flight += 1
        self.policy.on_routed(request, decision)
        return RouteOutcome(request=request, decision=decision, worker=chosen)

    def finish(self, outcome: RouteOutcome) -> None:
        """The request's stream ended: release its in-flight slot (idempotent)."""
        if outcome.finished:
            return
        outcome.finished = True
        outcome.worker.in_flight = max(0, outcome.worker.in_flight - 1)
        self.policy.on_complete(outcome.request, outcome.worker)

"""``session``: requests carrying the same session header stick to one worker.

Like HyperPod's ``session`` strategy: the first request of a session is placed by the fallback
policy (``prefix-aware`` by default, configured in its own section) and the session is pinned
there; while that worker stays healthy every later turn follows it (its KV cache holds the
conversation). If it leaves the candidate set the session is re-placed. Requests without any of the
affinity headers use the fallback directly. Clients name sessions differently (aiperf sends
``X-Session-Affinity``, SGLang's gateway reads ``X-SMG-Routing-Key``), so the policy accepts a list
of headers and uses the first one present.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from pydantic import Field

from extproc.decision.policies.base import Candidate, Decision, Policy, PolicyError, PolicyOptions, RoutingRequest
from extproc.fleet.reports import WorkerLoad
from extproc.fleet.workers import Worker

__all__ = ["SessionOptions", "SessionPolicy"]


class SessionOptions(PolicyOptions):
    """Constants of the ``session`` policy."""

    headers: list[str] = Field(
        default_factory=lambda: ["x-session-id", "x-session-affinity", "x-smg-routing-key"],
        min_length=1,
        description="Request headers whose value pins a session to a worker; the first one present counts.",
    )
    fallback: str = Field(
        "prefix-aware", description="Policy that places a new session (or a request without the header)."
    )
    max_sessions: int = Field(
        100_000, gt=0, description="Session -> worker entries kept (least recently used dropped)."
    )


class SessionPolicy(Policy[SessionOptions]):
    name = "session"

    def setup(self) -> None:
        if self.opts.fallback == self.name:
            raise PolicyError("the session policy cannot fall back to itself")
        self.headers = [h.lower() for h in self.opts.headers]
        self._sessions: OrderedDict[str, str] = OrderedDict()  # session id -> worker id

    def compose(self, create: Callable[[str], Policy]) -> None:
        """New sessions are placed by the fallback policy, configured in its own section."""
        self.fallback = create(self.opts.fallback)
        self.needs_tokens = self.fallback.needs_tokens
        self.needs_text = self.fallback.needs_text

    def share_decisions(self) -> None:
        """New sessions are placed by the fallback: it is the one that must place them alike on every replica."""
        self.fallback.share_decisions()

    def use_memory(self, budget_bytes: int) -> None:
        """The fallback keeps the per-worker state, so it gets the memory."""
        self.fallback.use_memory(budget_bytes)

    def memory_bytes(self) -> int:
        return self.fallback.memory_bytes()

    def session_of(self, request: RoutingRequest) -> str | None:
        """The request's session: the value of the first affinity header it carries."""
        for header in self.headers:
            value = request.headers.get(header)
            if value:
                return f"{header}={value}"
        return None

    def select(self, request: RoutingRequest, candidates: list[Candidate]) -> Decision:
        return self._follow(request, self.fallback.select(request, candidates), touch=True)

    def explain(self, request: RoutingRequest, candidates: list[Candidate]) -> Decision:
        """``select`` over the fallback's own explain, the session's place in the LRU order left alone."""
        return self._follow(request, self.fallback.explain(request, candidates), touch=False)

    def learned(self, worker_id: str) -> dict[str, float]:
        return self.fallback.learned(worker_id)

    def _follow(self, request: RoutingRequest, placed: Decision, touch: bool) -> Decision:
        """The fallback's ranking ``placed``, with the session's worker first while it is a candidate."""
        session = self.session_of(request)
        if not session:
            return Decision(ranked=placed.ranked, reason=f"no-session:{placed.reason}", scores=placed.scores)
        pinned = self._sessions.get(session)
        if pinned is not None:
            for worker in placed.ranked:
                if worker.id == pinned:
                    if touch:
                        self._sessions.move_to_end(session)
                    ranked = [worker, *(w for w in placed.ranked if w is not worker)]
                    return Decision(ranked=ranked, reason="session-affinity", scores=placed.scores)
        return Decision(
            ranked=placed.ranked, reason="session-new" if pinned is None else "session-moved", scores=placed.scores
        )

    def on_routed(self, request: RoutingRequest, decision: Decision) -> None:
        session = self.session_of(request)
        if session:
            self._sessions[session] = decision.ranked[0].id
            self._sessions.move_to_end(session)
            while len(self._sessions) > self.opts.max_sessions:
                self._sessions.popitem(last=False)
        self.fallback.on_routed(request, decision)

    def on_complete(self, request: RoutingRequest, worker: Worker) -> None:
        self.fallback.on_complete(request, worker)

    def on_load(self, worker: Worker, load: WorkerLoad) -> None:
        self.fallback.on_load(worker, load)

    def on_evicted(self, worker_id: str, keys: Sequence[int]) -> None:
        self.fallback.on_evicted(worker_id, keys)

    def remove_worker(self, worker_id: str) -> None:
        self.fallback.remove_worker(worker_id)

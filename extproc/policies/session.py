"""``session``: requests carrying the same session header stick to one worker.

Like HyperPod's ``session`` strategy: the first request of a session is placed by the fallback
policy (``prefix-aware`` by default) and the session is pinned there; while that worker stays
healthy every later turn follows it (its KV cache holds the conversation). If it leaves the
candidate set the session is re-placed. Requests without the header use the fallback directly.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from extproc.config import SessionOptions
from extproc.policies.base import Candidate, Decision, Policy, PolicyError, RoutingRequest
from extproc.workers import Worker

__all__ = ["SessionPolicy"]


class SessionPolicy(Policy):
    name = "session"

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(options)
        raw = dict(self.options)
        self.header = str(raw.pop("header", "x-session-id")).lower()
        fallback_options = raw.pop("fallback_options", None)
        try:
            self.opts = SessionOptions.model_validate(raw)
        except ValidationError as exc:
            raise PolicyError(f"invalid session options: {exc}") from exc
        if self.opts.fallback == self.name:
            raise PolicyError("the session policy cannot fall back to itself")
        from extproc.policies import create_policy  # the registry imports this module

        self.fallback = create_policy(self.opts.fallback, fallback_options)
        self.needs_tokens = self.fallback.needs_tokens
        self.needs_text = self.fallback.needs_text
        self._sessions: OrderedDict[str, str] = OrderedDict()  # session id -> worker id

    def select(self, request: RoutingRequest, candidates: list[Candidate]) -> Decision:
        session = request.headers.get(self.header)
        placed = self.fallback.select(request, candidates)
        if not session:
            return Decision(ranked=placed.ranked, reason=f"no-session:{placed.reason}", scores=placed.scores)
        pinned = self._sessions.get(session)
        if pinned is not None:
            for worker in placed.ranked:
                if worker.id == pinned:
                    self._sessions.move_to_end(session)
                    ranked = [worker, *(w for w in placed.ranked if w is not worker)]
                    return Decision(ranked=ranked, reason="session-affinity", scores=placed.scores)
        return Decision(ranked=placed.ranked, reason="session-new" if pinned is None else "session-moved",
                        scores=placed.scores)

    def on_routed(self, request: RoutingRequest, decision: Decision) -> None:
        session = request.headers.get(self.header)
        if session:
            self._sessions[session] = decision.ranked[0].id
            self._sessions.move_to_end(session)
            while len(self._sessions) > self.opts.max_sessions:
                self._sessions.popitem(last=False)
        self.fallback.on_routed(request, decision)

    def on_complete(self, request: RoutingRequest, worker: Worker) -> None:
        self.fallback.on_complete(request, worker)

    def remove_worker(self, worker: Worker) -> None:
        for session in [s for s, w in self._sessions.items() if w == worker.id]:
            del self._sessions[session]
        self.fallback.remove_worker(worker)

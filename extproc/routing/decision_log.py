"""The last routing decisions, kept for the debug view (``/debug/decisions``): a bounded ring buffer.

Recording costs the request one small object and a ``deque`` append: the record holds references to
what the decision already built (its candidates and the policy's figures), and everything a reader
sees (the predicted cached tokens, the runner-up and why it lost) is worked out when ``/debug/decisions``
is read, never on the request path. The router records every decision (``Router._record``); the
drift meter adds what the engine reported for the sampled ones; ``served`` notes a fallback.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from extproc.decision.policies import Candidate, Decision

__all__ = ["DecisionLog", "DecisionRecord", "why_lost"]

# Figures a policy reports per candidate that best say why one ranked above another, in this order.
_TELLING = (
    "score",
    "ttft_s",
    "cached_tokens",
    "queue_s",
    "memory_wait_s",
    "prefill_s",
    "work_price",
    "cost",
    "prefix",
    "in_flight",
    "decode_queue",
)


@dataclass
class DecisionRecord:
    """One decision as the debug view shows it (references to the decision's own objects, no copies)."""

    request_id: str
    at: float  # wall-clock seconds
    path: str
    model: str
    policy: str
    decision: Decision
    candidates: list[Candidate]
    prompt_tokens: int
    decision_ms: float
    dp_rank: int | None = None
    queue_wait_ms: float = 0.0
    decode: Decision | None = None  # a disaggregated decision's decode side
    served_by: str | None = None  # the worker Envoy fell back to, if it did
    # What the engine reported for a sampled response (drift): cached prompt tokens, prompt tokens, mismatch.
    served: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        """The record as ``/debug/decisions`` shows it."""
        decision = self.decision
        chosen = decision.ranked[0]
        winner = next((c for c in self.candidates if c.worker is chosen), None)
        figures = decision.scores.get(chosen.id, {})
        out: dict[str, Any] = {
            "request_id": self.request_id,
            "at": self.at,
            "path": self.path,
            "model": self.model,
            "policy": self.policy,
            "reason": decision.reason,
            "worker": chosen.id,
            "endpoint": chosen.endpoint,
            "dp_rank": self.dp_rank,
            "prompt_tokens": self.prompt_tokens,
            "matched_blocks": winner.matched_blocks if winner else 0,
            "block_size": winner.block_size if winner else None,
            "predicted_cached_tokens": winner.predicted_cached_tokens(self.prompt_tokens) if winner else 0,
            "predicted_ttft_s": figures.get("ttft_s"),
            "candidates": len(self.candidates),
            "decision_ms": round(self.decision_ms, 3),
            "queue_wait_ms": round(self.queue_wait_ms, 3),
            "runner_up": None,
            "served_by": self.served_by,
            "served": self.served,
        }
        if len(decision.ranked) > 1:
            second = decision.ranked[1]
            out["runner_up"] = {
                "worker": second.id,
                "matched_blocks": next((c.matched_blocks for c in self.candidates if c.worker is second), 0),
                "predicted_ttft_s": decision.scores.get(second.id, {}).get("ttft_s"),
                "why_lost": why_lost(decision, chosen.id, second.id),
            }
        if self.decode is not None:
            out["decode_worker"] = self.decode.ranked[0].id
            out["decode_reason"] = self.decode.reason
        return out


def why_lost(decision: Decision, winner: str, loser: str) -> str:
    """Why ``loser`` ranked below ``winner``, in the policy's own figures (the ones that differ)."""
    ours, theirs = decision.scores.get(winner, {}), decision.scores.get(loser, {})
    differ = [
        f"{name} {_fmt(theirs[name])} vs {_fmt(ours[name])}"
        for name in _TELLING
        if name in ours and name in theirs and _fmt(ours[name]) != _fmt(theirs[name])
    ]
    if differ:
        return "; ".join(differ[:4]) + " (runner-up vs chosen)"
    if ours or theirs:
        return f"equal on {decision.reason}'s figures: the tie-break chose the winner"
    return f"ranked second by {decision.reason}"


def _fmt(value: float) -> str:
    return f"{value:.4g}"


class DecisionLog:
    """The last ``size`` decisions, newest last (0: nothing is kept)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._records: deque[DecisionRecord] = deque(maxlen=max(size, 1))

    def add(self, record: DecisionRecord) -> None:
        if self.size:
            self._records.append(record)

    def find(self, request_id: str) -> DecisionRecord | None:
        """The newest record of ``request_id`` still kept (a scan: only sampled or fallen-back requests ask)."""
        if not request_id:
            return None
        for record in reversed(self._records):
            if record.request_id == request_id:
                return record
        return None

    def recent(self, limit: int | None = None) -> list[DecisionRecord]:
        """The newest ``limit`` records (all kept when None), newest first."""
        out = list(reversed(self._records))
        return out if limit is None else out[:limit]

    def __len__(self) -> int:
        return len(self._records)

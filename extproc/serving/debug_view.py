"""What the debug endpoints show, as JSON-ready values: the fleet, the last decisions, an explained prompt.

Read on the router's event loop (the metrics server runs there), so every figure is the one the next
decision would read, and nothing here writes: the fleet view reads the registry, the load book, the
index and the policy's learned constants; the decisions come from the router's ring buffer; an
explained prompt is ranked by ``Router.explain``, which pins, books and records nothing.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from extproc.config import RouterConfig
from extproc.decision.pipeline import DecisionPipeline, Explained
from extproc.decision.policies import Candidate, Decision, Policy
from extproc.fleet.index import TIERS, BlockIndex, rank_key
from extproc.fleet.info import disaggregation_role, dp_size
from extproc.fleet.reports import LoadBook, WorkerLoad
from extproc.fleet.workers import Worker, WorkerRegistry
from extproc.routing.router import Router
from extproc.sync.hub import EventHub

__all__ = ["RouterParts", "decisions_view", "explain_view", "workers_view"]


class RouterParts(Protocol):
    """The parts of a router the debug view reads (``extproc.serving.app.RouterApp`` has them all)."""

    @property
    def config(self) -> RouterConfig: ...
    @property
    def registry(self) -> WorkerRegistry: ...
    @property
    def index(self) -> BlockIndex: ...
    @property
    def events(self) -> EventHub: ...
    @property
    def loads(self) -> LoadBook: ...
    @property
    def pipeline(self) -> DecisionPipeline: ...
    @property
    def router(self) -> Router: ...


_LOAD_FIELDS = (
    "num_running_reqs",
    "num_waiting_reqs",
    "num_used_tokens",
    "max_total_num_tokens",
    "token_usage",
    "num_waiting_uncached_tokens",
    "cache_hit_rate",
    "age_s",
)


def _load(load: WorkerLoad | None) -> dict[str, Any] | None:
    if load is None:
        return None
    return {name: getattr(load, name) for name in _LOAD_FIELDS}


def _blocks(app: RouterParts, slot: str) -> dict[str, int]:
    return {tier: app.index.size(slot, tier) for tier in TIERS}


def _worker(app: RouterParts, worker: Worker, policy: Policy) -> dict[str, Any]:
    ranks = dp_size(worker)
    index: dict[str, Any] = {
        "state": app.events.state(worker),
        "page_size": app.pipeline.layout.block_size(worker),
        "blocks": _blocks(app, worker.id) if ranks == 1 else {},
    }
    if ranks > 1:
        by_rank = [_blocks(app, rank_key(worker.id, r)) for r in range(ranks)]
        index["ranks"] = [
            {"rank": r, "state": app.events.rank_state(worker, r), "blocks": blocks} for r, blocks in enumerate(by_rank)
        ]
        index["blocks"] = {tier: sum(blocks[tier] for blocks in by_rank) for tier in TIERS}
    return {
        "id": worker.id,
        "url": worker.url,
        "endpoint": worker.endpoint,
        "model": worker.model,
        "role": disaggregation_role(worker),
        "healthy": worker.healthy,
        "in_flight": worker.in_flight,
        "rank_in_flight": {str(r): n for r, n in sorted(worker.rank_in_flight.items())},
        "load": _load(app.loads.peek(worker)),
        "index": index,
        "learned": policy.learned(worker.id),
        "drift": app.router.drift.counts(worker.id) if app.router.drift is not None else None,
    }


def workers_view(app: RouterParts) -> dict[str, Any]:
    """``/debug/workers``: every worker's health, load, learned costs, cached blocks by tier and index drift."""
    policy = app.pipeline.policy
    return {
        "at": time.time(),
        "policy": app.config.policy.name,
        "workers": [_worker(app, w, policy) for w in app.registry.workers],
        "shared_groups": {group: app.index.shared_size(group) for group in app.index.shared_groups()},
    }


def decisions_view(app: RouterParts, limit: int | None) -> dict[str, Any]:
    """``/debug/decisions``: the newest ``limit`` decisions (all kept when None), newest first."""
    log = app.router.decisions
    return {
        "at": time.time(),
        "kept": len(log),
        "capacity": log.size,
        "sample_rate": app.config.observability.drift_sample_rate,
        "decisions": [record.to_json() for record in log.recent(limit)],
    }


def _candidate(c: Candidate, decision: Decision, prompt_tokens: int) -> dict[str, Any]:
    tiers = c.tier_blocks
    position = next((i for i, w in enumerate(decision.ranked) if w is c.worker), None)
    return {
        "worker": c.worker.id,
        "rank": position,
        "matched_blocks": c.matched_blocks,
        "host_blocks": tiers["host"],
        "shared_blocks": tiers["shared"],
        "block_size": c.block_size,
        "matched_tokens": c.predicted_cached_tokens(prompt_tokens),
        "in_flight": c.in_flight,
        "index_state": c.index_state,
        "figures": decision.scores.get(c.worker.id, {}),
    }


def explain_view(app: RouterParts, explained: Explained) -> dict[str, Any]:
    """``/debug/explain``: each candidate's matched prefix and figures, the worker the policy would choose."""
    decision, request = explained.decision, explained.request
    tokens = request.prompt_tokens
    candidates = sorted(
        (_candidate(c, decision, tokens) for c in explained.candidates),
        key=lambda c: (c["rank"] is None, c["rank"]),
    )
    scored = {c.worker.id for c in (*explained.candidates, *explained.decode_candidates)}
    out: dict[str, Any] = {
        "policy": app.config.policy.name,
        "model": request.model,
        "path": request.path,
        "tokenized": request.token_ids is not None,
        "prompt_tokens": tokens if request.token_ids is not None else None,
        "would_choose": decision.ranked[0].id,
        "reason": decision.reason,
        "candidates": candidates,
        "not_scored": [w.id for w in app.registry.candidates(None) if w.id not in scored],
        "pd_skipped": explained.pd_skipped,
        "routed": False,
    }
    if explained.decode is not None:
        out["decode"] = {
            "would_choose": explained.decode.ranked[0].id,
            "reason": explained.decode.reason,
            "candidates": [_candidate(c, explained.decode, tokens) for c in explained.decode_candidates],
        }
    return out

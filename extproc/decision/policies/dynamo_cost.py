"""``dynamo-cost``: NVIDIA Dynamo's KV-router cost, for comparisons on equal terms.

``cost = overlap_weight * prefill_blocks + decode_blocks`` per worker, where ``prefill_blocks`` is
the request's blocks less the worker's overlap credit, plus the prefill still owed for requests in
flight there, and ``decode_blocks`` the blocks of all requests active there (the router's own view,
as in Dynamo). The overlap credit is Dynamo's per tier: 1.0 per block on the device, 0.75 per block in
host memory, 0.25 per block on disk (here: the storage tier HiCache workers share, which is where
SGLang's L3 lives). The lowest cost wins; with ``temperature > 0`` a softmax over
``-cost / temperature`` samples instead. Blocks matched use the same event-fed index as
``prefix-aware``.
"""

from __future__ import annotations

import math

from pydantic import Field

from extproc.decision.policies.base import (
    Candidate,
    Decision,
    RandomTieBreakOptions,
    RandomTieBreakPolicy,
    RoutingRequest,
)
from extproc.fleet.workers import Worker

__all__ = ["DynamoCostOptions", "DynamoCostPolicy"]


class DynamoCostOptions(RandomTieBreakOptions):
    """NVIDIA Dynamo KV-router cost defaults."""

    overlap_weight: float = Field(1.0, description="Weight of prefill blocks against decode (active) blocks.")
    device_credit: float = Field(1.0, ge=0, le=1, description="Overlap credit of a block matched on the GPU.")
    host_credit: float = Field(0.75, ge=0, le=1, description="Overlap credit of a block matched in host memory.")
    disk_credit: float = Field(
        0.25, ge=0, le=1, description="Overlap credit of a block matched on disk (the shared storage tier)."
    )
    temperature: float = Field(0.0, ge=0, description="0: argmin; >0: softmax sampling over -cost/temperature.")


class DynamoCostPolicy(RandomTieBreakPolicy[DynamoCostOptions]):
    name = "dynamo-cost"
    needs_tokens = True

    def setup(self) -> None:
        self._active: dict[str, int] = {}  # worker id -> blocks of its active requests
        self._prefill: dict[str, float] = {}  # worker id -> uncached (credited) blocks of its active requests
        # request -> (worker, blocks, uncached blocks) until it completes. The router never sees the
        # first token, so unlike Dynamo the prefill share is owed until completion.
        self._owed: dict[int, tuple[str, int, float]] = {}
        super().setup()  # the seeded tie-break generator

    @staticmethod
    def _blocks(request: RoutingRequest, c: Candidate) -> int:
        return -(-request.prompt_tokens // max(c.block_size, 1))

    def select(self, request: RoutingRequest, candidates: list[Candidate]) -> Decision:
        costs: dict[str, dict[str, float]] = {}
        opts = self.opts
        for c in candidates:
            total = self._blocks(request, c)
            tiers = c.tier_blocks
            credit = opts.device_credit * tiers["gpu"] + opts.host_credit * tiers["host"]
            credit += opts.disk_credit * tiers["shared"]
            new = max(total - credit, 0.0)
            prefill = new + self._prefill.get(c.worker.id, 0)
            decode = total + self._active.get(c.worker.id, 0)
            costs[c.worker.id] = {
                "matched_blocks": c.matched_blocks,
                "overlap_credit": credit,
                "prefill_blocks": prefill,
                "decode_blocks": decode,
                "cost": self.opts.overlap_weight * prefill + decode,
                "new_blocks": new,
                "total_blocks": total,
            }
        order = sorted(candidates, key=lambda c: costs[c.worker.id]["cost"])
        if self.opts.temperature > 0 and len(order) > 1:
            low = costs[order[0].worker.id]["cost"]
            weights = [math.exp(-(costs[c.worker.id]["cost"] - low) / self.opts.temperature) for c in order]
            pick = self._rng.choices(order, weights=weights)[0]
            order = [pick, *(c for c in order if c is not pick)]
        else:
            best = costs[order[0].worker.id]["cost"]
            tied = [c for c in order if costs[c.worker.id]["cost"] == best]
            if len(tied) > 1:  # Dynamo breaks exact ties at random
                pick = self._rng.choice(tied)
                order = [pick, *(c for c in order if c is not pick)]
        return Decision(ranked=[c.worker for c in order], reason="dynamo-cost", scores=costs)

    def on_routed(self, request: RoutingRequest, decision: Decision) -> None:
        worker = decision.ranked[0]
        figures = decision.scores[worker.id]
        self._active[worker.id] = self._active.get(worker.id, 0) + int(figures["total_blocks"])
        self._prefill[worker.id] = self._prefill.get(worker.id, 0) + figures["new_blocks"]
        self._owed[id(request)] = (worker.id, int(figures["total_blocks"]), figures["new_blocks"])

    def on_complete(self, request: RoutingRequest, worker: Worker) -> None:
        owed = self._owed.pop(id(request), None)
        if owed is None:
            return
        wid, total, new = owed
        self._active[wid] = max(0, self._active.get(wid, 0) - total)
        self._prefill[wid] = max(0, self._prefill.get(wid, 0) - new)

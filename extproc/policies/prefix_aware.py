"""``prefix-aware`` (the default): send each request where its first token comes soonest.

For every healthy worker the policy predicts time-to-first-token as

    queue wait + prefill of the uncached tokens + a small penalty per running request
    (+ a KV-pressure penalty when the worker's cache is nearly full)

with prefill ``c0 + a*L + b*(L^2 + 2*P*L)`` for ``L`` uncached tokens after ``P`` cached ones
(linear part: the weights; quadratic part: attention over the whole context). The queue wait is
a virtual FCFS queue per worker: each decision appends its predicted prefill, which drains in real
time; what the worker itself reports waiting (requests from elsewhere) sets a floor. A request
that arrives during a prefill batch waits for all of it, so the whole predicted prefill (``c0``
included) queues up.

The ranking adds ``work_weight`` times the request's own prefill time, the GPU time the decision
spends: recomputing a prefix another worker holds costs the fleet capacity that later requests
queue for, so back-to-back requests with one prefix stay together, and a hot prefix spills to a
second worker only once queueing behind its holder costs more than the recomputation (about
``(1 + work_weight)`` times the prefix's prefill time). Near-ties (within ``tie_abs_s`` or
``tie_rel``) go to the worker that received the least traffic recently (requests, exponentially
decayed over ``balance_window_s``): a new prefix is placed where it will least unbalance the
fleet, since it attracts its followers there, instead of every tie herding onto one argmax.
Exact ties fall to rendezvous hashing of the first block not every tied worker holds, so
placement is deterministic per prefix.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any

import xxhash
from pydantic import Field

from extproc.policies.base import Candidate, Decision, Policy, PolicyOptions, RoutingRequest
from extproc.policies.tier_cost import costs_from_report, tier_extra
from extproc.sync.workers import Worker

__all__ = ["PrefixAwareOptions", "PrefixAwarePolicy", "prefill_seconds"]


class PrefixAwareOptions(PolicyOptions):
    """Constants of the ``prefix-aware`` policy: a predicted time-to-first-token per worker.

    Prefill of ``L`` uncached tokens after ``P`` cached ones costs ``c0 + a*L + b*(L^2 + 2*P*L)``
    (linear part: weights; quadratic part: attention over the whole context). Defaults are an 8B
    model on one H100 in BF16 (docs/routing.md derives them).
    """

    prefill_floor_s: float = Field(0.015, ge=0, description="c0: fixed cost of one prefill (scheduling, launch).")
    prefill_per_token_s: float = Field(23e-6, ge=0, description="a: seconds per uncached prompt token (~43k tok/s).")
    attention_per_token2_s: float = Field(0.52e-9, ge=0, description="b: attention seconds per token^2 of context.")
    running_penalty_s: float = Field(
        0.0005,
        ge=0,
        description="Added per request decoding on the worker (decode steps interleave with prefill chunks).",
    )
    waiting_prefill_s: float = Field(
        0.05,
        ge=0,
        description="Assumed prefill time of each request the worker reports waiting that the router did not send.",
    )
    kv_pressure_threshold: float = Field(
        0.92, ge=0, le=1, description="KV usage above which a worker must evict or retract before admitting more."
    )
    kv_pressure_penalty_s: float = Field(0.25, ge=0, description="Penalty at 100% KV usage, linear from the threshold.")
    tie_abs_s: float = Field(
        0.003, ge=0, description="Predicted TTFTs within this many seconds of the best count as a tie."
    )
    tie_rel: float = Field(0.05, ge=0, description="... or within this fraction of the best.")
    work_weight: float = Field(
        1.0,
        ge=0,
        description=(
            "Ranking adds this times the request's own prefill seconds (GPU time spent); 0 ranks by TTFT alone."
        ),
    )
    balance_window_s: float = Field(
        10.0, gt=0, description="Near-ties go to the worker with the least traffic over about this window."
    )
    speedup: float = Field(
        1.0,
        gt=0,
        description=(
            "Divides every time constant (a fleet faster than the constants describe). Simulated workers "
            "report their own --speedup in /server_info and are scaled by it automatically."
        ),
    )


def prefill_seconds(opts: PrefixAwareOptions, new_tokens: int, cached_tokens: int) -> float:
    """Predicted prefill time of ``new_tokens`` on top of ``cached_tokens`` already in the KV cache."""
    n, p = new_tokens, cached_tokens
    return (
        opts.prefill_floor_s + opts.prefill_per_token_s * n + opts.attention_per_token2_s * (n * n + 2 * p * n)
    ) / opts.speedup


def _time_scale(worker: Worker) -> float:
    """A simulated worker says how much faster than its profile it runs; real GPUs say nothing."""
    sim = worker.info.get("simulator") if isinstance(worker.info, dict) else None
    speedup = sim.get("speedup") if isinstance(sim, dict) else None
    return 1.0 / speedup if isinstance(speedup, (int, float)) and speedup > 0 else 1.0


class PrefixAwarePolicy(Policy):
    name = "prefix-aware"
    Options = PrefixAwareOptions
    opts: PrefixAwareOptions
    needs_tokens = True

    def __init__(
        self, options: Mapping[str, Any] | None = None, sections: Mapping[str, Mapping[str, Any]] | None = None
    ) -> None:
        super().__init__(options, sections)
        self._busy_until: dict[str, float] = {}  # worker id -> when its predicted prefill queue drains
        self._traffic: dict[str, tuple[float, float]] = {}  # worker id -> (decayed request count, as of)
        self._turn = 0

    def predict(self, request: RoutingRequest, c: Candidate, now: float) -> dict[str, float]:
        """The figures behind one candidate's predicted TTFT (also reported on the decision span)."""
        opts = self.opts
        scale = _time_scale(c.worker)  # on top of opts.speedup, which is already in every constant
        total = request.prompt_tokens
        limit = max(total - 1, 0)  # SGLang always computes at least the last prompt token
        gpu = min(c.matched_blocks * c.block_size, limit)
        host = max(min(c.host_matched_blocks * c.block_size, limit) - gpu, 0)
        shared = max(min(c.shared_matched_blocks * c.block_size, limit) - gpu - host, 0)
        # Host hits load back overlapping the prefill; shared-storage hits are read first (policies/tier_cost.py).
        compute = prefill_seconds(opts, total - gpu - host - shared, gpu + host + shared) * scale
        tiers = tier_extra(host, shared, costs_from_report(c.tier_report, scale / opts.speedup), compute, c.block_size)
        new = total - gpu - tiers.host_tokens - tiers.shared_tokens
        prefill = prefill_seconds(opts, new, total - new) * scale + tiers.load_back_s
        backlog = max(0.0, self._busy_until.get(c.worker.id, 0.0) - now)
        load = c.load
        waiting = load.num_waiting_reqs if load else 0
        queue = max(backlog, waiting * opts.waiting_prefill_s / opts.speedup * scale)
        running = max(load.num_running_reqs if load else 0, c.in_flight)
        penalty = running * opts.running_penalty_s / opts.speedup * scale
        usage = load.token_usage if load else 0.0
        if usage > opts.kv_pressure_threshold and opts.kv_pressure_threshold < 1:
            penalty += (
                opts.kv_pressure_penalty_s
                * (usage - opts.kv_pressure_threshold)
                / (1 - opts.kv_pressure_threshold)
                / opts.speedup
                * scale
            )
        ttft = queue + prefill + penalty + tiers.prefetch_s
        return {
            "matched_blocks": c.matched_blocks,
            "cached_tokens": total - new,
            "host_tokens": tiers.host_tokens,
            "shared_tokens": tiers.shared_tokens,
            "tier_s": tiers.seconds,
            "queue_s": queue,
            "prefill_s": prefill,
            "in_flight": c.in_flight,
            "ttft_s": ttft,
            "score": ttft + opts.work_weight * prefill,
        }

    def select(self, request: RoutingRequest, candidates: list[Candidate]) -> Decision:
        now = time.monotonic()
        figures = {c.worker.id: self.predict(request, c, now) for c in candidates}
        score = {wid: f["score"] for wid, f in figures.items()}
        best = min(score.values())
        band = best + max(self.opts.tie_abs_s, self.opts.tie_rel * best)
        tied = [c for c in candidates if score[c.worker.id] <= band]
        winner = self._break_tie(request, tied) if len(tied) > 1 else tied[0]
        rest = sorted((c for c in candidates if c is not winner), key=lambda c: score[c.worker.id])
        ranked = [winner, *rest]
        top = max(c.matched_blocks for c in candidates)
        if winner.matched_blocks and winner.matched_blocks == top:
            reason = "prefix-hit"
        elif top:
            reason = "prefix-spill"  # a holder exists but is predicted slower than recomputing here
        else:
            reason = "cold"
        if winner.index_state != "synced" and winner.matched_blocks:
            reason += "-own-record"
        return Decision(ranked=[c.worker for c in ranked], reason=reason, scores=figures)

    def _break_tie(self, request: RoutingRequest, tied: list[Candidate]) -> Candidate:
        keys = request.block_keys
        if not keys:
            # Nothing to hash (untokenized request): least in-flight, rotating among equals.
            self._turn += 1
            fewest = min(c.in_flight for c in tied)
            idle = [c for c in tied if c.in_flight == fewest]
            return idle[self._turn % len(idle)]
        depth = min(*(c.matched_blocks for c in tied), len(keys) - 1)
        key = keys[depth].to_bytes(8, "little")
        now = time.monotonic()
        return min(
            tied,
            key=lambda c: (
                round(self._recent_traffic(c.worker.id, now), 3),
                -xxhash.xxh3_64_intdigest(key + c.worker.id.encode()),
            ),
        )

    def on_routed(self, request: RoutingRequest, decision: Decision) -> None:
        worker = decision.ranked[0]
        figures = decision.scores.get(worker.id)
        if figures is None:
            return
        now = time.monotonic()
        start = max(now, self._busy_until.get(worker.id, 0.0))
        self._busy_until[worker.id] = start + figures["prefill_s"]
        self._traffic[worker.id] = (self._recent_traffic(worker.id, now) + 1.0, now)

    def _recent_traffic(self, worker_id: str, now: float) -> float:
        count, stamp = self._traffic.get(worker_id, (0.0, now))
        return count * math.exp(-(now - stamp) / self.opts.balance_window_s)

    def on_complete(self, request: RoutingRequest, worker: Worker) -> None:
        if worker.in_flight == 0:
            self._busy_until.pop(worker.id, None)  # nothing outstanding: no queue either

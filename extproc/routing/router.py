"""The router as the exchange sees it: one decision per request, and its accounting until the request ends.

The ext_proc servicer awaits ``aroute()`` once per generation request (after the body is parsed) and
calls ``finish()`` when that request's ext_proc stream ends, which Envoy only does once the response
has been completely sent: that brackets the in-flight count per worker. In between, ``served()``
moves the accounting to the worker Envoy fell back to, if it did.

``aroute`` reads the fleet once, prepares the prompt (render, tokenize, hash: CPU work that reads no
shared state) in a small thread pool (``server.tokenize_threads``) unless it is warm, so a cold
32k-token prompt never stalls the other streams on the event loop (tokenizers releases the GIL);
waits in flow control past saturation; then runs the decision pipeline (``extproc.decision.pipeline``)
on the loop, where the index, the policies and the in-flight counts stay single-threaded; and
records the decision (a span and metrics, the replicas' shared state). ``route()`` does the same on
the calling thread (tests, benchmarks). Nothing here builds its collaborators: ``extproc.serving.app``
does, for the whole process.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field

from extproc.config import RouterConfig
from extproc.decision.pipeline import (
    Decided,
    DecisionPipeline,
    Explained,
    FleetView,
    LoadSource,
    NoWorkerError,
    RouteOutcome,
)
from extproc.decision.prompt import PreparedPrompt
from extproc.decision.request import ParsedRequest, RequestError
from extproc.fleet.info import DP_RANK_HEADERS
from extproc.fleet.workers import Worker, WorkerRegistry
from extproc.routing.decision_log import DecisionLog, DecisionRecord
from extproc.routing.drift import DriftMeter
from extproc.routing.flow_control import Admission, FlowController
from extproc.routing.telemetry import Telemetry
from extproc.sync.shared_state import SharedDecisions

__all__ = ["NoWorkerError", "RouteOutcome", "Router"]

log = logging.getLogger(__name__)

_ADMIT_ALL = Admission()


@dataclass
class Router:
    """Runs the decision pipeline for each request and keeps its books; knows nothing of gRPC.

    ``pool`` prepares prompts off the loop; ``decisions`` keeps the last decisions for the debug view (none
    kept by default); ``drift`` meters sampled responses (none sampled without one).
    """

    config: RouterConfig
    registry: WorkerRegistry
    pipeline: DecisionPipeline
    loads: LoadSource
    telemetry: Telemetry
    pool: Executor
    flow: FlowController | None = None
    shared: SharedDecisions | None = None
    decisions: DecisionLog = field(default_factory=lambda: DecisionLog(0))
    drift: DriftMeter | None = None

    # -- the decision -----------------------------------------------------------------------------
    def route(self, parsed: ParsedRequest) -> RouteOutcome:
        """Choose a worker for ``parsed`` on the calling thread; raises NoWorkerError when none is healthy.

        For tests and benchmarks; the server uses ``aroute`` so that tokenizing never blocks its loop.
        """
        start_ns, wall_ns = time.perf_counter_ns(), time.time_ns()
        fleet = self.pipeline.read_fleet(self.pipeline.eligible(parsed))
        prompt = self.pipeline.prompts.prepare(parsed, fleet.chains)
        assert prompt is not None  # no budget, so never refused
        return self._decide(parsed, prompt, fleet, start_ns, wall_ns)

    async def aroute(
        self,
        parsed: ParsedRequest,
        subset: frozenset[str] | None = None,
        admission: Admission | None = None,
        on_queued: Callable[[float], Awaitable[None]] | None = None,
    ) -> RouteOutcome:
        """``route`` for the event loop: a prompt that is mostly new is tokenized in the thread pool.

        ``subset`` (the gateway's subset hint): only workers at these ``ip:port``s may be chosen; an
        empty or ineligible subset raises NoWorkerError (503). With flow control on, the request
        waits here while every eligible worker is saturated (``admission``: its band and fairness
        id), or raises ``ShedError`` (429); ``on_queued`` is awaited when it starts waiting.

        A warm prompt (at most ``server.inline_tokenize_chars`` characters missing the piece cache)
        costs less than a thread hop and is done in place. The fleet is read before the prompt is
        prepared (it says which key chains to hash) and read again only if the request waited (for the
        pool or in flow control), since health may have changed meanwhile. Everything that reads or
        changes shared state (registry, index, in-flight counts, policy) runs on the loop in one
        synchronous step. If the caller is cancelled while the pool works, no slot has been taken yet.
        """
        start_ns, wall_ns = time.perf_counter_ns(), time.time_ns()
        pipeline = self.pipeline
        fleet = pipeline.read_fleet(pipeline.eligible(parsed, subset))
        chains = fleet.chains
        prompt = pipeline.prompts.prepare(parsed, chains, self.config.server.inline_tokenize_chars)
        stale = prompt is None
        if prompt is None:
            loop = asyncio.get_running_loop()
            prompt = await loop.run_in_executor(self.pool, pipeline.prompts.prepare, parsed, chains)
            assert prompt is not None  # no budget, so never refused
        waited = 0.0
        if self.flow is not None:
            admission = admission or _ADMIT_ALL
            priority = admission.priority
            has_room = lambda: self.has_room(parsed, subset, priority)  # noqa: E731 (read at every check)
            waited = await self.flow.admit(admission, has_room, on_queued)
            stale = stale or bool(waited)
        if stale:
            fleet = pipeline.read_fleet(pipeline.eligible(parsed, subset))
        if self.flow is not None:  # admitted because some worker has room: the policy chooses among those only
            fleet = pipeline.narrow(fleet, lambda w: self.room_at(w, priority))
        outcome = self._decide(parsed, prompt, fleet, start_ns, wall_ns, waited)
        if waited and self.flow is not None:
            self.flow.wake()  # this one took its slot: the next waiter may fit too
        return outcome

    def _decide(
        self,
        parsed: ParsedRequest,
        prompt: PreparedPrompt,
        fleet: FleetView,
        start_ns: int,
        wall_ns: int,
        queue_wait_s: float = 0.0,
    ) -> RouteOutcome:
        """Run the pipeline, then record the decision: span and metrics, shared state, upstream headers."""
        decided = self.pipeline.decide(parsed, prompt, fleet)
        chosen, outcome = decided.chosen, decided.outcome
        if decided.tokenize_error is not None:
            log.info("routing %s without tokens: %s", parsed.path, decided.tokenize_error)
            self.telemetry.tokenize_failed(chosen.request.model)
        if decided.pd_skipped:
            self.telemetry.pd_skipped()
        if self.shared is not None and chosen.recorded_keys:
            self.shared.publish(decided.slot, chosen.recorded_keys)
        if log.isEnabledFor(logging.DEBUG):  # why each candidate ranked where it did (--log-level debug)
            decision = chosen.decision
            log.debug("routed %s to %s (%s): %s", parsed.path, chosen.worker.id, decision.reason, decision.scores)
        headers = self._record(parsed, decided, start_ns, wall_ns, queue_wait_s)
        outcome.upstream_headers = dict(headers)  # a pair's decode side: the prefill rank's pin is the leg's only
        if chosen.dp_rank is not None:
            headers = {**headers, **dict.fromkeys(DP_RANK_HEADERS, str(chosen.dp_rank))}
        chosen.upstream_headers = headers
        chosen.queue_wait_s = outcome.queue_wait_s = queue_wait_s
        return outcome

    def _record(
        self, parsed: ParsedRequest, decided: Decided, start_ns: int, wall_ns: int, queue_wait_s: float
    ) -> dict[str, str]:
        """The decision's span, metrics and debug record; returns the headers that carry its trace upstream."""
        chosen = decided.chosen
        end_ns = time.perf_counter_ns()
        decode = decided.outcome.decision if decided.outcome is not chosen else None
        request_id = parsed.headers.get("x-request-id", "")
        if self.decisions.size:
            request_id = request_id or uuid.uuid4().hex
            self.decisions.add(
                DecisionRecord(
                    request_id=request_id,
                    at=wall_ns / 1e9,
                    path=parsed.path,
                    model=chosen.request.model,
                    policy=self.telemetry.policy_name,
                    decision=chosen.decision,
                    candidates=chosen.candidates,
                    prompt_tokens=chosen.request.prompt_tokens,
                    decision_ms=(end_ns - start_ns) / 1e6,
                    dp_rank=chosen.dp_rank,
                    queue_wait_ms=queue_wait_s * 1000,
                    decode=decode,
                )
            )
        decided.outcome.request_id = chosen.request_id = request_id
        return self.telemetry.decision(
            model=chosen.request.model,
            path=parsed.path,
            headers=parsed.headers,
            request=chosen.request,
            candidates=chosen.candidates,
            decision=chosen.decision,
            start_ns=wall_ns,
            end_ns=wall_ns + (end_ns - start_ns),
            blocks=decided.blocks,
            tokenized=decided.tokenized,
            queue_wait_s=queue_wait_s,
            decode=decode,
        )

    async def explain(self, parsed: ParsedRequest) -> Explained:
        """What the policy would rank for ``parsed`` now, without routing it (the debug port's explain).

        The prompt is prepared in the tokenize threads as a routed one would be; the ranking changes no
        state (``DecisionPipeline.explain``), so the next real decision is unaffected. Raises
        ``RequestError`` / ``NoWorkerError`` as routing would.
        """
        pipeline = self.pipeline
        fleet = pipeline.read_fleet(pipeline.eligible(parsed))
        loop = asyncio.get_running_loop()
        prompt = await loop.run_in_executor(self.pool, pipeline.prompts.prepare, parsed, fleet.chains)
        assert prompt is not None  # no budget, so never refused
        fleet = pipeline.read_fleet(pipeline.eligible(parsed))  # health may have changed meanwhile
        return pipeline.explain(parsed, prompt, fleet)

    def pass_through_endpoints(self, subset: frozenset[str] | None, fallbacks: int) -> list[str]:
        """Endpoints for a request the router does not route by prompt (``/v1/models``, health, ...).

        Our own Envoy config never sends those here; a GIE gateway sends every request of the pool's
        routes, and without a destination its ORIGINAL_DST cluster has no upstream. Fewest in
        flight first; nothing is counted (such requests are cheap and not tracked).
        """
        workers = self.registry.candidates(None)
        if subset is not None:
            workers = [w for w in workers if w.endpoint in subset]
        ranked = sorted(workers, key=lambda w: w.in_flight)
        return [w.endpoint for w in ranked[: fallbacks + 1]]

    # -- flow control -----------------------------------------------------------------------------
    def has_room(self, parsed: ParsedRequest, subset: frozenset[str] | None, priority: int = 0) -> bool:
        """Whether some worker this request may go to is below the saturation bounds of flow control."""
        try:
            workers = self.pipeline.eligible(parsed, subset)
        except (NoWorkerError, RequestError):
            return True  # routing will answer it (503 / 400) at once: no reason to hold it
        return any(self.room_at(w, priority) for w in workers)

    def room_at(self, worker: Worker, priority: int = 0) -> bool:
        """Below both saturation bounds: the router's in-flight count there, and its reported queue.

        A sheddable request (negative priority) gets only ``sheddable_share`` of the in-flight bound.
        """
        bounds = self.config.flow_control
        limit = bounds.max_in_flight_per_worker
        if priority < 0:
            limit = max(1, int(limit * bounds.sheddable_share))
        if worker.in_flight >= limit:
            return False
        if bounds.max_waiting_per_worker is not None:
            load = self.loads.get(worker)
            if load is not None and load.num_waiting_reqs >= bounds.max_waiting_per_worker:
                return False
        return True

    # -- the request's later life -----------------------------------------------------------------
    def served(self, outcome: RouteOutcome, endpoint: str) -> bool:
        """Envoy says ``endpoint`` served the request: move the accounting there if it fell back.

        The in-flight slot, the policy's booking and the router's record of the prompt's blocks
        follow the request to the worker that really has it. Returns whether anything moved (an
        endpoint that is the chosen one, or no worker of ours, moves nothing).
        """
        if outcome.finished or endpoint == outcome.worker.endpoint:
            return False
        new = next((w for w in self.registry.workers if w.endpoint == endpoint), None)
        if new is None:
            log.warning("served endpoint %s is none of the router's workers", endpoint)
            return False
        self.pipeline.move(outcome, new)
        self.telemetry.fell_back()
        record = self.decisions.find(outcome.request_id)
        if record is not None:
            record.served_by = new.id
        return True

    def finish(self, outcome: RouteOutcome) -> None:
        """The request's stream ended: release its in-flight slot, and its prefill worker's (idempotent)."""
        if outcome.prefill is not None:
            self.finish(outcome.prefill)
        if outcome.finished:
            return
        self.pipeline.release(outcome)
        outcome.finished = True
        if self.flow is not None:
            self.flow.wake()

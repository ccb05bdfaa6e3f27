"""The decision pipeline driven in process, with no sync path and no I/O: for benchmarks and harnesses.

``LocalDecider`` builds the pipeline exactly as the serving app does (``DecisionPipeline.build``, the
same memory plan and index), over sources the caller fills: a ``LoadBook`` it sets loads on, the
index it stores blocks in, and, where it follows KV events itself, the index states of its own event
views. Its decisions are the router's decisions for the same inputs and clock; what it leaves out is
what a decision does not read (telemetry, flow control, the replicas' shared state).
"""

from __future__ import annotations

from extproc.clock import MONOTONIC, Clock
from extproc.config import RouterConfig
from extproc.decision.pipeline import DecisionPipeline, IndexStates, RouteOutcome, TierSource
from extproc.decision.request import ParsedRequest
from extproc.fleet.index import BlockIndex
from extproc.fleet.reports import LoadBook, TierReport
from extproc.fleet.workers import Worker, WorkerRegistry
from extproc.memory import MemoryPlan

__all__ = ["LocalDecider", "NoEvents", "NoTiers"]


class NoEvents:
    """No worker's KV events are followed: every index state is ``unknown``, no page size is learnt."""

    def state(self, worker: Worker) -> str:
        return "unknown"

    def block_size(self, worker: Worker) -> int | None:
        return None


class NoTiers:
    """No worker reports tier-transfer figures."""

    def get(self, worker: Worker) -> TierReport | None:
        return None


class LocalDecider:
    """``route`` and ``finish`` on the calling thread, over an index and loads the caller owns."""

    def __init__(
        self,
        config: RouterConfig,
        registry: WorkerRegistry,
        clock: Clock = MONOTONIC,
        states: IndexStates | None = None,
        tiers: TierSource | None = None,
    ) -> None:
        memory = MemoryPlan.from_budget(config.memory.budget_bytes)
        self.registry = registry
        self.index = BlockIndex(
            config.index, clock=clock, max_blocks=memory.index_blocks, max_recent=memory.recent_keys
        )
        self.loads = LoadBook(clock)
        self.pipeline = DecisionPipeline.build(
            config, registry, self.index, memory, self.loads, states or NoEvents(), tiers or NoTiers(), clock
        )
        self.loads.listeners.append(self.pipeline.on_load)
        self.index.eviction_listeners.append(self.pipeline.on_evicted)
        registry.listeners.append(self.pipeline.forget_departed)

    def route(self, parsed: ParsedRequest) -> RouteOutcome:
        """The decision for ``parsed`` (raises ``NoWorkerError`` / ``RequestError`` as the router does)."""
        pipeline = self.pipeline
        fleet = pipeline.read_fleet(pipeline.eligible(parsed))
        prompt = pipeline.prompts.prepare(parsed, fleet.chains)
        assert prompt is not None  # no budget, so never refused
        return pipeline.decide(parsed, prompt, fleet).outcome

    def finish(self, outcome: RouteOutcome) -> None:
        """The request ended: release its slot, and its prefill worker's (idempotent)."""
        if outcome.prefill is not None:
            self.finish(outcome.prefill)
        if not outcome.finished:
            self.pipeline.release(outcome)
            outcome.finished = True

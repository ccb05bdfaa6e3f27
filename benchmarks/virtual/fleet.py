"""A whole fleet in one process on a virtual clock: the real router, real simulated workers, no wall time.

``prefix-router bench`` runs every part as its own process over real sockets, which is the measurement
that counts; on a small shared machine it is also slow and its figures carry the machine's noise. This
runs the same code paths deterministically and faster than real time, for exploring policies:

- every worker is the simulator's own ``Scheduler`` + ``RadixCache`` (same batching, same timing
  profile, same KV events, same ``/v1/loads`` figures), with ``--speedup 1``: the GPU of the profile;
- the router is the decision pipeline with the chosen policy (``LocalDecider``, built as the serving
  app builds it); the workers' KV events reach its index through ``WorkerCacheView`` (encoded and
  decoded as on the wire, after ``event_delay_s``), and their load reports every ``poll_interval_s``;
- the asyncio event loop's clock is virtual (``clock``): a 10-minute trace runs in seconds and two runs
  with one seed give the same numbers;
- ``floor`` is no router at all: the perfect-information reference (``floor``), which reads each
  simulated worker's true state and sends each request where its TTFT is lowest now.

Only the router's own CPU time is missing (decisions take no virtual time): at GPU time scales it is
a millisecond or two per request, which ``--suite overhead`` measures. Peers run as this project's
re-implementations of their policies (``sgl-cache-aware``, ``dynamo-cost``, ...), not their binaries.
``cells`` runs a cell (every policy over seeds) and ``--suite virtual-fleet`` is the command.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from benchmarks.fleet.shapes import Fleet
from benchmarks.metrics import max_over_mean
from benchmarks.stats import distribution
from benchmarks.virtual.clock import VirtualClockLoop, simulator_clock
from benchmarks.virtual.floor import ObservedRadixCache, ObservedScheduler, PerfectInformationFloor, cached_prefix
from benchmarks.workloads.base import Workload
from extproc.config import EventsConfig, MemoryConfig, RouterConfig
from extproc.decision.local import LocalDecider
from extproc.decision.request import ParsedRequest
from extproc.fleet.reports import poll_tick
from extproc.fleet.workers import Worker, WorkerRegistry
from extproc.sync.cache_view import WorkerCacheView
from extproc.sync.load import parse_loads
from prefix_common.tokenization import load_tokenizer
from sglang_workers.sim.config import SimWorkerConfig
from sglang_workers.sim.kv_events import KVEvent, encode_payload
from sglang_workers.sim.timing import get_profile

__all__ = [
    "FLOOR",
    "FLOORS",
    "FLOOR_PHASE_BLIND",
    "FLOOR_ROUTER_VIEW",
    "VirtualResult",
    "run_virtual",
    "virtual_fleet_of",
]

FLOOR = "floor"  # the perfect-information reference (``floor.py``), not a router policy
FLOOR_PHASE_BLIND = "floor-phase-blind"  # the same, blind to the phase of the decode step under way
FLOOR_ROUTER_VIEW = "floor-router-view"  # blind to the phase, and to when a prefill under way started
FLOORS = (FLOOR, FLOOR_PHASE_BLIND, FLOOR_ROUTER_VIEW)


class _DirectPublisher:
    """A KV-event publisher that hands each batch to the router's view of the worker, as the wire would."""

    def __init__(self, view: WorkerCacheView, delay_s: float) -> None:
        self.view = view
        self.delay_s = delay_s
        self.seq = 0

    def publish(self, events: Sequence[KVEvent], ts: float | None = None) -> int | None:
        payload = encode_payload(events, ts if ts is not None else time.time())
        seq, self.seq = self.seq, self.seq + 1
        asyncio.get_running_loop().call_later(self.delay_s, self.view.ingest, seq, payload)
        return seq


@dataclass
class VirtualResult:
    """One policy's run: per-request TTFTs, cache hits, per-worker counts, GPU busy time."""

    policy: str
    rate: float
    ttft_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    per_worker: dict[str, int] = field(default_factory=dict)
    prefill_busy_s: float = 0.0
    duration_s: float = 0.0
    errors: int = 0
    policy_memory_bytes: int = 0  # what the router's policy held at the end (its share of memory.budget_bytes)
    # One dict per request when the run is recorded (``run_virtual(record=True)``), in arrival order.
    records: list[dict[str, Any]] = field(default_factory=list)

    def summary(self, workers: int) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "rate": self.rate,
            "ttft_s": distribution(self.ttft_s),
            "hit_rate": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else float("nan"),
            "max_mean_requests": max_over_mean(self.per_worker, workers),
            "prefill_busy_s": self.prefill_busy_s,
            "duration_s": self.duration_s,
            "errors": self.errors,
        }


class _ViewStates:
    """The index state of each worker as its event view says (the event hub's answer, one view a worker)."""

    def __init__(self) -> None:
        self.views: dict[str, WorkerCacheView] = {}

    def state(self, worker: Worker) -> str:
        view = self.views.get(worker.id)
        return "unknown" if view is None else view.state

    def block_size(self, worker: Worker) -> int | None:
        view = self.views.get(worker.id)
        return view.block_size if view is not None and view.block_size else None


async def _run(
    policy: str,
    workload: Workload,
    fleet: Fleet,
    options: dict[str, Any],
    poll_interval_s: float,
    event_delay_s: float,
    record: bool = False,
    memory_budget_bytes: int | None = None,
) -> VirtualResult:
    loop = asyncio.get_running_loop()
    names = fleet.profile.split(",")
    workers = [
        Worker(id=f"w{i}", url=f"http://10.0.0.{i + 1}:30000", ip=f"10.0.0.{i + 1}", port=30000)
        for i in range(fleet.workers)
    ]
    name = "round-robin" if policy in FLOORS else policy  # a floor decides without the router
    config = RouterConfig(
        events=EventsConfig(enabled=False),
        policy={"name": name, name.replace("-", "_"): options} if options else {"name": name},
        memory=MemoryConfig(budget_bytes=memory_budget_bytes) if memory_budget_bytes else MemoryConfig(),
    )
    states = _ViewStates()
    router = LocalDecider(config, WorkerRegistry(workers), clock=loop.time, states=states)
    schedulers: dict[str, ObservedScheduler] = {}
    for i, worker in enumerate(workers):
        profile = get_profile(names[i % len(names)].strip())
        cfg = SimWorkerConfig(
            page_size=16,
            capacity_tokens=fleet.capacity_tokens,
            profile=profile.name,
            speedup=fleet.speedup,
            kv_events=True,
        )
        view = WorkerCacheView(worker.id, router.index, model=lambda: "", clock=loop.time)
        states.views[worker.id] = view  # what the event hub would hold: the decision reads the view's state
        cache = ObservedRadixCache(cfg.page_size, enable_events=True)
        publisher: Any = _DirectPublisher(view, event_delay_s)  # duck-types KVEventPublisher.publish
        scheduler = ObservedScheduler(cfg, profile, cache, publisher, list(range(1000, 5000)))
        scheduler.start()
        schedulers[worker.id] = scheduler
    result = VirtualResult(policy, workload.offered_rate)
    floor = None
    if policy in FLOORS:
        floor = PerfectInformationFloor(
            schedulers, sees_step_phase=policy == FLOOR, sees_prefill_start=policy != FLOOR_ROUTER_VIEW
        )
    floor_view = PerfectInformationFloor(schedulers) if record else None  # what the floor would estimate, per decision
    stop = asyncio.Event()
    # What each worker computes from the request (whether or not the policy tokenizes).
    prompts = dict(zip((r.index for r in workload.requests), workload.token_ids()))
    # A policy that reads tokens is handed those ids rather than tokenizing the chat again: it would
    # compute the same ids with the same tokenizer and template (decisions take no virtual time), and
    # tokenizing a trace's long prompts once more per run was a third of its wall time. A policy that
    # reads no tokens gets the chat as the router does (it sizes a prompt by its characters then).
    tokenizer = load_tokenizer()
    policy_reads = router.pipeline.policy

    # The load tracker's schedule (``LoadBook.due``, as ``LoadTracker.poll_due`` runs it).
    startup_s = config.load.startup_poll_interval_s
    tick = poll_tick(poll_interval_s, startup_s)

    async def poll() -> None:
        while not stop.is_set():
            for worker in router.loads.due(workers, loop.time(), poll_interval_s, startup_s):
                load = parse_loads({"loads": [schedulers[worker.id].load()]})
                if load is not None:
                    # What the router reads from the worker's /metrics beside /v1/loads (parse_prefill_passes,
                    # parse_new_token_ratio).
                    load.total_prefill_batches = schedulers[worker.id].stats.prefill_batches
                    load.new_token_ratio = schedulers[worker.id].reported_new_token_ratio
                    router.loads.set(worker, load)
            await asyncio.sleep(tick)

    async def one(request: Any) -> None:
        await asyncio.sleep(max(0.0, request.arrival_s - (loop.time() - start)))
        parsed = ParsedRequest(
            path="/v1/chat/completions",
            kind="chat",
            model="default",
            messages=request.messages,
            headers={"x-session-id": request.session or ""},
            max_new_tokens=request.max_tokens,
            input_ids=prompts[request.index] if policy_reads.needs_tokens else None,
            prompt_text=tokenizer.render_chat(request.messages)
            if policy_reads.needs_tokens and policy_reads.needs_text
            else None,
        )
        sent = loop.time()
        tokens = prompts[request.index]
        outcome = router.route(parsed) if floor is None else None
        chosen = outcome.worker.id if outcome is not None else floor.choose(tokens)  # type: ignore[union-attr]
        entry: dict[str, Any] | None = None
        if floor_view is not None:
            estimates = {wid: floor_view.ttft(s, tokens, sent) for wid, s in schedulers.items()}
            best = min(estimates, key=estimates.__getitem__)
            figures = outcome.decision.scores.get(chosen, {}) if outcome is not None else {}
            # What every worker's tree holds of the prompt now: copies of one prefix on several workers take
            # pool room that a fleet past its knee needs (how many hold it, and the most any does).
            held = {wid: cached_prefix(s.cache, tokens[:-1]) for wid, s in schedulers.items()}
            # What the chosen worker was doing (a prompt sent to one in a prefill is prefilled next; to one that
            # decodes, after the step under way), and how many workers had nothing at all to do.
            here = schedulers[chosen]
            entry = {
                "index": request.index,
                "sent_s": sent - start,
                "worker": chosen,
                "reason": outcome.decision.reason if outcome is not None else policy,
                "prompt_tokens": len(tokens),
                "predicted_ttft_s": figures.get("ttft_s"),
                "predicted_new_tokens": figures.get("new_tokens"),
                "predicted_queue_s": figures.get("queue_s"),
                "floor_estimate_here_s": estimates[chosen],
                "floor_estimate_best_s": estimates[best],
                "floor_best_worker": best,
                "true_cached_tokens_now": held[chosen],
                "true_cached_tokens_best": max(held.values()),
                "true_holders": sum(1 for tokens_held in held.values() if tokens_held > 0),
                "worker_state": _state(here),
                "worker_running": len(here.running),
                "worker_waiting": len(here.waiting),
                "idle_workers": sum(1 for s in schedulers.values() if s.idle),
                # Every worker the policy scored (its shortlist): its figures beside the truth there, so a choice can
                # be told from the ones it passed over (which a prediction got wrong, or a near-tie decided).
                "candidates": {
                    wid: {
                        **{k: v for k, v in scored.items() if isinstance(v, int | float)},
                        "floor_estimate_s": estimates[wid],
                        "true_cached_tokens": held[wid],
                        "state": _state(schedulers[wid]),
                    }
                    for wid, scored in (outcome.decision.scores.items() if outcome is not None else ())
                },
            }
            result.records.append(entry)
        try:
            req = schedulers[chosen].submit(tokens, request.max_tokens)
            first = await req.updates.get()
            if first is None or req.error:
                result.errors += 1
                return
            result.ttft_s.append(loop.time() - sent)
            if entry is not None:
                entry["ttft_s"] = loop.time() - sent
                entry["cached_tokens"] = max(req.cached_tokens, 0)
            while await req.updates.get() is not None:
                pass
            result.prompt_tokens += len(tokens)
            result.cached_tokens += max(req.cached_tokens, 0)
            result.per_worker[chosen] = result.per_worker.get(chosen, 0) + 1
        finally:
            if outcome is not None:
                router.finish(outcome)

    start = loop.time()
    poller = asyncio.create_task(poll())
    await asyncio.gather(*(one(r) for r in workload.requests))
    result.duration_s = loop.time() - start
    result.policy_memory_bytes = router.pipeline.policy.memory_bytes()
    stop.set()
    await poller
    for scheduler in schedulers.values():
        result.prefill_busy_s += scheduler.load()["total_prefill_busy_us"] / 1e6
        await scheduler.stop()
    return result


def _state(scheduler: ObservedScheduler) -> str:
    """What a worker is doing: a prefill batch under way, decode steps, only requests waiting, or nothing."""
    if scheduler.prefilling or scheduler.chunked:
        return "prefilling"
    if scheduler.running:
        return "decoding"
    return "waiting" if scheduler.waiting else "idle"


def run_virtual(
    policy: str,
    workload: Workload,
    fleet: Fleet,
    options: dict[str, Any] | None = None,
    poll_interval_s: float = 0.5,
    event_delay_s: float = 0.005,
    record: bool = False,
    memory_budget_bytes: int | None = None,
) -> VirtualResult:
    """Run ``workload`` through ``policy`` (or a floor) on a virtual ``fleet`` (GPU time, no wall time).

    ``record``: keep one dict per request in ``records`` (what the policy predicted for its choice and for each
    candidate it scored, what the floor would estimate there and on its own best worker at that moment, what
    happened); it walks every worker's tree once per request, so a recorded run is slower, and its decisions
    are the same.
    """
    loop = VirtualClockLoop()
    try:
        with simulator_clock(loop):
            return loop.run_until_complete(
                _run(
                    policy, workload, fleet, options or {}, poll_interval_s, event_delay_s, record, memory_budget_bytes
                )
            )
    finally:
        loop.close()


def virtual_fleet_of(fleet: Fleet, workers: int | None = None, gpu_slowdown: float = 1.0) -> Fleet:
    """``fleet`` resized to ``workers`` (its profiles cycled over them), its GPUs ``gpu_slowdown`` times slower
    than the profiles (1: the profiles' own speed)."""
    size = workers or fleet.workers
    name = fleet.name if size == fleet.workers else f"{fleet.name} x{size // fleet.workers or 1} ({size} workers)"
    if gpu_slowdown != 1.0:
        name += f", GPUs {gpu_slowdown:g}x slower"
    return Fleet(name, fleet.profile, size, 1.0 / gpu_slowdown, fleet.capacity_tokens)

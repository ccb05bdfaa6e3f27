"""A whole fleet in one process on a virtual clock: the real router, real simulated workers, no wall time.

``prefix-router bench`` runs every part as its own process over real sockets, which is the measurement
that counts; on a small shared machine it is also slow and its figures carry the machine's noise. This
harness runs the same code paths deterministically and faster than real time, for exploring policies:

- every worker is the simulator's own ``Scheduler`` + ``RadixCache`` (same batching, same timing
  profile, same KV events, same ``/v1/loads`` figures), with ``--speedup 1``: the GPU of the profile;
- the router is the decision pipeline with the chosen policy (``LocalDecider``, built as the serving
  app builds it); the workers' KV events reach its index through ``WorkerCacheView`` (encoded and
  decoded as on the wire, after ``event_delay_s``), and their load reports every ``poll_interval_s``;
- the asyncio event loop's clock is virtual: when nothing is ready it jumps to the next timer, so a
  10-minute trace runs in seconds and two runs with one seed give the same numbers. The router takes
  that clock as its ``clock``; the simulator has no clock seam, so only its scheduler module's view of
  ``time.monotonic`` is pointed at the loop for the run;
- ``floor`` is no router at all: the perfect-information reference (``benchmarks.floor``), which reads
  each simulated worker's true state and sends each request where its TTFT is lowest now. Every table
  reports it beside the policies, and for ``prefix-aware`` the share of the gap between round robin and
  the floor that it closes (mean and p99 TTFT).

Only the router's own CPU time is missing (decisions take no virtual time): at GPU time scales it is
a millisecond or two per request, which the real benchmark measures (``--suite overhead``). Peers run
as this project's re-implementations of their policies (``sgl-cache-aware``, ``dynamo-cost``, ...),
not their binaries. ``python -m benchmarks.virtual_fleet --help``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import selectors
import sys
import time
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sglang_workers.sim.admission as sim_admission
import sglang_workers.sim.scheduler as sim_scheduler
from benchmarks.floor import ObservedScheduler, PerfectInformationFloor, cached_prefix
from benchmarks.matrix import FLEETS, WORKLOADS, Fleet, MatrixOptions
from benchmarks.metrics import distribution, max_over_mean
from benchmarks.oracle import oracle_hit_rate
from benchmarks.workloads import Workload, iter_token_ids
from extproc.config import EventsConfig, RouterConfig
from extproc.decision.local import LocalDecider
from extproc.decision.request import ParsedRequest
from extproc.fleet.workers import Worker, WorkerRegistry
from extproc.sync.cache_view import WorkerCacheView
from extproc.sync.load import parse_loads
from sglang_workers.sim.config import SimWorkerConfig
from sglang_workers.sim.kv_events import KVEvent, encode_payload
from sglang_workers.sim.radix_cache import RadixCache
from sglang_workers.sim.timing import get_profile

__all__ = ["VirtualClockLoop", "VirtualResult", "run_virtual"]


class _VirtualSelector:
    """The loop's selector, except that waiting for a timer advances the virtual clock instead."""

    def __init__(self, real: selectors.BaseSelector, loop: VirtualClockLoop) -> None:
        self._real = real
        self._loop = loop

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        events = self._real.select(0)
        if events:
            return events
        if timeout is None:
            raise RuntimeError("virtual clock: nothing scheduled and nothing ready (the run cannot progress)")
        self._loop.now += max(timeout, 0.0)
        return []


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose ``time()`` only moves when every task waits for a timer."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        real: Any = self._selector  # type: ignore[has-type]
        self._selector = _VirtualSelector(real, self)

    def time(self) -> float:
        return self.now


FLOOR = "floor"  # the perfect-information reference (benchmarks.floor), not a router policy
FLOOR_PHASE_BLIND = "floor-phase-blind"  # the same, blind to the phase of the decode step under way
FLOORS = (FLOOR, FLOOR_PHASE_BLIND)


@contextlib.contextmanager
def _simulator_clock(loop: VirtualClockLoop) -> Iterator[None]:
    """The simulated scheduler reads ``time.monotonic``; for this run its modules read the loop's clock.

    Only the name ``time`` of the scheduler's two modules (batching, admission) is replaced (by a namespace
    whose ``monotonic`` is the loop's); the router gets the clock as a parameter, and nothing else in the
    process sees a changed ``time``.
    """
    shim = types.SimpleNamespace(**{name: getattr(time, name) for name in dir(time) if not name.startswith("_")})
    shim.monotonic = loop.time
    sim_scheduler.time = shim  # type: ignore[assignment]
    sim_admission.time = shim  # type: ignore[assignment]
    try:
        yield
    finally:
        sim_scheduler.time = time
        sim_admission.time = time


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
    )
    states = _ViewStates()
    router = LocalDecider(config, WorkerRegistry(workers), clock=loop.time, states=states)
    schedulers: dict[str, ObservedScheduler] = {}
    for i, worker in enumerate(workers):
        profile = get_profile(names[i % len(names)].strip())
        cfg = SimWorkerConfig(
            page_size=16, capacity_tokens=fleet.capacity_tokens, profile=profile.name, speedup=1.0, kv_events=True
        )
        view = WorkerCacheView(worker.id, router.index, model=lambda: "", clock=loop.time)
        states.views[worker.id] = view  # what the event hub would hold: the decision reads the view's state
        cache = RadixCache(cfg.page_size, enable_events=True)
        publisher: Any = _DirectPublisher(view, event_delay_s)  # duck-types KVEventPublisher.publish
        scheduler = ObservedScheduler(cfg, profile, cache, publisher, list(range(1000, 5000)))
        scheduler.start()
        schedulers[worker.id] = scheduler
    result = VirtualResult(policy, workload.offered_rate)
    floor = PerfectInformationFloor(schedulers, sees_step_phase=policy == FLOOR) if policy in FLOORS else None
    floor_view = PerfectInformationFloor(schedulers) if record else None  # what the floor would estimate, per decision
    stop = asyncio.Event()
    # What each worker computes from the request (whether or not the policy tokenizes).
    prompts = dict(zip((r.index for r in workload.requests), iter_token_ids(workload.requests)))

    async def poll() -> None:
        while not stop.is_set():
            for worker in workers:
                load = parse_loads({"loads": [schedulers[worker.id].load()]})
                if load is not None:
                    # What the router reads from the worker's /metrics beside /v1/loads (parse_prefill_passes).
                    load.total_prefill_batches = schedulers[worker.id].stats.prefill_batches
                    router.loads.set(worker, load)
            await asyncio.sleep(poll_interval_s)

    async def one(request: Any) -> None:
        await asyncio.sleep(max(0.0, request.arrival_s - (loop.time() - start)))
        parsed = ParsedRequest(
            path="/v1/chat/completions",
            kind="chat",
            model="default",
            messages=request.messages,
            headers={"x-session-id": request.session or ""},
            max_new_tokens=request.max_tokens,
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
                "true_cached_tokens_now": cached_prefix(schedulers[chosen].cache, tokens[:-1]),
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
    stop.set()
    await poller
    for scheduler in schedulers.values():
        result.prefill_busy_s += scheduler.load()["total_prefill_busy_us"] / 1e6
        await scheduler.stop()
    return result


def run_virtual(
    policy: str,
    workload: Workload,
    fleet: Fleet,
    options: dict[str, Any] | None = None,
    poll_interval_s: float = 0.5,
    event_delay_s: float = 0.005,
    record: bool = False,
) -> VirtualResult:
    """Run ``workload`` through ``policy`` (or a floor) on a virtual ``fleet`` (GPU time, no wall time).

    ``record``: keep one dict per request in ``records`` (what the policy predicted for its choice, what the
    floor would estimate there and on its own best worker at that moment, what happened); it walks every
    worker's tree once per request, so a recorded run is slower, and its decisions are the same.
    """
    loop = VirtualClockLoop()
    try:
        with _simulator_clock(loop):
            return loop.run_until_complete(
                _run(policy, workload, fleet, options or {}, poll_interval_s, event_delay_s, record)
            )
    finally:
        loop.close()


def virtual_fleet_of(fleet: Fleet, workers: int | None = None) -> Fleet:
    """``fleet`` at the profiles' own GPU speed, resized to ``workers`` (its profiles cycled over them)."""
    size = workers or fleet.workers
    name = fleet.name if size == fleet.workers else f"{fleet.name} x{size // fleet.workers or 1} ({size} workers)"
    return Fleet(name, fleet.profile, size, 1.0, fleet.capacity_tokens)


_KNEES: dict[tuple[str, Fleet, int, int], float] = {}


def virtual_knee(workload: str, fleet: Fleet, options: MatrixOptions) -> float:
    """Round robin's capacity (req/s at which its prefill time fills the fleet), as the matrix measures it.

    Measured once per workload, fleet and size in a process (the loads of one cell share it).
    """
    key = (workload, fleet, options.requests, options.seed)
    if key not in _KNEES:
        _KNEES[key] = _measure_knee(workload, fleet, options)
    return _KNEES[key]


def _measure_knee(workload: str, fleet: Fleet, options: MatrixOptions) -> float:
    rate = 2.0 * fleet.workers
    for _ in range(4):
        result = run_virtual("round-robin", WORKLOADS[workload](rate, options), fleet)
        utilization = result.prefill_busy_s / (result.duration_s * fleet.workers)
        if 0.15 <= utilization <= 0.7:
            break
        rate *= min(4.0, max(0.25, 0.4 / max(utilization, 1e-3)))
    return rate / max(utilization, 1e-3)


def gap_closed(rr: float, ours: float, floor: float) -> float:
    """Share of round robin's excess over the floor that ``ours`` removes (1: at the floor; above 1: below it)."""
    gap = rr - floor
    return (rr - ours) / gap if gap > 0 else math.nan


def run_cell(
    workload: str,
    fleet: Fleet,
    load: float,
    policies: Sequence[str],
    requests: int,
    seeds: Sequence[int],
    overrides: dict[str, Any] | None = None,
    log: Callable[[str], None] | None = None,
    records: Path | None = None,
) -> dict[str, Any]:
    """One virtual cell: every policy (and the floor) over every seed; figures per seed and their spread.

    ``records``: a folder that gets each run's per-request records as JSON lines (``run_virtual(record=True)``).
    """
    knee = virtual_knee(workload, fleet, MatrixOptions(requests=requests, seed=seeds[0]))
    runs: dict[str, list[dict[str, float]]] = {}
    for seed in seeds:
        workload_run = WORKLOADS[workload](load * knee, MatrixOptions(requests=requests, seed=seed))
        oracle = oracle_hit_rate(
            iter_token_ids(workload_run.requests),
            fleet.workers * fleet.capacity_tokens,
            16,
            max_prompt_tokens=fleet.capacity_tokens,
        )
        for policy in policies:
            started = time.monotonic()
            opts = overrides if policy == "prefix-aware" else None
            result = run_virtual(policy, workload_run, fleet, opts, record=records is not None)
            if records is not None:
                records.mkdir(parents=True, exist_ok=True)
                name = f"{fleet.workers}w-{workload}-{load:g}x-seed{seed}-{policy}.jsonl"
                (records / name).write_text("".join(json.dumps(r) + "\n" for r in result.records))
            s = result.summary(fleet.workers)
            ttft = s["ttft_s"]
            runs.setdefault(policy, []).append(
                {
                    "mean": ttft["mean"],
                    "p50": ttft["p50"],
                    "p90": ttft["p90"],
                    "p99": ttft["p99"],
                    "hit_vs_oracle": s["hit_rate"] / oracle if oracle > 0 else math.nan,
                    "max_mean": s["max_mean_requests"],
                    "prefill_busy_s": s["prefill_busy_s"],
                    "errors": s["errors"],
                }
            )
            if log is not None:
                log(
                    f"  {fleet.name} {workload} {load:g}x seed {seed} {policy}: mean {ttft['mean'] * 1000:.0f} "
                    f"p99 {ttft['p99'] * 1000:.0f} ms ({time.monotonic() - started:.0f} s wall)"
                )
    cell: dict[str, Any] = {
        "fleet": fleet.name,
        "workers": fleet.workers,
        "workload": workload,
        "load": load,
        "knee": knee,
        "rate": load * knee,
        "requests": requests,
        "seeds": list(seeds),
        "runs": runs,
    }
    for prefix, reference in (("", FLOOR), ("blind_", FLOOR_PHASE_BLIND)):
        if {"round-robin", reference, "prefix-aware"} <= set(runs):
            for metric in ("mean", "p99"):
                cell[f"{prefix}gap_closed_{metric}"] = [
                    gap_closed(rr[metric], ours[metric], fl[metric])
                    for rr, ours, fl in zip(runs["round-robin"], runs["prefix-aware"], runs[reference])
                ]
    return cell


def _spread(values: Sequence[float], scale: float = 1.0, digits: int = 0) -> str:
    """Mean over seeds, and the range across them."""
    ok = [v * scale for v in values if not math.isnan(v)]
    if not ok:
        return "-"
    mean = sum(ok) / len(ok)
    return f"{mean:.{digits}f} ({min(ok):.{digits}f}-{max(ok):.{digits}f})" if len(ok) > 1 else f"{mean:.{digits}f}"


def cell_markdown(cell: dict[str, Any]) -> list[str]:
    """One cell's rows: each policy's TTFT mean / p50 / p99 (ms) and hit rate, mean (range) over seeds."""
    lines = []
    closed = ""
    if "gap_closed_mean" in cell:
        closed = (
            f"; prefix-aware closes {_spread(cell['gap_closed_mean'], 100)} % of the round-robin-to-floor gap "
            f"in mean TTFT, {_spread(cell['gap_closed_p99'], 100)} % in p99"
        )
    if "blind_gap_closed_mean" in cell:
        closed += (
            f"; of the gap to the phase-blind floor, {_spread(cell['blind_gap_closed_mean'], 100)} % in mean, "
            f"{_spread(cell['blind_gap_closed_p99'], 100)} % in p99"
        )
    lines.append(
        f"**{cell['fleet']}, {cell['workload']}, {cell['load']:g} x knee ({cell['rate']:.2f} req/s)**, "
        f"{cell['requests']} requests x seeds {cell['seeds']}{closed}"
    )
    lines.append("")
    lines.append("| policy | TTFT mean ms | p50 ms | p99 ms | hit / oracle | max/mean req |")
    lines.append("|---|---|---|---|---|---|")
    for policy, runs in cell["runs"].items():

        def col(key: str, scale: float = 1000.0, digits: int = 0) -> str:
            return _spread([r[key] for r in runs], scale, digits)  # noqa: B023 (used at once)

        lines.append(
            f"| {policy} | {col('mean')} | {col('p50')} | {col('p99')} | {col('hit_vs_oracle', 1, 2)} "
            f"| {col('max_mean', 1, 2)} |"
        )
    lines.append("")
    return lines


TARGETS = {"mean": 0.9, "p99": 0.8}  # the share of the round-robin-to-floor gap ours must close (issue 22)


def meets_targets(cell: dict[str, Any]) -> bool:
    """The issue's virtual-fleet target: >= 90 % of the gap closed in mean TTFT and >= 80 % in p99 (seed mean).

    A figure where no seed has a gap (the greedy floor at or above round robin, as with bursts queued on
    their holders) is judged by the same inequality written as a bound, ``ours <= rr - share * (rr - floor)``,
    on the seeds' means: with the floor above round robin that asks ours to be below a point between the two.
    """
    if "gap_closed_mean" not in cell:
        return False
    runs = cell["runs"]
    for metric, share in TARGETS.items():
        closed = [v for v in cell[f"gap_closed_{metric}"] if not math.isnan(v)]
        if closed:
            if sum(closed) / len(closed) < share:
                return False
            continue
        rr, ours, floor = (
            sum(r[metric] for r in runs[p]) / len(runs[p]) for p in ("round-robin", "prefix-aware", FLOOR)
        )
        if ours > rr - share * (rr - floor):
            return False
    return True


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.virtual_fleet",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--workloads", default="gsp", help=f"Comma-separated subset of: {', '.join(WORKLOADS)}.")
    parser.add_argument("--fleets", default="4x8b-h100", help=f"Comma-separated subset of: {', '.join(FLEETS)}.")
    parser.add_argument(
        "--sizes", default="", help="Fleet sizes to run each fleet at, e.g. 4,16,64 (empty: the fleet's own)."
    )
    parser.add_argument("--loads", default="0.5,1.3", help="Offered loads as multiples of round robin's knee.")
    parser.add_argument(
        "--policies",
        default=f"round-robin,sgl-cache-aware,dynamo-cost,prefix-aware,{FLOOR}",
        help=f"Router policies, '{FLOOR}' (the perfect-information reference) and '{FLOOR_PHASE_BLIND}' (the "
        "same, blind to the phase of the decode step under way, which no router sees).",
    )
    parser.add_argument("--requests", type=int, default=1000, help="Requests per run.")
    parser.add_argument("--seeds", default="0,1,2", help="Comma-separated seeds; tables show mean (range).")
    parser.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="An option of the prefix-aware policy (repeatable), e.g. max_work_price=10.",
    )
    parser.add_argument("--out", type=Path, default=None, help="Write cells as JSON lines here (appended per cell).")
    parser.add_argument(
        "--records",
        type=Path,
        default=None,
        metavar="DIR",
        help="Write every run's per-request records here, one JSON-lines file a run: the worker chosen and why, "
        "the policy's predicted TTFT, the floor's estimate there and on its best worker at that moment, the "
        "cache found then and at admission, the TTFT (slower: the floor's view is computed per request).",
    )
    args = parser.parse_args(argv)
    seeds = [int(x) for x in args.seeds.split(",")]
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    overrides: dict[str, Any] = {}
    for item in args.option:
        key, _, value = item.partition("=")
        overrides[key] = float(value)
    unknown = [f for f in args.fleets.split(",") if f not in FLEETS] + [
        w for w in args.workloads.split(",") if w not in WORKLOADS
    ]
    if unknown:
        parser.error(f"unknown fleet or workload: {', '.join(unknown)}")
    sizes = [int(x) for x in args.sizes.split(",") if x.strip()] or [0]
    met = total = 0
    for fleet_name in args.fleets.split(","):
        for size in sizes:
            fleet = virtual_fleet_of(FLEETS[fleet_name], size or None)
            for workload in args.workloads.split(","):
                for load in (float(x) for x in args.loads.split(",")):
                    cell = run_cell(
                        workload, fleet, load, policies, args.requests, seeds, overrides, _stderr, args.records
                    )
                    print("\n".join(cell_markdown(cell)), flush=True)
                    total += 1
                    met += meets_targets(cell)
                    if args.out is not None:
                        with args.out.open("a") as out:
                            out.write(json.dumps(cell) + "\n")
    if FLOOR in policies and "prefix-aware" in policies and "round-robin" in policies:
        print(f"Cells where prefix-aware closes >= 90 % (mean) and >= 80 % (p99) of the gap: {met} of {total}.")
    return 0


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())

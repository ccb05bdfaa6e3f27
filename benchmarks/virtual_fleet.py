"""A whole fleet in one process on a virtual clock: the real router, real simulated workers, no wall time.

``prefix-router bench`` runs every part as its own process over real sockets, which is the measurement
that counts; on a small shared machine it is also slow and its figures carry the machine's noise. This
harness runs the same code paths deterministically and faster than real time, for exploring policies:

- every worker is the simulator's own ``Scheduler`` + ``RadixCache`` (same batching, same timing
  profile, same KV events, same ``/v1/loads`` figures), with ``--speedup 1``: the GPU of the profile;
- the router is ``extproc.router.Router`` with the chosen policy; the workers' KV events reach its
  index through ``WorkerCacheView`` (encoded and decoded as on the wire, after ``event_delay_s``), and
  their load reports every ``poll_interval_s``;
- the asyncio event loop's clock is virtual: when nothing is ready it jumps to the next timer, so a
  10-minute trace runs in seconds and two runs with one seed give the same numbers.

Only the router's own CPU time is missing (decisions take no virtual time): at GPU time scales it is
a millisecond or two per request, which the real benchmark measures (``--suite overhead``). Peers run
as this project's re-implementations of their policies (``sgl-cache-aware``, ``dynamo-cost``, ...),
not their binaries. ``python -m benchmarks.virtual_fleet --help``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import selectors
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from benchmarks.matrix import FLEETS, LOADS, WORKLOADS, Fleet, MatrixOptions
from benchmarks.metrics import distribution, max_over_mean
from benchmarks.oracle import oracle_hit_rate
from benchmarks.workloads import Workload, iter_token_ids
from extproc.config import EventsConfig, RouterConfig
from extproc.request import ParsedRequest
from extproc.router import Router
from extproc.sync.cache_view import WorkerCacheView
from extproc.sync.load import parse_loads
from extproc.sync.workers import Worker, WorkerRegistry
from sglang_workers.sim.config import SimWorkerConfig
from sglang_workers.sim.kv_events import KVEvent, encode_payload
from sglang_workers.sim.radix_cache import RadixCache
from sglang_workers.sim.scheduler import Scheduler
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


@contextlib.contextmanager
def _virtual_monotonic(loop: VirtualClockLoop) -> Iterator[None]:
    """``time.monotonic`` reads the virtual clock (the scheduler, the index and the policy call it)."""
    real = time.monotonic
    time.monotonic = loop.time
    try:
        yield
    finally:
        time.monotonic = real


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


async def _run(
    policy: str, workload: Workload, fleet: Fleet, options: dict[str, Any], poll_interval_s: float, event_delay_s: float
) -> VirtualResult:
    loop = asyncio.get_running_loop()
    names = fleet.profile.split(",")
    workers = [
        Worker(id=f"w{i}", url=f"http://10.0.0.{i + 1}:30000", ip=f"10.0.0.{i + 1}", port=30000)
        for i in range(fleet.workers)
    ]
    config = RouterConfig(
        events=EventsConfig(enabled=False),
        policy={"name": policy, policy.replace("-", "_"): options} if options else {"name": policy},
    )
    router = Router(config, WorkerRegistry(workers))
    schedulers: dict[str, Scheduler] = {}
    for i, worker in enumerate(workers):
        profile = get_profile(names[i % len(names)].strip())
        cfg = SimWorkerConfig(
            page_size=16, capacity_tokens=fleet.capacity_tokens, profile=profile.name, speedup=1.0, kv_events=True
        )
        view = WorkerCacheView(worker.id, router.index, model=lambda: "", clock=loop.time)
        router.events.views[worker.id] = [view]  # what the hub would hold: the router reads the view's state
        cache = RadixCache(cfg.page_size, enable_events=True)
        publisher: Any = _DirectPublisher(view, event_delay_s)  # duck-types KVEventPublisher.publish
        scheduler = Scheduler(cfg, profile, cache, publisher, list(range(1000, 5000)))
        scheduler.start()
        schedulers[worker.id] = scheduler
    result = VirtualResult(policy, workload.offered_rate)
    stop = asyncio.Event()
    # What each worker computes from the request (whether or not the policy tokenizes).
    prompts = dict(zip((r.index for r in workload.requests), iter_token_ids(workload.requests)))

    async def poll() -> None:
        while not stop.is_set():
            for worker in workers:
                load = parse_loads({"loads": [schedulers[worker.id].load()]})
                if load is not None:
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
        )
        sent = loop.time()
        outcome = router.route(parsed)
        try:
            tokens = prompts[request.index]
            req = schedulers[outcome.worker.id].submit(tokens, request.max_tokens)
            first = await req.updates.get()
            if first is None or req.error:
                result.errors += 1
                return
            result.ttft_s.append(loop.time() - sent)
            while await req.updates.get() is not None:
                pass
            result.prompt_tokens += len(tokens)
            result.cached_tokens += max(req.cached_tokens, 0)
            result.per_worker[outcome.worker.id] = result.per_worker.get(outcome.worker.id, 0) + 1
        finally:
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
) -> VirtualResult:
    """Run ``workload`` through ``policy`` on a virtual ``fleet`` (GPU time, no wall time)."""
    loop = VirtualClockLoop()
    try:
        with _virtual_monotonic(loop):
            return loop.run_until_complete(_run(policy, workload, fleet, options or {}, poll_interval_s, event_delay_s))
    finally:
        loop.close()


def _virtual_fleet(fleet: Fleet) -> Fleet:
    return Fleet(fleet.name, fleet.profile, fleet.workers, 1.0, fleet.capacity_tokens)


def virtual_knee(workload: str, fleet: Fleet, options: MatrixOptions) -> float:
    """Round robin's capacity (req/s at which its prefill time fills the fleet), as the matrix measures it."""
    rate = 2.0 * fleet.workers
    for _ in range(4):
        result = run_virtual("round-robin", WORKLOADS[workload](rate, options), fleet)
        utilization = result.prefill_busy_s / (result.duration_s * fleet.workers)
        if 0.15 <= utilization <= 0.7:
            break
        rate *= min(4.0, max(0.25, 0.4 / max(utilization, 1e-3)))
    return rate / max(utilization, 1e-3)


def _print_table(rows: list[dict[str, Any]], out: Callable[[str], None]) -> None:
    out("| load | policy | TTFT p50 ms | TTFT p99 ms | hit / oracle | max/mean | prefill busy s |")
    out("|---|---|---|---|---|---|---|")
    for row in rows:
        out(
            f"| {row['load']:g} | {row['policy']} | {row['p50'] * 1000:.0f} | {row['p99'] * 1000:.0f} | "
            f"{row['hit_vs_oracle']:.2f} | {row['max_mean']:.2f} | {row['prefill_busy_s']:.1f} |"
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.virtual_fleet",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--workload", choices=list(WORKLOADS), default="gsp")
    parser.add_argument("--fleet", choices=list(FLEETS), default="4x8b-h100")
    parser.add_argument(
        "--loads", default=",".join(f"{x:g}" for x in LOADS), help="Offered loads as multiples of round robin's knee."
    )
    parser.add_argument("--policies", default="round-robin,sgl-cache-aware,dynamo-cost,prefix-aware")
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--seeds", default="0", help="Comma-separated seeds; figures are averaged over them.")
    parser.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="An option of the prefix-aware policy (repeatable), e.g. max_work_price=10.",
    )
    args = parser.parse_args(argv)
    fleet = _virtual_fleet(FLEETS[args.fleet])
    seeds = [int(x) for x in args.seeds.split(",")]
    overrides: dict[str, Any] = {}
    for item in args.option:
        key, _, value = item.partition("=")
        overrides[key] = float(value)
    knee = virtual_knee(args.workload, fleet, MatrixOptions(requests=args.requests, seed=seeds[0]))
    print(f"# {args.workload} on {fleet.name} (virtual, GPU time): round robin's knee {knee:.2f} req/s, seeds {seeds}")
    rows = []
    for load in (float(x) for x in args.loads.split(",")):
        per_policy: dict[str, list[dict[str, float]]] = {}
        for seed in seeds:
            workload = WORKLOADS[args.workload](load * knee, MatrixOptions(requests=args.requests, seed=seed))
            oracle = oracle_hit_rate(
                iter_token_ids(workload.requests),
                fleet.workers * fleet.capacity_tokens,
                16,
                max_prompt_tokens=fleet.capacity_tokens,
            )
            for policy in (p.strip() for p in args.policies.split(",")):
                opts = overrides if policy == "prefix-aware" else {}
                s = run_virtual(policy, workload, fleet, opts).summary(fleet.workers)
                per_policy.setdefault(policy, []).append(
                    {
                        "p50": s["ttft_s"]["p50"],
                        "p99": s["ttft_s"]["p99"],
                        "hit_vs_oracle": s["hit_rate"] / oracle,
                        "max_mean": s["max_mean_requests"],
                        "prefill_busy_s": s["prefill_busy_s"],
                    }
                )
        for policy, runs in per_policy.items():
            rows.append({"load": load, "policy": policy, **{k: sum(r[k] for r in runs) / len(runs) for k in runs[0]}})
    _print_table(rows, print)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``prefix-router bench --suite scale``: the router at fleet scale, what a decision, the sync path and the
memory cost at 16 / 64 / 256 workers (the defaults take ~10 min on 2 cores; ``--parts`` picks some).

Prints, per fleet size (figures, not a test):

- **decision latency**: ``Router.route()`` (the serving app's router, in process) end to end (render,
  tokenize, hash, look up, prune, score, trace) for chat prompts of about 1k / 8k / 32k tokens, cold
  (never seen) and warm (a later turn whose history one worker holds), p50 / p99 in ms, with the shortlist of
  ``policy.max_candidates`` (``extproc/decision/pruning.py``) and, for comparison, with every worker scored
  (the tokenizer's piece cache outlives each fleet's router, so only the first fleet's cold rows
  are cold: compare fleets on the warm columns);
- **event ingestion**: real msgpack ``BlockStored`` batches from one ZMQ publisher per worker (in
  another process) into the router's subscribers (with ``--full-cache`` each batch also removes an
  older one, as a full cache does), blocks stored and removed per second and per CPU-second of the
  router's process (the figure a shared machine does not move), and whether the index then holds
  exactly the blocks stored and not removed (``exact``), with the process's resident-memory growth
  per million blocks stored (index entries plus the engine-hash maps of the event streams);
- **paced ingestion** (with ``--paced-rate N``): the same streams sent on a schedule of N blocks a
  second per publisher (1600: a busy worker, docs/benchmarks.md), as a busy fleet sends them: the
  rate the router applies, its CPU per wall second, and the publish-to-apply lag of its batches;
- **memory per worker**: what the router holds per worker that is not a cache block (registry entry,
  load report, cost model, index slot), measured with ``tracemalloc``, and the index entries per
  million blocks; with the default 256 MiB budget, how many blocks that leaves per worker;
- **pollers' CPU**: the load poller (``/v1/loads`` every ``load.poll_interval_s``) and the health
  checker (``/health`` every ``health.interval_s``) against one light HTTP stand-in per worker (in
  another process, so only the router's side is counted), as CPU seconds per wall second (cores)
  and CPU microseconds per poll.

Every worker is simulated: no SGLang runs. The machine this runs on may be shared; compare figures
of one run with each other, not across runs.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import tracemalloc

from benchmarks.argtypes import names, positive, positive_list
from benchmarks.probes.decisions import decision_latency
from benchmarks.probes.ingestion import Ingestion, event_ingestion
from benchmarks.probes.pollers import poll_cpu
from extproc.config import EventsConfig, HealthConfig, IndexConfig, LoadConfig, PolicyConfig, RouterConfig
from extproc.decision.request import ParsedRequest
from extproc.fleet.index import BlockIndex
from extproc.fleet.reports import WorkerLoad
from extproc.fleet.workers import Worker, WorkerRegistry
from extproc.memory import MemoryPlan
from extproc.serving.app import RouterApp

__all__ = ["configure", "main"]

PARTS = ("decisions", "ingestion", "memory", "pollers")

UNPRUNED = 1_000_000  # max_candidates larger than any fleet: every worker scored


def _fleet(size: int, base_port: int = 41000) -> list[Worker]:
    return [
        Worker(id=f"w{i}", url=f"http://127.0.0.1:{base_port + i}", ip="127.0.0.1", port=base_port + i)
        for i in range(size)
    ]


def print_decisions(fleets: list[int], samples: int, max_candidates: int) -> None:
    print(f"\n== decision latency (ms), prefix-aware, page 16, {samples} conversations x (1 cold + 3 warm turns)")
    print(f"{'workers':>7} {'scored':>8} {'prompt':>6} {'cold p50':>9} {'cold p99':>9} {'warm p50':>9} {'warm p99':>9}")
    warm_p99: dict[tuple[int, str, int], float] = {}
    for fleet in fleets:
        for label, k in (("shortlist", max_candidates), ("all", UNPRUNED)):
            if label == "all" and fleet <= max_candidates:
                continue  # the same decision: nothing is pruned on a fleet this small
            for size, _tokens, (c50, c99), (w50, w99) in decision_latency(samples, fleet, k):
                warm_p99[(fleet, label, size)] = w99
                print(f"{fleet:>7} {label:>8} {size // 1024:>5}k {c50:>9.2f} {c99:>9.2f} {w50:>9.2f} {w99:>9.2f}")
    small, large = min(fleets), max(fleets)
    ratios = [
        f"{size // 1024}k {warm_p99[(large, 'shortlist', size)] / warm_p99[(small, 'shortlist', size)]:.2f}x"
        for size in (1024, 8192, 32768)
        if (large, "shortlist", size) in warm_p99 and (small, "shortlist", size) in warm_p99
    ]
    print(f"warm p99 at {large} workers / at {small} workers (shortlist): {', '.join(ratios)}")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def print_ingestion(fleets: list[int], total_blocks: int, full_cache: bool = False) -> None:
    removed = ", each batch after the 8th removing an older one" if full_cache else ""
    print(f"\n== KV event ingestion, {total_blocks:,} blocks stored in batches of 16 pages x 16 tokens{removed}")
    print(
        f"{'publishers':>10} {'stored':>9} {'removed':>9} {'seconds':>8} {'blocks/s':>10} {'per CPU-s':>10} "
        f"{'exact':>6} {'RSS MiB / M stored':>19}"
    )
    for fleet in fleets:
        gc.collect()
        before = _rss_bytes()
        run = asyncio.run(event_ingestion(fleet, total_blocks, full_cache))
        grown = _rss_bytes() - before
        per_million = grown / max(run.stored, 1) * 1e6 / 2**20
        print(
            f"{fleet:>10} {run.stored:>9,} {run.removed:>9,} {run.seconds:>8.2f} {run.blocks / run.seconds:>10,.0f} "
            f"{run.blocks / max(run.cpu_s, 1e-9):>10,.0f} {_exact(run):>6} {per_million:>19.0f}"
        )


def _exact(run: Ingestion) -> str:
    return "yes" if run.exact else f"no ({run.held} held, {run.expected_held} expected)"


def print_paced_ingestion(fleets: list[int], seconds: float, per_worker: float, full_cache: bool) -> None:
    """The same streams sent on a busy fleet's schedule: does the router keep up, and at what CPU share."""
    removed = ", half of them removals once a cache is full" if full_cache else ""
    print(
        f"\n== KV event ingestion at a busy fleet's rate: {per_worker:,.0f} blocks/s per publisher{removed}, "
        f"~{seconds:g} s per fleet"
    )
    print(
        f"{'publishers':>10} {'offered/s':>10} {'sent/s':>10} {'applied/s':>10} {'seconds':>8} {'router cores':>12} "
        f"{'lag p50 ms':>10} {'lag p99 ms':>10} {'lag max ms':>10} {'exact':>6}"
    )
    for fleet in fleets:
        gc.collect()
        rate = per_worker * fleet
        stored = round(rate * seconds / (2 if full_cache else 1))  # a full cache removes a block per block stored
        run = asyncio.run(event_ingestion(fleet, stored, full_cache, rate=rate))
        sent = run.blocks / run.sent_s if run.sent_s else 0.0
        print(
            f"{fleet:>10} {rate:>10,.0f} {sent:>10,.0f} {run.blocks / run.seconds:>10,.0f} {run.seconds:>8.2f} "
            f"{run.cores:>12.2f} {run.lag_ms(0.5):>10.1f} {run.lag_ms(0.99):>10.1f} {run.lag_ms(1.0):>10.1f} "
            f"{_exact(run):>6}"
        )


def _report(i: int) -> WorkerLoad:
    return WorkerLoad(
        num_running_reqs=i % 7, num_waiting_reqs=i % 3, num_used_tokens=1000, max_total_num_tokens=100_000
    )


def print_memory(fleets: list[int], blocks: int) -> None:
    print("\n== router memory (tracemalloc)")
    per_fleet: dict[int, int] = {}
    for fleet in fleets:
        gc.collect()
        tracemalloc.start()
        workers = _fleet(fleet)
        config = RouterConfig(events=EventsConfig(enabled=False), index=IndexConfig(default_block_size=16))
        app = RouterApp(config, WorkerRegistry(workers))
        router = app.router
        base = tracemalloc.get_traced_memory()[0]
        for i, worker in enumerate(workers):  # what a live fleet adds: a load report, a slot, a cost model
            app.loads.set(worker, _report(i))
            app.index.slot(worker.id)
        for i in range(fleet):  # the shortlist rotates over idle workers: every one gets scored
            parsed = ParsedRequest(path="/generate", kind="generate", model="m", prompt_text=f"request {i}")
            router.finish(router.route(parsed))
        per_fleet[fleet] = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
        del router
    for fleet, used in per_fleet.items():
        print(f"{fleet:>5} workers: {used / fleet:,.0f} bytes per worker outside the cache entries")
    gc.collect()
    tracemalloc.start()
    index = BlockIndex(max_blocks=blocks * 2)
    start = tracemalloc.get_traced_memory()[0]
    fleet = max(fleets)
    per_worker = blocks // fleet
    for w in range(fleet):
        base = (w + 1) << 40
        index.store(f"w{w}", range(base, base + per_worker))
    used = tracemalloc.get_traced_memory()[0] - start
    tracemalloc.stop()
    stored = per_worker * fleet
    plan = MemoryPlan.from_budget(256 * 2**20)
    print(
        f"index: {used / stored * 1e6 / 2**20:,.0f} MiB per million blocks ({used / stored:.0f} bytes per entry, "
        f"{fleet} workers; budgeted at {plan.limits()['index'] / plan.index_blocks:.0f})"
    )
    for fleet in fleets:
        print(
            f"default 256 MiB budget: {plan.index_blocks:,} blocks = "
            f"{plan.index_blocks // fleet:,} per worker at {fleet}"
        )


def print_pollers(fleets: list[int], seconds: float) -> None:
    load, health = LoadConfig(), HealthConfig()
    print(
        f"\n== pollers' CPU: /v1/loads every {load.poll_interval_s} s + /health every {health.interval_s} s "
        "per worker, "
        f"one shared HTTP client, {seconds:.0f} s"
    )
    print(f"{'workers':>7} {'answered':>8} {'router cores':>12} {'us CPU per poll':>15}")
    for fleet in fleets:
        cores, polls, answered = asyncio.run(poll_cpu(fleet, seconds, load, health))
        print(f"{fleet:>7} {answered:>8} {cores:>12.3f} {cores * seconds / max(polls, 1) * 1e6:>15.0f}")


def configure(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("fleets and parts")
    g.add_argument(
        "--fleets", type=positive_list(int), default="16,64,256", help="Comma-separated fleet sizes (workers)."
    )
    g.add_argument(
        "--parts",
        type=names(PARTS),
        default=",".join(PARTS),
        help=f"Which parts to run (comma-separated: {', '.join(PARTS)}).",
    )
    g.add_argument(
        "--samples", type=positive(int), default=20, help="Conversations per prompt size (3 warm turns each)."
    )
    g.add_argument(
        "--max-candidates",
        type=positive(int),
        default=PolicyConfig().max_candidates,
        help="The shortlist measured (policy.max_candidates; default: the config default).",
    )
    g.add_argument("--event-blocks", type=positive(int), default=400_000, help="Blocks published per ingestion run.")
    g.add_argument(
        "--full-cache",
        action="store_true",
        help="Ingestion as a full cache sends it: every batch after a worker's 8th also removes an older one.",
    )
    g.add_argument(
        "--paced-rate",
        type=positive(float),
        default=None,
        metavar="BLOCKS_PER_S",
        help="Also run ingestion paced: each publisher sends this many blocks a second (stored and removed "
        "together; 1600 is the busy worker docs/benchmarks.md derives) and the run reports the lag.",
    )
    g.add_argument(
        "--paced-seconds",
        type=positive(float),
        default=5.0,
        help="How long each paced ingestion run sends (with --paced-rate).",
    )
    g.add_argument(
        "--memory-blocks", type=positive(int), default=1_000_000, help="Blocks stored for the index memory figure."
    )
    g.add_argument("--poll-seconds", type=positive(float), default=10.0, help="How long the pollers run per fleet.")


def main(args: argparse.Namespace) -> int:
    fleets = sorted(set(args.fleets))
    parts = set(args.parts)
    print(f"fleets {fleets}, {os.cpu_count()} CPUs, shortlist policy.max_candidates={args.max_candidates}")
    if "decisions" in parts:
        print_decisions(fleets, args.samples, args.max_candidates)
    if "ingestion" in parts:
        print_ingestion(fleets, args.event_blocks, args.full_cache)
        if args.paced_rate is not None:
            print_paced_ingestion(fleets, args.paced_seconds, args.paced_rate, args.full_cache)
    if "memory" in parts:
        print_memory(fleets, args.memory_blocks)
    if "pollers" in parts:
        print_pollers(fleets, args.poll_seconds)
    return 0

"""``prefix-router bench --suite poll-cost``: the router's CPU per load poll of one worker, with and without
the prefill-batch count (prints figures).

Each poll reads ``/v1/loads``; with ``load.read_prefill_batches`` (the default) it also reads the
worker's ``/metrics`` page at the same moment for its count of prefill batches (``extproc/sync/load.py``).
This starts ``--workers`` simulated workers (real HTTP servers, separate processes, a ``/metrics``
page the size of SGLang 0.5.23's) and times the router process's CPU over ``--polls`` rounds of
both settings, twice each, alternating. CPU seconds, not wall time, so the figure holds on a shared
machine. Multiply by workers x polls per second (``load.poll_interval_s``, 0.5 s) for a fleet.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections.abc import Sequence

from benchmarks.argtypes import positive
from extproc.config import LoadConfig
from extproc.fleet.workers import Worker, WorkerRegistry
from extproc.sync.http import WorkerHttp
from extproc.sync.load import LoadTracker
from prefix_router.fleet import start_fleet

__all__ = ["configure", "main", "poll_cpu_s"]


async def poll_cpu_s(workers: Sequence[Worker], read_prefill_batches: bool, polls: int) -> float:
    """Router CPU seconds per worker per poll, after two warm-up rounds (path discovery, connections)."""
    http = WorkerHttp()
    try:
        tracker = LoadTracker(
            LoadConfig(read_prefill_batches=read_prefill_batches), WorkerRegistry(list(workers)), http
        )
        for _ in range(2):
            await tracker.poll_once()
        started = time.process_time()
        for _ in range(polls):
            await tracker.poll_once()
        return (time.process_time() - started) / polls / len(workers)
    finally:
        await http.close()


def configure(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("polls")
    g.add_argument("--workers", type=positive(int), default=4, help="Simulated workers to poll.")
    g.add_argument("--polls", type=positive(int), default=60, help="Poll rounds timed per setting and repeat.")


def main(args: argparse.Namespace) -> int:
    with contextlib.ExitStack() as stack:
        procs = [stack.enter_context(p) for p in start_fleet("sim", args.workers)]
        workers = [Worker(id=f"w{i}", url=p.url, ip="127.0.0.1", port=p.port) for i, p in enumerate(procs)]
        figures: dict[bool, list[float]] = {False: [], True: []}
        for read in (False, True, False, True):
            figures[read].append(asyncio.run(poll_cpu_s(workers, read, args.polls)))
    for read, label in ((False, "/v1/loads only"), (True, "/v1/loads + /metrics (prefill batches)")):
        values = ", ".join(f"{v * 1e3:.2f}" for v in figures[read])
        print(f"{label}: {values} ms of router CPU per worker poll")
    return 0

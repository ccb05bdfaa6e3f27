"""What the router's pollers cost in this process: ``/v1/loads`` and ``/health`` against N light stand-ins.

One light HTTP stand-in per worker runs in another process (one aiohttp app on N ports), so only the
router's side is counted: the load poller (``/v1/loads`` every ``load.poll_interval_s``) and the health
checker (``/health`` every ``health.interval_s``) run for a while and their CPU seconds per wall second
are read from this process. Used by ``--suite scale``.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time
from typing import Any

from extproc.config import HealthConfig, LoadConfig
from extproc.fleet.workers import Worker, WorkerRegistry
from extproc.sync.health import HealthChecker
from extproc.sync.http import WorkerHttp
from extproc.sync.load import LoadTracker
from prefix_common.addresses import free_ports

__all__ = ["poll_cpu"]


async def _serve_stand_ins(ports: list[int], ready: Any, stop: Any) -> None:
    from aiohttp import web

    loads = {
        "loads": [
            {
                "dp_rank": 0,
                "num_running_reqs": 3,
                "num_waiting_reqs": 1,
                "num_used_tokens": 5000,
                "max_total_num_tokens": 100000,
                "token_usage": 0.05,
                "gen_throughput": 900.0,
            }
        ]
    }

    async def v1_loads(_request: web.Request) -> web.Response:
        return web.json_response(loads)

    async def health(_request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/v1/loads", v1_loads)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    for port in ports:
        await web.TCPSite(runner, "127.0.0.1", port).start()
    ready.set()
    while not stop.is_set():
        await asyncio.sleep(0.1)
    await runner.cleanup()


def _stand_ins(ports: list[int], ready: Any, stop: Any) -> None:
    asyncio.run(_serve_stand_ins(ports, ready, stop))


async def poll_cpu(fleet: int, seconds: float, load: LoadConfig, health: HealthConfig) -> tuple[float, int, int]:
    """(router cores, polls made, workers that answered) for ``fleet`` workers polled for ``seconds``."""
    ports = free_ports(fleet)
    workers = [Worker(id=f"w{i}", url=f"http://127.0.0.1:{p}", ip="127.0.0.1", port=p) for i, p in enumerate(ports)]
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    server = ctx.Process(target=_stand_ins, args=(ports, ready, stop), daemon=True)
    server.start()
    await asyncio.get_running_loop().run_in_executor(None, ready.wait)
    registry = WorkerRegistry(workers)
    http = WorkerHttp()
    loads = LoadTracker(load, registry, http)
    checker = HealthChecker(registry, health, http)
    await checker.start()
    await loads.poll_once()  # connections open, paths known: the steady state is what is measured
    polled = {w.id: loads.get(w) for w in workers}
    await loads.start()
    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.sleep(seconds)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    await loads.stop()
    await checker.stop()
    await http.close()
    stop.set()
    server.join(5)
    answered = sum(1 for v in polled.values() if v is not None)
    polls = int(wall / load.poll_interval_s) * fleet + int(wall / health.interval_s) * fleet
    return cpu / wall, polls, answered

"""Worker health: probe each worker, move workers in and out of the candidate set.

Two probes, because SGLang's cheap one cannot see a hung scheduler and its thorough one is slow:

* readiness, once, when the router starts: ``/ready`` is a flag in SGLang (200 once warm-up is over,
  503 while starting or after a failed ``/health``), so the router is up in milliseconds;
* liveness, in the background: ``/health`` (= ``/health_generate``) pushes a one-token generation
  through the scheduler and answers after 1 s at the earliest, so each worker has its own probe loop
  (one slow worker never delays another's check) and the timeout is several seconds.

Thresholds from ``HealthConfig`` decide when a worker leaves (consecutive failures) and returns
(consecutive successes). A worker that joins or rejoins is asked what it serves
(``extproc.sync.discovery``) before it becomes a candidate: it may have restarted with other
settings.
"""

from __future__ import annotations

import asyncio

import aiohttp

from extproc.config import HealthConfig
from extproc.fleet.workers import Worker, WorkerRegistry
from extproc.sync.discovery import discover
from extproc.sync.http import WorkerHttp

__all__ = ["HealthChecker"]


class HealthChecker:
    """Probes every worker: readiness once at ``start``, then liveness every ``interval_s``, thresholds applied."""

    def __init__(self, registry: WorkerRegistry, config: HealthConfig, http: WorkerHttp) -> None:
        self.registry = registry
        self.config = config
        self.http = http
        self._fails: dict[Worker, int] = {}
        self._oks: dict[Worker, int] = {}
        self._no_ready_path: set[Worker] = set()  # workers that answered ``ready_path`` with 404
        self._loops: dict[Worker, asyncio.Task[None]] = {}

    async def start(self) -> None:
        """Check every worker's readiness once (a dead worker is never routed to at start-up), then poll."""
        results = await asyncio.gather(*(self._probe_ready(w) for w in self.registry.workers))
        for worker, ok in zip(self.registry.workers, results):
            if ok:
                await self._discover(worker)
            self.registry.set_healthy(worker, ok)
        self._follow(joined=False)
        self.registry.listeners.append(self._follow)

    def _follow(self, joined: bool = True) -> None:
        """One probe loop per worker of the registry (workers join and leave: ``extproc.sync.sources``).

        A worker that joined later is checked for readiness at once, so it need not wait a liveness round.
        """
        current = set(self.registry.workers)
        for worker in [w for w in self._loops if w not in current]:
            self._loops.pop(worker).cancel()
            for state in (self._fails, self._oks):
                state.pop(worker, None)
            self._no_ready_path.discard(worker)
        for worker in self.registry.workers:
            if worker not in self._loops:
                self._loops[worker] = asyncio.create_task(self._loop(worker, joined), name=f"worker-health-{worker.id}")

    async def stop(self) -> None:
        if self._follow in self.registry.listeners:
            self.registry.listeners.remove(self._follow)
        tasks = list(self._loops.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._loops = {}

    async def _loop(self, worker: Worker, joined: bool = False) -> None:
        if joined and await self._probe_ready(worker):
            await self._discover(worker)
            self.registry.set_healthy(worker, True)
        while True:
            await asyncio.sleep(self.config.interval_s)
            await self.check(worker)

    async def check(self, worker: Worker) -> None:
        """One liveness probe, applied through the consecutive-result thresholds."""
        ok = await self._probe(worker, self.config.path)
        if ok:
            self._fails[worker] = 0
            self._oks[worker] = self._oks.get(worker, 0) + 1
            if not worker.healthy and self._oks[worker] >= self.config.healthy_after:
                await self._discover(worker)  # it may have restarted with other settings
                self.registry.set_healthy(worker, True)
        else:
            self._oks[worker] = 0
            self._fails[worker] = self._fails.get(worker, 0) + 1
            if worker.healthy and self._fails[worker] >= self.config.unhealthy_after:
                self.registry.set_healthy(worker, False, "failed liveness probes", may_still_serve=True)

    async def _discover(self, worker: Worker) -> None:
        await discover(self.http, worker, self.config.timeout_s)

    async def _probe_ready(self, worker: Worker) -> bool:
        """Readiness: ``ready_path`` where the worker has one, else the liveness path."""
        ready_path = self.config.ready_path
        if ready_path is not None and worker not in self._no_ready_path:
            status = await self._status(worker, ready_path)
            if status != 404:
                return status == 200
            self._no_ready_path.add(worker)
        return await self._probe(worker, self.config.path)

    async def _probe(self, worker: Worker, path: str) -> bool:
        return await self._status(worker, path) == 200

    async def _status(self, worker: Worker, path: str) -> int | None:
        """HTTP status of ``GET path``; None when the worker did not answer in time."""
        try:
            async with self.http.get(worker.url + path, self.config.timeout_s) as response:
                return response.status
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return None

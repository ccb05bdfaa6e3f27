"""Worker health: poll ``/health``, move workers in and out of the candidate set.

Thresholds from ``HealthConfig`` decide when a worker leaves (consecutive failures) and returns
(consecutive successes). A worker that joins or rejoins is asked what it serves
(``extproc.sync.discovery``) before it becomes a candidate: it may have restarted with other
settings.
"""

from __future__ import annotations

import asyncio

import aiohttp

from extproc.config import HealthConfig
from extproc.sync.discovery import discover
from extproc.sync.workers import Worker, WorkerRegistry

__all__ = ["HealthChecker"]


class HealthChecker:
    """Polls each worker's ``/health`` every ``interval_s`` and applies the thresholds."""

    def __init__(self, registry: WorkerRegistry, config: HealthConfig) -> None:
        self.registry = registry
        self.config = config
        self._fails: dict[Worker, int] = {}
        self._oks: dict[Worker, int] = {}
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Check every worker once (so a dead worker is never routed to at start-up), then poll."""
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.config.timeout_s))
        results = await asyncio.gather(*(self._probe(w) for w in self.registry.workers))
        for worker, ok in zip(self.registry.workers, results):
            if ok:
                await discover(self._session, worker)
            self.registry.set_healthy(worker, ok)
        self._task = asyncio.create_task(self._loop(), name="worker-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval_s)
            await asyncio.gather(*(self.check(w) for w in self.registry.workers))

    async def check(self, worker: Worker) -> None:
        """One health probe, applied through the consecutive-result thresholds."""
        ok = await self._probe(worker)
        if ok:
            self._fails[worker] = 0
            self._oks[worker] = self._oks.get(worker, 0) + 1
            if not worker.healthy and self._oks[worker] >= self.config.healthy_after:
                assert self._session is not None
                await discover(self._session, worker)  # it may have restarted with other settings
                self.registry.set_healthy(worker, True)
        else:
            self._oks[worker] = 0
            self._fails[worker] = self._fails.get(worker, 0) + 1
            if worker.healthy and self._fails[worker] >= self.config.unhealthy_after:
                self.registry.set_healthy(worker, False)

    async def _probe(self, worker: Worker) -> bool:
        assert self._session is not None
        try:
            async with self._session.get(worker.url + "/health") as response:
                return response.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

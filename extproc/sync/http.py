"""The sync path's HTTP plumbing: one client for every worker request, one shape for every poll loop.

Health probes, load and tier polls, discovery and the fleet metrics view all talk to the same
workers. One ``aiohttp`` session means one connection pool (keep-alive connections are reused
across the pollers instead of each opening its own), one place for limits and timeouts, and one
thing to close. Each caller still sets its own timeout per request: a ``/health`` probe may take
seconds on SGLang, a ``/v1/loads`` poll must not.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import aiohttp

from prefix_common.tasks import cancel_and_wait

__all__ = ["Poller", "WorkerHttp"]

log = logging.getLogger(__name__)


class WorkerHttp:
    """One ``aiohttp`` session to the workers, created on first use (inside the event loop).

    Whoever creates a ``WorkerHttp`` closes it; components handed one only use it.
    """

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # limit=0: a fleet of hundreds of workers is polled concurrently; aiohttp's default pool of 100
            # connections would queue the polls of the rest behind slow /health probes.
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        return self._session

    def get(self, url: str, timeout_s: float) -> aiohttp.client._RequestContextManager:
        """``GET url`` bounded by ``timeout_s`` in total (connect, headers and body)."""
        return self.session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class Poller:
    """Runs ``poll_once`` every ``interval_s`` in one background task until ``stop``.

    A round that raises is logged and the next round runs: a poll loop of the sync path must never die.
    """

    def __init__(
        self, name: str, interval_s: float, poll_once: Callable[[], Awaitable[None]], wait_first: bool = False
    ) -> None:
        self.name = name
        self.interval_s = interval_s
        self._poll_once = poll_once
        self._wait_first = wait_first  # the owner ran a round itself before starting the loop
        self._task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self._task is not None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=self.name)

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    async def _run(self) -> None:
        if self._wait_first:
            await asyncio.sleep(self.interval_s)
        while True:
            try:
                await self._poll_once()
            except Exception:
                log.exception("%s: poll failed; the next round retries", self.name)
            await asyncio.sleep(self.interval_s)

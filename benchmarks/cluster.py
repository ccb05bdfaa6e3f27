"""A fresh cluster of simulated SGLang workers for one contender.

Every contender gets its own cluster built from the same ``ClusterSpec``: same number of workers,
timing profile, speed-up, KV capacity, page size and seed. Caches therefore start cold and
identical, and nothing one contender did (cached prefixes, queued work) leaks into the next one's
numbers. All workers share one seed: a worker's output depends only on the prompt and the seed, so
a request produces the same tokens whichever worker a contender sends it to. Every worker serves
both front doors, the HTTP API (``urls``) and SGLang's gRPC scheduler API (``grpc_urls``), so the
clusters stay identical whichever one a contender talks to.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from typing import Any

import aiohttp

__all__ = ["Cluster", "ClusterError", "ClusterSpec"]

_REQUESTS_TOTAL = re.compile(r"^sglang:num_requests_total(?:\{[^}]*\})?\s+([0-9.eE+-]+)\s*$", re.MULTILINE)


class ClusterError(RuntimeError):
    """The workers could not be started (the message carries the worker's own error)."""


@dataclass(frozen=True)
class ClusterSpec:
    """Everything that makes two clusters identical."""

    workers: int
    profile: str
    speedup: float
    capacity_tokens: int
    page_size: int
    seed: int


class Cluster:
    """N sim-worker processes on free loopback ports; ``stop()`` always kills them."""

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self._workers: list[Any] = []

    @property
    def urls(self) -> list[str]:
        return [str(w.url) for w in self._workers]

    @property
    def grpc_urls(self) -> list[str]:
        """``grpc://`` addresses of the workers' gRPC scheduler API."""
        return [str(w.grpc_url) for w in self._workers]

    async def start(self) -> None:
        from sglang_workers.process import SimWorkerError, start_sim_workers

        try:
            self._workers = await asyncio.to_thread(
                start_sim_workers,
                self.spec.workers,
                profile=self.spec.profile,
                speedup=self.spec.speedup,
                capacity_tokens=self.spec.capacity_tokens,
                page_size=self.spec.page_size,
                seed=self.spec.seed,
                log_level="warning",
                grpc=True,
            )
        except (SimWorkerError, OSError) as exc:  # reported in the contender's row
            raise ClusterError(str(exc)[-1000:]) from None

    @property
    def kv_events_endpoints(self) -> list[str]:
        return [str(w.kv_events_endpoint) for w in self._workers]

    async def served_model(self) -> str | None:
        """The model name the workers serve (``/v1/models``), which clients put in ``model``."""
        if not self._workers:
            return None
        try:
            async with (
                aiohttp.ClientSession() as session,
                session.get(f"{self._workers[0].url}/v1/models", timeout=aiohttp.ClientTimeout(total=5)) as resp,
            ):
                data = await resp.json()
            return str(data["data"][0]["id"])
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, IndexError, TypeError):
            return None

    async def request_counts(self) -> dict[str, int]:
        """Requests each worker processed (``sglang:num_requests_total``); {} if they do not say."""
        counts: dict[str, int] = {}
        async with aiohttp.ClientSession() as session:
            for worker in self._workers:
                try:
                    async with session.get(f"{worker.url}/metrics", timeout=aiohttp.ClientTimeout(total=5)) as resp:
                        text = await resp.text()
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    return {}
                match = _REQUESTS_TOTAL.search(text)
                if match is None:
                    return {}
                counts[str(worker.url)] = int(float(match.group(1)))
        return counts

    async def stop(self) -> None:
        workers, self._workers = self._workers, []
        for worker in workers:
            await asyncio.to_thread(worker.stop)

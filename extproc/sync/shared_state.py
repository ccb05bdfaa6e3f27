"""Router replicas share their unconfirmed decisions through Redis (or Valkey) pub/sub.

Every replica learns what the workers cache from the workers' own KV events, so confirmed state
converges without help. What a replica cannot see is another replica's decision that the worker has
not confirmed yet (``BlockStored`` comes after the prefill): requests sharing a prefix that arrive in
that window, spread over replicas, can land on different workers. Here each replica publishes every
decision (worker id + the prompt's block keys) on one channel, and every other replica enters it in
its index exactly like its own decisions (``BlockIndex.record_routed``: same TTL, same expiry).

Lookups stay local and the request path never waits for Redis: ``publish()`` only queues; a writer
task sends in batches. With Redis down, replicas keep routing on their own state (logged once,
reconnected with back-off), as without this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Sequence
from typing import Any

import msgpack
from prometheus_client import CollectorRegistry, Counter

from extproc.config import SharedStateConfig
from extproc.fleet.index import BlockIndex

__all__ = ["SharedDecisions"]

log = logging.getLogger(__name__)


class SharedDecisions:
    """Publishes this replica's decisions and applies the other replicas' to ``index``."""

    def __init__(
        self,
        config: SharedStateConfig,
        index: BlockIndex,
        replica_id: str | None = None,
        metrics: CollectorRegistry | None = None,
        max_keys: int = 500_000,
    ) -> None:
        self.config = config
        self.index = index
        self.max_keys = max_keys  # block keys waiting to be published (memory.budget_bytes's share)
        self.queued_keys = 0
        self._counter = Counter(
            "prefix_router_shared_decisions_total",
            "Unconfirmed decisions shared between router replicas, by direction (published, received, dropped).",
            ["direction"],
            registry=metrics if metrics is not None else CollectorRegistry(),
        )
        # Unique per process: a replica must skip its own messages (it recorded them already).
        self.replica_id = replica_id or f"{socket.gethostname()}:{os.getpid()}:{id(self):x}"
        self._queue: asyncio.Queue[tuple[str, list[int]]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._client: Any = None  # redis.asyncio.Redis once started
        self.subscribed = asyncio.Event()

    async def start(self) -> None:
        import redis.asyncio as redis  # imported here: only deployments that share state need it

        self._client = redis.Redis.from_url(
            self.config.url, socket_timeout=self.config.timeout_s, socket_connect_timeout=self.config.timeout_s
        )
        self._tasks = [
            asyncio.create_task(self._write_loop(), name="shared-state-writer"),
            asyncio.create_task(self._read_loop(), name="shared-state-reader"),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []
        if self._client is not None:
            with contextlib.suppress(Exception):
                await self._client.aclose()
            self._client = None

    def publish(self, worker_id: str, keys: Sequence[int]) -> None:
        """Queue one decision for the other replicas; never blocks (past ``max_keys`` queued, it is dropped)."""
        if self.queued_keys + len(keys) > self.max_keys:
            self._counter.labels("dropped").inc()
            return
        self.queued_keys += len(keys)
        self._queue.put_nowait((worker_id, list(keys)))

    async def _write_loop(self) -> None:
        channel = self.config.channel
        failing = False
        while True:
            batch = [await self._queue.get()]
            while not self._queue.empty() and len(batch) < 256:
                batch.append(self._queue.get_nowait())
            self.queued_keys -= sum(len(keys) for _, keys in batch)
            payload = msgpack.packb([self.replica_id, batch], use_bin_type=True)
            try:
                await self._client.publish(channel, payload)
            except Exception as exc:  # Redis down or slow: these decisions stay local, routing goes on
                self._counter.labels("dropped").inc(len(batch))
                if not failing:
                    log.warning("shared state: cannot publish to %s: %s", self.config.url, exc)
                failing = True
                await asyncio.sleep(self.config.retry_s)
                continue
            if failing:
                log.info("shared state: publishing to %s again", self.config.url)
            failing = False
            self._counter.labels("published").inc(len(batch))

    async def _read_loop(self) -> None:
        while True:
            try:
                pubsub = self._client.pubsub(ignore_subscribe_messages=True)
                await pubsub.subscribe(self.config.channel)
                self.subscribed.set()
                async with pubsub:
                    while True:
                        message = await pubsub.get_message(timeout=1.0)
                        if message is not None:
                            self._apply(message["data"])
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.subscribed.clear()
                log.warning(
                    "shared state: subscription to %s lost (%s); retrying in %.1fs",
                    self.config.url,
                    exc,
                    self.config.retry_s,
                )
                await asyncio.sleep(self.config.retry_s)

    def _apply(self, data: bytes) -> None:
        try:
            sender, batch = msgpack.unpackb(data, raw=False)
        except (ValueError, TypeError, msgpack.exceptions.ExtraData) as exc:
            log.warning("shared state: ignoring an undecodable message: %s", exc)
            return
        if sender == self.replica_id:
            return
        for worker_id, keys in batch:
            self.index.record_routed(worker_id, keys)
        self._counter.labels("received").inc(len(batch))

"""The write path's root: one event subscriber per worker publisher (per DP rank).

``EventHub`` keeps the set of subscriptions equal to what the workers publish: on start and every
``discovery_interval_s`` it subscribes to workers it can now reach (their endpoints come from
configuration or ``/server_info``, see ``extproc.sync.discovery``), resubscribes a worker whose
endpoints changed (restarted with other settings), and forgets workers that left the registry.
Per publisher: ``EventSubscriber`` (ZMQ) -> ``WorkerCacheView`` (sequencing, decode, apply) ->
``BlockIndex``. A worker started with ``--dp-size N`` has N publishers, one per rank, each with its
own radix cache: each rank's view writes to its own index slot (``index.rank_key``), so the ranks
never clear each other's entries and the router can tell which rank holds a prefix.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import zmq.asyncio

from extproc.config import EventsConfig
from extproc.fleet.index import BlockIndex, rank_key
from extproc.fleet.info import event_endpoints, storage_group
from extproc.fleet.workers import Worker, WorkerRegistry
from extproc.memory import HASH_BYTES, SharedBound
from extproc.sync.cache_view import IndexState, ViewStats, WorkerCacheView
from extproc.sync.discovery import discover
from extproc.sync.http import Poller, WorkerHttp
from extproc.sync.subscriber import EventSubscriber

__all__ = ["EventHub"]

log = logging.getLogger(__name__)

Endpoints = list[tuple[str, str | None]]
# Asking a worker that has no subscription yet for its publishers: a slow answer waits for the next round.
DISCOVERY_TIMEOUT_S = 2.0


class EventHub:
    """Keeps one subscriber per worker publisher and answers what the router may trust."""

    def __init__(
        self,
        config: EventsConfig,
        registry: WorkerRegistry,
        index: BlockIndex,
        http: WorkerHttp,
        hashes: SharedBound | None = None,
    ) -> None:
        self.config = config
        self.registry = registry
        self.index = index
        self.http = http
        # Every view's engine-hash map counts against this one bound (memory.budget_bytes's share).
        self.hashes = hashes or SharedBound(index.max_blocks)
        self.views: dict[str, list[WorkerCacheView]] = {}
        self._endpoints: dict[str, Endpoints] = {}
        self._tasks: dict[str, list[asyncio.Task[None]]] = {}
        self._ctx: zmq.asyncio.Context | None = None
        # The first round runs in start() (subscriptions exist before the router serves); the loop follows.
        self._discovery = Poller("kv-event-discovery", config.discovery_interval_s, self.sync_once, wait_first=True)

    def state(self, worker: Worker) -> IndexState:
        """``synced`` only when every publisher of the worker is."""
        views = self.views.get(worker.id)
        if not views:
            return "unknown"
        return "synced" if all(v.state == "synced" for v in views) else "unknown"

    def rank_state(self, worker: Worker, rank: int) -> IndexState:
        """The event state of one DP rank's stream."""
        views = self.views.get(worker.id, ())
        return views[rank].state if rank < len(views) else "unknown"

    def block_size(self, worker: Worker) -> int | None:
        """The page size the worker's events carry (None before the first ``BlockStored``)."""
        for view in self.views.get(worker.id, ()):
            if view.block_size:
                return view.block_size
        return None

    def stats(self, worker: Worker) -> list[ViewStats]:
        """Counters of each of the worker's event streams (one per DP rank)."""
        return [view.stats for view in self.views.get(worker.id, ())]

    async def start(self) -> None:
        if not self.config.enabled or self._discovery.running:
            return
        self._ctx = zmq.asyncio.Context()
        await self.sync_once()
        self._discovery.start()

    async def stop(self) -> None:
        await self._discovery.stop()
        tasks = [t for ts in self._tasks.values() for t in ts]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    async def sync_once(self) -> None:
        """Subscribe to newly reachable publishers; follow changed endpoints; drop departed workers."""
        present = {w.id for w in self.registry.workers}
        for worker_id in list(self._tasks):
            if worker_id not in present:
                for key in self._rank_keys(worker_id):
                    self.index.forget(key)
                self._unsubscribe(worker_id)
        for worker in self.registry.workers:
            subscribed = self._endpoints.get(worker.id)
            if subscribed is None and not worker.kv_events_endpoint and not worker.info:
                await discover(self.http, worker, DISCOVERY_TIMEOUT_S)
            endpoints = event_endpoints(worker)
            if endpoints == subscribed or not endpoints:
                continue
            if subscribed is not None:
                log.info("worker %s: KV-event endpoints changed to %s; resubscribing", worker.id, endpoints)
                for key in self._rank_keys(worker.id):
                    if key == worker.id:
                        self.index.clear(key)
                        self.index.forget_routed(key)
                    else:  # its other ranks' slots are rebuilt (or, with fewer ranks now, gone)
                        self.index.forget(key)
                self._unsubscribe(worker.id)
            await self.subscribe(worker, endpoints)

    def _rank_keys(self, worker_id: str) -> list[str]:
        return [rank_key(worker_id, r) for r in range(max(1, len(self._endpoints.get(worker_id, ()))))]

    def memory(self) -> int:
        """Estimated bytes of every view's engine-hash map."""
        return self.hashes.used * HASH_BYTES

    def _unsubscribe(self, worker_id: str) -> None:
        for task in self._tasks.pop(worker_id, ()):
            task.cancel()
        for view in self.views.pop(worker_id, ()):
            view.close()
        self._endpoints.pop(worker_id, None)

    async def subscribe(self, worker: Worker, endpoints: Endpoints) -> list[EventSubscriber]:
        assert self._ctx is not None, "EventHub.start() first"
        views, tasks, subs = [], [], []

        def model() -> str:  # read at use: the served model may be discovered after subscribing
            return worker.model or ""

        def group() -> str | None:  # read at use too: /server_info may change on a rejoin
            return storage_group(worker)

        for rank, (events_ep, replay_ep) in enumerate(endpoints):
            view = WorkerCacheView(
                rank_key(worker.id, rank),
                self.index,
                model=model,
                resync_after_s=self.config.resync_after_s,
                hashes=self.hashes,
                storage_group=group if self.index.config.shared_tier else None,
            )
            sub = EventSubscriber(view, events_ep, replay_ep, self.config, self._ctx)
            views.append(view)
            subs.append(sub)
            tasks.append(asyncio.create_task(sub.run(), name=f"kv-events-{rank_key(worker.id, rank)}"))
        self.views[worker.id] = views
        self._tasks[worker.id] = tasks
        self._endpoints[worker.id] = list(endpoints)
        return subs

"""KV-event ingestion measured in this process: real msgpack batches over real ZMQ into the router's index.

``event_ingestion`` sends ``BlockStored`` batches (16 pages of 16 tokens each) from one ZMQ PUB socket
per worker, in another process, to the router's subscribers (``EventHub``) and times how fast the index
absorbs them. With ``full_cache`` every batch after a worker's first ``FULL_AFTER`` also carries a
``BlockRemoved`` of the batch stored ``FULL_AFTER`` batches before (a worker whose cache is full evicts
a page for every page it stores: what a busy fleet sends). The router's CPU seconds over the run (this
process: the subscribers and the index; the publisher is another) give blocks per CPU-second, a
figure that holds on a shared machine where wall-clock rates do not. With ``rate`` the publishers
send on a schedule instead of flat out, and the run reports the publish-to-apply lag. Used by
``--suite decision-latency`` and ``--suite scale``.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import random
import struct
import time
from dataclasses import dataclass
from typing import Any

from benchmarks.stats import sorted_percentile
from extproc.config import EventsConfig
from extproc.fleet.index import BlockIndex
from extproc.fleet.workers import Worker, WorkerRegistry
from extproc.sync.http import WorkerHttp
from extproc.sync.hub import EventHub

__all__ = ["FULL_AFTER", "Ingestion", "event_ingestion"]

PAGE = 16
FULL_AFTER = 8  # batches a worker stores before its cache is full (with ``full_cache``)


def _stamped(payload: bytes, ts: float) -> bytes:
    """``payload`` with its batch timestamp set to ``ts``: the time a paced publisher sends it.

    The batches are packed before the run (packing costs the publisher more than sending), as
    ``[float64 ts, events, rank]``: a fixarray header, the float's marker, its 8 bytes; those 8 are replaced.
    """
    return payload[:2] + _TS.pack(ts) + payload[10:]


_TS = struct.Struct(">d")


def _publisher(
    ports: list[int], batches: int, pages: int, full_cache: bool, rate: float | None, ready: Any, go: Any, span: Any
) -> None:
    import msgpack
    import zmq

    rng = random.Random(7)
    ctx = zmq.Context()
    socks = []
    for port in ports:
        sock = ctx.socket(zmq.PUB)
        sock.sndhwm = 0
        sock.bind(f"tcp://127.0.0.1:{port}")
        socks.append(sock)
    payloads: list[list[bytes]] = []
    sizes: list[list[int]] = []  # blocks (stored + removed) per batch
    for _ in ports:
        out = [msgpack.packb([time.time(), [{"type": "AllBlocksCleared"}], 0])]
        blocks = [0]
        parent = None
        stored: list[list[int]] = []
        for b in range(batches):
            tokens = [rng.randrange(128_000) for _ in range(pages * PAGE)]
            hashes = [rng.getrandbits(63) for _ in range(pages)]
            event = {
                "type": "BlockStored",
                "block_hashes": hashes,
                "parent_block_hash": parent,
                "token_ids": tokens,
                "block_size": PAGE,
                "lora_id": None,
                "medium": "GPU",
            }
            events: list[dict[str, Any]] = [event]
            if full_cache and b >= FULL_AFTER:
                events.append({"type": "BlockRemoved", "block_hashes": stored[b - FULL_AFTER], "medium": "GPU"})
            stored.append(hashes)
            # A float ts always: ``_stamped`` overwrites it in place.
            out.append(msgpack.packb([float(time.time()), events, 0], use_single_float=False))
            blocks.append(pages * len(events))
            parent = hashes[-1] if b % 8 else None  # chains of 8 batches, then a new root
        payloads.append(out)
        sizes.append(blocks)
    ready.set()
    go.wait()
    start = time.time()
    sent = 0
    for seq in range(batches + 1):
        for w, sock in enumerate(socks):
            payload = payloads[w][seq]
            if rate is not None:
                # On schedule: the batch leaves once the blocks before it have had their time at ``rate``
                # (sleeping only for gaps above a millisecond: a paced stream is a steady one, not a precise one).
                due = start + sent / rate
                now = time.time()
                if due - now > 0.001:
                    time.sleep(due - now)
                payload = _stamped(payload, time.time())
            sent += sizes[w][seq]
            sock.send_multipart([b"", seq.to_bytes(8, "big"), payload])
    span.value = time.time() - start
    time.sleep(2.0)
    ctx.destroy(linger=0)


@dataclass(frozen=True)
class Ingestion:
    """One ingestion run: blocks stored and removed by the streams, how long, the router's CPU, the index after.

    A paced run (``rate`` set) also has the publishers' own sending time and the lag of the batches the
    router applied (``lags_s``: publish to applied, one sample per stream per poll of the views).
    """

    stored: int
    removed: int
    expected_held: int  # what the index must hold: every stored block not removed since
    seconds: float
    cpu_s: float  # this process's CPU seconds over the run (subscribers, decoding, index; every thread)
    held: int  # entries the index holds at the end
    rate: float | None = None  # offered blocks/s (stored + removed), all publishers together; None: flat out
    sent_s: float = 0.0  # how long the publishers took to send everything
    lags_s: tuple[float, ...] = ()

    @property
    def blocks(self) -> int:
        return self.stored + self.removed

    @property
    def exact(self) -> bool:
        return self.held == self.expected_held

    @property
    def cores(self) -> float:
        """The router's CPU seconds per wall second over the run: its share of a core the stream costs."""
        return self.cpu_s / self.seconds if self.seconds else 0.0

    def lag_ms(self, quantile: float) -> float:
        """A quantile of the applied batches' publish-to-apply lag, in ms (0 without samples)."""
        if not self.lags_s:
            return 0.0
        return sorted_percentile(sorted(self.lags_s), quantile * 100) * 1000


async def event_ingestion(
    workers: int, total_blocks: int, full_cache: bool = False, rate: float | None = None
) -> Ingestion:
    """Publish ``total_blocks`` stored blocks from ``workers`` publishers (and as many removals, less the
    first ``FULL_AFTER`` batches', with ``full_cache``) and time how fast the index absorbs them.

    Flat out by default (the router's ceiling); with ``rate`` the publishers send on a schedule of
    ``rate`` blocks per second (stored and removed, all together), as a busy fleet does, and the run
    reports whether the router keeps up: how far behind the publishers its index is, and its CPU share.
    """
    from prefix_common.addresses import free_ports

    if rate is not None and rate <= 0:
        raise ValueError("rate must be positive blocks per second")
    pages = 16
    batches = max(1, total_blocks // (workers * pages))
    ports = free_ports(workers)
    fleet = [
        Worker(
            id=f"w{i}",
            url=f"http://127.0.0.1:{ports[i]}",
            ip="127.0.0.1",
            port=ports[i],
            kv_events_endpoint=f"tcp://127.0.0.1:{ports[i]}",
        )
        for i in range(workers)
    ]
    index = BlockIndex(max_blocks=10_000_000)
    http = WorkerHttp()  # unused: every worker names its publisher, so nothing is discovered over HTTP
    hub = EventHub(EventsConfig(discovery_interval_s=3600), WorkerRegistry(fleet), index, http)
    ctx = mp.get_context("spawn")
    ready, go, span = ctx.Event(), ctx.Event(), ctx.Value("d", 0.0)
    proc = ctx.Process(target=_publisher, args=(ports, batches, pages, full_cache, rate, ready, go, span), daemon=True)
    proc.start()
    await asyncio.get_running_loop().run_in_executor(None, ready.wait)
    await hub.start()
    await asyncio.sleep(1.0)  # subscriptions established (ZMQ slow joiner)
    expected_stored = workers * batches * pages
    expected_removed = workers * max(0, batches - FULL_AFTER) * pages if full_cache else 0
    views = [v for per_worker in hub.views.values() for v in per_worker]
    seen = [v.stats.batches for v in views]
    lags: list[float] = []
    go.set()
    start, cpu_start = time.perf_counter(), time.process_time()

    def counted() -> tuple[int, int]:
        return sum(v.stats.blocks_stored for v in views), sum(v.stats.blocks_removed for v in views)

    def done() -> bool:
        stored, removed = counted()
        return stored >= expected_stored and removed >= expected_removed

    deadline = start + 120 + (expected_stored + expected_removed) / (rate or float("inf"))
    while not done() and time.perf_counter() < deadline:
        await asyncio.sleep(0.005)
        if rate is not None:  # the lag of each stream's latest batch, if it applied one since the last look
            for i, view in enumerate(views):
                if view.stats.batches != seen[i]:
                    seen[i] = view.stats.batches
                    lags.append(view.stats.lag_s)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    stored, removed = counted()
    held = index.blocks_total
    await hub.stop()
    proc.join(5)
    return Ingestion(
        stored, removed, expected_stored - expected_removed, elapsed, cpu, held, rate, span.value, tuple(lags)
    )

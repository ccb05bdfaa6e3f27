"""The write path: SGLang KV-cache events over ZMQ -> the router's block index.

Per worker (and data-parallel rank) a ZMQ SUB socket receives ``[topic, seq, payload]`` batches.
``WorkerCacheView`` applies them strictly in sequence order:

- ``BlockStored`` carries one engine hash per page plus all the pages' ``token_ids``; the router
  never trusts the engine's hash for identity but recomputes its own chained keys from the tokens,
  continuing from the parent's own key, and remembers engine hash -> own key for later removals;
- ``BlockRemoved`` evicts through that map; ``AllBlocksCleared`` empties the worker;
- a jump in ``seq`` is a lost batch: the view asks the worker's replay socket for the missing
  batches; if the replay cannot fill the hole, the worker's entries are dropped (removals may have
  been missed) and its state is ``unknown`` until it is provably whole again;
- ``seq`` going backwards is a restarted worker: its entries are reset.

Both payload encodings SGLang has shipped are decoded: positional arrays (up to 0.5.15) and maps
tagged with ``type`` (0.5.20 and later), as are both replay reply shapes (``[seq, payload]`` and,
in 0.5.23, ``[topic, seq, payload]``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
import msgpack
import zmq
import zmq.asyncio

from extproc.blocks import block_keys, chain_seed
from extproc.config import EventsConfig
from extproc.index import BlockIndex, tier_of
from extproc.workers import Worker, WorkerRegistry

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "EventDecodeError",
    "EventHub",
    "EventSubscriber",
    "WorkerCacheView",
    "decode_payload",
    "event_endpoints",
    "replay",
]

log = logging.getLogger(__name__)

IndexState = Literal["synced", "unknown"]
_END_SEQ = -1
_WILDCARD_HOSTS = {"*", "0.0.0.0", "::", "[::]", ""}


class EventDecodeError(ValueError):
    """A payload that is not an SGLang KV-event batch."""


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    cache_salt: str | None = None
    lora_name: str | None = None


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: str | None = None


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class EventBatch:
    ts: float
    events: list[Event]
    dp_rank: int | None = None


def _signed64(value: Any) -> int:
    # Hashes arrive as uint64 when non-negative and int64 when negative; normalise to signed.
    if not isinstance(value, int) or isinstance(value, bool):
        raise EventDecodeError(f"block hash must be an integer, got {type(value).__name__}")
    return value - (1 << 64) if value >= 1 << 63 else value


def _hashes(value: Any) -> list[int]:
    if not isinstance(value, (list, tuple)):
        raise EventDecodeError("block_hashes must be an array")
    return [_signed64(v) for v in value]


def _opt_hash(value: Any) -> int | None:
    return None if value is None else _signed64(value)


def _text(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


# Positional field order of each event type (msgspec ``array_like`` structs, tag first).
_POSITIONAL = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                    "cache_salt", "lora_name"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


def _decode_event(raw: Any) -> Event | None:
    if isinstance(raw, dict):
        kind = _text(raw.get("type"))
        fields = raw
    elif isinstance(raw, (list, tuple)) and raw:
        kind = _text(raw[0])
        names = _POSITIONAL.get(kind or "", ())
        fields = dict(zip(names, raw[1:]))
    else:
        raise EventDecodeError(f"event must be a map or an array, got {type(raw).__name__}")
    if kind == "BlockStored":
        try:
            tokens = list(fields["token_ids"])
            block_size = int(fields["block_size"])
        except (KeyError, TypeError, ValueError) as exc:
            raise EventDecodeError(f"BlockStored lacks token_ids/block_size: {exc}") from exc
        if block_size <= 0:
            raise EventDecodeError("BlockStored block_size must be positive")
        return BlockStored(block_hashes=_hashes(fields.get("block_hashes")),
                           parent_block_hash=_opt_hash(fields.get("parent_block_hash")),
                           token_ids=tokens, block_size=block_size, lora_id=fields.get("lora_id"),
                           medium=_text(fields.get("medium")), cache_salt=_text(fields.get("cache_salt")),
                           lora_name=_text(fields.get("lora_name")))
    if kind == "BlockRemoved":
        return BlockRemoved(block_hashes=_hashes(fields.get("block_hashes")), medium=_text(fields.get("medium")))
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    return None  # event types added by later releases are not ours to interpret


def decode_payload(payload: bytes) -> EventBatch:
    """Decode one payload frame: ``[ts, events, dp_rank]`` in either encoding."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.exceptions.ExtraData, msgpack.exceptions.FormatError,
            msgpack.exceptions.StackError) as exc:
        raise EventDecodeError(f"payload is not msgpack: {exc}") from exc
    if not isinstance(raw, (list, tuple)) or len(raw) < 2 or not isinstance(raw[1], (list, tuple)):
        raise EventDecodeError("payload must be an array [ts, events, dp_rank]")
    events = [e for e in (_decode_event(item) for item in raw[1]) if e is not None]
    dp_rank = raw[2] if len(raw) > 2 and isinstance(raw[2], int) else None
    ts = float(raw[0]) if isinstance(raw[0], (int, float)) else 0.0
    return EventBatch(ts=ts, events=events, dp_rank=dp_rank)


@dataclass
class ViewStats:
    """Counters of one view; read by ``extproc.telemetry`` at scrape time."""

    batches: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0
    clears: int = 0
    gaps: int = 0
    gaps_repaired: int = 0
    replays: int = 0
    restarts: int = 0
    orphans: int = 0
    decode_errors: int = 0
    lag_s: float = 0.0  # publish-to-apply delay of the last batch


@dataclass
class WorkerCacheView:
    """One publisher's (worker, DP rank) event stream applied to the index, in ``seq`` order."""

    worker_id: str
    index: BlockIndex
    model: str | Callable[[], str] = ""  # the worker's served model (a callable: read at use, it may be discovered late)
    resync_after_s: float = 60.0
    max_hashes: int = 6_000_000  # engine-hash map bound (the index's per-tier bound x tiers)
    clock: Callable[[], float] = time.monotonic
    last_seq: int | None = None
    block_size: int | None = None  # learnt from events
    stats: ViewStats = field(default_factory=ViewStats)
    _state: IndexState = "unknown"
    _unknown_since: float = 0.0
    _own: dict[int, tuple[int, int]] = field(default_factory=dict)  # engine hash -> (own key, tier bits)
    _pending: tuple[int, bytes] | None = None
    _seeds: dict[tuple[str, str | None, str | None], int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._unknown_since = self.clock()
        self.index.set_unknown(self.worker_id, True)

    # -- state ----------------------------------------------------------------------------------
    @property
    def state(self) -> IndexState:
        if self._state == "unknown" and self.last_seq is not None and \
                self.clock() - self._unknown_since >= self.resync_after_s:
            self._set_state("synced")
        return self._state

    def _set_state(self, state: IndexState) -> None:
        if state != self._state:
            self._state = state
            if state == "unknown":
                self._unknown_since = self.clock()
            self.index.set_unknown(self.worker_id, state == "unknown")

    def _reset(self) -> None:
        self.index.clear(self.worker_id)
        self._own.clear()

    def resync(self) -> None:
        """Forget everything and start from the next batch or replay (after a reconnect)."""
        self.stats.restarts += 1
        self._reset()
        self.index.forget_routed(self.worker_id)
        self.last_seq = None
        self._pending = None
        self._set_state("unknown")

    def _lose_sync(self) -> None:
        """Removals may have been missed: claim nothing we cannot vouch for."""
        self._reset()
        self._set_state("unknown")
        self._unknown_since = self.clock()

    # -- sequencing -----------------------------------------------------------------------------
    def ingest(self, seq: int, payload: bytes) -> int | None:
        """Apply a live batch; returns the seq to replay from when batches are missing."""
        last = self.last_seq
        if last is None:
            if seq == 0:
                self._apply(seq, payload)
                self._set_state("synced")
                return None
            self._pending = (seq, payload)
            return 0
        if seq == last + 1:
            self._apply(seq, payload)
            return None
        if seq > last + 1:
            self.stats.gaps += 1
            self._pending = (seq, payload)
            return last + 1
        if seq == last:
            return None  # duplicate
        # seq went backwards: the worker restarted (its publisher numbers from 0 again).
        self.resync()
        return self.ingest(seq, payload)

    def replayed(self, entries: Sequence[tuple[int, bytes]] | None) -> None:
        """Apply the replay's answer (None: no answer), then the live batch that asked for it."""
        pending, self._pending = self._pending, None
        self.stats.replays += 1
        batches = sorted([*(entries or ()), *([pending] if pending else [])], key=lambda item: item[0])
        initial = self.last_seq is None
        orphans = self.stats.orphans
        whole = entries is not None
        for seq, payload in batches:
            last = self.last_seq
            if last is not None and seq <= last:
                continue
            if seq != (0 if last is None else last + 1):
                whole = False  # the replay buffer no longer reaches back far enough
                self._lose_sync()
            self._apply(seq, payload)
        if not whole or self.last_seq is None:
            return
        if initial:
            if self.stats.orphans == orphans:
                self._set_state("synced")  # the worker's whole history since its start, in order
        else:
            self.stats.gaps_repaired += 1

    # -- applying -------------------------------------------------------------------------------
    def _seed(self, lora: str | None, salt: str | None) -> int:
        model = self.model() if callable(self.model) else self.model
        seed = self._seeds.get((model, lora, salt))
        if seed is None:
            seed = self._seeds[(model, lora, salt)] = chain_seed(model, lora, salt)
        return seed

    def _apply(self, seq: int, payload: bytes) -> None:
        self.last_seq = seq
        try:
            batch = decode_payload(payload)
        except EventDecodeError as exc:
            self.stats.decode_errors += 1
            log.warning("worker %s: undecodable KV-event batch %d: %s", self.worker_id, seq, exc)
            self._lose_sync()
            return
        self.apply_batch(batch)

    def apply_batch(self, batch: EventBatch) -> None:
        """Apply decoded events (sequencing already checked)."""
        self.stats.batches += 1
        if batch.ts:
            self.stats.lag_s = max(0.0, time.time() - batch.ts)
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._stored(event)
            elif isinstance(event, BlockRemoved):
                self._removed(event)
            else:
                self._reset()
                self.stats.clears += 1
                self._set_state("synced")  # an empty cache is a fully known cache

    def _stored(self, event: BlockStored) -> None:
        parent: int | None = None
        if event.parent_block_hash is not None:
            known = self._own.get(event.parent_block_hash)
            if known is None:
                # Stored before we listened (or lost): the chain cannot be keyed. Under-claiming is safe.
                self.stats.orphans += 1
                if self._state == "synced":
                    self._set_state("unknown")
                return
            parent = known[0]
        lora = event.lora_name if event.lora_name is not None else (
            None if event.lora_id is None else str(event.lora_id))
        keys = block_keys(event.token_ids, event.block_size, self._seed(lora, event.cache_salt), parent=parent)
        self.block_size = event.block_size
        tier = tier_of(event.medium)
        bit = 1 << ("gpu", "host", "disk").index(tier)
        own = self._own
        for engine_hash, key in zip(event.block_hashes, keys):
            previous = own.get(engine_hash)
            own[engine_hash] = (key, (previous[1] if previous else 0) | bit)
        if len(own) > self.max_hashes:  # oldest mappings first; their later removals become no-ops
            for stale in list(itertools.islice(own, len(own) - self.max_hashes)):
                del own[stale]
        stored = keys[: len(event.block_hashes)]
        self.index.store(self.worker_id, stored, tier)
        self.stats.blocks_stored += len(stored)

    def _removed(self, event: BlockRemoved) -> None:
        tier = tier_of(event.medium)
        bit = 1 << ("gpu", "host", "disk").index(tier)
        own = self._own
        keys: list[int] = []
        for engine_hash in event.block_hashes:
            entry = own.get(engine_hash)
            if entry is None:
                continue
            key, bits = entry
            keys.append(key)
            bits &= ~bit
            if bits:
                own[engine_hash] = (key, bits)
            else:
                del own[engine_hash]
        self.index.remove(self.worker_id, keys, tier)
        self.stats.blocks_removed += len(keys)


def _decode_seq(frame: bytes) -> int:
    return int.from_bytes(frame, "big", signed=True)


async def replay(ctx: zmq.asyncio.Context, endpoint: str, start_seq: int, timeout_s: float,
                 ) -> list[tuple[int, bytes]] | None:
    """Ask a replay (ROUTER) socket for every buffered batch from ``start_seq``; None on timeout."""
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(endpoint)
    try:
        await sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
        out: list[tuple[int, bytes]] = []
        while True:
            if not await sock.poll(timeout_s * 1000):
                return None
            frames = await sock.recv_multipart()
            if frames and frames[0] == b"":
                frames = frames[1:]  # the ROUTER envelope delimiter
            if len(frames) == 3:  # 0.5.23: topic, seq, payload
                seq_frame, payload = frames[1], frames[2]
            elif len(frames) == 2:  # older: seq, payload
                seq_frame, payload = frames
            else:
                continue
            seq = _decode_seq(seq_frame)
            if seq == _END_SEQ:
                return out
            out.append((seq, payload))
    finally:
        sock.close()


class EventSubscriber:
    """One SUB socket (plus replay on demand) feeding one ``WorkerCacheView``."""

    def __init__(self, view: WorkerCacheView, endpoint: str, replay_endpoint: str | None,
                 config: EventsConfig, ctx: zmq.asyncio.Context) -> None:
        self.view = view
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.config = config
        self.ctx = ctx
        self.connected = asyncio.Event()

    async def run(self) -> None:
        sub = self.ctx.socket(zmq.SUB)
        sub.linger = 0
        sub.rcvhwm = 0  # never drop on our side; the publisher's HWM is the only loss point
        sub.setsockopt(zmq.SUBSCRIBE, self.config.topic.encode())
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED)
        sub.connect(self.endpoint)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            while True:
                # Until the first batch is in, keep asking the replay socket: a worker that just
                # (re)started may not have bound it, or published anything, when we connected.
                catching_up = self.view.last_seq is None and self.replay_endpoint is not None
                ready = dict(await poller.poll(self.config.replay_timeout_s * 1000 if catching_up else None))
                if not ready and catching_up and self.connected.is_set():
                    await self._repair(0)
                if sub in ready:
                    # Everything queued from the old connection first, then the reconnect (below).
                    await self._drain(sub)
                if monitor in ready:
                    await monitor.recv_multipart()
                    # (Re)connected: the publisher may have restarted or batches were lost while we
                    # were away. Start over from what its replay buffer holds.
                    if self.view.last_seq is not None:
                        self.view.resync()
                    if self.replay_endpoint:
                        await self._repair(0)
                    self.connected.set()
        finally:
            sub.disable_monitor()
            monitor.close(0)
            sub.close()

    async def _drain(self, sub: zmq.asyncio.Socket) -> None:
        while True:
            try:
                frames = await sub.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) < 2:
                continue
            seq, payload = _decode_seq(frames[-2]), frames[-1]
            start = self.view.ingest(seq, payload)
            if start is not None:
                await self._repair(start)

    async def _repair(self, start: int) -> None:
        entries = None
        if self.replay_endpoint:
            try:
                entries = await replay(self.ctx, self.replay_endpoint, start, self.config.replay_timeout_s)
            except zmq.ZMQError as exc:
                log.warning("worker %s: replay from %s failed: %s", self.view.worker_id, self.replay_endpoint, exc)
        if entries is None and self.view._pending is None and self.view.last_seq is None:
            return  # initial catch-up without an answer: just wait for live batches
        self.view.replayed(entries)


def _substitute_host(host: str | None, worker: Worker) -> str:
    if host is None or host.strip("[]") in _WILDCARD_HOSTS or host == "*":
        host = worker.ip
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def event_endpoints(worker: Worker) -> list[tuple[str, str | None]]:
    """``(events, replay)`` endpoints per DP rank, from config or the worker's ``/server_info``."""
    if worker.kv_events_endpoint:
        return [(worker.kv_events_endpoint, worker.replay_endpoint)]
    info = worker.info.get("kv_events") if isinstance(worker.info, dict) else None
    if not isinstance(info, dict):
        return []
    publisher = info.get("publisher", "zmq")
    base = info.get("endpoint_port_base")
    if publisher not in (None, "zmq") or not isinstance(base, int):
        return []
    host = _substitute_host(info.get("endpoint_host"), worker)
    replay_base = info.get("replay_endpoint_port_base")
    dp_size = info.get("dp_size") if isinstance(info.get("dp_size"), int) else 1
    out = []
    for rank in range(max(1, dp_size)):
        replay_ep = f"tcp://{host}:{replay_base + rank}" if isinstance(replay_base, int) else None
        out.append((f"tcp://{host}:{base + rank}", replay_ep))
    return out


def worker_block_size(worker: Worker) -> int | None:
    """The worker's page size as its ``/server_info`` reports it."""
    info = worker.info if isinstance(worker.info, dict) else {}
    events = info.get("kv_events")
    for value in (info.get("page_size"), events.get("block_size") if isinstance(events, dict) else None):
        if isinstance(value, int) and value > 0:
            return value
    return None


class EventHub:
    """Keeps one subscriber per worker publisher, discovering endpoints from ``/server_info``."""

    def __init__(self, config: EventsConfig, registry: WorkerRegistry, index: BlockIndex) -> None:
        self.config = config
        self.registry = registry
        self.index = index
        self.views: dict[str, list[WorkerCacheView]] = {}
        self._tasks: dict[str, list[asyncio.Task[None]]] = {}
        self._ctx: zmq.asyncio.Context | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._http: aiohttp.ClientSession | None = None

    def state(self, worker: Worker) -> IndexState:
        """``synced`` only when every publisher of the worker is."""
        views = self.views.get(worker.id)
        if not views:
            return "unknown"
        return "synced" if all(v.state == "synced" for v in views) else "unknown"

    def block_size(self, worker: Worker) -> int | None:
        for view in self.views.get(worker.id, ()):
            if view.block_size:
                return view.block_size
        return None

    async def start(self) -> None:
        if not self.config.enabled or self._loop_task is not None:
            return
        self._ctx = zmq.asyncio.Context()
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0))
        await self.sync_once()
        self._loop_task = asyncio.create_task(self._discover_forever(), name="kv-event-discovery")

    async def stop(self) -> None:
        tasks = [t for ts in self._tasks.values() for t in ts]
        if self._loop_task is not None:
            tasks.append(self._loop_task)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        self._loop_task = None
        if self._http is not None:
            await self._http.close()
            self._http = None
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    async def _discover_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.discovery_interval_s)
            try:
                await self.sync_once()
            except Exception:  # discovery must never die; the next round retries
                log.exception("KV-event discovery failed")

    async def _fetch_info(self, worker: Worker) -> None:
        assert self._http is not None
        for path in ("/server_info", "/get_server_info"):
            try:
                async with self._http.get(worker.url + path) as resp:
                    if resp.status == 200:
                        body = await resp.json(content_type=None)
                        if isinstance(body, dict):
                            worker.info = body
                            return
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                return

    async def sync_once(self) -> None:
        """Subscribe to newly discoverable workers; drop workers that left the registry."""
        present = {w.id for w in self.registry.workers}
        for worker_id in list(self._tasks):
            if worker_id not in present:
                for task in self._tasks.pop(worker_id):
                    task.cancel()
                self.views.pop(worker_id, None)
                self.index.forget(worker_id)
        for worker in self.registry.workers:
            if worker.id in self._tasks:
                continue
            if not worker.kv_events_endpoint and not worker.info:
                await self._fetch_info(worker)
            endpoints = event_endpoints(worker)
            if endpoints:
                await self.subscribe(worker, endpoints)

    async def subscribe(self, worker: Worker, endpoints: list[tuple[str, str | None]]) -> list[EventSubscriber]:
        assert self._ctx is not None, "EventHub.start() first"
        views, tasks, subs = [], [], []
        for events_ep, replay_ep in endpoints:
            view = WorkerCacheView(worker.id, self.index, model=lambda w=worker: w.model or "",
                                   resync_after_s=self.config.resync_after_s,
                                   max_hashes=self.index.config.max_blocks_per_worker * 3)
            sub = EventSubscriber(view, events_ep, replay_ep, self.config, self._ctx)
            views.append(view)
            subs.append(sub)
            tasks.append(asyncio.create_task(sub.run(), name=f"kv-events-{worker.id}"))
        self.views[worker.id] = views
        self._tasks[worker.id] = tasks
        return subs

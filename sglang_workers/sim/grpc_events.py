"""The KV-event stream of SGLang's gRPC scheduler API (``SubscribeKvEvents``), relayed from the ZMQ publisher.

SGLang's gRPC mode does not emit events of its own: its servicer subscribes to the scheduler's ZMQ
publisher and re-sends every batch on the stream. This relay does the same in-process: it hears each
batch the moment :class:`~sglang_workers.sim.kv_events.KVEventPublisher` sends it (the very payload bytes ZMQ
carries, decoded), so a gRPC subscriber and a ZMQ subscriber see the same events under the same
sequence numbers.

What the stream promises, and why (smg 1.13 is the consumer this is written for):

* **Batches as SGLang's bridge shapes them.** Every ``BlockStored`` is cut into one ``KvBlock`` per page
  carrying exactly that page's tokens (smg hashes each block's own tokens and uses the engine hash only
  as an identity), the first linked to ``parent_block_hash``; the medium becomes a tier (``GPU`` ->
  device), the blocks are ``LOCAL``; ``dp_rank`` on every batch; ``timestamp`` in epoch seconds (smg's
  lag metric).
* **Resume.** ``start_sequence_number = N > 0`` is the last batch the subscriber applied: batches N+1...
  are replayed from the relay's history (``--kv-buffer-steps`` batches, like the publisher's replay
  buffer), then live ones follow with no gap and no duplicate. A cursor the history no longer reaches,
  or one beyond the last batch (the worker restarted: sequence numbers start again at 0 in every
  process), is ``OUT_OF_RANGE``; smg then clears the worker and subscribes again from 0. This is what
  SGLang's bridge does with a ``replay_endpoint``.
* **Subscribe from 0** ("start from the current state"): while the history reaches back to the
  publisher's first batch, the whole history is replayed; once it does not, a snapshot of the live
  blocks (``KvSnapshotChunk``: chunk 0 opens with a clear, parents before children, sequence numbers
  ending at the batch the state was taken at) stands in for it, as the protocol defines.
* **A subscriber that falls behind** by more than the history holds gets ``DATA_LOSS`` (smg clears and
  resubscribes) instead of a silent gap.
* **Load records.** Every batch carries an ``EngineLoad`` with the figures ``GetLoads`` answers; when no
  event flows, a ``load_only`` batch (the last sequence repeated) goes out when the load moved (checked
  every 0.1 s) and as a heartbeat after 1 s of silence (every 5 s once two heartbeats in a row were
  unchanged), as SGLang's servicer paces them. smg then skips its ``GetLoads`` polls for the worker and
  its liveness tracker keeps hearing from it.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from typing import Any

import grpc
from smg_grpc_proto.generated import common_pb2

from .kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventPublisher,
    decode_payload,
)

__all__ = [
    "HEARTBEAT_BACKOFF_S",
    "HEARTBEAT_INTERVAL_S",
    "LOAD_TICK_S",
    "KvEventRelay",
    "LoadSource",
    "StreamError",
    "engine_load",
]

LOAD_TICK_S = 0.1  # how often an idle stream looks at the load for a change
HEARTBEAT_INTERVAL_S = 1.0  # silence after which a load_only heartbeat goes out
HEARTBEAT_BACKOFF_S = 5.0  # the heartbeat interval once two heartbeats in a row carried the same load
SNAPSHOT_CHUNK_BLOCKS = 1024  # stored blocks per snapshot chunk

# SGLang's medium strings and the protocol's tiers (HiCache publishes the host and disk tiers).
_TIERS = {
    MEDIUM_GPU: common_pb2.KV_CACHE_TIER_DEVICE,
    "CPU_PINNED": common_pb2.KV_CACHE_TIER_HOST,
    "DISK": common_pb2.KV_CACHE_TIER_DISK,
    "EXTERNAL": common_pb2.KV_CACHE_TIER_EXTERNAL,
}
# EngineLoad fields beyond the routing core: sent on a stream's first record and on heartbeats only.
_TELEMETRY = ("cache_hit_rate", "num_used_tokens", "max_total_num_tokens", "memory", "queues")

#: The worker's current load as the stream's record (``None`` while it is not known, e.g. still loading).
LoadSource = Callable[[], "common_pb2.EngineLoad | None"]


class StreamError(Exception):
    """The stream cannot go on (or start) as asked: ends it with this gRPC status and message."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


# One stored page as the stream announced it (what a snapshot re-announces): its parent, its tokens, and
# the attributes of the event that stored it (block size, LoRA id, medium, cache salt), shared by its pages.
_LiveBlock = tuple[int | None, tuple[int, ...], tuple[int, int | None, str | None, str | None]]


def _add_event(batch: common_pb2.KvEventBatch, event: KVEvent, event_id: int) -> None:
    """Append ``event`` to ``batch`` as SGLang's bridge converts it (one ``KvBlock`` per page)."""
    if isinstance(event, BlockStored):
        stored = batch.events.add(event_id=event_id).stored
        stored.locality = common_pb2.KV_CACHE_LOCALITY_LOCAL
        if event.parent_block_hash is not None:
            stored.parent_block_hash = event.parent_block_hash
        if event.medium is not None:
            stored.medium = event.medium
            if event.medium in _TIERS:
                stored.tier = _TIERS[event.medium]
        if event.cache_salt is not None:
            stored.cache_salt = event.cache_salt
        add, size, tokens = stored.blocks.add, event.block_size, event.token_ids
        for i, h in enumerate(event.block_hashes):
            block = add(block_hash=h, token_ids=tokens[i * size : (i + 1) * size], block_size=size)
            if event.lora_id is not None:
                block.lora_id = event.lora_id
    elif isinstance(event, BlockRemoved):
        removed = batch.events.add(event_id=event_id).removed
        removed.block_hashes.extend(event.block_hashes)
        removed.locality = common_pb2.KV_CACHE_LOCALITY_LOCAL
        if event.medium is not None:
            removed.medium = event.medium
            if event.medium in _TIERS:
                removed.tier = _TIERS[event.medium]
    else:
        batch.events.add(event_id=event_id, cleared=common_pb2.KvCacheCleared())


class _LoadPacer:
    """One stream's load records: numbered, telemetry on the first and on heartbeats, heartbeats paced."""

    def __init__(self, source: LoadSource, last_seq: int, dp_rank: int | None) -> None:
        self._source = source
        self._sample = 0
        self._last: common_pb2.EngineLoad | None = None
        self._sent_at = time.monotonic()
        self._same_beats = 0  # heartbeats in a row whose record did not change
        self.last_seq = max(last_seq, 0)  # what a load_only batch repeats
        self._dp_rank = dp_rank

    def _record(self, current: common_pb2.EngineLoad, load_only: bool) -> common_pb2.EngineLoad:
        record = common_pb2.EngineLoad()
        record.CopyFrom(current)
        self._sample += 1
        record.sample = self._sample
        record.load_only = load_only
        if not load_only and self._sample > 1:  # event batches (one per scheduler step) carry the core only
            for name in _TELEMETRY:
                record.ClearField(name)
        self._last = current
        self._sent_at = time.monotonic()
        return record

    def stamp(self, batch: common_pb2.KvEventBatch) -> common_pb2.KvEventBatch:
        """Attach the current record to a batch about to be sent (and remember what it names)."""
        self.last_seq = batch.sequence_number
        self._same_beats = 0
        current = self._source()
        if current is not None:
            batch.load.CopyFrom(self._record(current, load_only=False))
        else:
            self._sent_at = time.monotonic()
        return batch

    def heartbeat(self) -> common_pb2.KvEventBatch | None:
        """A ``load_only`` batch if one is due now (the load moved, or the stream was quiet long enough)."""
        current = self._source()
        if current is None:
            return None
        changed = self._last is None or _load_moved(self._last, current)
        interval = HEARTBEAT_BACKOFF_S if self._same_beats >= 2 else HEARTBEAT_INTERVAL_S
        if not changed and time.monotonic() - self._sent_at < interval:
            return None
        self._same_beats = 0 if changed else self._same_beats + 1
        batch = common_pb2.KvEventBatch(sequence_number=self.last_seq, timestamp=time.time())
        if self._dp_rank is not None:
            batch.dp_rank = self._dp_rank
        batch.load.CopyFrom(self._record(current, load_only=True))
        return batch


def _load_moved(last: common_pb2.EngineLoad, now: common_pb2.EngineLoad) -> bool:
    """Worth a load_only batch: any count changed, KV usage moved half a percent, the rate 5 %."""
    if (
        last.running_requests,
        last.waiting_requests,
        last.max_running_requests,
        last.waiting_uncached_tokens if last.HasField("waiting_uncached_tokens") else None,
    ) != (
        now.running_requests,
        now.waiting_requests,
        now.max_running_requests,
        now.waiting_uncached_tokens if now.HasField("waiting_uncached_tokens") else None,
    ):
        return True
    if abs(last.token_usage - now.token_usage) > 0.005:
        return True
    rate_moved: bool = abs(last.gen_throughput - now.gen_throughput) > 0.05 * max(
        last.gen_throughput, now.gen_throughput, 1.0
    )
    return rate_moved


class KvEventRelay:
    """The publisher's batches for ``SubscribeKvEvents``: a bounded history, the live blocks, subscriptions.

    Built after the worker started (it seeds itself from the publisher's replay buffer, which then still
    holds everything from seq 0) and driven from the worker's event loop, like the publisher. A batch is
    kept as the payload bytes ZMQ sent and turned into a ``KvEventBatch`` only when a subscriber reads
    it, so a worker nobody subscribes to pays only for the live-block record.
    """

    def __init__(self, publisher: KVEventPublisher, history: int) -> None:
        self._history: deque[tuple[int, bytes, int]] = deque(maxlen=max(history, 1))  # seq, payload, 1st event id
        self._live: dict[tuple[int, str | None], _LiveBlock] = {}
        self._event_ids = 0
        self._dp_rank: int | None = publisher.dp_rank
        self._wake = asyncio.Event()
        self.last_seq = -1
        self.last_batch_at = 0.0  # epoch seconds of the last batch (GetServerInfo.last_receive_timestamp)
        for seq, payload in publisher.buffered():
            self._on_batch(seq, payload, decode_payload(payload)[1])
        publisher.add_listener(self._on_batch)

    # -- intake ------------------------------------------------------------------------------------
    def _on_batch(self, seq: int, payload: bytes, events: Sequence[KVEvent]) -> None:
        self._history.append((seq, payload, self._event_ids + 1))
        self._event_ids += len(events)
        for event in events:
            self._apply(event)
        self.last_seq = seq
        self.last_batch_at = time.time()
        self._wake.set()
        self._wake = asyncio.Event()

    def _apply(self, event: KVEvent) -> None:
        """Keep the live blocks (per medium: a HiCache block can live in two tiers) for snapshots."""
        if isinstance(event, BlockStored):
            size, parent, tokens, medium = event.block_size, event.parent_block_hash, event.token_ids, event.medium
            attrs = (size, event.lora_id, medium, event.cache_salt)
            live = self._live
            for i, h in enumerate(event.block_hashes):
                live[(h, medium)] = (parent, tuple(tokens[i * size : (i + 1) * size]), attrs)
                parent = h
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                self._live.pop((h, event.medium), None)
        elif isinstance(event, AllBlocksCleared):
            self._live.clear()

    # -- what a subscriber gets --------------------------------------------------------------------
    @property
    def oldest_seq(self) -> int:
        return self._history[0][0] if self._history else self.last_seq + 1

    @property
    def live_blocks(self) -> int:
        return len(self._live)

    def _batch_message(self, seq: int, payload: bytes, first_event_id: int) -> common_pb2.KvEventBatch:
        ts, events, dp_rank = decode_payload(payload)
        batch = common_pb2.KvEventBatch(sequence_number=seq, timestamp=ts)
        if dp_rank is not None:
            batch.dp_rank = dp_rank
        for event_id, event in enumerate(events, first_event_id):
            _add_event(batch, event, event_id)
        return batch

    def snapshot(self) -> tuple[int, Iterator[common_pb2.KvEventBatch]]:
        """The live blocks now, as snapshot chunks whose sequence numbers end at the last batch.

        Returns that sequence number and the chunks. The state is captured at the call; the chunks are
        built as they are read, so a stream that yields between them never stalls the worker's loop for
        a large cache.
        """
        through = self.last_seq
        blocks = list(self._live.items())  # insertion order: a parent is always stored before its children
        if through < 0:
            return through, iter(())
        count = min(max(-(-len(blocks) // SNAPSHOT_CHUNK_BLOCKS), 1), through + 1)
        per_chunk = -(-len(blocks) // count) if blocks else 0

        def chunks() -> Iterator[common_pb2.KvEventBatch]:
            for index in range(count):
                batch = common_pb2.KvEventBatch(sequence_number=through - count + 1 + index, timestamp=time.time())
                if self._dp_rank is not None:
                    batch.dp_rank = self._dp_rank
                batch.snapshot.CopyFrom(
                    common_pb2.KvSnapshotChunk(index=index, count=count, blocks=len(blocks), unknown_before=0)
                )
                if index == 0:
                    batch.events.add(event_id=0, cleared=common_pb2.KvCacheCleared())
                for (block_hash, _), (parent, tokens, (size, lora_id, medium, salt)) in blocks[
                    index * per_chunk : (index + 1) * per_chunk
                ]:
                    event = BlockStored([block_hash], parent, list(tokens), size, lora_id, medium, salt)
                    _add_event(batch, event, 0)  # synthesized events carry id 0
                yield batch

        return through, chunks()

    def check_cursor(self, start: int) -> None:
        """Refuse a resume cursor this relay cannot serve with ``OUT_OF_RANGE`` (``0`` is always served).

        Called before the stream's headers go out: smg clears the worker and subscribes again from 0 only
        when the subscription itself is refused this way (an error after the headers is a broken stream,
        and it would retry the same cursor).
        """
        if start == 0:
            return
        if start > self.last_seq:
            raise StreamError(
                grpc.StatusCode.OUT_OF_RANGE,
                f"start_sequence_number {start} is beyond this worker's last batch {self.last_seq}: the worker "
                "restarted (sequence numbers start again at 0); subscribe again from 0",
            )
        if start + 1 < self.oldest_seq:
            raise StreamError(
                grpc.StatusCode.OUT_OF_RANGE,
                f"batches after {start} are no longer kept (the history starts at {self.oldest_seq}); "
                "subscribe again from 0",
            )

    def _batch(self, seq: int) -> common_pb2.KvEventBatch:
        oldest = self.oldest_seq
        if seq < oldest:
            raise StreamError(
                grpc.StatusCode.DATA_LOSS,
                f"the subscriber fell behind: batch {seq} is no longer kept (the history starts at {oldest})",
            )
        return self._batch_message(*self._history[seq - oldest])

    async def stream(self, start: int, load: LoadSource) -> AsyncGenerator[common_pb2.KvEventBatch, None]:
        """Batches for one subscription from cursor ``start`` (0: the current state), until cancelled.

        Raises :class:`StreamError` when the cursor cannot be served or the subscriber fell behind.
        """
        pacer = _LoadPacer(load, start, self._dp_rank)
        if start == 0 and self.oldest_seq > 0:
            through, chunks = self.snapshot()
            for chunk in chunks:
                yield pacer.stamp(chunk)
            next_seq = through + 1
        elif start == 0:
            next_seq = 0
        else:
            self.check_cursor(start)
            next_seq = start + 1
        while True:
            while next_seq <= self.last_seq:
                yield pacer.stamp(self._batch(next_seq))
                next_seq += 1
            wake = self._wake
            try:
                await asyncio.wait_for(wake.wait(), LOAD_TICK_S)
            except asyncio.TimeoutError:
                beat = pacer.heartbeat()
                if beat is not None:
                    yield beat


def engine_load(load: Any, queued_work_known: bool) -> common_pb2.EngineLoad:
    """The stream's load record from a ``GetLoads`` ``SchedulerLoad``: the same figures, field for field.

    ``waiting_uncached_tokens`` is set only when the worker reports it (``queued_work_known``): absent
    and 0 mean different things to smg.
    """
    record = common_pb2.EngineLoad(
        running_requests=max(load.num_running_reqs, 0),
        waiting_requests=max(load.num_waiting_reqs, 0),
        token_usage=load.token_usage,
        gen_throughput=load.gen_throughput,
        max_running_requests=max(load.max_running_requests, 0),
        age_ms=0,  # read from the scheduler as the record is sent, not from an older sample
        cache_hit_rate=load.cache_hit_rate,
        num_used_tokens=load.num_used_tokens,
        max_total_num_tokens=load.max_total_num_tokens,
    )
    if queued_work_known:
        record.waiting_uncached_tokens = max(load.num_waiting_uncached_tokens, 0)
    for section in ("memory", "queues"):
        if load.HasField(section):
            source, target = getattr(load, section), getattr(record, section)
            for f in target.DESCRIPTOR.fields:
                if f.name in source.DESCRIPTOR.fields_by_name:
                    setattr(target, f.name, getattr(source, f.name))
    return record

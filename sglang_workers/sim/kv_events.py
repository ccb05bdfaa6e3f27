"""KV-cache events exactly as SGLang puts them on the wire: hashes, encodings, ZMQ publisher, replay.

A consumer (our router, Dynamo, llm-d) must not be able to tell the simulator from SGLang, so every
byte here follows SGLang 0.5.23 (checked against payloads recorded from it, ``../shared/sglang-events``):

* block hash: SHA-256 chain over pages, ``d_i = sha256(d_{i-1} || tokens as u32 LE)``; a page holding a
  token >= 2**32 is hashed as ``0xff`` + u64 LE tokens; a salted chain starts from
  ``sha256(b"sglang-cache-salt-v1\\0" + salt)``; the published int is ``digest[:8]`` big-endian signed.
* payload: msgpack ``[ts, events, attn_dp_rank]``; events are tagged maps (0.5.20+: ``type`` first, then
  the fields, ``None`` fields left out except ``parent_block_hash`` and ``lora_id``) or positional
  arrays (<= 0.5.15: ``["BlockStored", hashes, parent, tokens, block_size, lora_id, medium]`` with
  trailing ``None`` left out).
* frames: ``topic``, ``seq`` (u64 big-endian, from 0 per process), ``payload``.
* replay: a ROUTER socket; ``[b"", start_seq]`` asks for every buffered batch from ``start_seq``;
  the replies are ``[topic, seq, payload]`` (0.5.23) or ``[seq, payload]`` (<= 0.5.20), then an end
  marker with seq -1 and an empty payload.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import struct
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import msgpack
import zmq
import zmq.asyncio

from prefix_common.tasks import cancel_and_wait

__all__ = [
    "MEDIUM_GPU",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEvent",
    "KVEventPublisher",
    "decode_payload",
    "encode_payload",
    "hash_to_int64",
    "merge_events",
    "page_digest",
    "salt_prior",
]

logger = logging.getLogger(__name__)

MEDIUM_GPU = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_WIDE = 1 << 32


# -- hashing ---------------------------------------------------------------------------------------
def salt_prior(cache_salt: str) -> bytes:
    """The digest a salted chain starts from (SGLang's domain-separated salt seed)."""
    return hashlib.sha256(b"sglang-cache-salt-v1\0" + cache_salt.encode("utf-8")).digest()


def page_digest(prior: bytes | None, tokens: Sequence[int]) -> bytes:
    """SHA-256 of one page chained on the previous page's 32-byte digest."""
    hasher = hashlib.sha256()
    if prior is not None:
        hasher.update(prior)
    if tokens and (max(tokens) >= _WIDE or min(tokens) < 0):
        # SGLang's native hasher switches a page with a wide id to a marker byte + u64 words.
        hasher.update(b"\xff" + struct.pack(f"<{len(tokens)}Q", *(t & 0xFFFFFFFFFFFFFFFF for t in tokens)))
    else:
        hasher.update(struct.pack(f"<{len(tokens)}I", *tokens))
    return hasher.digest()


def hash_to_int64(digest: bytes) -> int:
    """The block hash SGLang publishes for a page digest."""
    return int.from_bytes(digest[:8], "big", signed=True)


# -- events ----------------------------------------------------------------------------------------
@dataclass(slots=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    cache_salt: str | None = None


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: str | None = MEDIUM_GPU


@dataclass(slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def merge_events(events: Iterable[KVEvent]) -> list[KVEvent]:
    """Merge consecutive events the way SGLang 0.5.23 batches them.

    Consecutive ``BlockRemoved`` of one medium become one; a ``BlockStored`` whose parent is the last
    block of the previous ``BlockStored`` (same page size, salt, medium) extends it. Order is kept.
    """
    merged: list[KVEvent] = []
    for event in events:
        last = merged[-1] if merged else None
        if isinstance(event, BlockRemoved) and isinstance(last, BlockRemoved) and last.medium == event.medium:
            last.block_hashes.extend(event.block_hashes)
            continue
        if (
            isinstance(event, BlockStored)
            and isinstance(last, BlockStored)
            and event.parent_block_hash == last.block_hashes[-1]
            and (event.block_size, event.cache_salt, event.medium, event.lora_id)
            == (last.block_size, last.cache_salt, last.medium, last.lora_id)
        ):
            last.block_hashes.extend(event.block_hashes)
            last.token_ids.extend(event.token_ids)
            continue
        copy: KVEvent = event  # merging extends lists in place: never those of the caller's events
        if isinstance(event, BlockStored):
            copy = BlockStored(
                list(event.block_hashes),
                event.parent_block_hash,
                list(event.token_ids),
                event.block_size,
                event.lora_id,
                event.medium,
                event.cache_salt,
            )
        elif isinstance(event, BlockRemoved):
            copy = BlockRemoved(list(event.block_hashes), event.medium)
        merged.append(copy)
    return merged


# -- encoding --------------------------------------------------------------------------------------
EventFormat = Literal["tagged", "positional"]


def _tagged(event: KVEvent) -> dict[str, Any]:
    if isinstance(event, BlockStored):
        out: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": event.block_hashes,
            "parent_block_hash": event.parent_block_hash,
            "token_ids": event.token_ids,
            "block_size": event.block_size,
            "lora_id": event.lora_id,
        }
        if event.medium is not None:
            out["medium"] = event.medium
        if event.cache_salt is not None:
            out["cache_salt"] = event.cache_salt
        return out
    if isinstance(event, BlockRemoved):
        out = {"type": "BlockRemoved", "block_hashes": event.block_hashes}
        if event.medium is not None:
            out["medium"] = event.medium
        return out
    return {"type": "AllBlocksCleared"}


def _positional(event: KVEvent) -> list[Any]:
    if isinstance(event, BlockStored):
        row: list[Any] = [
            "BlockStored",
            event.block_hashes,
            event.parent_block_hash,
            event.token_ids,
            event.block_size,
            event.lora_id,
        ]
        if event.medium is not None:
            row.append(event.medium)
        return row
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", event.block_hashes] + ([event.medium] if event.medium is not None else [])
    return ["AllBlocksCleared"]


def encode_payload(events: Sequence[KVEvent], ts: float, dp_rank: int | None = 0, fmt: EventFormat = "tagged") -> bytes:
    """The msgpack payload frame of one batch."""
    encode = _tagged if fmt == "tagged" else _positional
    payload: bytes = msgpack.packb([ts, [encode(e) for e in events], dp_rank], use_bin_type=True)
    return payload


def _decode_event(raw: Any) -> KVEvent:
    if isinstance(raw, dict):
        kind = raw.get("type")
        if kind == "BlockStored":
            return BlockStored(
                list(raw["block_hashes"]),
                raw.get("parent_block_hash"),
                list(raw["token_ids"]),
                raw["block_size"],
                raw.get("lora_id"),
                raw.get("medium"),
                raw.get("cache_salt"),
            )
        if kind == "BlockRemoved":
            return BlockRemoved(list(raw["block_hashes"]), raw.get("medium"))
        if kind == "AllBlocksCleared":
            return AllBlocksCleared()
        raise ValueError(f"unknown event type {kind!r}")
    if isinstance(raw, (list, tuple)) and raw:
        kind, rest = raw[0], list(raw[1:])
        if kind == "BlockStored":
            rest += [None] * (6 - len(rest))
            return BlockStored(list(rest[0]), rest[1], list(rest[2]), rest[3], rest[4], rest[5])
        if kind == "BlockRemoved":
            return BlockRemoved(list(rest[0]), rest[1] if len(rest) > 1 else None)
        if kind == "AllBlocksCleared":
            return AllBlocksCleared()
        raise ValueError(f"unknown event type {kind!r}")
    raise ValueError(f"malformed event {raw!r}")


def decode_payload(payload: bytes) -> tuple[float, list[KVEvent], int | None]:
    """Decode a payload frame in either encoding (used by tests and tools)."""
    raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    ts, events = raw[0], raw[1]
    dp_rank = raw[2] if len(raw) > 2 else None
    return ts, [_decode_event(e) for e in events], dp_rank


# -- publisher -------------------------------------------------------------------------------------
@dataclass
class KVEventPublisher:
    """ZMQ PUB socket plus replay ROUTER socket, driven from the worker's asyncio loop.

    ``publish`` is synchronous and cheap (PUB never blocks; SGLang's publisher thread likewise drops
    at the high-water mark), so the scheduler calls it at the end of every step like SGLang does.
    """

    host: str
    port: int
    replay_port: int | None
    topic: str = ""
    buffer_steps: int = 10_000
    dp_rank: int = 0
    event_format: EventFormat = "tagged"
    replay_format: int = 3
    hwm: int = 100_000
    _ctx: zmq.asyncio.Context | None = field(default=None, init=False)
    _pub: zmq.Socket | None = field(default=None, init=False)
    _replay: zmq.asyncio.Socket | None = field(default=None, init=False)
    _buffer: deque[tuple[int, bytes]] = field(default_factory=deque, init=False)
    _seq: int = field(default=0, init=False)
    _task: asyncio.Task[None] | None = field(default=None, init=False)
    _listeners: list[Callable[[int, bytes, list[KVEvent]], None]] = field(default_factory=list, init=False)

    def start(self) -> None:
        """Bind the sockets (raises ``zmq.ZMQError`` if a port is taken)."""
        self._buffer = deque(maxlen=self.buffer_steps)
        self._ctx = zmq.asyncio.Context()
        # A plain (blocking-API) socket: publish() sends synchronously with NOBLOCK, no future to await.
        self._pub = zmq.Socket(self._ctx, zmq.PUB)
        self._pub.set_hwm(self.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(f"tcp://{self.host}:{self.port}")
        if self.replay_port is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(f"tcp://{self.host}:{self.replay_port}")
            self._task = asyncio.get_running_loop().create_task(self._serve_replay())

    @property
    def next_seq(self) -> int:
        return self._seq

    def buffered(self) -> list[tuple[int, bytes]]:
        """The batches kept for replay, oldest first, as ``(seq, payload)``."""
        return list(self._buffer)

    def add_listener(self, listener: Callable[[int, bytes, list[KVEvent]], None]) -> None:
        """Call ``listener(seq, payload, events)`` with every batch published from now on, right after it is sent.

        ``payload`` is the frame ZMQ carried and ``events`` what it encodes (merged), so another front door
        (the gRPC ``SubscribeKvEvents`` stream) relays exactly what ZMQ subscribers get.
        """
        self._listeners.append(listener)

    def publish(self, events: Sequence[KVEvent], ts: float | None = None) -> int | None:
        """Send one batch (merged like SGLang); returns its seq, or None when there was nothing to send."""
        if not events:
            return None
        merged = merge_events(events)
        payload = encode_payload(merged, time.time() if ts is None else ts, self.dp_rank, self.event_format)
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        if self._pub is not None:
            try:
                self._pub.send_multipart([self.topic.encode(), seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK)
            except zmq.Again:  # past the high-water mark: dropped, as SGLang's PUB does
                logger.warning("kv event batch %d dropped (high-water mark)", seq)
        for listener in self._listeners:
            listener(seq, payload, merged)
        return seq

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        while True:
            try:
                frames = await self._replay.recv_multipart()
            except (asyncio.CancelledError, zmq.ZMQError):
                return
            if len(frames) < 2 or len(frames[-1]) != 8:
                logger.warning("invalid replay request (%d frames)", len(frames))
                continue
            envelope = frames[:-1]  # identity (+ empty delimiter from REQ/DEALER clients)
            start = int.from_bytes(frames[-1], "big")
            topic = self.topic.encode()
            for seq, payload in list(self._buffer):
                if seq >= start:
                    body = [seq.to_bytes(8, "big"), payload]
                    await self._replay.send_multipart(envelope + ([topic] + body if self.replay_format == 3 else body))
            end = [END_SEQ, b""]
            await self._replay.send_multipart(envelope + ([b""] + end if self.replay_format == 3 else end))

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()
        self._pub = self._replay = None

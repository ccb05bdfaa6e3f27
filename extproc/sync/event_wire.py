"""SGLang's KV-event wire format, decoded: ``[ts, events, dp_rank]`` msgpack payloads.

Each ZMQ message of a publisher is three frames: ``topic``, ``seq`` (8 bytes, big-endian, from 0
at process start) and this payload. Both event encodings SGLang has shipped are decoded:
positional arrays with trailing defaults omitted (up to 0.5.15, msgspec ``array_like`` structs,
tag first) and maps tagged with ``type`` (0.5.20 and later). Event types added by later releases
are skipped, not refused. Pure functions, no I/O: ``extproc.sync.cache_view`` applies the result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

__all__ = [
    "END_OF_REPLAY",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "Event",
    "EventBatch",
    "EventDecodeError",
    "decode_payload",
    "decode_seq",
]

END_OF_REPLAY = -1  # the seq of the replay socket's end marker


class EventDecodeError(ValueError):
    """A payload that is not an SGLang KV-event batch."""


# Plain slotted classes, not frozen ones: a frozen dataclass's ``__init__`` sets each field through
# ``object.__setattr__`` (~2.5 us for ``BlockStored`` against ~0.5 us), paid twice per batch on the
# ingestion path. Nothing keeps or hashes a decoded event; the view applies it and drops it.
@dataclass(slots=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    cache_salt: str | None = None
    lora_name: str | None = None


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: str | None = None


@dataclass(slots=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class EventBatch:
    ts: float
    events: list[Event]
    dp_rank: int | None = None


_U63, _U64 = 1 << 63, 1 << 64


def _signed64(value: Any) -> int:
    # Hashes arrive as uint64 when non-negative and int64 when negative; normalise to signed.
    if not isinstance(value, int) or isinstance(value, bool):
        raise EventDecodeError(f"block hash must be an integer, got {type(value).__name__}")
    return value - _U64 if value >= _U63 else value


def _hashes(value: Any) -> list[int]:
    if not isinstance(value, (list, tuple)):
        raise EventDecodeError("block_hashes must be an array")
    if set(map(type, value)) <= {int}:  # the wire's case, checked in C: one pass, no call per hash
        return [v - _U64 if v >= _U63 else v for v in value]
    return [_signed64(v) for v in value]  # names the first bad element


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
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "cache_salt",
        "lora_name",
    ),
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
            tokens = fields["token_ids"]
            if type(tokens) is not list:  # msgpack hands over a fresh list: no copy needed then
                tokens = list(tokens)
            block_size = int(fields["block_size"])
        except (KeyError, TypeError, ValueError) as exc:
            raise EventDecodeError(f"BlockStored lacks token_ids/block_size: {exc}") from exc
        if block_size <= 0:
            raise EventDecodeError("BlockStored block_size must be positive")
        return BlockStored(
            block_hashes=_hashes(fields.get("block_hashes")),
            parent_block_hash=_opt_hash(fields.get("parent_block_hash")),
            token_ids=tokens,
            block_size=block_size,
            lora_id=fields.get("lora_id"),
            medium=_text(fields.get("medium")),
            cache_salt=_text(fields.get("cache_salt")),
            lora_name=_text(fields.get("lora_name")),
        )
    if kind == "BlockRemoved":
        return BlockRemoved(block_hashes=_hashes(fields.get("block_hashes")), medium=_text(fields.get("medium")))
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    return None  # event types added by later releases are not ours to interpret


def decode_payload(payload: bytes) -> EventBatch:
    """Decode one payload frame: ``[ts, events, dp_rank]`` in either encoding."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (
        ValueError,
        msgpack.exceptions.ExtraData,
        msgpack.exceptions.FormatError,
        msgpack.exceptions.StackError,
    ) as exc:
        raise EventDecodeError(f"payload is not msgpack: {exc}") from exc
    if not isinstance(raw, (list, tuple)) or len(raw) < 2 or not isinstance(raw[1], (list, tuple)):
        raise EventDecodeError("payload must be an array [ts, events, dp_rank]")
    events = [e for e in (_decode_event(item) for item in raw[1]) if e is not None]
    dp_rank = raw[2] if len(raw) > 2 and isinstance(raw[2], int) else None
    ts = float(raw[0]) if isinstance(raw[0], (int, float)) else 0.0
    return EventBatch(ts=ts, events=events, dp_rank=dp_rank)


def decode_seq(frame: bytes) -> int:
    """The ``seq`` frame: a big-endian signed 64-bit integer (``-1`` ends a replay)."""
    return int.from_bytes(frame, "big", signed=True)

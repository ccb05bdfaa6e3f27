"""KV-event batches as a worker's publisher puts them on the wire (msgpack ``[ts, events, dp_rank]``): written by
hand for the sync path's tests (pages of ``PAGE`` tokens), and read back independently of the router."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgpack

PAGE = 4
CLEARED = msgpack.packb([1.0, [{"type": "AllBlocksCleared"}], 0])


def stored(tokens: list[int], hashes: list[int], parent: int | None = None, medium: str = "GPU") -> bytes:
    """One ``BlockStored`` of ``tokens`` (whole pages), engine hashes ``hashes``, after the block ``parent``."""
    event = {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": PAGE,
        "lora_id": None,
        "medium": medium,
    }
    return msgpack.packb([1.0, [event], 0])


def removed(hashes: list[int], medium: str = "GPU") -> bytes:
    """One ``BlockRemoved`` of the blocks ``hashes``."""
    return msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}], 0])


def apply_events(blocks: set[int], events: Iterable[dict[str, Any]]) -> None:
    """Apply decoded events (msgpack maps) to ``blocks``, the engine hashes a worker holds: what its own stream
    says it caches, to hold the router's index against."""
    for event in events:
        if event["type"] == "BlockStored":
            blocks.update(event["block_hashes"])
        elif event["type"] == "BlockRemoved":
            blocks.difference_update(event["block_hashes"])
        else:
            blocks.clear()

"""Token ids -> block keys: the router's own prefix-block identity.

A block is a full ``block_size``-token page (equal to the workers' ``--page-size``); a trailing
partial page is never a block, exactly as SGLang never caches or publishes one. Keys are XXH3-64
chained: ``key_i = xxh3_64(key_{i-1} as 8 bytes LE || page tokens as u32 LE, seed)``, with a seed
derived from the model name, LoRA adapter and cache salt, so the same tokens under another model,
adapter or tenant salt never collide. The engine's own hash (SHA-256 in SGLang >= 0.5.6) is never
trusted for identity: events are re-keyed from their ``token_ids`` (see ``extproc.sync.cache_view``).
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Sequence

import xxhash

__all__ = ["block_keys", "chain_seed", "u32_bytes"]

_U64 = struct.Struct("<Q")


def chain_seed(model: str, lora: str | None = None, cache_salt: str | None = None) -> int:
    """The 64-bit seed of a key chain for one (model, LoRA, salt) namespace."""
    material = f"{model}\0{lora or ''}\0{cache_salt or ''}".encode()
    return xxhash.xxh3_64_intdigest(material)


def u32_bytes(tokens: Sequence[int]) -> bytes:
    """``tokens`` as u32 little-endian bytes, what a page's key hashes; OverflowError for ids outside u32."""
    if sys.byteorder != "little":
        try:
            return struct.pack(f"<{len(tokens)}I", *tokens)
        except struct.error as exc:
            raise OverflowError(str(exc)) from exc
    if isinstance(tokens, array) and tokens.typecode == "I":
        return tokens.tobytes()  # the tokenizer's ids (prefix_common.tokenization): already u32
    return array("I", tokens).tobytes()


def _page_bytes(page: Sequence[int]) -> bytes:
    if max(page, default=0) < 1 << 32 and min(page, default=0) >= 0:
        return struct.pack(f"<{len(page)}I", *page)
    # Wide ids (>= 2^32) cannot be packed as u32; mark the page and widen, as SGLang does.
    return b"\xff" + struct.pack(f"<{len(page)}Q", *page)


def block_keys(
    tokens: Sequence[int], block_size: int, seed: int = 0, parent: int | None = None, limit: int | None = None
) -> list[int]:
    """Chained keys of the full pages of ``tokens``.

    ``parent`` continues an existing chain (the key of the page before ``tokens[0]``); ``limit``
    caps the number of pages hashed (routing needs no more than the longest cached prefix).
    """
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    pages = len(tokens) // block_size
    if limit is not None:
        pages = min(pages, limit)
    if pages == 0:
        return []
    span = pages * block_size
    head = tokens[:span]
    try:
        data = u32_bytes(head)
        width = 4 * block_size
    except OverflowError:
        data = b""  # wide ids (or negative): page by page below
    hash64 = xxhash.xxh3_64_intdigest
    pack = _U64.pack
    keys: list[int] = []
    prev = parent
    if not data:
        for i in range(pages):
            body = _page_bytes(tokens[i * block_size : (i + 1) * block_size])
            prev = hash64(body if prev is None else pack(prev) + body, seed)
            keys.append(prev)
        return keys
    start = 0
    if prev is None:  # a chain's root page has no parent key in front
        prev = hash64(data[:width], seed)
        keys.append(prev)
        start = width
    append = keys.append
    for offset in range(start, pages * width, width):  # the hot loop: no branch per page
        prev = hash64(pack(prev) + data[offset : offset + width], seed)
        append(prev)
    return keys

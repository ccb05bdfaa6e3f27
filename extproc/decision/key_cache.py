"""Block keys of recent prompts, reused for the leading blocks a new prompt shares with one of them.

Prompts that share a prefix (a system prompt, a document, earlier turns) are the point of
prefix-aware routing, and hashing their blocks again is the largest part of a warm decision
(~0.2-0.4 ms for 8k tokens). Keys are chained, so the key of block ``i`` depends only on the seed and
tokens ``0 .. i``: the keys of the blocks a prompt shares byte for byte with a remembered one are
exactly that prompt's keys, and hashing continues from the last shared key (``parent``).

Remembered prompts are found by *anchors*: the hash of their first ``c`` blocks' token bytes for
``c`` = 1, 2, 4, 8, ... A new prompt probes its own anchors from the longest down; the first hit
is the latest prompt sharing at least ``c`` blocks with it (a miss at ``2c`` means none shares
``2c``), and comparing the bytes gives the exact shared run, so a collision of anchor hashes can
cost reuse but never correctness. Many sessions interleaving over one system prompt each find their
own earlier turn (their first blocks alone would all name the latest session's prompt). A prompt
that a later one extends is dropped (the later one covers it). Bounded by the bytes they take
(token data, keys and anchors; least recently used dropped). Thread-safe: the router hashes in its
tokenize threads.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from extproc.fleet.blocks import block_keys, u32_bytes

__all__ = ["KeyCache"]


_KEY_BYTES = 40  # one block key: an int object (32 B for 64 bits) and its list slot
_ENTRY_BYTES = 300  # per remembered prompt: its record, the LRU entry, bytes and list headers
_ANCHOR_BYTES = 150  # per anchor: the dict entry, its tuple key and ints

_Anchor = tuple[int, int, int, int]  # (seed, block size, blocks, hash of their token bytes)


@dataclass(slots=True)
class _Prompt:
    data: bytes
    keys: list[int]
    anchors: list[_Anchor]

    @property
    def cost(self) -> int:
        return len(self.data) + _KEY_BYTES * len(self.keys) + _ANCHOR_BYTES * len(self.anchors) + _ENTRY_BYTES


def _anchor_blocks(pages: int) -> list[int]:
    """1, 2, 4, ... up to ``pages``, longest first."""
    out: list[int] = []
    blocks = 1
    while blocks <= pages:
        out.append(blocks)
        blocks *= 2
    out.reverse()
    return out


class KeyCache:
    """``block_keys`` with reuse of the longest shared run of full blocks with a recent prompt."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._prompts: OrderedDict[int, _Prompt] = OrderedDict()  # id -> prompt, least recently used first
        self._anchors: dict[_Anchor, int] = {}  # anchor -> id of the latest prompt that has it
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._prompts)

    def keys(self, tokens: Sequence[int], block_size: int, seed: int, limit: int | None = None) -> list[int]:
        """Exactly ``block_keys(tokens, block_size, seed, limit=limit)``."""
        pages = len(tokens) // block_size
        if limit is not None:
            pages = min(pages, limit)
        if pages == 0 or self.max_bytes <= 0:
            return block_keys(tokens, block_size, seed, limit=limit)
        span = pages * block_size
        try:
            data = u32_bytes(tokens[:span])  # the same bytes block_keys hashes
        except OverflowError:  # wide ids: block_keys has its own encoding for those
            return block_keys(tokens, block_size, seed, limit=limit)
        width = 4 * block_size
        hash64 = xxhash.xxh3_64_intdigest
        anchors = [(seed, block_size, c, hash64(data[: c * width])) for c in _anchor_blocks(pages)]
        shared, source = 0, None
        with self._lock:
            for anchor in anchors:
                found = self._anchors.get(anchor)
                if found is not None:
                    source = found, self._prompts[found]
                    self._prompts.move_to_end(found)  # used: the least recently used go first
                    break
        if source is not None:
            old = source[1]
            shared = _shared_blocks(data, old.data, width, min(pages, len(old.keys)))
        if shared:
            keys = old.keys[:shared]
            keys += block_keys(tokens[shared * block_size : span], block_size, seed, parent=keys[-1])
        else:
            keys = block_keys(tokens, block_size, seed, limit=pages)
        prompt = _Prompt(data, keys, anchors)
        with self._lock:
            if source is not None and shared == len(source[1].keys):
                self._drop(source[0])  # this prompt extends it: it covers everything the old one did
            if prompt.cost <= self.max_bytes:
                self._add(prompt)
        return keys

    def _add(self, prompt: _Prompt) -> None:
        pid = next(self._ids)
        self._prompts[pid] = prompt
        for anchor in prompt.anchors:
            self._anchors[anchor] = pid  # the latest prompt with an anchor is the one found
        self.bytes += prompt.cost
        while self.bytes > self.max_bytes:
            self._drop(next(iter(self._prompts)))

    def _drop(self, pid: int) -> None:
        prompt = self._prompts.pop(pid, None)
        if prompt is None:
            return
        self.bytes -= prompt.cost
        for anchor in prompt.anchors:
            if self._anchors.get(anchor) == pid:  # a later prompt may have taken the anchor over
                del self._anchors[anchor]


def _shared_blocks(a: bytes, b: bytes, width: int, most: int) -> int:
    """How many leading ``width``-byte blocks ``a`` and ``b`` share (binary search of memcmp's)."""
    if a[: most * width] == b[: most * width]:
        return most
    low, high = 0, most  # ``low`` blocks are shared, ``high`` are not
    while high - low > 1:
        mid = (low + high) // 2
        if a[: mid * width] == b[: mid * width]:
            low = mid
        else:
            high = mid
    return low

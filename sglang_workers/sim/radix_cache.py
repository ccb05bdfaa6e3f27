"""SGLang's radix cache over token ids, without tensors, publishing the same KV events.

The tree follows ``sglang.srt.mem_cache.radix_cache.RadixCache`` (0.5.23) step for step, because what
a router learns from the events is only right if the tree splits, matches and evicts like SGLang's:

* keys are cut to whole pages; a child is found by its first page (plus the cache salt namespace);
  a partial trailing page is never cached nor published.
* ``match_prefix`` splits a node when the match ends inside it (which publishes nothing) and refreshes
  access times; ``insert`` does the same and creates one new leaf for the unmatched rest, which is one
  ``BlockStored`` carrying all of its pages.
* ``evict`` pops the least recently used unlocked leaves from a heap, pushing a parent once its last
  child went, until at least ``num_tokens`` are freed; each leaf is one ``BlockRemoved``.
* ``lock`` / ``unlock`` (SGLang's ``inc_lock_ref`` / ``dec_lock_ref``) pin the path of a running request.
* ``reset`` (construction, ``/flush_cache``) publishes ``AllBlocksCleared``.

Time is a logical clock: every place SGLang reads ``time.monotonic()`` takes the next tick, so LRU
order matches SGLang's without depending on clock resolution.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from .kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    hash_to_int64,
    merge_events,
    page_digest,
    salt_prior,
)

__all__ = ["RadixCache", "TierMatch", "TreeNode"]


class TreeNode:
    """One edge of the tree: a run of whole pages with their chained digests.

    The tier fields are used by ``HiRadixCache`` (``sglang_workers.sim.hiradix_cache``) only: without
    HiCache every node lives on the GPU and the rest keep their defaults.
    """

    __slots__ = (
        "backup",
        "children",
        "device",
        "digests",
        "from_storage",
        "hit_count",
        "host",
        "host_lock",
        "id",
        "key",
        "last_access",
        "lock_ref",
        "parent",
        "salt",
    )

    _ids = itertools.count()

    def __init__(
        self, parent: TreeNode | None, key: list[int], digests: list[bytes], tick: int, salt: str | None
    ) -> None:
        self.children: dict[Any, TreeNode] = {}
        self.parent = parent
        self.key = key
        self.digests = digests
        self.lock_ref = 0
        self.last_access = tick
        self.id = next(TreeNode._ids)
        self.salt = salt
        self.device = True  # KV in the GPU pool (SGLang: value is not None)
        self.host = False  # KV in the host pool (SGLang: host_value is not None, "backuped")
        self.hit_count = 0  # insert walks through the node (write_through_selective backs up at 2)
        self.backup: Any = None  # the device-to-host copy in flight for it, if any
        self.host_lock = 0  # pins the host copy (a load-back or prefetch reads it)
        self.from_storage = False  # its host copy came from L3 storage (never written back there)

    def __lt__(self, other: TreeNode) -> bool:  # heap tie-break, like SGLang's TreeNode.__lt__
        return (self.last_access, self.id) < (other.last_access, other.id)


@dataclass
class TierMatch:
    """A prefix match split by tier: the first ``device_len`` tokens on the GPU, then ``host_len`` in host memory."""

    device_len: int
    host_len: int
    device_node: TreeNode  # deepest matched node on the GPU (the root when none)
    node: TreeNode  # deepest matched node (== device_node without a host part)


class RadixCache:
    """Prefix tree of cached pages; sizes are in tokens; events queue until ``take_events``."""

    def __init__(self, page_size: int, enable_events: bool = True) -> None:
        if page_size < 1:
            raise ValueError("page_size must be >= 1")
        self.page_size = page_size
        self.enable_events = enable_events
        self._events: list[KVEvent] = []
        self._clock = itertools.count(1)
        self.reset()

    # -- public API --------------------------------------------------------------------------------
    def reset(self) -> None:
        """Drop everything (SGLang ``reset``: construction and ``/flush_cache``)."""
        self.root = TreeNode(None, [], [], next(self._clock), None)
        self.root.lock_ref = 1
        self._evictable_leaves: set[TreeNode] = set()
        self.evictable_size = 0
        self.protected_size = 0
        if self.enable_events:
            self._events.append(AllBlocksCleared())

    @property
    def total_size(self) -> int:
        """Tokens held by the tree (evictable + locked)."""
        return self.evictable_size + self.protected_size

    def page_align(self, length: int) -> int:
        return length // self.page_size * self.page_size

    def match_prefix(self, key: Sequence[int], salt: str | None = None) -> tuple[int, TreeNode]:
        """Longest cached whole-page prefix of ``key``: (length in tokens, last node)."""
        node, matched = self.root, 0
        for node in self._walk(list(key[: self.page_align(len(key))]), salt):
            matched += len(node.key)
        return matched, node

    def match(self, key: Sequence[int], salt: str | None = None) -> TierMatch:
        """``match_prefix`` by tier; without a host tier everything matched is on the GPU."""
        length, node = self.match_prefix(key, salt)
        return TierMatch(length, 0, node, node)

    def insert(self, key: Sequence[int], salt: str | None = None, inserted_len: int = 0) -> int:
        """Cache ``key`` (cut to whole pages); returns how many of its tokens were already cached.

        ``inserted_len`` (tokens this request inserted before) matters to HiCache's hit counts only. The walk is
        shared with ``HiRadixCache``, which adds its host tier through the hooks ``_reached`` (a cached node on
        the key's path), ``_stored`` (the new leaf) and ``_inserted`` (after the walk).
        """
        key = list(key[: self.page_align(len(key))])
        node, total = self.root, 0
        for node in self._walk(key, salt):
            self._reached(node, total + len(node.key) > inserted_len)
            total += len(node.key)
        rest = key[total:]
        if rest:
            leaf = self._new_leaf(node, rest, salt)
            self.evictable_size += len(rest)
            self._update_leaf_status(node)
            self._update_leaf_status(leaf)
            self._stored(leaf, total + len(rest) > inserted_len)
        self._inserted()
        return total

    def _walk(
        self, key: list[int], salt: str | None, stop: Callable[[TreeNode], bool] | None = None
    ) -> Iterator[TreeNode]:
        """The cached nodes along ``key`` (whole pages) from the root, each given this walk's access tick.

        The walk of ``match_prefix`` and ``insert`` (SGLang's ``_match_prefix_helper`` and ``_insert_helper``):
        where the match ends inside a node, that node is split and its upper part is the last one yielded.
        ``stop``: a node it holds for ends the walk before it (HiCache's tombstones).
        """
        node = self.root
        tick = next(self._clock)
        node.last_access = tick
        while key:
            child = node.children.get(self._child_key(key, salt))
            if child is None or (stop is not None and stop(child)):
                return
            child.last_access = tick
            n = self._match_len(child.key, key)
            if n < len(child.key):
                yield self._split(child, n)
                return
            yield child
            node = child
            key = key[n:]

    def _reached(self, node: TreeNode, new: bool) -> None:
        """``insert`` walked through ``node``, already cached (``new``: not inserted by this request before)."""

    def _stored(self, leaf: TreeNode, new: bool) -> None:
        """``insert`` added ``leaf``: SGLang publishes it as one ``BlockStored``."""
        self._record_store(leaf, MEDIUM_GPU)

    def _record_store(self, node: TreeNode, medium: str) -> None:
        """``node``'s pages now held in ``medium``: one ``BlockStored``."""
        if not self.enable_events:
            return
        parent = node.parent
        assert parent is not None
        self._events.append(
            BlockStored(
                block_hashes=[hash_to_int64(d) for d in node.digests],
                parent_block_hash=hash_to_int64(parent.digests[-1]) if parent.digests else None,
                token_ids=list(node.key),
                block_size=self.page_size,
                medium=medium,
                cache_salt=node.salt,
            )
        )

    def _record_remove(self, node: TreeNode, medium: str) -> None:
        """``node``'s pages gone from ``medium``: one ``BlockRemoved``."""
        if self.enable_events:
            self._events.append(BlockRemoved([hash_to_int64(d) for d in node.digests], medium))

    def _inserted(self) -> None:
        """``insert`` is done with its walk."""

    def _new_leaf(self, parent: TreeNode, key: list[int], salt: str | None) -> TreeNode:
        """A node for ``key`` under ``parent``, with its pages' chained digests, linked into the tree."""
        prior = parent.digests[-1] if parent.digests else (salt_prior(salt) if salt is not None else None)
        digests = []
        for start in range(0, len(key), self.page_size):
            prior = page_digest(prior, key[start : start + self.page_size])
            digests.append(prior)
        leaf = TreeNode(parent, key, digests, next(self._clock), salt)
        parent.children[self._child_key(key, salt)] = leaf
        return leaf

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` (if possible) from unlocked leaves, LRU first; returns tokens freed."""
        heap = list(self._evictable_leaves)
        heapq.heapify(heap)
        evicted = 0
        while evicted < num_tokens and heap:
            leaf = heapq.heappop(heap)
            evicted += len(leaf.key)
            self._delete_leaf(leaf)
            parent = leaf.parent
            assert parent is not None
            if not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, parent)
            self._record_remove(leaf, MEDIUM_GPU)
        return evicted

    def lock(self, node: TreeNode) -> None:
        """Pin ``node`` and its ancestors (a running request uses them); only GPU pages leave the evictable pool
        (with HiCache a host-only node on the path holds no GPU pages)."""
        while node is not self.root:
            if node.lock_ref == 0 and node.device:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
            node.lock_ref += 1
            self._update_leaf_status(node)
            assert node.parent is not None
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 1 and node.device:
                self.evictable_size += len(node.key)
                self.protected_size -= len(node.key)
            node.lock_ref -= 1
            self._update_leaf_status(node)
            assert node.parent is not None
            node = node.parent

    def take_events(self) -> list[KVEvent]:
        """The events since the last call, merged as SGLang publishes them in one batch."""
        events, self._events = self._events, []
        return merge_events(events)

    # -- internals ---------------------------------------------------------------------------------
    def _child_key(self, key: Sequence[int], salt: str | None) -> Any:
        plain = key[0] if self.page_size == 1 else tuple(key[: self.page_size])
        return plain if salt is None else (salt, plain)

    def _match_len(self, a: list[int], b: list[int]) -> int:
        """Tokens of ``a`` and ``b`` equal from the start, in whole pages (slice compares run in C)."""
        n = min(len(a), len(b))
        if a[:n] == b[:n]:
            return n
        step = self.page_size
        i = 0
        while i < n and a[i : i + step] == b[i : i + step]:
            i += step
        return i

    def _split(self, child: TreeNode, split_len: int) -> TreeNode:
        """Cut ``child`` after ``split_len`` tokens; the new upper node takes a fresh access tick."""
        pages = split_len // self.page_size
        parent = child.parent
        assert parent is not None
        upper = TreeNode(parent, child.key[:split_len], child.digests[:pages], next(self._clock), child.salt)
        upper.lock_ref = child.lock_ref
        parent.children[self._child_key(child.key, child.salt)] = upper
        child.key = child.key[split_len:]
        child.digests = child.digests[pages:]
        child.parent = upper
        upper.children[self._child_key(child.key, child.salt)] = child
        return upper

    def _delete_leaf(self, leaf: TreeNode) -> None:
        parent = leaf.parent
        assert parent is not None
        del parent.children[self._child_key(leaf.key, leaf.salt)]
        self.evictable_size -= len(leaf.key)
        self._evictable_leaves.discard(leaf)
        self._update_leaf_status(parent)

    def _update_leaf_status(self, node: TreeNode) -> None:
        if node is self.root or node.lock_ref > 0 or node.children:
            self._evictable_leaves.discard(node)
        else:
            self._evictable_leaves.add(node)

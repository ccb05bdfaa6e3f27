"""SGLang's hierarchical cache (HiCache) over the radix tree: a host-memory tier behind the GPU pool.

In SGLang 0.5.23 HiCache is part of ``UnifiedRadixCache`` (``mem_cache/unified_radix_cache.py``,
tree states and KV events in ``mem_cache/unified_cache/unified_tree_core.py``). Each node holds its
pages on the GPU (``device``), in host memory (``host``, SGLang's "backuped"), or both; this module
follows its rules, because what a router learns from the events is only right if the tiers change
like SGLang's:

* **match**: one contiguous prefix, the GPU part first, then host-only nodes (a node on neither tier
  ends it). GPU nodes are closed under ancestors (eviction takes device leaves first, load-back fills
  the whole host path), so the host part always hangs below the GPU part.
* **hit counts** rise only in insert walks, once per request and span (``inserted_len``), and only on
  nodes on the GPU; a new leaf counts 1. ``write_through`` backs a node up at 1, ``write_through_selective``
  at 2 (normally a second request caching the prefix), ``write_back`` never at insert.
* **backup (GPU -> host)**: the node and its unbacked ancestors, root first; host space comes from
  host eviction, and the backup is skipped when there still is none. The node counts as backed up
  at once and stays locked until the copy is acknowledged, which SGLang sees at the start of a later
  scheduler iteration (``writing_check``): only then is ``BlockStored(CPU_PINNED)`` published.
* **device eviction**: LRU over device leaves (on the GPU, unlocked, no child on the GPU). A backed-up
  leaf is demoted (``BlockRemoved(GPU)``, the node stays host-only); under ``write_back`` an unbacked
  leaf is copied to host synchronously first (``BlockStored(CPU_PINNED)`` then ``BlockRemoved(GPU)``,
  same batch; the copy stalls the step), or dropped with its host-only subtree when the host pool is
  full; under the write-through policies an unbacked leaf is deleted (``BlockRemoved(GPU)``).
* **host eviction**: LRU over host-only leaves (``BlockRemoved(CPU_PINNED)``); under ``write_back``
  host copies of nodes still on the GPU are reclaimed first (``BlockRemoved(CPU_PINNED)``, the GPU copy
  stays). Under the write-through policies the host tier is inclusive of backed-up GPU nodes.
* **load-back (host -> GPU)**: at admission, for a host part of at least ``LOAD_BACK_THRESHOLD`` tokens:
  ``BlockStored(GPU)`` per loaded node, root first, at once (before any byte moves); the host copy stays.
* **L3 graft** (``insert_host``): pages a storage prefetch landed become host-only nodes
  (``BlockStored(CPU_PINNED)``), to be loaded back like any host hit.
* **reset** (``/flush_cache``) clears both tiers: one ``AllBlocksCleared``.

Sizes: ``evictable_size`` / ``protected_size`` / ``total_size`` count GPU tokens only (the device
pool), ``host_used`` counts host copies plus what storage prefetches have reserved.
"""

from __future__ import annotations

import heapq
import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .kv_events import MEDIUM_GPU
from .radix_cache import RadixCache, TierMatch, TreeNode

__all__ = [
    "LOAD_BACK_THRESHOLD",
    "Backup",
    "HiCacheStats",
    "HiRadixCache",
    "host_pool_tokens",
]

logger = logging.getLogger(__name__)

MEDIUM_HOST = "CPU_PINNED"  # SGLang's StorageMedium.CPU
LOAD_BACK_THRESHOLD = 10  # SGLang's load_back_threshold: shorter host spans are recomputed
WRITE_THROUGH_THRESHOLD = {"write_through": 1, "write_through_selective": 2, "write_back": 2}


def _tombstone(node: TreeNode) -> bool:
    """A node on neither tier (its pages are gone, its children are not): matching stops there."""
    return not (node.device or node.host)


def host_pool_tokens(device_tokens: int, page_size: int, ratio: float, size_gb: int, bytes_per_token: int) -> int:
    """SGLang's host pool size (``pool_host/base.py``): ``--hicache-size`` GB when set, else ratio x device.

    One padding page is added, as ``page_num = size // page_size + 1`` does.
    """
    if size_gb > 0:
        if bytes_per_token <= 0:
            raise ValueError("--hicache-size needs a timing profile with KV bytes per token; use --hicache-ratio")
        size = int(size_gb * 1e9 // bytes_per_token)
    else:
        size = int(device_tokens * ratio)
    return (size // page_size + 1) * page_size


@dataclass(eq=False)
class Backup:
    """One merged device-to-host copy: the nodes it backs up (root first) and when it completes."""

    nodes: list[TreeNode]
    tokens: int
    done_at: float = 0.0  # on the scheduler's clock (simulated seconds)
    seconds: float = 0.0  # copy time on the D2H stream
    locked: list[TreeNode] = field(default_factory=list)  # write-through targets pinned until the ack


@dataclass
class HiCacheStats:
    """Counters behind SGLang's RadixCacheMetricsCollector figures."""

    evicted_tokens: int = 0
    backup_tokens: int = 0
    backup_ops: int = 0
    dropped_host_pressure: int = 0
    dropped_write_through_unbacked: int = 0
    host_evicted_tokens: int = 0


class HiRadixCache(RadixCache):
    """Radix tree with a host tier; ``clock`` and ``d2h_time`` come from the scheduler's timing profile."""

    def __init__(
        self,
        page_size: int,
        enable_events: bool = True,
        *,
        host_capacity: int,
        write_policy: str = "write_through",
        clock: Callable[[], float] = lambda: 0.0,
        d2h_time: Callable[[int], float] = lambda tokens: 0.0,
    ) -> None:
        if write_policy not in WRITE_THROUGH_THRESHOLD:
            raise ValueError(f"unknown write policy {write_policy!r}")
        self.host_capacity = host_capacity
        self.write_policy = write_policy
        self.write_back = write_policy == "write_back"
        self.threshold = WRITE_THROUGH_THRESHOLD[write_policy]
        self.clock = clock
        self.d2h_time = d2h_time
        self.stats = HiCacheStats()
        self._host_leaves: set[TreeNode] = set()
        self._duplicates: dict[int, TreeNode] = {}
        self._queued: list[TreeNode] = []  # nodes backed up this step (merged into one copy at flush)
        self._hit_targets: list[TreeNode] = []  # nodes an insert made hot enough to back up (write_through_selective)
        self._queued_locks: list[TreeNode] = []
        self._in_flight: deque[Backup] = deque()
        self._d2h_busy_until = 0.0
        self.sync_backups: list[Backup] = []  # write_back copies done inside eviction (they stall the step)
        self.host_used = 0
        self.host_reserved = 0
        super().__init__(page_size, enable_events)

    # -- public API ----------------------------------------------------------------------------
    def reset(self) -> None:
        """Both tiers go (SGLang's ``_reset_full`` clears the host pool too); L3 storage is untouched."""
        self._host_leaves = set()
        self._duplicates = {}
        self._queued, self._queued_locks = [], []
        self._in_flight = deque()
        self.sync_backups = []
        self.host_used = 0
        self.host_reserved = 0
        super().reset()

    @property
    def host_free(self) -> int:
        return self.host_capacity - self.host_used - self.host_reserved

    def match_prefix(self, key: Sequence[int], salt: str | None = None) -> tuple[int, TreeNode]:
        """The GPU part of the match (what the base scheduler path and LPM would use without a host tier)."""
        m = self.match(key, salt)
        return m.device_len, m.device_node

    def match(self, key: Sequence[int], salt: str | None = None) -> TierMatch:
        node = device_node = self.root
        device_len = host_len = 0
        for node in self._walk(list(key[: self.page_align(len(key))]), salt, stop=_tombstone):
            if node.device:
                device_len += len(node.key)
                device_node = node
            else:
                host_len += len(node.key)
        return TierMatch(device_len, host_len, device_node, node)

    def _reached(self, node: TreeNode, new: bool) -> None:
        if not node.device:
            self._unevict(node)  # this request computed it again (its load-back was skipped)
        if new and self._count_hit(node):
            self._hit_targets.append(node)

    def _stored(self, leaf: TreeNode, new: bool) -> None:
        self._record_store(leaf, MEDIUM_GPU)
        if new and self._count_hit(leaf):
            self._hit_targets.append(leaf)

    def _inserted(self) -> None:
        targets, self._hit_targets = self._hit_targets, []
        for target in targets:
            self._backup_through(target)

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` GPU tokens from device leaves, LRU first (demote, back up, or delete)."""
        heap = list(self._evictable_leaves)
        heapq.heapify(heap)
        evicted = 0
        while evicted < num_tokens and heap:
            leaf = heapq.heappop(heap)
            if leaf not in self._evictable_leaves:
                continue  # its state changed since the heap was built
            parent = leaf.parent
            assert parent is not None
            size = len(leaf.key)
            if leaf.host or (self.write_back and self._backup_sync(leaf)):
                self._demote(leaf)  # backed up (now, synchronously, under write_back): GPU copy freed
            elif self.write_back:
                self._drop_subtree(leaf)
                self.stats.dropped_host_pressure += size
            else:
                self._delete_device_leaf(leaf)
                if self.write_policy == "write_through":
                    self.stats.dropped_write_through_unbacked += size
            evicted += size
            if parent in self._evictable_leaves:
                heapq.heappush(heap, parent)
        self.stats.evicted_tokens += evicted
        return evicted

    def host_lock(self, node: TreeNode, delta: int) -> None:
        """Pin (``delta=1``) or unpin (``-1``) the host copies of ``node`` and its ancestors."""
        while node is not self.root:
            node.host_lock += delta
            self._update_leaf_status(node)
            assert node.parent is not None
            node = node.parent

    # -- load-back -------------------------------------------------------------------------------
    def host_path(self, match: TierMatch) -> list[TreeNode]:
        """The host-only nodes of a match, root first."""
        path = []
        node = match.node
        while node is not match.device_node:
            path.append(node)
            assert node.parent is not None
            node = node.parent
        path.reverse()
        return path

    def load_back(self, match: TierMatch) -> int:
        """Put the match's host part on the GPU (the caller made room); returns the tokens loaded.

        SGLang's ``commit_load_back``: the device values are set and ``BlockStored(GPU)`` is recorded
        for each node at once, before the copy runs; the host copies stay (duplicates).
        """
        loaded = 0
        for node in self.host_path(match):
            node.device = True
            size = len(node.key)
            if node.lock_ref > 0:
                self.protected_size += size
            else:
                self.evictable_size += size
            loaded += size
            self._record_store(node, MEDIUM_GPU)
            self._update_leaf_status(node)
            assert node.parent is not None
            self._update_leaf_status(node.parent)
            self._track_duplicate(node)
        return loaded

    # -- L3 storage graft --------------------------------------------------------------------------
    def insert_host(self, key: Sequence[int], salt: str | None, start: int, tokens: int) -> int:
        """Graft ``key[start:start+tokens]`` (pages a storage prefetch landed) as host-only nodes.

        The first ``start`` tokens must still be cached (the prefetch anchor); returns the tokens that
        became new host copies (pages the tree already had are not counted). Uses host space the
        prefetch reserved (``reserve_host``); the caller releases the reservation.
        """
        end = self.page_align(start + tokens)
        key = list(key[:end])
        node = self.root
        depth = 0
        while depth < end:
            child = node.children.get(self._child_key(key[depth:], salt))
            if child is None:
                break
            n = self._match_len(child.key, key[depth:])
            if n == 0:
                break
            if n < len(child.key):
                child = self._split(child, n)
            if not (child.device or child.host):
                return 0  # a tombstone in the way (transient here; SGLang refills it)
            depth += n
            node = child
        if depth < start:
            return 0  # the anchor is gone (SGLang: anchor_lost)
        rest = key[depth:]
        if not rest:
            return 0
        leaf = self._new_leaf(node, rest, salt)
        leaf.device = False
        leaf.host = True
        leaf.from_storage = True
        self.host_used += len(rest)
        self._update_leaf_status(leaf)
        self._update_leaf_status(node)
        self._record_store(leaf, MEDIUM_HOST)
        return len(rest)

    def reserve_host(self, tokens: int) -> bool:
        """Hold host space for a storage prefetch (evicting host pages if needed)."""
        if not self._make_host_room(tokens):
            return False
        self.host_reserved += tokens
        return True

    def release_host(self, tokens: int) -> None:
        self.host_reserved = max(0, self.host_reserved - tokens)

    # -- backups ---------------------------------------------------------------------------------
    def flush_backups(self) -> Backup | None:
        """Merge this step's write-through backups into one copy on the D2H stream (SGLang ``start_writing``)."""
        if not self._queued:
            return None
        nodes, locked = self._queued, self._queued_locks
        self._queued, self._queued_locks = [], []
        tokens = sum(len(n.key) for n in nodes)
        op = Backup(nodes, tokens, locked=locked)
        for node in nodes:
            node.backup = op
        op.seconds = self.d2h_time(tokens)
        op.done_at = max(self.clock(), self._d2h_busy_until) + op.seconds
        self._d2h_busy_until = op.done_at
        self._in_flight.append(op)
        return op

    @property
    def next_ack_at(self) -> float | None:
        """When the oldest copy in flight completes (None: nothing in flight)."""
        return self._in_flight[0].done_at if self._in_flight else None

    def poll_backups(self) -> list[Backup]:
        """Acknowledge the copies that completed (SGLang ``writing_check``): publish their host stores."""
        done: list[Backup] = []
        now = self.clock()
        while self._in_flight and self._in_flight[0].done_at <= now:
            op = self._in_flight.popleft()
            for node in op.nodes:
                node.backup = None
                if node.host and self._in_tree(node):
                    self._record_store(node, MEDIUM_HOST)
                    self._track_duplicate(node)
            for node in op.locked:
                self.unlock(node)
            self.stats.backup_tokens += op.tokens
            self.stats.backup_ops += 1
            done.append(op)
        return done

    def take_sync_backups(self) -> list[Backup]:
        """The write_back copies evictions did since the last call (their time stalls the step)."""
        out, self.sync_backups = self.sync_backups, []
        for op in out:
            self.stats.backup_tokens += op.tokens
            self.stats.backup_ops += 1
        return out

    # -- internals -------------------------------------------------------------------------------
    def _in_tree(self, node: TreeNode) -> bool:
        parent = node.parent
        return parent is not None and parent.children.get(self._child_key(node.key, node.salt)) is node

    def _count_hit(self, node: TreeNode) -> bool:
        """SGLang ``_inc_hit_count_and_check``: count the walk; True when the node should be backed up."""
        if not node.device or self.write_back:
            return False
        node.hit_count += 1
        return not node.host and node.hit_count >= self.threshold

    def _backup_through(self, target: TreeNode) -> None:
        """Write-through backup of ``target`` and its unbacked ancestors (root first), or nothing."""
        chain = []
        node = target
        while node is not self.root and not node.host:
            chain.append(node)
            assert node.parent is not None
            node = node.parent
        if not chain:
            return
        chain.reverse()
        tokens = sum(len(n.key) for n in chain)
        if not self._make_host_room(tokens):
            return  # SGLang skips the backup when the host pool has no room even after eviction
        for node in chain:
            node.host = True
            self._update_leaf_status(node)
        self.host_used += tokens
        self.lock(target)  # pinned until the copy is acknowledged
        self._queued.extend(chain)
        self._queued_locks.append(target)

    def _backup_sync(self, leaf: TreeNode) -> bool:
        """write_back: copy an unbacked device leaf to host inside eviction; publish its host store now."""
        size = len(leaf.key)
        if not self._make_host_room(size):
            return False
        leaf.host = True
        self.host_used += size
        self._record_store(leaf, MEDIUM_HOST)
        seconds = self.d2h_time(size)
        self.sync_backups.append(Backup([leaf], size, done_at=self.clock(), seconds=seconds))
        return True

    def _demote(self, node: TreeNode) -> None:
        """Free the GPU copy of a backed-up device leaf; it stays in the tree, host-only."""
        node.device = False
        self.evictable_size -= len(node.key)
        self._duplicates.pop(node.id, None)
        self._record_remove(node, MEDIUM_GPU)
        self._update_leaf_status(node)
        assert node.parent is not None
        self._update_leaf_status(node.parent)

    def _unevict(self, node: TreeNode) -> None:
        """An insert recomputed a host-only node: it is on the GPU again (and keeps its host copy)."""
        node.device = True
        if node.lock_ref > 0:
            self.protected_size += len(node.key)
        else:
            self.evictable_size += len(node.key)
        self._record_store(node, MEDIUM_GPU)
        self._update_leaf_status(node)
        assert node.parent is not None
        self._update_leaf_status(node.parent)
        self._track_duplicate(node)

    def _delete_device_leaf(self, leaf: TreeNode) -> None:
        """An unbacked device leaf goes entirely (``BlockRemoved(GPU)``), with any host-only children."""
        for child in list(leaf.children.values()):
            self._drop_host_subtree(child)
        self._record_remove(leaf, MEDIUM_GPU)
        self.evictable_size -= len(leaf.key)
        self._remove_node(leaf)

    def _drop_subtree(self, leaf: TreeNode) -> None:
        """write_back under host pressure: host-only descendants first (CPU_PINNED removes), then the leaf."""
        self._delete_device_leaf(leaf)

    def _drop_host_subtree(self, node: TreeNode) -> None:
        for child in list(node.children.values()):
            self._drop_host_subtree(child)
        if node.host:
            self._record_remove(node, MEDIUM_HOST)
            self.host_used -= len(node.key)
        self._remove_node(node)

    def _remove_node(self, node: TreeNode) -> None:
        parent = node.parent
        assert parent is not None
        del parent.children[self._child_key(node.key, node.salt)]
        self._evictable_leaves.discard(node)
        self._host_leaves.discard(node)
        self._duplicates.pop(node.id, None)
        self._update_leaf_status(parent)
        # A parent left on neither tier with no children is a tombstone: it goes too (no event).
        if parent is not self.root and not parent.children and not (parent.device or parent.host):
            self._remove_node(parent)

    def _make_host_room(self, tokens: int) -> bool:
        if self.host_free < tokens:
            self._evict_host(tokens - self.host_free)
        return self.host_free >= tokens

    def _evict_host(self, num_tokens: int) -> int:
        """Free host copies: under write_back, duplicates of GPU nodes first; then host-only leaves, LRU."""
        freed = 0
        if self.write_back:
            for spare_demotable in (True, False):
                for node in list(self._duplicates.values()):
                    if freed >= num_tokens:
                        break
                    if not (node.device and node.host) or node.backup is not None or node.host_lock > 0:
                        continue
                    if spare_demotable and node in self._evictable_leaves:
                        continue  # about to be demoted for free; take it only in the second pass
                    node.host = False
                    self.host_used -= len(node.key)
                    freed += len(node.key)
                    self._duplicates.pop(node.id, None)
                    self._record_remove(node, MEDIUM_HOST)
                    self._update_leaf_status(node)
        heap = list(self._host_leaves)
        heapq.heapify(heap)
        while freed < num_tokens and heap:
            leaf = heapq.heappop(heap)
            if leaf not in self._host_leaves:
                continue
            parent = leaf.parent
            assert parent is not None
            self._record_remove(leaf, MEDIUM_HOST)
            self.host_used -= len(leaf.key)
            freed += len(leaf.key)
            self._remove_node(leaf)
            if parent in self._host_leaves:
                heapq.heappush(heap, parent)
        self.stats.host_evicted_tokens += freed
        return freed

    def _track_duplicate(self, node: TreeNode) -> None:
        if node.device and node.host and node.backup is None:
            self._duplicates.setdefault(node.id, node)

    def _split(self, child: TreeNode, split_len: int) -> TreeNode:
        upper = super()._split(child, split_len)
        upper.device, upper.host = child.device, child.host
        upper.hit_count = child.hit_count
        upper.host_lock = child.host_lock
        upper.from_storage = child.from_storage
        op = child.backup
        if op is not None:  # the copy in flight covers both halves: the ack publishes both, root first
            upper.backup = op
            op.nodes.insert(op.nodes.index(child), upper)
        elif child in self._queued:
            self._queued.insert(self._queued.index(child), upper)
        self._track_duplicate(upper)
        self._update_leaf_status(upper)
        return upper

    def _update_leaf_status(self, node: TreeNode) -> None:
        if node is self.root:
            self._evictable_leaves.discard(node)
            self._host_leaves.discard(node)
            return
        if node.device and node.lock_ref == 0 and not any(c.device for c in node.children.values()):
            self._evictable_leaves.add(node)
        else:
            self._evictable_leaves.discard(node)
        if not node.device and node.host and not node.children and node.lock_ref == 0 and node.host_lock == 0:
            self._host_leaves.add(node)
        else:
            self._host_leaves.discard(node)

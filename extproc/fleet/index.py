"""Which worker holds which prefix block: the router's view of every worker's KV cache.

Three kinds of entry, kept apart because they deserve different trust:

- *confirmed* entries come from the workers' KV events (``extproc.sync``), one map per storage
  tier (GPU, host memory, disk): a key maps to a bitmask of worker slots, so one lookup answers for
  the whole fleet and a prompt's lookup costs one dict probe per block, however many workers exist;
- *recent* entries are the router's own record of what it sent where. For a worker whose events are
  flowing they live ``speculative_ttl_s`` (long enough for the worker to prefill and publish), so
  back-to-back requests with one prefix land together before the first event arrives; for a worker
  whose state is unknown (no events, or a gap that replay could not repair) they live
  ``fallback_ttl_s`` and are the only evidence the router has;
- *shared* entries are pages a storage tier holds that several workers read (SGLang HiCache's L3, e.g.
  the ``file`` backend on one directory). 0.5.23 publishes no events for L3, but every page a worker
  backs up to host memory (``BlockStored`` with medium ``CPU_PINNED``) is also written to its storage
  backend, so those pages are recorded per storage group (the workers sharing one backend) and count
  for every worker of the group. L3 keeps pages when host memory drops them, so removals do not
  touch this tier; it counts against the same memory bound as the rest;
- nothing else: an entry is never inferred.

Memory is bounded fleet-wide (``extproc.memory``): beyond ``max_blocks`` confirmed entries (all
workers, ranks and tiers together) the least recently stored blocks of the largest worker are
dropped, and beyond ``max_recent`` record entries the oldest decisions of the largest worker go;
both only ever under-claim a cache.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from extproc.config import IndexConfig
from extproc.memory import BLOCK_BYTES, RECENT_BYTES, MemoryPlan

__all__ = ["SHARED_TIER", "TIERS", "BlockIndex", "TierDepth", "rank_key", "tier_of"]

TIERS = ("gpu", "host", "disk")
SHARED_TIER = "shared"  # pages of a storage tier shared by a group of workers (keyed by group, not worker)
_GROUP_PREFIX = "storage-group:"

_MEDIUM_TIER = {
    None: "gpu",
    "GPU": "gpu",
    "CPU": "host",
    "CPU_PINNED": "host",
    "CPU_TIER": "host",
    "DISK": "disk",
    "EXTERNAL": "disk",
}


def rank_key(worker_id: str, rank: int) -> str:
    """The index slot of one data-parallel rank of a worker: its own id for rank 0, ``id#dpN`` after.

    Each rank of a ``--dp-size N`` worker has its own radix cache and publisher, so each gets its
    own slot; a single-rank worker keeps the slot named after it.
    """
    return worker_id if rank == 0 else f"{worker_id}#dp{rank}"


def tier_of(medium: str | None) -> str:
    """Map an SGLang ``medium`` to one of ``TIERS`` (unknown media count as the slowest tier)."""
    return _MEDIUM_TIER.get(medium.upper() if isinstance(medium, str) else medium, "disk")


def _set_depths(depth: dict[str, int], names: Mapping[int, str], bits: int, value: int) -> None:
    """``depth[worker] = value`` for each slot whose bit is set in ``bits``."""
    while bits:
        low = bits & -bits
        depth[names[low.bit_length() - 1]] = value
        bits ^= low


class _Tier:
    """Confirmed entries of one storage tier: key -> worker bitmask, plus per-worker LRU order.

    A slot's order is an ``OrderedDict`` (not a plain dict: eviction pops from the front, which a
    dict does in time proportional to the keys deleted before it). Keys go in one by one: its
    ``update`` is the generic mapping update, about twice the cost on the event path.
    """

    def __init__(self) -> None:
        self.holders: dict[int, int] = {}
        self.order: dict[int, OrderedDict[int, None]] = {}

    def add(self, slot: int, keys: Sequence[int]) -> int:
        """Store ``keys`` for ``slot`` (refreshing ones it has); returns how many are new."""
        bit = 1 << slot
        order = self.order.get(slot)
        if order is None:
            order = self.order[slot] = OrderedDict()
        holders = self.holders
        get = holders.get
        before = len(order)
        for key in keys:
            if key in order:
                order.move_to_end(key)
                continue
            order[key] = None
            holders[key] = get(key, 0) | bit
        return len(order) - before

    def evict(self, slot: int, count: int) -> int:
        """Drop the slot's ``count`` least recently stored keys; returns how many went."""
        bit = 1 << slot
        order = self.order.get(slot)
        dropped = 0
        while order and dropped < count:
            old, _ = order.popitem(last=False)
            self._clear_bit(old, bit)
            dropped += 1
        return dropped

    def remove(self, slot: int, keys: Iterable[int]) -> int:
        bit = 1 << slot
        order = self.order.get(slot)
        if not order:
            return 0
        holders, held, pop = self.holders, self.holders.get, order.pop
        removed = 0
        for key in keys:  # ``_clear_bit`` inlined: one call less per block on the event path
            if pop(key, 0) is None:
                mask = held(key, 0) & ~bit
                if mask:
                    holders[key] = mask
                else:
                    holders.pop(key, None)
                removed += 1
        return removed

    def clear(self, slot: int) -> int:
        bit = 1 << slot
        keys = self.order.pop(slot, ())
        for key in keys:
            self._clear_bit(key, bit)
        return len(keys)

    def _clear_bit(self, key: int, bit: int) -> None:
        mask = self.holders.get(key, 0) & ~bit
        if mask:
            self.holders[key] = mask
        else:
            self.holders.pop(key, None)

    def count(self, slot: int) -> int:
        return len(self.order.get(slot, ()))


@dataclass(frozen=True)
class TierDepth:
    """Leading blocks of a prompt a worker can serve from each tier, cumulatively.

    ``gpu``: on the GPU (or recently routed there); ``local``: on the GPU then in its host memory (the
    contiguous prefix the worker's own cache matches); ``shared``: ``local`` plus the run of following
    blocks its storage group holds (what a storage prefetch can bring in). ``gpu <= local <= shared``.
    """

    gpu: int
    local: int
    shared: int


class BlockIndex:
    """Per-worker block sets with fleet-wide lookup. Thread-safe (one lock; every call is short)."""

    def __init__(
        self,
        config: IndexConfig | None = None,
        clock: Callable[[], float] | None = None,
        max_blocks: int | None = None,
        max_recent: int | None = None,
    ) -> None:
        self.config = config or IndexConfig()
        plan = MemoryPlan.from_budget(256 * 1024 * 1024)  # the default budget's shares when none are given
        self.max_blocks = max_blocks if max_blocks is not None else plan.index_blocks
        self.max_recent = max_recent if max_recent is not None else plan.recent_keys
        self.blocks_total = 0  # confirmed entries, all slots and tiers
        self.recent_total = 0  # keys in the router's own record, all slots
        self._clock = clock or time.monotonic
        self._lock = threading.Lock()
        self._slots: dict[str, int] = {}
        self._free: list[int] = []
        self._tiers = {name: _Tier() for name in (*TIERS, SHARED_TIER)}
        # Router's own record: key -> {slot: time routed}; per slot a FIFO of (time, keys) for expiry.
        self._recent: dict[int, dict[int, float]] = {}
        self._recent_fifo: dict[int, deque[tuple[float, Sequence[int]]]] = {}
        self._recent_count: dict[int, int] = {}
        self._synced: int = 0  # bitmask of slots whose event stream is in sync (others: state unknown)
        # Called with (worker id, keys) after a worker's events evict blocks from its GPU pool, outside the lock:
        # the policy learns from a worker's evictions how much of the pool its cached prefixes really fill.
        self.eviction_listeners: list[Callable[[str, Sequence[int]], None]] = []

    # -- worker slots -------------------------------------------------------------------------
    def slot(self, worker_id: str) -> int:
        with self._lock:
            return self._slot(worker_id)

    def _slot(self, worker_id: str) -> int:
        slot = self._slots.get(worker_id)
        if slot is None:
            slot = self._free.pop() if self._free else len(self._slots)
            self._slots[worker_id] = slot
        return slot

    def forget(self, worker_id: str) -> None:
        """The worker left the fleet: drop everything about it and recycle its slot."""
        with self._lock:
            slot = self._slots.pop(worker_id, None)
            if slot is None:
                return
            self._clear_confirmed(slot)
            self._drop_recent(slot)
            self._synced &= ~(1 << slot)
            self._free.append(slot)

    # -- write path (events) ------------------------------------------------------------------
    def store(self, worker_id: str, keys: Sequence[int], tier: str = "gpu") -> None:
        with self._lock:
            self.blocks_total += self._tiers[tier].add(self._slot(worker_id), keys)
            if self.blocks_total > self.max_blocks:
                self._evict_confirmed(self.blocks_total - self.max_blocks)

    def _evict_confirmed(self, excess: int) -> None:
        """Drop ``excess`` entries, oldest first, from whichever worker (and tier) holds the most."""
        while excess > 0:
            tier, slot = max(
                ((t, s) for t in self._tiers.values() for s in t.order), key=lambda ts: len(ts[0].order[ts[1]])
            )
            # Down to the next largest holder at most, so that a large eviction is spread fairly.
            counts = sorted((len(o) for t in self._tiers.values() for o in t.order.values()), reverse=True)
            step = max(1, min(excess, counts[0] - (counts[1] if len(counts) > 1 else 0)))
            dropped = tier.evict(slot, step)
            if not dropped:
                return
            self.blocks_total -= dropped
            excess -= dropped

    def store_shared(self, group: str, keys: Sequence[int]) -> None:
        """Pages now held by a storage tier the workers of ``group`` share."""
        with self._lock:  # under the same memory budget as the workers' own entries
            self.blocks_total += self._tiers[SHARED_TIER].add(self._slot(_GROUP_PREFIX + group), keys)
            if self.blocks_total > self.max_blocks:
                self._evict_confirmed(self.blocks_total - self.max_blocks)

    def shared_size(self, group: str) -> int:
        with self._lock:
            slot = self._slots.get(_GROUP_PREFIX + group)
            return self._tiers[SHARED_TIER].count(slot) if slot is not None else 0

    def shared_groups(self) -> list[str]:
        with self._lock:
            return [w[len(_GROUP_PREFIX) :] for w in self._slots if w.startswith(_GROUP_PREFIX)]

    def remove(self, worker_id: str, keys: Sequence[int], tier: str = "gpu") -> None:
        with self._lock:
            slot = self._slot(worker_id)
            self.blocks_total -= self._tiers[tier].remove(slot, keys)
            if tier == "gpu" and self._recent:
                # The worker says these blocks are gone: a record of having sent them there (younger
                # than ``speculative_ttl_s``) must not claim them any longer. Real SGLang evicts a
                # prompt within a second of storing it when its pool is full.
                recent = self._recent
                for key in keys:
                    entry = recent.get(key)
                    if entry is not None and entry.pop(slot, None) is not None and not entry:
                        del recent[key]
        if tier == "gpu" and keys:
            for listener in self.eviction_listeners:
                listener(worker_id, keys)

    def clear(self, worker_id: str) -> None:
        """All confirmed entries of the worker go (``AllBlocksCleared``, restart, lost sync)."""
        with self._lock:
            self._clear_confirmed(self._slot(worker_id))

    def forget_routed(self, worker_id: str) -> None:
        """Drop the router's own record for the worker (it restarted: nothing it was sent survives)."""
        with self._lock:
            self._drop_recent(self._slot(worker_id))

    def _clear_confirmed(self, slot: int) -> None:
        for tier in self._tiers.values():
            self.blocks_total -= tier.clear(slot)

    def set_unknown(self, worker_id: str, unknown: bool) -> None:
        """Mark whether the worker's events are in sync (changes the record's TTL).

        Workers start unknown: one that never publishes events is judged by the router's record.
        """
        with self._lock:
            bit = 1 << self._slot(worker_id)
            self._synced = (self._synced & ~bit) if unknown else (self._synced | bit)

    # -- the router's own record ----------------------------------------------------------------
    def record_routed(self, worker_id: str, keys: Sequence[int]) -> None:
        """A request with these leading blocks was just sent to the worker."""
        if not keys:
            return
        with self._lock:
            slot = self._slot(worker_id)
            now = self._clock()
            self._expire(slot, now)
            recent = self._recent
            for key in keys:
                entry = recent.get(key)
                if entry is None:
                    recent[key] = {slot: now}
                else:
                    entry[slot] = now
            self._recent_fifo.setdefault(slot, deque()).append((now, keys))
            self._recent_count[slot] = self._recent_count.get(slot, 0) + len(keys)
            self.recent_total += len(keys)
            # Bound the record like the confirmed entries: the largest worker's oldest decisions first. Keys a
            # later decision sent again are that decision's now and stay (each key counts in the decision that
            # last wrote it, so what is held never exceeds the count).
            while self.recent_total > self.max_recent:
                largest = max(self._recent_count, key=self._recent_count.__getitem__)
                fifo = self._recent_fifo[largest]
                if not fifo or (largest == slot and len(fifo) <= 1):
                    break  # never drop the decision just recorded
                self._pop_recent(largest, fifo)

    def unrecord_routed(self, worker_id: str, keys: Sequence[int]) -> None:
        """Take back the record of the latest decision that sent ``keys`` to the worker (Envoy served it elsewhere)."""
        with self._lock:
            slot = self._slot(worker_id)
            fifo = self._recent_fifo.get(slot)
            if not fifo:
                return
            for position in range(len(fifo) - 1, -1, -1):
                stamp, recorded = fifo[position]
                if recorded is keys or list(recorded) == list(keys):
                    del fifo[position]
                    fifo.appendleft((stamp, recorded))
                    self._pop_recent(slot, fifo)
                    return

    def _expire(self, slot: int, now: float) -> None:
        fifo = self._recent_fifo.get(slot)
        if not fifo:
            return
        horizon = now - max(self.config.fallback_ttl_s, self.config.speculative_ttl_s)
        while fifo and fifo[0][0] < horizon:
            self._pop_recent(slot, fifo)

    def _pop_recent(self, slot: int, fifo: deque[tuple[float, Sequence[int]]]) -> None:
        stamp, keys = fifo.popleft()
        self._recent_count[slot] -= len(keys)
        self.recent_total -= len(keys)
        recent = self._recent
        for key in keys:
            entry = recent.get(key)
            # Only drop the entry this decision wrote; a later decision refreshed it otherwise.
            if entry is not None and entry.get(slot) == stamp:
                entry.pop(slot, None)
                if not entry:
                    del recent[key]

    def _drop_recent(self, slot: int) -> None:
        self.recent_total -= self._recent_count.pop(slot, 0)
        recent = self._recent
        for _, keys in self._recent_fifo.pop(slot, ()):
            for key in keys:
                entry = recent.get(key)
                if entry is not None:
                    entry.pop(slot, None)
                    if not entry:
                        del recent[key]

    # -- read path ------------------------------------------------------------------------------
    def match(
        self, keys: Sequence[int], worker_ids: Sequence[str], tier: str | Sequence[str] = "gpu"
    ) -> dict[str, int]:
        """Leading blocks of ``keys`` each worker holds (confirmed in ``tier``, or in any of several, or recently sent).

        Walks the prompt's keys once, carrying the set of workers still matching as a bitmask, and
        stops as soon as none does: cost is proportional to the matched prefix, not to the fleet.
        The answer lists the workers in the order of ``worker_ids`` (the router reads it in that order).
        """
        with self._lock:
            now = self._clock()
            slots = self._slots_of(worker_ids)
            self._expire_each(slots, now)
            alive = 0
            for slot in slots:
                alive |= 1 << slot
            depth = dict.fromkeys(worker_ids, 0)
            names: dict[int, str] | None = None  # slot -> worker id, built once some worker matches a block
            holders_get = self._holders_lookup((tier,) if isinstance(tier, str) else tuple(tier))
            fresh: list[float] | None = None  # per-slot record cutoffs, computed at the first record met
            recent_get = self._recent.get
            if alive and not alive & (alive - 1):  # one worker asked about: its own walk from the start
                slot = alive.bit_length() - 1
                depth[worker_ids[slots.index(slot)]] = self._walk_one(keys, 0, slot, holders_get, now)
                return depth
            for i, key in enumerate(keys):
                mask = holders_get(key, 0) & alive
                entry = recent_get(key) if mask != alive else None  # confirmed for all: skip the record
                if entry:
                    if fresh is None:
                        fresh = self._fresh_cutoffs(slots, now)
                    for slot, stamp in entry.items():
                        if stamp > fresh[slot]:
                            mask |= 1 << slot
                    mask &= alive
                if mask != alive:
                    if i:  # depths start at 0: only workers that matched some blocks are written
                        names = names or dict(zip(slots, worker_ids))
                        _set_depths(depth, names, alive & ~mask, i)
                    alive = mask
                    if not alive:
                        break
                    if not alive & (alive - 1):  # one worker left (the common case): a tighter walk for the rest
                        slot = alive.bit_length() - 1
                        depth[worker_ids[slots.index(slot)]] = self._walk_one(keys, i + 1, slot, holders_get, now)
                        break
            else:
                if alive:
                    _set_depths(depth, names or dict(zip(slots, worker_ids)), alive, len(keys))
            return depth

    def _walk_one(
        self, keys: Sequence[int], start: int, slot: int, holders_get: Callable[[int, int], int], now: float
    ) -> int:
        """The first index from ``start`` whose key ``slot`` holds neither confirmed nor in a fresh record.

        ``match`` with one worker left, decision for decision the same: one bit to test instead of a
        mask to carry, and the record read for that slot alone.
        """
        bit = 1 << slot
        cut = self._fresh_cutoff(slot, now)
        recent_get = self._recent.get
        end = len(keys)
        for i in range(start, end):
            key = keys[i]
            if not holders_get(key, 0) & bit:
                entry = recent_get(key)
                if entry is None:
                    return i
                stamp = entry.get(slot)
                if stamp is None or stamp <= cut:
                    return i
        return end

    def _slots_of(self, worker_ids: Sequence[str]) -> list[int]:
        """The slots of ``worker_ids`` (made for ids not seen before)."""
        known = self._slots
        try:
            return [known[w] for w in worker_ids]
        except KeyError:
            return [self._slot(w) for w in worker_ids]

    def _expire_each(self, slots: Sequence[int], now: float) -> None:
        """Drop the router's stale records of these slots (only slots holding one are visited further)."""
        fifos = self._recent_fifo
        if not fifos:
            return
        horizon = now - max(self.config.fallback_ttl_s, self.config.speculative_ttl_s)
        for slot in slots:
            fifo = fifos.get(slot)
            if fifo and fifo[0][0] < horizon:
                self._expire(slot, now)

    def _holders_lookup(self, tiers: tuple[str, ...]) -> Callable[[int, int], int]:
        """``key -> holder bitmask`` over one tier (a plain dict lookup: the hot case) or the union of several."""
        holder_maps = [self._tiers[t].holders for t in tiers]
        if len(holder_maps) == 1:
            return holder_maps[0].get

        def holders_get(key: int, default: int = 0) -> int:
            mask = default
            for holders in holder_maps:
                mask |= holders.get(key, 0)
            return mask

        return holders_get

    def _fresh_cutoffs(self, slots: Sequence[int], now: float) -> list[float]:
        """Per slot, the oldest record time still fresh (its TTL depends on the event state).

        Slots not asked about never match. Computed once per lookup, outside the per-key loop (the hot part).
        """
        fresh = [float("inf")] * (len(self._slots) + len(self._free))
        for slot in slots:
            fresh[slot] = self._fresh_cutoff(slot, now)
        return fresh

    def _fresh_cutoff(self, slot: int, now: float) -> float:
        """The oldest record time still fresh for one slot: events in sync keep it briefly, unknown ones longer."""
        ttl = self.config.speculative_ttl_s if self._synced >> slot & 1 else self.config.fallback_ttl_s
        return now - ttl

    def match_tiers(
        self, keys: Sequence[int], worker_ids: Sequence[str], groups: Mapping[str, str | None] | None = None
    ) -> dict[str, TierDepth]:
        """Per worker, how far the prompt reaches on its GPU, then its host memory, then its storage group."""
        gpu = self.match(keys, worker_ids, "gpu")
        local = self.match(keys, worker_ids, ("gpu", "host")) if self.has_tier("host") else gpu
        out: dict[str, TierDepth] = {}
        shared_holders = self._tiers[SHARED_TIER].holders
        runs: dict[tuple[str, int], int] = {}  # workers of one group starting at one depth share the walk
        for wid in worker_ids:
            g, l_ = gpu[wid], max(local[wid], gpu[wid])
            total = l_
            group = groups.get(wid) if groups else None
            if group is not None and shared_holders:
                run = runs.get((group, l_))
                if run is None:
                    with self._lock:
                        slot = self._slots.get(_GROUP_PREFIX + group)
                        run = 0
                        if slot is not None:
                            bit = 1 << slot
                            while l_ + run < len(keys) and shared_holders.get(keys[l_ + run], 0) & bit:
                                run += 1
                    runs[(group, l_)] = run
                total += run
            out[wid] = TierDepth(g, l_, total)
        return out

    def blocks(self, worker_id: str, tier: str = "gpu") -> set[int]:
        """The confirmed keys of one worker in one tier (a copy)."""
        with self._lock:
            slot = self._slots.get(worker_id)
            return set(self._tiers[tier].order.get(slot, ())) if slot is not None else set()

    def has_tier(self, tier: str) -> bool:
        """Whether any worker has confirmed entries in ``tier`` (skip lookups that cannot match)."""
        return bool(self._tiers[tier].holders)

    def memory(self) -> dict[str, int]:
        """Estimated bytes held: ``index`` (confirmed entries) and ``speculative`` (the router's record)."""
        return {"index": self.blocks_total * BLOCK_BYTES, "speculative": self.recent_total * RECENT_BYTES}

    def size(self, worker_id: str, tier: str = "gpu") -> int:
        with self._lock:
            slot = self._slots.get(worker_id)
            return self._tiers[tier].count(slot) if slot is not None else 0

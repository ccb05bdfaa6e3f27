"""One publisher's KV-event stream applied to the block index, strictly in ``seq`` order.

Per worker (and data-parallel rank) a ``WorkerCacheView`` turns decoded batches into index
entries:

- ``BlockStored`` carries one engine hash per page plus all the pages' ``token_ids``; the router
  never trusts the engine's hash for identity but recomputes its own chained keys from the tokens,
  continuing from the parent's own key, and remembers engine hash -> own key for later removals;
- ``BlockRemoved`` evicts through that map; ``AllBlocksCleared`` empties the worker;
- a jump in ``seq`` is a lost batch: the view holds the batch and asks its transport
  (``extproc.sync.subscriber``) for a replay of the missing ones; if the replay cannot fill the
  hole, the worker's entries are dropped (removals may have been missed) and its state is
  ``unknown`` until it is provably whole again;
- ``seq`` going backwards is a restarted worker: its entries are reset;
- a host-tier store (``medium`` ``CPU_PINNED``) of a worker in a storage group (HiCache workers sharing
  one L3 backend) is also recorded for the group: SGLang writes every acknowledged host copy to its
  storage backend, and L3 publishes nothing of its own.

No I/O here: the subscriber feeds ``ingest`` and ``replayed``; tests drive them directly.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from extproc.fleet.blocks import block_keys, chain_seed
from extproc.fleet.index import BlockIndex, tier_of
from extproc.memory import SharedBound
from extproc.sync.event_wire import BlockRemoved, BlockStored, EventBatch, EventDecodeError, decode_payload

__all__ = ["IndexState", "ViewStats", "WorkerCacheView"]

log = logging.getLogger(__name__)

IndexState = Literal["synced", "unknown"]


_TIER_BITS = {tier: 1 << position for position, tier in enumerate(("gpu", "host", "disk"))}
_MEDIUM_TIER_BIT: dict[str | None, tuple[str, int]] = {}


def _tier_bit(medium: str | None) -> tuple[str, int]:
    """The index tier of an event's ``medium`` and its bit in the engine-hash map (memoized: per event)."""
    found = _MEDIUM_TIER_BIT.get(medium)
    if found is None:
        tier = tier_of(medium)
        found = (tier, _TIER_BITS[tier])
        if len(_MEDIUM_TIER_BIT) < 64:  # media are a handful of names; never grow on garbage
            _MEDIUM_TIER_BIT[medium] = found
    return found


@dataclass
class ViewStats:
    """Counters of one view; read by ``extproc.routing.telemetry`` at scrape time."""

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
    model: str | Callable[[], str] = (
        ""  # the worker's served model (a callable: read at use, it may be discovered late)
    )
    resync_after_s: float = 60.0
    # The engine-hash maps of every view share one bound (``memory.budget_bytes``'s share); over it,
    # the largest map drops its oldest mappings (their later removals become no-ops).
    hashes: SharedBound | None = None
    max_hashes: int | None = None  # a bound of its own instead (tests)
    clock: Callable[[], float] = time.monotonic
    storage_group: Callable[[], str | None] | None = None  # the worker's shared storage tier, read at use
    last_seq: int | None = None
    block_size: int | None = None  # learnt from events
    stats: ViewStats = field(default_factory=ViewStats)
    _state: IndexState = "unknown"
    _unknown_since: float = 0.0
    _own: dict[int, tuple[int, int]] = field(default_factory=dict)  # engine hash -> (own key, tier bits)
    _pending: tuple[int, bytes] | None = None
    _seeds: dict[tuple[str, str | None, str | None], int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.hashes is None:
            self.hashes = SharedBound(self.max_hashes if self.max_hashes is not None else 6_000_000)
        self.hashes.members.append(self)
        self._unknown_since = self.clock()
        self.index.set_unknown(self.worker_id, True)

    # -- state ----------------------------------------------------------------------------------
    @property
    def state(self) -> IndexState:
        if (
            self._state == "unknown"
            and self.last_seq is not None
            and self.clock() - self._unknown_since >= self.resync_after_s
        ):
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
        self._forget_hashes()

    def _forget_hashes(self) -> None:
        assert self.hashes is not None
        self.hashes.used -= len(self._own)
        self._own.clear()

    def close(self) -> None:
        """The view is dropped (unsubscribed): give its share of the engine-hash bound back."""
        self._forget_hashes()
        assert self.hashes is not None
        if self in self.hashes.members:
            self.hashes.members.remove(self)

    def bound_size(self) -> int:
        return len(self._own)

    def shrink(self, count: int) -> int:
        """Drop up to ``count`` of the oldest engine-hash mappings (the shared bound is over)."""
        own = self._own
        count = min(count, len(own))
        for stale in list(itertools.islice(own, count)):
            del own[stale]
        assert self.hashes is not None
        self.hashes.used -= count
        return count

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

    @property
    def awaiting_replay(self) -> bool:
        """A live batch is held back until a replay fills the gap before it."""
        return self._pending is not None

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
                # SGLang flushes only an idle cache: nothing the router sent is still to be stored, so its record of
                # those sends (held ``speculative_ttl_s`` for a synced worker) names blocks that are gone too.
                self.index.forget_routed(self.worker_id)
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
        lora = (
            event.lora_name if event.lora_name is not None else (None if event.lora_id is None else str(event.lora_id))
        )
        keys = block_keys(event.token_ids, event.block_size, self._seed(lora, event.cache_salt), parent=parent)
        self.block_size = event.block_size
        tier, bit = _tier_bit(event.medium)
        own = self._own
        before = len(own)
        if own.keys().isdisjoint(event.block_hashes):  # the usual case: pages never seen before
            own.update(zip(event.block_hashes, zip(keys, itertools.repeat(bit))))
        else:
            for engine_hash, key in zip(event.block_hashes, keys):
                previous = own.get(engine_hash)
                own[engine_hash] = (key, (previous[1] if previous else 0) | bit)
        bound = self.hashes
        assert bound is not None
        bound.used += len(own) - before
        if bound.used > bound.limit:
            bound.reclaim()
        stored = keys[: len(event.block_hashes)]
        self.index.store(self.worker_id, stored, tier)
        if tier == "host" and self.storage_group is not None:
            group = self.storage_group()
            if group is not None:
                self.index.store_shared(group, stored)
        self.stats.blocks_stored += len(stored)

    def _removed(self, event: BlockRemoved) -> None:
        tier, bit = _tier_bit(event.medium)
        own = self._own
        pop = own.pop
        keys: list[int] = []
        kept = 0  # entries still held in another tier
        for engine_hash in event.block_hashes:
            entry = pop(engine_hash, None)
            if entry is None:
                continue
            key, bits = entry
            keys.append(key)
            bits &= ~bit
            if bits:
                own[engine_hash] = (key, bits)
                kept += 1
        if keys:
            assert self.hashes is not None
            self.hashes.used -= len(keys) - kept
        self.index.remove(self.worker_id, keys, tier)
        self.stats.blocks_removed += len(keys)

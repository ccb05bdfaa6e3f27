"""HiCache's L3 tier: SGLang's ``file`` storage backend, shared by every worker pointed at one directory.

What SGLang 0.5.23 does (``mem_cache/hicache_storage.py`` ``HiCacheFile``, the prefetch path of
``unified_radix_cache.py`` / ``managers/cache_controller.py``) and this module reproduces:

* **layout**: one flat directory; one file per page named ``{storage hash}{suffix}.bin``, written as a
  temporary file and renamed into place. The storage hash is the page's 64-hex SHA-256 chain, the same
  chain the KV events publish (its first 8 bytes are the event's block hash) unless a cache salt is
  set, which seeds it with ``storage_namespace_seed``. The suffix is ``_{model with '/' -> '-'}_{tp
  rank}_{tp size}``. Workers find each other's pages by name alone: no index, no events.
* **writes**: every node whose host copy is acknowledged is written, page by page, skipping pages
  already there (pages that came from storage are not written back). They run on a background thread
  of their own (SGLang's backup thread), apart from the prefetch thread that answers lookups, so a
  burst of writes never delays a lookup.
  The simulator has no KV tensors: a file holds the page's token ids, not its KV bytes.
* **prefetch** (on arrival, when the local match ends at the root or a backed-up node and the rest of
  the prompt, cut to pages, is at least ``prefetch_threshold`` tokens): existence checks in batches of
  128 pages up to the first miss, then reads of the hit pages; admission skips the request until the
  prefetch ends, which depends on ``--hicache-storage-prefetch-policy``: ``best_effort`` stops at the
  first admission poll with what has landed, ``wait_complete`` waits for all of it, ``timeout`` waits
  at most ``prefetch_timeout_base + prefetch_timeout_per_ki_token`` per 1024 requested tokens from the
  first poll that found it unfinished. Landed pages become host-only tree nodes
  (``BlockStored(CPU_PINNED)``) and are then loaded back like any host hit.
* **cost**: SGLang's ``file`` backend is real file I/O with no cost model; the simulator charges what
  SGLang's own ``sim`` benchmark backend sleeps (``storage/sim_storage.py``): per operation (a batch of
  up to 128 pages) ``sim_op_latency_us`` (100 us) plus bytes over ``sim_read_gbps`` (5 GB/s per rank);
  existence checks pay the latency only. Bytes are the profile's KV bytes per token.
* **eviction**: SGLang's ``LRUFileEvictor`` is off by default (unbounded storage); so is it here.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import struct
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config import StorageSettings
from .hiradix_cache import HiRadixCache
from .kv_events import page_digest
from .radix_cache import TreeNode

__all__ = ["STORAGE_BATCH_PAGES", "FileStorage", "PrefetchOp", "StoragePrefetcher", "StorageStats", "storage_chain"]

logger = logging.getLogger(__name__)

STORAGE_BATCH_PAGES = 128  # SGLang's STORAGE_BATCH_SIZE: pages per exists / read / write operation
PREFETCH_OCCUPANCY_LIMIT = 0.5  # prefetches may reserve at most this share of the host pool (rate limit)
UNFULFILLED_REASONS = (
    "below_threshold",
    "host_capacity",
    "device_capacity",
    "device_covered",
    "storage_transfer",
    "deadline",
    "anchor_lost",
    "aux_window_trim",
    "device_overlap",
    "cache_admission_shortfall",
    "dropped",
)


def storage_prior(cache_salt: str | None) -> bytes | None:
    """The digest a storage chain starts from: none, or SGLang's ``storage_namespace_seed`` for a salt."""
    if cache_salt is None:
        return None
    digest = hashlib.sha256(b"sglang-cache-namespace-v1")
    digest.update(b"\x00")  # no extra_key
    encoded = cache_salt.encode("utf-8")
    digest.update(b"\x01" + len(encoded).to_bytes(8, "little") + encoded)
    return digest.digest()


def storage_chain(tokens: Sequence[int], page_size: int, cache_salt: str | None) -> list[bytes]:
    """Storage digests of the whole pages of ``tokens`` (the hex of each names its file)."""
    prior = storage_prior(cache_salt)
    out = []
    for start in range(0, len(tokens) - len(tokens) % page_size, page_size):
        prior = page_digest(prior, tokens[start : start + page_size])
        out.append(prior)
    return out


@dataclass
class StorageStats:
    """Counters behind SGLang's StorageMetricsCollector figures."""

    prefetched_tokens: int = 0  # landed in host memory (L3 -> L2)
    backuped_tokens: int = 0  # written to storage (L2 -> L3)
    prefetch_hit_tokens: int = 0  # hits the existence checks found
    unfulfilled: dict[str, int] = field(default_factory=lambda: dict.fromkeys(UNFULFILLED_REASONS, 0))
    prefetch_ops: list[tuple[int, float]] = field(default_factory=list)  # (pages, GB/s) per read op, until taken


class FileStorage:
    """One worker's handle on a ``file`` backend directory (several workers may share it)."""

    def __init__(self, directory: Path, model: str, tp_rank: int = 0, tp_size: int = 1) -> None:
        self.directory = directory
        self.suffix = f"_{'-'.join(model.split('/'))}_{tp_rank}_{tp_size}"
        directory.mkdir(parents=True, exist_ok=True)

    def path(self, digest: bytes) -> Path:
        return self.directory / f"{digest.hex()}{self.suffix}.bin"

    def count_prefix(self, digests: Sequence[bytes]) -> int:
        """How many leading pages exist (SGLang ``batch_exists`` per 128 pages, stopping at the first miss)."""
        for i, digest in enumerate(digests):
            if not os.path.exists(self.path(digest)):
                return i
        return len(digests)

    def write(self, pages: Sequence[tuple[bytes, Sequence[int]]]) -> int:
        """Write the pages not stored yet (temporary file, then rename); returns how many were written."""
        written = 0
        for digest, tokens in pages:
            target = self.path(digest)
            if target.exists():
                continue  # HiCacheFile.set skips existing keys
            tmp = self.directory / f".{uuid.uuid4().hex}.tmp"
            try:
                tmp.write_bytes(struct.pack(f"<{len(tokens)}I", *(t & 0xFFFFFFFF for t in tokens)))
                os.replace(tmp, target)
                written += 1
            except OSError as exc:
                logger.warning("hicache file storage: cannot write %s: %s", target.name, exc)
                tmp.unlink(missing_ok=True)
        return written


@dataclass(eq=False)
class PrefetchOp:
    """One storage prefetch of one request: the pages it asked for and where it stands."""

    start: int  # token offset of the first requested page (the local match)
    digests: list[bytes]  # storage digests of the requested pages
    issued_at: float
    query: Future[int]
    hits: int | None = None  # pages found (None: the existence checks still run)
    reserved: int = 0  # host tokens held for the hit pages
    batch_done: list[float] = field(default_factory=list)  # when each read op completes
    deadline: float | None = None  # timeout policy: set at the first blocked admission poll

    @property
    def requested_tokens(self) -> int:
        return len(self.digests)


class StoragePrefetcher:
    """Storage prefetches and write-backs of one worker, on the scheduler's clock (simulated seconds)."""

    def __init__(
        self,
        storage: FileStorage,
        cache: HiRadixCache,
        settings: StorageSettings,
        policy: str,
        kv_bytes: Callable[[int], int],
        clock: Callable[[], float],
        wake: Callable[[], None],
    ) -> None:
        self.storage = storage
        self.cache = cache
        self.settings = settings
        self.policy = policy
        self.kv_bytes = kv_bytes
        self.clock = clock
        self.wake = wake
        self.page_size = cache.page_size
        self.threshold = max(settings.prefetch_threshold, cache.page_size)
        self.stats = StorageStats()
        self.ops: dict[Any, PrefetchOp] = {}
        # SGLang runs prefetch lookups and backups on separate threads; so does this.
        self._prefetch_io = ThreadPoolExecutor(1, thread_name_prefix="hicache-prefetch")
        self._backup_io = ThreadPoolExecutor(1, thread_name_prefix="hicache-backup")

    def close(self) -> None:
        self._prefetch_io.shutdown(wait=False, cancel_futures=True)
        self._backup_io.shutdown(wait=False, cancel_futures=True)

    async def drain(self) -> None:
        """Wait until the storage I/O queued so far is done (each thread runs its queue in order)."""
        loop = asyncio.get_running_loop()
        for io in (self._prefetch_io, self._backup_io):
            await loop.run_in_executor(io, lambda: None)

    # -- costs ---------------------------------------------------------------------------------
    def _op_seconds(self, pages: int, gbps: float) -> float:
        seconds = self.settings.sim_op_latency_us * 1e-6
        if gbps > 0:
            seconds += self.kv_bytes(pages * self.page_size) / (gbps * 1e9)
        return seconds

    # -- prefetch ------------------------------------------------------------------------------
    def start(self, key: Any, tokens: Sequence[int], salt: str | None, anchor: TreeNode, matched: int) -> bool:
        """Issue a prefetch for ``tokens[matched:]`` (cut to pages), as SGLang's ``_prefetch_kvcache`` does."""
        if not (anchor is self.cache.root or anchor.host):
            return False  # an unbacked anchor means a guaranteed storage miss
        end = self.cache.page_align(len(tokens) - 1)  # the last prompt token is always computed
        if end - matched < self.threshold:
            return False
        if self.cache.host_reserved >= PREFETCH_OCCUPANCY_LIMIT * self.cache.host_capacity:
            return False  # rate limited
        digests = storage_chain(tokens[:end], self.page_size, salt)[matched // self.page_size :]
        query = self._prefetch_io.submit(self.storage.count_prefix, digests)
        query.add_done_callback(lambda _f: self.wake())
        self.ops[key] = PrefetchOp(matched, digests, self.clock(), query)
        return True

    def pending(self, key: Any) -> bool:
        return key in self.ops

    def next_wake(self) -> float | None:
        """The earliest clock time at which a gated request could change state."""
        times = []
        for op in self.ops.values():
            if op.hits is not None and op.batch_done:
                times.append(op.batch_done[-1])
            if op.deadline is not None:
                times.append(op.deadline)
        return min(times) if times else None

    def poll(self, key: Any, tokens: Sequence[int], salt: str | None) -> tuple[bool, int]:
        """Admission's ``check_prefetch_progress``: (may the request go on, storage tokens it landed)."""
        op = self.ops.get(key)
        if op is None:
            return True, 0
        now = self.clock()
        if op.hits is None:
            if not op.query.done():
                return self._blocked(key, op, now, landed=0, tokens=tokens, salt=salt)
            self._query_finished(op)
            if op.hits == 0:
                del self.ops[key]
                return True, 0
        landed = sum(1 for t in op.batch_done if t <= now)
        landed_pages = min(op.hits or 0, landed * STORAGE_BATCH_PAGES)
        if landed_pages >= (op.hits or 0):
            return True, self._finish(key, op, landed_pages, tokens, salt)
        return self._blocked(key, op, now, landed=landed_pages, tokens=tokens, salt=salt)

    def _blocked(
        self, key: Any, op: PrefetchOp, now: float, landed: int, tokens: Sequence[int], salt: str | None
    ) -> tuple[bool, int]:
        if self.policy == "best_effort":
            return True, self._finish(key, op, landed, tokens, salt)
        if op.hits is None:
            # The existence checks run on a real thread; their simulated cost is charged from the
            # issue time once they answer, so the wait budget starts only then.
            return False, 0
        if self.policy == "timeout":
            if op.deadline is None:
                pages = op.requested_tokens
                per_page = self.page_size / 1024 * self.settings.prefetch_timeout_per_ki_token
                op.deadline = now + self.settings.prefetch_timeout_base + pages * per_page
            elif now >= op.deadline:
                return True, self._finish(key, op, landed, tokens, salt, expired=True)
        return False, 0

    def _query_finished(self, op: PrefetchOp) -> None:
        try:
            hits = op.query.result()
        except Exception as exc:  # an unreadable directory is a miss, not a crash
            logger.warning("hicache file storage: existence check failed: %s", exc)
            hits = 0
        checked = min(len(op.digests), hits + 1)
        query_s = -(-checked // STORAGE_BATCH_PAGES) * self.settings.sim_op_latency_us * 1e-6
        hit_tokens = hits * self.page_size
        self.stats.prefetch_hit_tokens += hit_tokens
        if hit_tokens < self.threshold:
            self.stats.unfulfilled["below_threshold"] += hit_tokens
            op.hits = 0
            return
        if not self.cache.reserve_host(hit_tokens):
            self.stats.unfulfilled["host_capacity"] += hit_tokens
            op.hits = 0
            return
        op.hits, op.reserved = hits, hit_tokens
        t = op.issued_at + query_s
        for first in range(0, hits, STORAGE_BATCH_PAGES):
            pages = min(STORAGE_BATCH_PAGES, hits - first)
            seconds = self._op_seconds(pages, self.settings.sim_read_gbps)
            t += seconds
            op.batch_done.append(t)
            gbps = self.kv_bytes(pages * self.page_size) / seconds / 1e9 if seconds > 0 else 0.0
            self.stats.prefetch_ops.append((pages, gbps))

    def _finish(
        self,
        key: Any,
        op: PrefetchOp,
        landed_pages: int,
        tokens: Sequence[int],
        salt: str | None,
        expired: bool = False,
    ) -> int:
        """End the prefetch: graft what landed as host nodes, release the reservation."""
        del self.ops[key]
        landed = landed_pages * self.page_size
        grafted = self.cache.insert_host(tokens, salt, op.start, landed) if landed else 0
        self.cache.release_host(op.reserved)
        self.stats.prefetched_tokens += landed
        short = op.reserved - landed
        if short > 0:
            self.stats.unfulfilled["deadline" if expired else "storage_transfer"] += short
        if landed and not grafted:
            self.stats.unfulfilled["anchor_lost"] += landed
        return grafted

    def cancel(self, key: Any) -> None:
        """The request went away (aborted): drop its prefetch."""
        op = self.ops.pop(key, None)
        if op is not None:
            self.cache.release_host(op.reserved)
            self.stats.unfulfilled["dropped"] += op.reserved

    # -- write-back to storage -------------------------------------------------------------------
    def write_nodes(self, nodes: Sequence[TreeNode]) -> None:
        """Write the pages of newly backed-up host nodes to storage (in the background)."""
        pages: list[tuple[bytes, Sequence[int]]] = []
        for node in nodes:
            if node.from_storage or not node.host:
                continue
            digests = self._node_storage_digests(node)
            for i, digest in enumerate(digests):
                pages.append((digest, node.key[i * self.page_size : (i + 1) * self.page_size]))
        if not pages:
            return
        future = self._backup_io.submit(self.storage.write, pages)

        def done(f: Future[int]) -> None:
            if not f.cancelled() and f.exception() is None:
                self.stats.backuped_tokens += f.result() * self.page_size

        future.add_done_callback(done)

    def _node_storage_digests(self, node: TreeNode) -> list[bytes]:
        if node.salt is None:
            return list(node.digests)  # unsalted: the event chain is the storage chain
        path: list[TreeNode] = []
        cursor: TreeNode | None = node
        while cursor is not None and cursor is not self.cache.root:
            path.append(cursor)
            cursor = cursor.parent
        tokens = [t for n in reversed(path) for t in n.key]
        chain = storage_chain(tokens, self.page_size, node.salt)
        return chain[len(chain) - len(node.digests) :]

"""Which waiting requests join the next prefill batch: SGLang 0.5.23's ``PrefillAdder``, on the simulated pool.

Queue order (``fcfs``, or ``lpm`` = longest cached prefix first, which falls back to fcfs above 128 waiting
requests), then per request the running-requests cap, the KV budget (free + evictable tokens minus what running
requests may still need: remaining ``max_new_tokens`` clipped to 4096 x ``new_token_ratio``), the
``--max-prefill-tokens`` budget and the ``--chunked-prefill-size`` budget; a request that does not fit the chunk
budget is chunked (cut to whole pages) and continues first in the next prefill batch. With HiCache a host hit of
at least 10 tokens counts as cached and is loaded back if its pages fit; a request whose storage prefetch still
runs is skipped this pass. The scheduler's batching loop calls ``next_prefill_batch`` once per iteration.
"""

from __future__ import annotations

import time
from typing import Protocol

from .config import SimWorkerConfig
from .hicache_storage import StoragePrefetcher
from .hiradix_cache import LOAD_BACK_THRESHOLD, HiRadixCache
from .metrics import SchedulerStats, record_admission
from .radix_cache import RadixCache, TierMatch, TreeNode
from .request import Request

__all__ = [
    "CLIP_MAX_NEW_TOKENS",
    "LPM_FALLBACK_QUEUE",
    "SchedulerState",
    "load_back",
    "next_prefill_batch",
    "ordered_waiting",
    "reserved_for_running",
]

CLIP_MAX_NEW_TOKENS = 4096  # SGLang's CLIP_MAX_NEW_TOKENS_ESTIMATION
LPM_FALLBACK_QUEUE = 128  # lpm turns into fcfs above this many waiting requests


class SchedulerState(Protocol):
    """What admission reads and changes of one rank's scheduler (``scheduler.Scheduler``)."""

    config: SimWorkerConfig
    cache: RadixCache
    hicache: HiRadixCache | None
    prefetcher: StoragePrefetcher | None
    waiting: list[Request]
    running: list[Request]
    chunked: Request | None  # the request whose prefill continues in the next batch
    prefilling: list[Request]  # the prefill batch being formed / in flight
    new_token_ratio: float
    stats: SchedulerStats

    @property
    def free_tokens(self) -> int: ...

    def ensure_free(self, tokens: int) -> bool: ...

    def page_ceil(self, tokens: int) -> int: ...


def ordered_waiting(s: SchedulerState) -> list[Request]:
    """The waiting queue in admission order: ``lpm`` (longest cached prefix first, up to 128 waiting) or fcfs."""
    if s.config.schedule_policy == "lpm" and len(s.waiting) <= LPM_FALLBACK_QUEUE:
        prefix = {}
        for r in s.waiting:  # host hits count as matched too (num_matched_prefix_tokens)
            m = s.cache.match(r.fill_ids[:-1], r.cache_salt)
            prefix[id(r)] = m.device_len + m.host_len
        return sorted(s.waiting, key=lambda r: -prefix[id(r)])
    return list(s.waiting)


def reserved_for_running(s: SchedulerState) -> float:
    """KV tokens the running requests may still need: remaining ``max_new_tokens`` (clipped) x new_token_ratio."""
    return sum(min(r.max_new_tokens - len(r.output_ids), CLIP_MAX_NEW_TOKENS) for r in s.running) * s.new_token_ratio


def next_prefill_batch(s: SchedulerState) -> list[Request]:
    """SGLang's ``PrefillAdder``: the next prefill batch (also ``s.prefilling``), possibly empty; may chunk one."""
    if not s.waiting and s.chunked is None:
        return []
    cfg = s.config
    rem_chunk = cfg.chunked_prefill_size
    rem_input = cfg.max_prefill_tokens
    offset = reserved_for_running(s)
    batch = s.prefilling = []

    if s.chunked is not None:  # an unfinished chunked prefill always continues first
        taken = _continue_chunked(s, s.chunked, batch, rem_chunk)
        if taken is None:
            return batch
        rem_chunk -= taken
        rem_input -= taken

    if len(s.running) + len(batch) >= cfg.max_running_requests:
        return batch
    for req in ordered_waiting(s):
        if len(s.running) + len(batch) >= cfg.max_running_requests or rem_chunk <= 0:
            break
        if s.prefetcher is not None:  # SGLang check_prefetch_progress: skip it while storage reads run
            ready, landed = s.prefetcher.poll(req, req.input_ids, req.cache_salt)
            req.storage_landed += landed
            if not ready:
                continue
        fill = req.fill_ids
        m = s.cache.match(fill[:-1], req.cache_salt)
        prefix_len, node = m.device_len, m.device_node
        host = m.host_len if m.host_len >= LOAD_BACK_THRESHOLD else 0  # shorter spans are recomputed
        extend = len(fill) - prefix_len - host
        s.cache.lock(node)  # lock first: a locked prefix no longer counts as evictable
        budget = s.free_tokens + s.cache.evictable_size - offset
        need = extend + min(req.max_new_tokens - len(req.output_ids), CLIP_MAX_NEW_TOKENS)
        if host:  # PrefillAdder reserves the loaded pages too (plus a page)
            need += host + s.config.page_size
        if need >= budget or (extend > rem_input and batch):
            s.cache.unlock(node)
            break
        loaded = 0
        if host:
            held, loaded = load_back(s, m)
            if held is None:
                break
            node = held
            prefix_len += loaded
        take = extend if extend <= rem_chunk else s.cache.page_align(rem_chunk)
        if take <= 0 or not s.ensure_free(s.page_ceil(prefix_len + take) - prefix_len):
            s.cache.unlock(node)
            break
        _admit(s, req, node, prefix_len, take, loaded)
        batch.append(req)
        rem_chunk -= take
        rem_input -= take
        if take < extend:
            s.chunked = req
            break
        offset += take + min(req.max_new_tokens - len(req.output_ids), CLIP_MAX_NEW_TOKENS)
    return batch


def _continue_chunked(s: SchedulerState, req: Request, batch: list[Request], rem_chunk: int) -> int | None:
    """The next chunk of the unfinished chunked prefill ``req``, added to ``batch``.

    Returns the tokens it takes when it finishes now (admission goes on), None when the batch ends here: the
    chunk did not fit, or more chunks follow.
    """
    remaining = len(req.fill_ids) - req.kv_len
    take = remaining if remaining <= rem_chunk else s.cache.page_align(rem_chunk)
    if take <= 0 or not s.ensure_free(s.page_ceil(req.kv_len + take) - s.page_ceil(req.kv_len)):
        return None
    req.chunk_prefix, req.chunk_len = req.kv_len, take
    req.load_tokens = 0
    req.kv_len += take
    batch.append(req)
    if take < remaining:
        return None
    s.chunked = None
    return take


def _admit(s: SchedulerState, req: Request, node: TreeNode, prefix_len: int, take: int, loaded: int) -> None:
    """Move ``req`` from the queue into the prefill batch: its KV extent, its chunk, and on its first admission
    what of its prompt was cached where (device, host, storage)."""
    s.waiting.remove(req)
    req.last_node, req.tree_len = node, prefix_len
    req.kv_len = prefix_len + take
    req.chunk_prefix, req.chunk_len = prefix_len, take
    req.load_tokens = loaded
    if req.cached_tokens < 0:
        req.cached_tokens = prefix_len
        req.admitted_at = time.monotonic()
        req.cached_storage = min(req.storage_landed, loaded)
        req.cached_host = loaded - req.cached_storage
        req.cached_device = prefix_len - loaded
        if not req.health_check:
            record_admission(s.stats, req)


def load_back(s: SchedulerState, m: TierMatch) -> tuple[TreeNode | None, int]:
    """Load a match's host part onto the GPU; moves the request's lock from its GPU part to all of it.

    Returns (the node now locked, tokens loaded), or (None, 0) with nothing locked when the GPU
    cannot make room (SGLang then answers NO_TOKEN).
    """
    cache = s.hicache
    assert cache is not None
    host_tokens = m.host_len
    cache.host_lock(m.node, 1)  # evictions that make room must not take the pages being loaded
    try:
        if not s.ensure_free(host_tokens):
            s.cache.unlock(m.device_node)
            return None, 0
        loaded = cache.load_back(m)
    finally:
        cache.host_lock(m.node, -1)
    cache.lock(m.node)
    cache.unlock(m.device_node)
    return m.node, loaded

"""HiCache in the simulator: the tier states, events and accounting of SGLang 0.5.23's UnifiedRadixCache.

The tree is driven directly (no sockets), so each test pins one rule of
``sglang/srt/mem_cache/unified_cache/unified_tree_core.py`` (see ``sglang_workers/sim/hiradix_cache.py``):
which events a transition publishes, in which order and with which medium, and what it does to the
GPU and host sizes. The scheduler tests run the real loop in-process with a huge speedup.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest

from sglang_workers.sim.config import SimWorkerConfig
from sglang_workers.sim.hiradix_cache import HiRadixCache, host_pool_tokens
from sglang_workers.sim.kv_events import AllBlocksCleared, BlockStored, KVEvent
from sglang_workers.sim.scheduler import Scheduler
from tests.support.sim_scheduler import PROFILE as BASE_PROFILE
from tests.support.sim_scheduler import VOCAB, Factory, finish, started

PAGE = 4
GPU, HOST = "GPU", "CPU_PINNED"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_cache(policy: str = "write_through", host: int = 64, d2h: float = 0.001) -> tuple[HiRadixCache, Clock]:
    clock = Clock()
    cache = HiRadixCache(PAGE, host_capacity=host, write_policy=policy, clock=clock, d2h_time=lambda n: d2h * n)
    cache.take_events()  # construction's AllBlocksCleared
    return cache, clock


def shape(events: list[KVEvent]) -> list[tuple[str, str | None, int]]:
    """(type, medium, pages) per event."""
    out: list[tuple[str, str | None, int]] = []
    for e in events:
        if isinstance(e, AllBlocksCleared):
            out.append(("AllBlocksCleared", None, 0))
        else:
            out.append((type(e).__name__, e.medium, len(e.block_hashes)))
    return out


def ack_all(cache: HiRadixCache, clock: Clock) -> None:
    cache.flush_backups()
    clock.now += 1000.0
    cache.poll_backups()


def tokens(base: int, n: int) -> list[int]:
    return list(range(base, base + n))


def test_write_through_publishes_the_host_copy_only_when_the_copy_is_acknowledged() -> None:
    cache, clock = make_cache()
    a = tokens(100, 16)
    cache.insert(a)
    stored = cache.take_events()
    assert shape(stored) == [("BlockStored", GPU, 4)]
    # Counted as backed up at once (host space taken), and pinned on the GPU until the ack.
    assert cache.host_used == 16 and cache.protected_size == 16 and cache.evictable_size == 0
    op = cache.flush_backups()
    assert op is not None and op.done_at == pytest.approx(0.016)
    clock.now = 0.01
    assert cache.poll_backups() == [] and cache.take_events() == []  # the copy still runs
    clock.now = 0.02
    assert len(cache.poll_backups()) == 1
    host = cache.take_events()
    assert shape(host) == [("BlockStored", HOST, 4)]
    gpu_store, host_store = stored[0], host[0]
    assert isinstance(gpu_store, BlockStored) and isinstance(host_store, BlockStored)
    # Same pages on both tiers: same hashes, parent and tokens; only the medium differs.
    assert host_store.block_hashes == gpu_store.block_hashes
    assert host_store.parent_block_hash == gpu_store.parent_block_hash is None
    assert host_store.token_ids == a
    assert cache.protected_size == 0 and cache.evictable_size == 16


def test_copies_queue_on_one_device_to_host_stream() -> None:
    cache, clock = make_cache(d2h=0.001)
    cache.insert(tokens(100, 16))
    first = cache.flush_backups()
    cache.insert(tokens(200, 8))
    second = cache.flush_backups()
    assert first is not None and second is not None
    assert second.done_at == pytest.approx(first.done_at + 0.008)  # waits for the first copy
    clock.now = first.done_at
    assert cache.poll_backups() == [first]


def test_demotion_frees_the_gpu_copy_and_keeps_the_page_in_host_memory() -> None:
    cache, clock = make_cache()
    a, b = tokens(100, 16), tokens(200, 16)
    cache.insert(a)
    ack_all(cache, clock)
    cache.take_events()
    assert cache.evict(16) == 16
    removed = cache.take_events()
    assert shape(removed) == [("BlockRemoved", GPU, 4)]  # no host event: the host copy stays
    assert cache.total_size == 0 and cache.host_used == 16
    m = cache.match(a)
    assert (m.device_len, m.host_len) == (0, 16)
    cache.insert(b)
    assert cache.match(b).device_len == 16


def test_load_back_publishes_gpu_stores_root_first_at_once() -> None:
    cache, clock = make_cache()
    prefix, a = tokens(100, 8), tokens(500, 8)
    cache.insert(prefix + a)
    cache.insert(prefix + tokens(900, 8))  # splits: prefix node with two children
    ack_all(cache, clock)
    cache.take_events()
    cache.evict(100)  # everything demoted, leaves first
    assert shape(cache.take_events()) == [("BlockRemoved", GPU, 6)]
    m = cache.match(prefix + a)
    assert (m.device_len, m.host_len) == (0, 16)
    cache.lock(m.device_node)
    assert cache.load_back(m) == 16
    events = cache.take_events()
    # One BlockStored per loaded node, root first; chained, so merged into one event as SGLang batches them.
    assert shape(events) == [("BlockStored", GPU, 4)]
    again = cache.match(prefix + a)
    assert (again.device_len, again.host_len) == (16, 0)
    assert cache.host_used == 24  # host copies stay (now duplicates)


def test_selective_backs_up_a_node_on_the_second_insert_through_it() -> None:
    cache, clock = make_cache("write_through_selective")
    a = tokens(100, 16)
    cache.insert(a)
    assert cache.host_used == 0 and cache.flush_backups() is None
    assert shape(cache.take_events()) == [("BlockStored", GPU, 4)]
    cache.insert(a, inserted_len=16)  # the same request inserting again does not count
    assert cache.flush_backups() is None
    cache.insert(a + tokens(900, 4))  # a second request walks through the node
    assert cache.host_used == 16  # the shared node is backed up; the new leaf (hit once) is not
    ack_all(cache, clock)
    assert shape(cache.take_events()) == [("BlockStored", GPU, 1), ("BlockStored", HOST, 4)]
    cache.evict(100)
    # The unbacked leaf is deleted, the backed one demoted: both are GPU removals.
    assert shape(cache.take_events()) == [("BlockRemoved", GPU, 5)]
    assert cache.match(a).host_len == 16


def test_write_through_deletes_an_unbacked_leaf_and_counts_the_drop() -> None:
    cache, _clock = make_cache(host=4)  # room for one page: the 4-page backup is skipped
    cache.insert(tokens(100, 16))
    assert cache.host_used == 0
    cache.take_events()
    cache.evict(16)
    assert shape(cache.take_events()) == [("BlockRemoved", GPU, 4)]
    assert cache.match(tokens(100, 16)).host_len == 0
    assert cache.stats.dropped_write_through_unbacked == 16


def test_write_back_copies_inside_eviction_host_store_then_gpu_removal() -> None:
    cache, _clock = make_cache("write_back")
    a = tokens(100, 16)
    cache.insert(a)
    assert cache.host_used == 0 and cache.flush_backups() is None  # nothing at insert
    cache.take_events()
    cache.evict(16)
    assert shape(cache.take_events()) == [("BlockStored", HOST, 4), ("BlockRemoved", GPU, 4)]
    sync = cache.take_sync_backups()
    assert [op.tokens for op in sync] == [16] and sync[0].seconds == pytest.approx(0.016)  # stalls the step
    assert cache.match(a).host_len == 16


def test_write_back_drops_the_leaf_when_host_memory_is_full() -> None:
    cache, _clock = make_cache("write_back", host=4)
    cache.insert(tokens(100, 16))
    cache.take_events()
    cache.evict(16)
    assert shape(cache.take_events()) == [("BlockRemoved", GPU, 4)]
    assert cache.stats.dropped_host_pressure == 16 and cache.host_used == 0


def test_host_pool_evicts_least_recently_used_host_only_leaves() -> None:
    cache, clock = make_cache(host=32)
    a, b, c = tokens(100, 16), tokens(200, 16), tokens(300, 16)
    for t in (a, b):
        cache.insert(t)
        ack_all(cache, clock)
        cache.evict(16)
    cache.match(a)  # a is now more recent than b
    cache.take_events()
    cache.insert(c)  # its backup needs room: b (least recent host leaf) goes
    assert shape(cache.take_events()) == [("BlockStored", GPU, 4), ("BlockRemoved", HOST, 4)]
    assert cache.match(b).host_len == 0 and cache.match(a).host_len == 16


def test_write_back_reclaims_host_copies_of_gpu_pages_first() -> None:
    cache, _clock = make_cache("write_back", host=16)
    a, b = tokens(100, 16), tokens(200, 16)
    cache.insert(a)
    cache.evict(16)  # a: backed up synchronously, demoted
    m = cache.match(a)
    cache.lock(m.device_node)
    cache.load_back(m)  # a on both tiers: its host copy is a duplicate
    cache.unlock(m.node)
    cache.insert(b)
    cache.take_events()
    cache.lock(cache.match(a).node)  # a stays on the GPU; b is the eviction victim
    cache.evict(16)
    # b's backup needs the host pool: a's duplicate copy goes first (a keeps its GPU copy).
    assert shape(cache.take_events()) == [
        ("BlockRemoved", HOST, 4),
        ("BlockStored", HOST, 4),
        ("BlockRemoved", GPU, 4),
    ]
    assert cache.match(a).device_len == 16


def test_an_insert_that_recomputed_a_host_page_puts_it_back_on_the_gpu() -> None:
    cache, clock = make_cache()
    a = tokens(100, 16)
    cache.insert(a)
    ack_all(cache, clock)
    cache.evict(16)
    cache.take_events()
    cache.insert(a + tokens(900, 4))  # (a load-back that was skipped): the request computed a again
    # The recomputed node's store and the new leaf's are one chain: merged into one event.
    assert shape(cache.take_events()) == [("BlockStored", GPU, 5)]
    assert cache.match(a).device_len == 16 and cache.host_used == 20  # new leaf backed up too


def test_splitting_a_node_in_flight_publishes_both_halves_at_the_ack() -> None:
    cache, clock = make_cache()
    a = tokens(100, 16)
    cache.insert(a)
    cache.flush_backups()
    cache.match(a[:8])  # splits the node while its copy runs
    cache.take_events()
    clock.now = 1.0
    cache.poll_backups()
    events = cache.take_events()
    assert shape(events) == [("BlockStored", HOST, 4)]  # both halves, root first, merged
    first = events[0]
    assert isinstance(first, BlockStored) and first.token_ids == a


def test_flush_clears_both_tiers_with_one_event() -> None:
    cache, clock = make_cache()
    cache.insert(tokens(100, 16))
    ack_all(cache, clock)
    cache.evict(16)
    cache.take_events()
    cache.reset()
    assert shape(cache.take_events()) == [("AllBlocksCleared", None, 0)]
    assert cache.host_used == 0 and cache.match(tokens(100, 16)).host_len == 0


def test_host_pool_is_sized_like_sglang() -> None:
    # ratio x device, plus one padding page; real 0.5.23 with --max-total-tokens 2048 logged
    # "Allocating kv hierarchical KV host pool: 4112 tokens" before failing on this CPU (docs/sim-worker.md)
    assert host_pool_tokens(2048, 16, 2.0, 0, 131_072) == 4112
    assert host_pool_tokens(1000, 16, 2.0, 0, 131_072) == (2000 // 16 + 1) * 16
    # --hicache-size GB (decimal) over the KV bytes per token overrides the ratio
    assert host_pool_tokens(1000, 16, 2.0, 4, 131_072) == (int(4e9 // 131_072) // 16 + 1) * 16
    with pytest.raises(ValueError, match="hicache-size"):
        host_pool_tokens(1000, 16, 2.0, 4, 0)


# -- the scheduler with a host tier -----------------------------------------------------------------
PROFILE = replace(
    BASE_PROFILE,
    layers=10,
    kv_bytes_per_token=1000,
    h2d_gbps=1.0,  # 1 us per token: easy to read
    d2h_gbps=1.0,
)


@pytest.fixture
async def make(tmp_path: Path) -> AsyncIterator[Factory]:
    def build(**overrides: object) -> Scheduler:
        values: dict[str, object] = {
            "page_size": 16,
            "speedup": 1e9,
            "kv_events": False,
            "enable_hierarchical_cache": True,
            "file_storage_path": str(tmp_path / "hicache"),
            **overrides,
        }
        config = SimWorkerConfig.model_validate(values)
        cache = HiRadixCache(16, enable_events=False, host_capacity=100_000, write_policy=config.hicache_write_policy)
        return Scheduler(config, PROFILE, cache, None, VOCAB)

    async with started(build) as factory:
        yield factory


async def test_a_host_hit_counts_as_cached_and_its_copy_overlaps_the_prefill(make: Factory) -> None:
    s = make(capacity_tokens=4096)
    a, b = list(range(3000)), list(range(10_000, 13_000))
    await finish(s.submit(a, 1))
    await finish(s.submit(b, 1))  # evicts a from the GPU to host memory
    again = s.submit(a + [7] * 16, 1)
    await finish(again)
    assert again.cached_tokens == 2992  # 187 pages: host hits count, as SGLang's cached_tokens does
    assert (again.cached_device, again.cached_host, again.cached_storage) == (0, 2992, 0)
    step = next(st for st in s.steps if again.rid in st.rids and st.kind == "prefill")
    compute = PROFILE.c0 + PROFILE.a * 24 + PROFILE.b * (24 * 24 + 2 * 2992 * 24)
    h2d = 2992 * 1000 / 1e9  # 3.0 ms > compute: the copy is not hidden
    assert step.duration == pytest.approx(max(compute, h2d + compute / PROFILE.layers))
    assert s.stats.load_back_tokens == 2992 and s.stats.cached_host_tokens == 2992


async def written_prompt(make: Factory, base: int) -> list[int]:
    """A 1000-token prompt one worker has cached and written to the shared storage directory."""
    writer = make(hicache_storage_backend="file", capacity_tokens=8192)
    prompt = list(range(base, base + 1000))
    await finish(writer.submit(prompt, 1))
    await asyncio.sleep(0.05)  # the write-through ack (next iteration) queues the file writes
    assert writer.prefetcher is not None
    await writer.prefetcher.drain()
    return prompt


async def test_storage_prefetch_lands_pages_another_worker_wrote(make: Factory) -> None:
    prompt = await written_prompt(make, 5000)
    reader = make(hicache_storage_backend="file", capacity_tokens=8192)
    req = reader.submit(prompt + [1, 2, 3], 1)
    await finish(req)
    assert req.cached_storage == req.cached_tokens == 992  # 62 pages from the files the writer left
    assert (req.cached_device, req.cached_host) == (0, 0)
    assert reader.prefetcher is not None and reader.prefetcher.stats.prefetched_tokens == 992


SLOW_STORAGE = '{"sim_op_latency_us": 200000}'  # 0.2 s per storage operation, at speedup 1


def slow_reader(make: Factory, policy: str, extra_config: str = SLOW_STORAGE) -> Scheduler:
    """A worker prefetching from the shared storage directory with ``policy``, in real time (speedup 1)."""
    return make(
        hicache_storage_backend="file",
        hicache_storage_prefetch_policy=policy,
        hicache_storage_backend_extra_config=extra_config,
        speedup=1.0,
        capacity_tokens=8192,
    )


async def test_best_effort_prefetch_does_not_wait_for_the_reads(make: Factory) -> None:
    prompt = await written_prompt(make, 7000)
    reader = slow_reader(make, "best_effort")
    req = reader.submit(prompt + [1, 2, 3], 1)
    await finish(req)
    assert req.cached_tokens == 0  # admitted at the first poll, before any page landed
    assert reader.prefetcher is not None and reader.prefetcher.stats.prefetched_tokens == 0


async def test_timeout_prefetch_gives_up_at_its_deadline(make: Factory) -> None:
    prompt = await written_prompt(make, 9000)
    reader = slow_reader(
        make,
        "timeout",
        '{"sim_op_latency_us": 200000, "prefetch_timeout_base": 0.05, "prefetch_timeout_per_ki_token": 0}',
    )
    req = reader.submit(prompt + [1, 2, 3], 1)
    await finish(req)
    assert req.cached_tokens == 0  # the reads (0.4 s) outlast the 50 ms budget
    assert reader.prefetcher is not None and reader.prefetcher.stats.unfulfilled["deadline"] == 992
    assert req.sim_first_token is not None


async def test_wait_complete_prefetch_waits_for_slow_reads(make: Factory) -> None:
    prompt = await written_prompt(make, 11000)
    reader = slow_reader(make, "wait_complete")
    started = asyncio.get_running_loop().time()
    req = reader.submit(prompt + [1, 2, 3], 1)
    await finish(req)
    assert req.cached_storage == 992
    assert asyncio.get_running_loop().time() - started >= 0.4  # one existence check + one read, 0.2 s each

"""HiCache end to end over real sockets: simulated workers with a host tier (and a shared file storage
tier) publish SGLang 0.5.23's tier events over ZMQ, and the router's index follows each tier.

Workers are real ``prefix-router sim-worker`` processes (HTTP + ZMQ); the router is the real one
(``Router`` with its event hub, subscribers and load/tier pollers), driven directly without Envoy.
Ground truth is what the worker answers over HTTP (``cached_tokens_details``).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from extproc.config import RouterConfig, WorkerConfig
from extproc.decision.request import ParsedRequest
from extproc.fleet.blocks import block_keys, chain_seed
from extproc.fleet.workers import Worker, WorkerRegistry
from extproc.serving.app import RouterApp
from prefix_router.fleet import start_fleet
from sglang_workers.process import WorkerProcess
from sglang_workers.sim.kv_events import BlockRemoved, BlockStored, KVEvent
from tests.support.sim_fixtures import EventSubscriber, sha256_chain
from tests.support.waiting import until

PAGE = 16
pytestmark = pytest.mark.timeout(60)


async def generate(url: str, ids: list[int]) -> dict[str, Any]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}}
    async with aiohttp.ClientSession() as http, http.post(url + "/generate", json=body) as resp:
        assert resp.status == 200, await resp.text()
        meta: dict[str, Any] = (await resp.json())["meta_info"]
    return meta


def tier_events(batches: list[tuple[int, list[KVEvent], bytes]]) -> list[tuple[str, str | None, list[int]]]:
    out = []
    for _seq, events, _raw in batches:
        for e in events:
            if isinstance(e, (BlockStored, BlockRemoved)):
                out.append((type(e).__name__, e.medium, list(e.block_hashes)))
    return out


def router_for(workers: list[WorkerProcess]) -> RouterApp:
    config = RouterConfig(
        workers=[WorkerConfig(url=w.url) for w in workers],
        load={"poll_interval_s": 0.1, "tier_poll_interval_s": 0.1},
    )
    return RouterApp(config, WorkerRegistry([Worker.from_config(c) for c in config.workers]))


def parsed(ids: list[int]) -> ParsedRequest:
    return ParsedRequest(path="/generate", kind="generate", input_ids=ids)


def router_keys(worker: Worker, ids: list[int]) -> list[int]:
    """The router's own block keys of a prompt (computed, not routed: routing would record them)."""
    return block_keys(ids, PAGE, chain_seed(worker.model or ""))


A = list(range(1000, 1000 + 161))  # 10 full pages + 1 token
B = list(range(3000, 3000 + 161))


async def test_host_tier_events_on_the_wire_and_in_the_router_index() -> None:
    # GPU pool of 256 tokens: A and B (160 cacheable tokens each) cannot both stay on the GPU.
    (worker,) = start_fleet(
        "sim", 1, page_size=PAGE, profile="instant", capacity_tokens=256, enable_hierarchical_cache=True
    )
    sub = EventSubscriber(worker)
    app = router_for([worker])
    try:
        sub.sync()
        await app.start()
        (w,) = app.registry.workers
        await until(lambda: app.events.state(w) == "synced", "synced events")
        a_hashes, b_hashes = sha256_chain(A, PAGE), sha256_chain(B, PAGE)

        first = await generate(worker.url, A)
        assert first["cached_tokens"] == 0 and first["cached_tokens_details"] is None
        await asyncio.sleep(0.2)
        # The GPU store at prefill, then the CPU_PINNED store once the write-through copy is acknowledged.
        assert tier_events(sub.drain()) == [("BlockStored", "GPU", a_hashes), ("BlockStored", "CPU_PINNED", a_hashes)]

        await generate(worker.url, B)  # evicts A from the GPU: demoted, not lost
        await asyncio.sleep(0.2)
        events = tier_events(sub.drain())
        assert events[0] == ("BlockRemoved", "GPU", a_hashes)
        assert ("BlockStored", "GPU", b_hashes) in events
        assert ("BlockRemoved", "CPU_PINNED", a_hashes) not in events

        a_keys = router_keys(w, A)
        await until(lambda: not app.index.blocks(w.id, "gpu") & set(a_keys), "the GPU removal in the index")
        assert set(a_keys) <= app.index.blocks(w.id, "host")
        outcome = app.router.route(parsed(A))
        app.router.finish(outcome)
        (candidate,) = outcome.candidates
        assert candidate.tier_blocks == {"gpu": 0, "host": 10, "shared": 0}

        again = await generate(worker.url, A)  # a host hit: loaded back, and counted as cached
        assert again["cached_tokens"] == 160
        assert again["cached_tokens_details"] == {"device": 0, "host": 160}
        await asyncio.sleep(0.2)
        events = tier_events(sub.drain())
        assert ("BlockStored", "GPU", a_hashes) in events  # the load-back's GPU store
        assert ("BlockRemoved", "GPU", b_hashes) in events  # room made for it
        await until(lambda: set(a_keys) <= app.index.blocks(w.id, "gpu"), "the load-back in the index")
        assert set(a_keys) <= app.index.blocks(w.id, "host")  # the host copy stays

        # The worker's reported load-back figures reach the policy's inputs.
        await until(lambda: app.tier_stats.get(w) is not None, "tier metrics")
        report = app.tier_stats.get(w)
        assert report is not None and report.load_back_tokens == 160
    finally:
        await app.stop()
        sub.close()
        worker.stop()


async def test_file_storage_is_shared_between_two_workers(tmp_path: Path) -> None:
    storage = tmp_path / "hicache"
    workers = start_fleet(
        "sim",
        2,
        page_size=PAGE,
        profile="instant",
        capacity_tokens=4096,
        enable_hierarchical_cache=True,
        hicache_storage_backend="file",
        file_storage_path=str(storage),
    )
    writer, reader = workers
    sub = EventSubscriber(reader)
    app = router_for(workers)
    try:
        sub.sync()
        await app.start()
        w_writer, w_reader = app.registry.workers
        await until(lambda: all(app.events.state(w) == "synced" for w in (w_writer, w_reader)), "synced events")
        prompt = list(range(20_000, 20_000 + 600))  # 37 full pages: over the 256-token prefetch threshold
        hashes = sha256_chain(prompt, PAGE)

        await generate(writer.url, prompt)
        await until(lambda: len(list(storage.glob("*.bin"))) == 37, "the writer's pages on disk")
        names = {p.name for p in storage.glob("*.bin")}
        assert all(n.endswith("_meta-llama-Llama-3.1-8B-Instruct_0_1.bin") for n in names)

        # The router credits the pages to every worker of the storage group, before the reader has them.
        keys = router_keys(w_writer, prompt)
        await until(lambda: set(keys) <= app.index.blocks(w_writer.id, "host"), "the writer's host stores")
        outcome = app.router.route(parsed(prompt))
        app.router.finish(outcome)
        tiers = {c.worker.id: c.tier_blocks for c in outcome.candidates}
        assert tiers[w_reader.id] == {"gpu": 0, "host": 0, "shared": 37}
        assert tiers[w_writer.id]["gpu"] == 37

        meta = await generate(reader.url, prompt + [1, 2, 3])
        assert meta["cached_tokens"] == 592
        assert meta["cached_tokens_details"] == {
            "device": 0,
            "host": 0,
            "storage": 592,
            "storage_backend": "HiCacheFile",
        }
        await asyncio.sleep(0.2)
        events = tier_events(sub.drain())
        # Landed pages become host nodes (CPU_PINNED), then the load-back puts them on the GPU; no DISK event.
        assert events[:2] == [("BlockStored", "CPU_PINNED", hashes), ("BlockStored", "GPU", hashes)]
        assert all(medium in ("GPU", "CPU_PINNED") for _kind, medium, _h in events)

        status, info = await get_json(reader.url + "/server_info")
        assert status == 200
        assert info["hicache_storage_backend"] == "file" and info["enable_hierarchical_cache"] is True
    finally:
        await app.stop()
        sub.close()
        for worker in workers:
            worker.stop()


async def get_json(url: str) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as http, http.get(url) as resp:
        return resp.status, json.loads(await resp.text())

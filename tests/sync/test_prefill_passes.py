"""A worker's count of prefill batches and its ``new_token_ratio``, read from its ``/metrics`` beside every
``/v1/loads`` poll.

The prefix-aware cost model fits its prefill floor per batch with the count, and prices the wait for KV room
with the ratio (docs/routing.md). Real HTTP
servers throughout: a simulated worker (two DP ranks), and a bare server that has ``/v1/loads`` but no
such count on ``/metrics``, which is asked three times and then left alone for five minutes.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from extproc.config import LoadConfig
from extproc.fleet.workers import Worker, WorkerRegistry
from extproc.sync.http import WorkerHttp
from extproc.sync.load import LoadTracker, parse_metrics, parse_new_token_ratio, parse_prefill_passes
from prefix_router.fleet import start_fleet
from tests.support.gateway_http import post
from tests.support.http_server import serving_app

pytestmark = pytest.mark.timeout(120)

PAGE = """# HELP sglang:cuda_graph_passes_total Total number of forward passes categorized by CUDA graph.
# TYPE sglang:cuda_graph_passes_total counter
sglang:cuda_graph_passes_total{model_name="m",dp_rank="0",tp_rank="0",mode="prefill_none"} 7.0
sglang:cuda_graph_passes_total{model_name="m",dp_rank="0",tp_rank="0",mode="prefill_cuda_graph"} 2.0
sglang:cuda_graph_passes_total{model_name="m",dp_rank="0",tp_rank="1",mode="prefill_none"} 9.0
sglang:cuda_graph_passes_total{model_name="m",dp_rank="0",tp_rank="0",mode="decode_cuda_graph"} 500.0
sglang:cuda_graph_passes_total{model_name="m",dp_rank="1",tp_rank="0",mode="prefill_none"} 5.0
sglang:num_running_reqs{model_name="m"} 1.0
# HELP sglang:new_token_ratio The new token ratio.
# TYPE sglang:new_token_ratio gauge
sglang:new_token_ratio{model_name="m",dp_rank="0",tp_rank="0"} 0.3125
sglang:new_token_ratio{model_name="m",dp_rank="1",tp_rank="0"} 0.7
sglang:new_token_ratio_other{model_name="m"} 0.9
"""


def test_prefill_passes_are_counted_per_dp_rank_over_modes_not_over_tp_ranks() -> None:
    # dp 0: 7 + 2 on TP rank 0, 9 on TP rank 1 (the same batches, seen by every rank): 9; dp 1: 5.
    assert parse_prefill_passes(PAGE) == {"0": 9, "1": 5}
    decode_only = "\n".join(line for line in PAGE.splitlines() if "prefill" not in line)
    assert parse_prefill_passes(decode_only) == {}
    assert parse_prefill_passes("") == {}
    assert parse_prefill_passes('sglang:cuda_graph_passes_total{mode="prefill_none"} oops\n') == {}
    assert parse_prefill_passes('sglang:cuda_graph_passes_total{tp_rank="0",mode="prefill_none"} 4') == {"": 4}


def test_the_new_token_ratio_is_the_most_reserving_schedulers() -> None:
    assert parse_new_token_ratio(PAGE) == 0.7  # rank 1's; a family whose name merely starts alike is not read
    assert parse_new_token_ratio("sglang:new_token_ratio 0.25\n") == 0.25
    assert parse_new_token_ratio("") is None
    assert parse_new_token_ratio('sglang:new_token_ratio{dp_rank="0"} NaN-ish\nsglang:new_token_ratio 7\n') is None
    fallback = parse_metrics(PAGE)  # a worker read through /metrics alone
    assert fallback is not None and fallback.new_token_ratio == 0.7


async def _poll(tracker: LoadTracker, worker: Worker, times: int) -> None:
    for _ in range(times):
        await tracker.poll_once()


async def _chat(url: str, rank: int | None = None) -> None:
    body: dict[str, object] = {"model": "m", "messages": [{"role": "user", "content": f"hi {rank}"}], "max_tokens": 2}
    if rank is not None:
        body["routed_dp_rank"] = rank
    reply = await asyncio.to_thread(post, url + "/v1/chat/completions", body)
    assert reply.status == 200


async def test_a_workers_prefill_batches_are_read_with_its_loads() -> None:
    with start_fleet("sim", 1)[0] as sim:
        worker = Worker(id="w", url=sim.url, ip="127.0.0.1", port=sim.port)
        http = WorkerHttp()
        tracker = LoadTracker(LoadConfig(), WorkerRegistry([worker]), http)
        try:
            await _poll(tracker, worker, 2)  # the first finds the path, the second reads the count beside it
            before = tracker.get(worker)
            assert before is not None and before.total_prefill_batches is not None
            for _ in range(3):
                await _chat(sim.url)
            await tracker.poll_once()
            after = tracker.get(worker)
            assert after is not None and after.total_prefill_batches is not None
            assert after.total_prefill_batches - before.total_prefill_batches == 3  # one at a time: a batch each
            # Each was admitted by an idle scheduler, whose ratio SGLang resets to 0.7.
            assert after.new_token_ratio == pytest.approx(0.7)
            page = await asyncio.to_thread(lambda: urllib.request.urlopen(sim.url + "/metrics", timeout=5).read())
            assert sum(parse_prefill_passes(page.decode()).values()) == after.total_prefill_batches
        finally:
            await http.close()


async def test_a_count_that_misses_dp_ranks_the_load_sums_is_not_used() -> None:
    """The simulator's /metrics shows rank 0 only; /v1/loads sums both ranks' busy time: no count."""
    with start_fleet("sim", 1, dp_size=2)[0] as sim:
        worker = Worker(id="w", url=sim.url, ip="127.0.0.1", port=sim.port)
        http = WorkerHttp()
        tracker = LoadTracker(LoadConfig(), WorkerRegistry([worker]), http)
        try:
            await _chat(sim.url, 1)
            await _poll(tracker, worker, 2)
            load = tracker.get(worker)
            assert load is not None and load.ranks == 2 and load.total_prefill_busy_us is not None
            assert load.total_prefill_batches is None
        finally:
            await http.close()


@pytest.fixture
async def no_count_worker() -> AsyncIterator[tuple[str, list[str]]]:
    """/v1/loads as SGLang 0.5.23 answers it; /metrics without the prefill-pass family."""
    hits: list[str] = []

    async def loads(request: web.Request) -> web.Response:
        rank = {"num_running_reqs": 0, "num_waiting_reqs": 0, "total_prefill_uncached_tokens": 0,
                "total_prefill_busy_us": 0}  # fmt: skip
        return web.Response(text=json.dumps({"loads": [rank]}))

    async def metrics(request: web.Request) -> web.Response:
        hits.append(request.path)
        return web.Response(text="sglang:num_running_reqs 0\n")

    app = web.Application()
    app.router.add_get("/v1/loads", loads)
    app.router.add_get("/metrics", metrics)
    async with serving_app(app) as url:
        yield url, hits


async def test_a_worker_without_the_count_is_asked_three_times_then_left_alone(
    no_count_worker: tuple[str, list[str]],
) -> None:
    url, hits = no_count_worker
    worker = Worker(id="w", url=url, ip="127.0.0.1", port=int(url.rsplit(":", 1)[1]))
    http = WorkerHttp()
    try:
        now = [0.0]
        tracker = LoadTracker(LoadConfig(), WorkerRegistry([worker]), http, clock=lambda: now[0])
        await _poll(tracker, worker, 8)
        load = tracker.get(worker)
        assert load is not None and load.total_prefill_batches is None and load.total_prefill_busy_us == 0
        assert len(hits) == 3
        now[0] = 299.0
        await _poll(tracker, worker, 1)
        assert len(hits) == 3
        now[0] = 301.0  # five minutes on: asked again (metrics may have been switched on)
        await _poll(tracker, worker, 1)
        assert len(hits) == 4
        off = LoadTracker(LoadConfig(read_prefill_batches=False), WorkerRegistry([worker]), http)
        await _poll(off, worker, 3)
        assert len(hits) == 4 and off.get(worker) is not None
    finally:
        await http.close()

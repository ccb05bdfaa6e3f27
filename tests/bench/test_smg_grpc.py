"""The real smg 1.13 (PyPI ``smg``) in front of sim-workers, over their gRPC and their HTTP front doors.

Over gRPC smg tokenizes itself, subscribes to every worker's ``SubscribeKvEvents`` stream and routes
``cache_aware`` on the block index those events build: the test checks that tokens stream back through
it, that its KV-event metrics grow, and that a repeated prefix comes back with ``cached_tokens`` > 0.
Each smg is started by the benchmark's own contender, so these tests also cover how ``prefix-router
bench`` launches it.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from benchmarks.fleet.sgl_routers import Smg
from prefix_router.fleet import start_fleet
from sglang_workers.process import WorkerProcess

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("smg") is None, reason="smg is not installed (pip install smg)"
)

MODEL = "sim-llama"
SYSTEM = " ".join(["You answer questions about the weather with care, and in plain words."] * 6)


@pytest.fixture
def worker() -> Iterator[WorkerProcess]:
    with start_fleet("sim", 1, grpc=True, profile="instant", page_size=16, model=MODEL)[0] as w:
        yield w


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` (0 when there are none)."""
    total = 0.0
    for match in re.finditer(rf"^{re.escape(name)}\{{([^}}]*)\}} ([0-9.eE+-]+)$", text, re.MULTILINE):
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1)))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(match.group(2))
    return total


async def scrape(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url) as resp:
        return await resp.text()


async def chat(session: aiohttp.ClientSession, base: str, question: str, max_tokens: int = 6) -> dict[str, Any]:
    """One streamed chat completion: the content pieces and the final usage."""
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    pieces: list[str] = []
    usage: dict[str, Any] = {}
    async with session.post(base + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            event = json.loads(line[5:])
            for choice in event.get("choices") or ():
                if (choice.get("delta") or {}).get("content"):
                    pieces.append(choice["delta"]["content"])
            usage = event.get("usage") or usage
    return {"pieces": pieces, "usage": usage}


async def wait_metric(
    session: aiohttp.ClientSession, url: str, name: str, above: float, timeout: float = 10.0, **labels: str
) -> float:
    deadline = asyncio.get_running_loop().time() + timeout
    value = 0.0
    while asyncio.get_running_loop().time() < deadline:
        value = metric(await scrape(session, url), name, **labels)
        if value > above:
            return value
        await asyncio.sleep(0.1)
    raise AssertionError(f"{name}{labels} stayed at {value} (wanted > {above})")


async def test_smg_over_grpc_streams_tokens_feeds_its_event_index_and_hits_the_cache(worker: WorkerProcess) -> None:
    smg = Smg("grpc", page_size=16)
    base = await smg.start([worker.grpc_url])
    try:
        assert smg.metrics_url is not None
        async with aiohttp.ClientSession() as session:
            url, who = smg.metrics_url, worker.grpc_url
            before = metric(await scrape(session, url), "smg_kv_event_batches_total", worker=who, disposition="applied")
            blocks_before = metric(await scrape(session, url), "smg_kv_index_blocks", worker=who)

            first = await chat(session, base, "Will it rain tomorrow?")
            assert len(first["pieces"]) == 6  # every generated token streamed back through smg
            assert first["usage"]["completion_tokens"] == 6
            prompt_tokens = first["usage"]["prompt_tokens"]
            assert prompt_tokens > 3 * 16

            applied = await wait_metric(
                session, url, "smg_kv_event_batches_total", before, worker=who, disposition="applied"
            )
            blocks = await wait_metric(session, url, "smg_kv_index_blocks", blocks_before, worker=who)
            assert blocks >= prompt_tokens // 16  # the prompt's pages, as the worker stored them

            second = await chat(session, base, "Will it be sunny on Sunday?")
            cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached > 0 and cached % 16 == 0  # the shared system prompt, in whole pages
            await wait_metric(session, url, "smg_kv_event_batches_total", applied, worker=who, disposition="applied")
    finally:
        await smg.stop()


async def test_smg_over_grpc_starts_from_a_snapshot_of_a_warm_worker() -> None:
    """A worker whose history no longer reaches its first batch hands a new subscriber a snapshot."""
    with start_fleet("sim", 1, grpc=True, profile="instant", page_size=16, model=MODEL, kv_buffer_steps=2)[0] as warm:
        async with aiohttp.ClientSession() as session:
            for start in (100, 300, 500):  # three prompts of 2 whole pages, sent over HTTP before smg exists
                body = {"input_ids": list(range(start, start + 40)), "sampling_params": {"max_new_tokens": 1}}
                async with session.post(warm.url + "/generate", json=body) as resp:
                    assert resp.status == 200
            smg = Smg("grpc", page_size=16)
            await smg.start([warm.grpc_url])
            try:
                assert smg.metrics_url is not None
                blocks = await wait_metric(session, smg.metrics_url, "smg_kv_index_blocks", 0, worker=warm.grpc_url)
                assert blocks == 3 * 2
                text = await scrape(session, smg.metrics_url)
                assert metric(text, "smg_kv_event_batches_total", worker=warm.grpc_url, disposition="snapshot") >= 1
            finally:
                await smg.stop()


async def test_smg_over_http_routes_chat_to_the_http_door(worker: WorkerProcess) -> None:
    smg = Smg("http")
    base = await smg.start([worker.url])
    try:
        async with aiohttp.ClientSession() as session:
            reply = await chat(session, base, "Is it windy?", max_tokens=4)
        assert len(reply["pieces"]) == 4
        assert reply["usage"]["prompt_tokens"] > 0
    finally:
        await smg.stop()

"""The sync path's one HTTP client and its one poll-loop shape, against a real HTTP server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from extproc.config import RouterConfig, WorkerConfig
from extproc.fleet.workers import WorkerRegistry
from extproc.serving.app import RouterApp
from extproc.sync.http import Poller, WorkerHttp
from tests.support.http_server import serving_app


@pytest.fixture
async def server() -> AsyncIterator[str]:
    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(2.0)
        return web.Response(text="late")

    async def fast(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/slow", slow)
    app.router.add_get("/fast", fast)
    async with serving_app(app) as url:
        yield url


async def test_each_request_has_its_own_timeout(server: str) -> None:
    http = WorkerHttp()
    try:
        async with http.get(server + "/fast", 1.0) as response:
            assert await response.text() == "ok"
        with pytest.raises(asyncio.TimeoutError):
            async with http.get(server + "/slow", 0.2) as response:
                await response.text()
        async with http.get(server + "/slow", 5.0) as response:  # same session, a longer bound
            assert await response.text() == "late"
    finally:
        await http.close()


async def test_poller_survives_a_failing_round() -> None:
    rounds: list[int] = []

    async def poll_once() -> None:
        rounds.append(len(rounds))
        if len(rounds) == 1:
            raise RuntimeError("first round fails")

    poller = Poller("test-poller", 0.01, poll_once)
    poller.start()
    try:
        for _ in range(200):
            if len(rounds) >= 3:
                break
            await asyncio.sleep(0.01)
    finally:
        await poller.stop()
    assert len(rounds) >= 3 and not poller.running


async def test_router_shares_one_client_across_the_sync_path() -> None:
    config = RouterConfig(workers=[WorkerConfig(url="http://127.0.0.1:9")])
    http = WorkerHttp()
    app = RouterApp(config, WorkerRegistry.from_configs(config.workers), http=http)
    assert app.loads.http is http and app.tier_stats.http is http and app.events.http is http
    await app.start()
    await app.stop()
    assert not http.session.closed  # the caller's client outlives the router; its owner closes it
    await http.close()

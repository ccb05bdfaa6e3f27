"""Who may read the debug endpoints: loopback binds are open, any other bind needs ``debug.token``.

A real metrics server (aiohttp on this test's loop, as ``prefix-router serve`` runs it) over a real router
with no healthy worker; requests go over real sockets.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from extproc.config import DebugConfig, RouterConfig, load_config
from extproc.fleet.workers import WorkerRegistry
from extproc.serving.app import RouterApp
from extproc.serving.debug_http import DebugRoutes
from extproc.serving.metrics_http import MetricsServer
from prefix_common.addresses import free_port
from tests.support.gateway_http import Reply, request


@asynccontextmanager
async def metrics_port(host: str, token: str | None) -> AsyncIterator[Callable[..., Reply]]:
    """A metrics port with the debug routes bound to ``host``; yields a GET/POST helper (over 127.0.0.1)."""
    config = RouterConfig(debug=DebugConfig(token=token))
    app = RouterApp(config, WorkerRegistry([]))
    port = free_port()
    server = MetricsServer(
        app.telemetry.metrics, app.registry, host, port, app.http, extra_routes=[DebugRoutes(app, host).install]
    )
    await server.start()

    def call(path: str, headers: dict[str, str] | None = None, body: bytes | None = None) -> Reply:
        return request(f"http://127.0.0.1:{port}{path}", "GET" if body is None else "POST", body, headers)

    try:
        yield call
    finally:
        await server.stop()
        await app.stop()


async def _get(call: Callable[..., Reply], *args: object, **kwargs: object) -> Reply:
    return await asyncio.to_thread(call, *args, **kwargs)


async def test_off_loopback_without_a_token_the_debug_endpoints_say_how_to_turn_them_on() -> None:
    async with metrics_port("0.0.0.0", None) as call:
        refused = await _get(call, "/debug/workers")
        assert refused.status == 403
        message = refused.json()["error"]["message"]
        assert "debug.token" in message and "PREFIX_ROUTER_DEBUG__TOKEN" in message and "0.0.0.0" in message
        assert (await _get(call, "/debug/explain", body=b"{}")).status == 403
        assert (await _get(call, "/metrics")).status == 200  # metrics stay public
        page = await _get(call, "/debug/")
        assert page.status == 200 and b"<title>prefix-router" in page.body  # the page holds no data


async def test_a_token_is_required_when_one_is_set() -> None:
    async with metrics_port("0.0.0.0", "s3cret") as call:
        missing = await _get(call, "/debug/decisions")
        assert missing.status == 401 and missing.headers["www-authenticate"].startswith("Bearer")
        assert "Authorization: Bearer" in missing.json()["error"]["message"]
        assert (await _get(call, "/debug/decisions", {"Authorization": "Bearer wrong"})).status == 401
        assert (await _get(call, "/debug/decisions", {"Authorization": "Basic s3cret"})).status == 401
        ok = await _get(call, "/debug/decisions", {"Authorization": "Bearer s3cret"})
        assert ok.status == 200 and ok.json()["decisions"] == []
        workers = await _get(call, "/debug/workers", {"Authorization": "bearer s3cret"})
        assert workers.status == 200 and workers.json()["workers"] == []
        body = b'{"messages": [{"role": "user", "content": "hi"}]}'
        none = await _get(call, "/debug/explain", {"Authorization": "Bearer s3cret"}, body)
        assert none.status == 503 and "no healthy worker" in none.json()["error"]["message"]


async def test_loopback_needs_no_token() -> None:
    async with metrics_port("127.0.0.1", None) as call:
        assert (await _get(call, "/debug/workers")).status == 200
        redirect = await _get(call, "/debug")
        assert redirect.status == 301 and redirect.headers["location"] == "/debug/"


def test_the_token_comes_from_the_environment_too() -> None:
    config = load_config(environ={"PREFIX_ROUTER_DEBUG__TOKEN": "123456", "PREFIX_ROUTER_DEBUG__DECISIONS": "8"})
    assert config.debug.token == "123456" and config.debug.decisions == 8

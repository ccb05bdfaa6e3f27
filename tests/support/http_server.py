"""aiohttp applications served on loopback for the tests: the stand-ins for a worker's HTTP endpoints."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiohttp import web

from prefix_common.addresses import LOOPBACK, free_port


async def start_app(app: web.Application, port: int | None = None) -> tuple[web.AppRunner, int]:
    """``app`` served on ``port`` (default: a free one): its runner (``cleanup()`` stops it) and its port."""
    runner = web.AppRunner(app)
    await runner.setup()
    port = port or free_port()
    await web.TCPSite(runner, LOOPBACK, port).start()
    return runner, port


@asynccontextmanager
async def serving_app(app: web.Application) -> AsyncIterator[str]:
    """``app`` served on a free port until the block ends: its base URL."""
    runner, port = await start_app(app)
    try:
        yield f"http://{LOOPBACK}:{port}"
    finally:
        await runner.cleanup()

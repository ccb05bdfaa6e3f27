"""A ``RouterApp``'s gRPC services on a loopback port, for the tests that speak ext_proc to it directly."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import grpc

from extproc.exchange.servicer import add_services, mark_ready, mark_serving
from extproc.serving.app import RouterApp


@asynccontextmanager
async def serving(app: RouterApp, options: Sequence[tuple[str, int]] = ()) -> AsyncIterator[grpc.aio.Channel]:
    """``app``'s ext_proc and health services, marked serving and ready, and a channel to them; on exit the
    channel, the server and ``app`` stop. ``options``: the gRPC server's (message size limits)."""
    server = grpc.aio.server(options=list(options))
    health = add_services(server, app.servicer())
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await mark_serving(health, True)
    await mark_ready(health, True)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield channel
    finally:
        await channel.close()
        await server.stop(0)
        await app.stop()

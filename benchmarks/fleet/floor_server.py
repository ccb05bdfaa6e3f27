"""A Python ext_proc server that decides nothing: the floor under any Python router's cost per request.

It runs as a child process (``python -m benchmarks.fleet.floor_server --kind aio|sync --port P``,
started by the suites, never by hand) and answers each ext_proc message at once with a constant reply
(``aio``: ``grpc.aio``, as the router serves; ``sync``: grpcio's thread-pool server). With ``--endpoint
IP:PORT`` (aio only) it answers the request body with the router's own routing reply to that worker
(``extproc.exchange.response.route_response``) and serves the gRPC health service: behind the real Envoy that is
the ``floor`` gateway of ``--suite overhead --extproc-floor`` and ``--suite host-throughput --floor``,
what any Python ext_proc server adds before it decides anything. ``--suite grpc-stream-cost`` drives it
directly from Python.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

__all__ = ["SERVERS", "floor_command", "server_command"]

SERVERS = ("aio", "sync")
_REPLIES = {
    "request_headers": pb.ProcessingResponse(request_headers=pb.HeadersResponse()),
    "request_body": pb.ProcessingResponse(request_body=pb.BodyResponse()),
    "response_headers": pb.ProcessingResponse(response_headers=pb.HeadersResponse()),
}


class _AioProcessor(pb_grpc.ExternalProcessorServicer):
    def __init__(self, replies: dict[str, pb.ProcessingResponse]) -> None:
        self.replies = replies

    async def Process(self, requests, context):  # type: ignore[no-untyped-def]  # noqa: N802 (gRPC's name)
        replies = self.replies
        async for message in requests:
            reply = replies.get(message.WhichOneof("request") or "")
            if reply is not None:
                yield reply


class _SyncProcessor(pb_grpc.ExternalProcessorServicer):
    def Process(self, requests, context):  # type: ignore[no-untyped-def]  # noqa: N802 (gRPC's name)
        for message in requests:
            reply = _REPLIES.get(message.WhichOneof("request") or "")
            if reply is not None:
                yield reply


def _serve(kind: str, port: int, endpoint: str | None = None) -> None:
    """The server process: a do-nothing ext_proc on ``port``; prints ``ready`` once it listens.

    ``endpoint`` (aio only): answer every body with the router's routing reply to that ``ip:port``.
    """
    if kind == "sync":
        from concurrent import futures

        server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
        pb_grpc.add_ExternalProcessorServicer_to_server(_SyncProcessor(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        print("ready", flush=True)
        server.wait_for_termination()
        return

    async def main() -> None:
        from grpc_health.v1 import health, health_pb2, health_pb2_grpc

        from extproc.exchange.response import route_response

        replies = dict(_REPLIES)
        if endpoint:
            replies["request_body"] = route_response([endpoint])
        server = grpc.aio.server()
        pb_grpc.add_ExternalProcessorServicer_to_server(_AioProcessor(replies), server)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        for service in ("", "readiness"):  # what the probes ask (prefix_router.stack, --suite host-throughput)
            await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
        print("ready", flush=True)
        await server.wait_for_termination()

    asyncio.run(main())


def server_command(kind: str, port: int | str) -> list[str]:
    """The argv of a bare do-nothing server of ``kind`` on ``port`` (constant replies)."""
    return [sys.executable, "-m", "benchmarks.fleet.floor_server", "--kind", kind, "--port", str(port)]


def floor_command(port: int | str, endpoint: str) -> list[str]:
    """The argv of the floor gateway's server: the aio server on ``port``, every body routed to ``endpoint``."""
    return [*server_command("aio", port), "--endpoint", endpoint]


def _main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="A do-nothing ext_proc server (a child process of the benchmarks).")
    parser.add_argument("--kind", choices=SERVERS, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--endpoint", help="aio only: answer every body with the routing reply to this ip:port.")
    args = parser.parse_args(argv)
    if args.endpoint and args.kind != "aio":
        parser.error("--endpoint is served by the aio server only")
    _serve(args.kind, args.port, args.endpoint)
    return 0


if __name__ == "__main__":  # the child process the suites start; not a command of its own
    sys.exit(_main())

"""What one ext_proc stream costs a Python gRPC server that does nothing (prints figures; not a test).

    python -m benchmarks.grpc_floor [--streams 1000] [--servers aio,sync] [--body-bytes 40000]

The router answers every HTTP request on its own ext_proc stream, so the CPU its gRPC server
spends on a stream that decides nothing is a floor under the router's cost per request, whatever
the decision costs. This starts a minimal ``ExternalProcessor`` in another process (``aio``:
``grpc.aio``, as the router serves; ``sync``: grpcio's thread-pool server), answers each message at
once with a constant reply, and drives it from this process with the messages Envoy sends for one
buffered request (request headers, the body, response headers; or the body alone with
``--messages 1``), one stream after another. The server's CPU time (from ``/proc``) over the
measured streams, divided by their number, is the floor; the wall time per stream is printed too.
The client is Python as well, so it measures the server, not Envoy's side of ext_proc.

The same server, started with ``--serve aio --port P --endpoint IP:PORT``, is the ``floor`` gateway of
``benchmarks.router_overhead --extproc-floor``: behind the real Envoy it answers the body with the
router's own routing reply (``extproc.exchange.response.route_response``, to one fixed worker) and serves the
gRPC health service, so what it adds to a request is what any Python ext_proc server adds before it
decides anything.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

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
        for service in ("", "readiness"):  # what the probes ask (prefix_router.stack, host_throughput)
            await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
        print("ready", flush=True)
        await server.wait_for_termination()

    asyncio.run(main())


def floor_command(port: int | str, endpoint: str) -> list[str]:
    """The argv of the floor gateway's server: the aio server on ``port``, every body routed to ``endpoint``."""
    return [
        sys.executable,
        "-m",
        "benchmarks.grpc_floor",
        "--serve",
        "aio",
        "--port",
        str(port),
        "--endpoint",
        endpoint,
    ]


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _messages(body_bytes: int, count: int) -> list[pb.ProcessingRequest]:
    names = (":path", ":method", ":authority", "content-type", "x-request-id", "user-agent", "accept")
    headers = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=b"v" * 20) for k in names])
    body = pb.ProcessingRequest(request_body=pb.HttpBody(body=b"x" * body_bytes, end_of_stream=True))
    status = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":status", raw_value=b"200")])
    full = [
        pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=headers)),
        body,
        pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=status)),
    ]
    return full if count == 3 else [body]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure(kind: str, streams: int, body_bytes: int, messages: int, lockstep: bool = False) -> tuple[float, float]:
    """(server CPU ms per stream, wall ms per stream) for ``streams`` sequential streams.

    ``lockstep``: each message is sent only once the last one's reply came, as Envoy does in
    ``BUFFERED`` mode; otherwise all of a stream's messages go out at once.
    """
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.grpc_floor", "--serve", kind, "--port", str(port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        if server.stdout is None or server.stdout.readline().strip() != "ready":
            raise SystemExit(f"the {kind} server did not start")
        batch = _messages(body_bytes, messages)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.ExternalProcessorStub(channel)

            def one() -> None:
                if not lockstep:
                    replies: Iterator[pb.ProcessingResponse] = stub.Process(iter(batch))
                    for _ in replies:
                        pass
                    return
                answered = threading.Semaphore(0)

                def requests() -> Iterator[pb.ProcessingRequest]:
                    for position, message in enumerate(batch):
                        if position:
                            answered.acquire()  # the reply to the message before
                        yield message

                for _ in stub.Process(requests()):
                    answered.release()

            for _ in range(min(100, streams)):
                one()  # connection, first calls
            cpu0, start = _cpu_seconds(server.pid), time.perf_counter()
            for _ in range(streams):
                one()
            wall, cpu = time.perf_counter() - start, _cpu_seconds(server.pid) - cpu0
        return 1000 * cpu / streams, 1000 * wall / streams
    finally:
        server.kill()
        server.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.grpc_floor",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--streams", type=int, default=1000, help="Measured streams per server (after 100 unmeasured).")
    parser.add_argument("--servers", default="aio,sync", help=f"Comma-separated, of {', '.join(SERVERS)}.")
    parser.add_argument("--body-bytes", type=int, default=40_000, help="Body size (an 8k-token chat is ~40 kB).")
    parser.add_argument("--messages", type=int, choices=(1, 3), default=3, help="3: headers, body, response headers.")
    parser.add_argument(
        "--lockstep", action="store_true", help="Send each message only after the last one's reply, as Envoy does."
    )
    parser.add_argument("--serve", choices=SERVERS, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        if args.endpoint and args.serve != "aio":
            parser.error("--endpoint is served by the aio server only")
        _serve(args.serve, args.port, args.endpoint)
        return 0
    kinds = [k.strip() for k in args.servers.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in SERVERS]
    if unknown or not kinds or args.streams < 1 or args.body_bytes < 0:
        parser.error(f"--servers takes {', '.join(SERVERS)}; --streams >= 1; --body-bytes >= 0")
    sending = "one after the other's reply" if args.lockstep else "all at once"
    print(f"do-nothing ext_proc server, {args.messages} message(s) a stream ({sending}), body {args.body_bytes} B")
    print(f"{'server':>7} {'streams':>8} {'server CPU ms/stream':>21} {'wall ms/stream':>15}")
    for kind in kinds:
        cpu, wall = measure(kind, args.streams, args.body_bytes, args.messages, args.lockstep)
        print(f"{kind:>7} {args.streams:>8} {cpu:>21.3f} {wall:>15.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``prefix-router bench --suite grpc-stream-cost``: what one ext_proc stream costs a Python gRPC server
that does nothing (prints figures).

The router answers every HTTP request on its own ext_proc stream, so the CPU its gRPC server spends
on a stream that decides nothing is a floor under the router's cost per request, whatever the
decision costs. This starts the do-nothing server (``benchmarks/fleet/floor_server.py``: ``aio`` is
``grpc.aio``, as the router serves; ``sync`` grpcio's thread-pool server) in another process and
drives it from this one with the messages Envoy sends for one buffered request (request headers, the
body, response headers; or the body alone with ``--messages 1``), one stream after another. The
server's CPU time (from ``/proc``) over the measured streams, divided by their number, is the floor;
the wall time per stream is printed too. The client is Python as well, so it measures the server,
not Envoy's side of ext_proc (``--suite overhead --extproc-floor`` puts the same server behind Envoy).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from benchmarks.argtypes import names, positive
from benchmarks.fleet.floor_server import SERVERS, server_command
from benchmarks.fleet.procs import cpu_seconds
from prefix_common.addresses import free_port

__all__ = ["configure", "main", "measure"]


def _messages(body_bytes: int, count: int) -> list[pb.ProcessingRequest]:
    keys = (":path", ":method", ":authority", "content-type", "x-request-id", "user-agent", "accept")
    headers = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=b"v" * 20) for k in keys])
    body = pb.ProcessingRequest(request_body=pb.HttpBody(body=b"x" * body_bytes, end_of_stream=True))
    status = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":status", raw_value=b"200")])
    full = [
        pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=headers)),
        body,
        pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=status)),
    ]
    return full if count == 3 else [body]


def measure(kind: str, streams: int, body_bytes: int, messages: int, lockstep: bool = False) -> tuple[float, float]:
    """(server CPU ms per stream, wall ms per stream) for ``streams`` sequential streams.

    ``lockstep``: each message is sent only once the last one's reply came, as Envoy does in
    ``BUFFERED`` mode; otherwise all of a stream's messages go out at once.
    """
    port = free_port()
    server = subprocess.Popen(server_command(kind, port), stdout=subprocess.PIPE, text=True)
    try:
        if server.stdout is None or server.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the {kind} server did not start")
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
            cpu0, start = cpu_seconds(server.pid) or 0.0, time.perf_counter()
            for _ in range(streams):
                one()
            wall, cpu = time.perf_counter() - start, (cpu_seconds(server.pid) or 0.0) - cpu0
        return 1000 * cpu / streams, 1000 * wall / streams
    finally:
        server.kill()
        server.wait()


def configure(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("streams")
    g.add_argument(
        "--streams", type=positive(int), default=1000, help="Measured streams per server (after 100 unmeasured)."
    )
    g.add_argument("--servers", type=names(SERVERS), default=",".join(SERVERS), help="Which servers, comma-separated.")
    g.add_argument("--body-bytes", type=int, default=40_000, help="Body size (an 8k-token chat is ~40 kB).")
    g.add_argument("--messages", type=int, choices=(1, 3), default=3, help="3: headers, body, response headers.")
    g.add_argument(
        "--lockstep", action="store_true", help="Send each message only after the last one's reply, as Envoy does."
    )


def main(args: argparse.Namespace) -> int:
    if args.body_bytes < 0:
        print("prefix-router bench: --body-bytes must be >= 0", file=sys.stderr)
        return 2
    sending = "one after the other's reply" if args.lockstep else "all at once"
    print(f"do-nothing ext_proc server, {args.messages} message(s) a stream ({sending}), body {args.body_bytes} B")
    print(f"{'server':>7} {'streams':>8} {'server CPU ms/stream':>21} {'wall ms/stream':>15}")
    for kind in args.servers:
        cpu, wall = measure(kind, args.streams, args.body_bytes, args.messages, args.lockstep)
        print(f"{kind:>7} {args.streams:>8} {cpu:>21.3f} {wall:>15.3f}")
    return 0

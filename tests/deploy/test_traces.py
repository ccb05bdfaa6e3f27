"""Routing spans leave the router over OTLP (gRPC and HTTP) and arrive intact at a real receiver.

No OpenTelemetry Collector binary installs here, so the test runs the two receivers the collector
would: an OTLP/gRPC ``TraceService`` (the generated stubs of ``opentelemetry-proto``) and an
OTLP/HTTP ``POST /v1/traces`` endpoint. The stack is the shipped one on loopback: the router image's
entrypoint command (``prefix-router serve --config FILE``, FILE = deploy/compose/router-sim.yaml with
loopback addresses), two replicas behind one Envoy (the ext_proc cluster lists both), one exporting
over gRPC and one over HTTP, and a simulated worker; requests go through Envoy.
"""

from __future__ import annotations

import gzip
import shutil
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from benchmarks.fleet.replica_gateway import ReplicaGateway
from prefix_router.fleet import start_fleet

ROOT = Path(__file__).resolve().parents[2]
MODEL = "meta-llama/Llama-3.1-8B-Instruct"


class Received:
    """Spans as (resource attributes, span) pairs, appended by a receiver thread."""

    def __init__(self) -> None:
        self.spans: list[tuple[dict[str, Any], Any]] = []
        self.lock = threading.Lock()

    def add(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        with self.lock:
            for resource_spans in request.resource_spans:
                resource = {kv.key: _value(kv.value) for kv in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    self.spans.extend((resource, span) for span in scope_spans.spans)


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    return getattr(any_value, kind) if kind else None


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, received: Received) -> None:
        self.received = received

    def Export(  # noqa: N802 (the gRPC method name)
        self,
        request: trace_service_pb2.ExportTraceServiceRequest,
        context: grpc.ServicerContext,
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        self.received.add(request)
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture(scope="module")
def grpc_receiver() -> Iterator[tuple[str, Received]]:
    received = Received()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(received), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"http://127.0.0.1:{port}", received
    server.stop(grace=None)


@pytest.fixture(scope="module")
def http_receiver() -> Iterator[tuple[str, Received]]:
    received = Received()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length", 0)))
            if self.path != "/v1/traces" or self.headers.get("content-type") != "application/x-protobuf":
                self.send_response(404 if self.path != "/v1/traces" else 415)
                self.end_headers()
                return
            if self.headers.get("content-encoding") == "gzip":
                body = gzip.decompress(body)
            received.add(trace_service_pb2.ExportTraceServiceRequest.FromString(body))
            reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1/traces", received
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def sim_worker() -> Iterator[Any]:
    with start_fleet("sim", 1, profile="instant", page_size=16, log_level="warning")[0] as worker:
        yield worker


def _entrypoint() -> list[str]:
    """The image's ENTRYPOINT (``prefix-router``) from this interpreter's environment."""
    script = Path(sys.executable).parent / "prefix-router"
    found = str(script) if script.exists() else shutil.which("prefix-router")
    if found is None:
        pytest.skip("the prefix-router console script is not installed (pip install -e .)")
    return [found]


def _shipped_router_config() -> dict[str, Any]:
    """deploy/compose/router-sim.yaml minus what only makes sense on the compose network."""
    config = yaml.safe_load((ROOT / "deploy" / "compose" / "router-sim.yaml").read_text())
    return {key: value for key, value in config.items() if key not in ("server", "workers", "observability")}


def _chat(url: str, text: str) -> dict[str, Any]:
    import json

    body = json.dumps(
        {
            "model": MODEL,
            "max_tokens": 4,
            "messages": [{"role": "system", "content": "You route prompts. " * 20}, {"role": "user", "content": text}],
        }
    ).encode()
    request = urllib.request.Request(
        url + "/v1/chat/completions", data=body, method="POST", headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200
        return json.loads(response.read())


async def test_routing_spans_reach_otlp_grpc_and_http_receivers(
    grpc_receiver: tuple[str, Received], http_receiver: tuple[str, Received], sim_worker: Any
) -> None:
    import asyncio

    grpc_url, via_grpc = grpc_receiver
    http_url, via_http = http_receiver
    observability = [
        {"observability": {"exporter": "otlp-grpc", "otlp_endpoint": grpc_url, "service_name": "prefix-router"}},
        {"observability": {"exporter": "otlp-http", "otlp_endpoint": http_url, "service_name": "prefix-router"}},
    ]
    gateway = ReplicaGateway(
        [sim_worker.url],
        replicas=2,
        router_config=_shipped_router_config(),
        replica_configs=observability,
        router_command=_entrypoint(),
        env={"OTEL_BSP_SCHEDULE_DELAY": "100"},
    )
    async with gateway:
        # Envoy round-robins ext_proc streams over the two replicas; a handful of requests reach both.
        for i in range(8):
            await asyncio.to_thread(_chat, gateway.url, f"question number {i}")
        logs = gateway.logs()
    # Stopping the replicas (SIGTERM) flushes their span batches; allow the receivers a moment.
    routes = lambda received: [(r, s) for r, s in received.spans if s.name == "route"]  # noqa: E731
    deadline = time.monotonic() + 10
    while len(routes(via_grpc)) + len(routes(via_http)) < 8 and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert routes(via_grpc), "no routing span arrived over OTLP/gRPC\n" + logs
    assert routes(via_http), "no routing span arrived over OTLP/HTTP\n" + logs
    assert len(routes(via_grpc)) + len(routes(via_http)) == 8, "one routing span per request"
    worker_endpoint = sim_worker.url.removeprefix("http://")
    for resource, span in routes(via_grpc) + routes(via_http):
        assert resource["service.name"] == "prefix-router"
        assert len(span.trace_id) == 16 and len(span.span_id) == 8
        assert span.end_time_unix_nano >= span.start_time_unix_nano > 0
        attributes = {kv.key: _value(kv.value) for kv in span.attributes}
        assert attributes["router.policy"] == "prefix-aware"
        assert attributes["router.model"] == MODEL
        assert attributes["router.path"] == "/v1/chat/completions"
        assert attributes["router.chosen_endpoint"] == worker_endpoint
        assert attributes["router.candidates"] == [attributes["router.chosen"]]
        assert attributes["router.tokenized"] is True
        assert attributes["router.block_size"] == 16
        assert attributes["router.prompt_tokens"] > 100  # the system prompt alone is ~100 tokens
        assert attributes["router.blocks"] == attributes["router.prompt_tokens"] // 16
        assert attributes["router.decision_ms"] >= 0
        assert attributes["router.reason"]

"""The data path end to end: real Envoy, the router process and sim-worker processes on loopback.

One stack for the module (2 simulated workers, round-robin so the router's hand is visible, fast
health checks, a 64 KiB body limit). Tests that break things (stopped workers, a killed router)
come last and put the stack back as they found it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from prefix_common.addresses import free_port
from prefix_router.stack import GatewayStack
from tests.support.gateway_http import (
    SpoofTarget,
    assert_streams_as_generated,
    envoy_stats,
    post,
    request,
    stream_lines,
)

LIMIT = 64 * 1024
PICKED = "cluster.prefix_router_picked.upstream_rq_total"
FAILOPEN = "cluster.prefix_router_workers.upstream_rq_total"
CHAT = {"model": "default", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def stack(envoy_bin: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayStack]:
    config = tmp_path_factory.mktemp("router") / "router.yaml"
    config.write_text(
        # keep_last_healthy_s: hung workers (SIGSTOP) stay candidates that long after their last probe.
        "health: {interval_s: 0.2, timeout_s: 1.5, unhealthy_after: 2, healthy_after: 1, keep_last_healthy_s: 0.5}\n"
        "events: {enabled: false}\n"
    )
    gateway = GatewayStack(
        sim_workers=2,
        sim_worker_options={"no_kv_events": True},
        policy="round-robin",
        config=config,
        max_body_bytes=LIMIT,
    )
    with gateway:
        yield gateway


def workers(stack: GatewayStack) -> set[str]:
    return {url.removeprefix("http://") for url in stack.worker_urls}


def stats(stack: GatewayStack) -> tuple[int, int]:
    s = envoy_stats(stack.admin_url)
    return s.get(PICKED, 0), s.get(FAILOPEN, 0)


BODIES = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": {"model": "default", "prompt": "Once upon a time", "max_tokens": 4},
    "/generate": {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 4}},
}


@pytest.mark.parametrize(
    ("path", "body"),
    [
        *BODIES.items(),
        ("/v1/completions", {"model": "default", "prompt": [1, 2, 3, 4, 5], "max_tokens": 4}),
        ("/generate", {"input_ids": [1, 2, 3, 4, 5], "sampling_params": {"max_new_tokens": 4}}),
    ],
)
def test_generation_requests_are_routed_by_the_router(stack: GatewayStack, path: str, body: dict) -> None:
    picked_before, _ = stats(stack)
    served = set()
    for _ in range(2):
        reply = post(stack.url + path, body)
        assert reply.status == 200, reply.body
        served.add(reply.headers["x-upstream-host"])
    # Round-robin over both workers, through the ORIGINAL_DST route: the router chose.
    assert served == workers(stack)
    assert stats(stack)[0] == picked_before + 2


def test_router_reply_sets_header_metadata_and_clears_route_cache(stack: GatewayStack) -> None:
    body = b'{"model": "m", "prompt": "hi"}'
    headers = [
        (":method", "POST"),
        (":path", "/v1/completions"),
        ("x-gateway-destination-endpoint", "10.9.9.9:1"),
        ("content-length", str(len(body))),
    ]
    messages = [
        pb.ProcessingRequest(
            request_headers=pb.HttpHeaders(
                headers=base_pb2.HeaderMap(
                    headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers]
                )
            ),
            # As Envoy declares its body mode (a gateway that declares none is handled as streaming).
            protocol_config=pb.ProtocolConfiguration(request_body_mode=ProcessingMode.BUFFERED),
        ),
        pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)),
    ]
    with grpc.insecure_channel(stack.router_address) as channel:
        replies = list(pb_grpc.ExternalProcessorStub(channel).Process(iter(messages), timeout=5))
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "envoy.service.ext_proc.v3.ExternalProcessor"):
            status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
            assert status == health_pb2.HealthCheckResponse.SERVING
    assert replies[0].WhichOneof("response") == "request_headers"
    common = replies[1].request_body.response
    assert common.clear_route_cache
    (option,) = [h for h in common.header_mutation.set_headers if h.header.key == "x-gateway-destination-endpoint"]
    assert option.append_action == base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
    assert set(option.header.raw_value.decode().split(",")) == workers(stack)
    lb = replies[1].dynamic_metadata.fields["envoy.lb"].struct_value.fields
    listed = lb["x-gateway-destination-endpoint"].string_value.split(",")
    # The protocol's MUST: header and metadata equal, primary plus fallbacks in ip:port,ip:port form.
    assert ",".join(listed) == option.header.raw_value.decode() and set(listed) == workers(stack)


STREAMS = "http.gateway.ext_proc.streams_started"


def test_other_paths_pass_through_to_ordinary_routing(stack: GatewayStack) -> None:
    picked_before, failopen_before = stats(stack)
    streams_before = envoy_stats(stack.admin_url).get(STREAMS, 0)
    reply = request(stack.url + "/v1/models")
    assert reply.status == 200 and reply.json()["object"] == "list"
    assert reply.headers["x-upstream-host"] in workers(stack)
    assert stats(stack) == (picked_before, failopen_before + 1)
    assert envoy_stats(stack.admin_url).get(STREAMS, 0) == streams_before  # the router was not even asked


def test_pass_through_bodies_are_not_buffered_for_the_router(stack: GatewayStack) -> None:
    # Bigger than Envoy's buffer limit (2 x LIMIT): a buffered body would be refused with 413.
    before = envoy_stats(stack.admin_url).get(FAILOPEN, 0)
    reply = post(stack.url + "/v1/embeddings", b'{"input": "' + b"a" * (3 * LIMIT) + b'"}')
    assert reply.status != 413 and reply.headers["x-upstream-host"] in workers(stack)
    assert envoy_stats(stack.admin_url)[FAILOPEN] == before + 1


@pytest.mark.parametrize(
    ("path", "body", "status", "message"),
    [
        ("/v1/chat/completions", b"{not json", 400, "not valid JSON"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, "UTF-8"),
        ("/v1/chat/completions", b'{"model": "m"}', 400, "'messages'"),
        ("/v1/completions", b'{"model": "m"}', 400, "'prompt'"),
        ("/generate", b'{"sampling_params": {}}', 400, "'text'"),
        ("/v1/completions", b"[1, 2]", 400, "JSON object"),
        ("/v1/completions", b"", 400, "empty"),
        ("/v1/completions", b'{"prompt": "' + b"a" * (LIMIT + 10) + b'"}', 413, "limit"),
    ],
)
def test_bad_input_is_answered_by_the_router_and_never_reaches_a_worker(
    stack: GatewayStack, path: str, body: bytes, status: int, message: str
) -> None:
    before = stats(stack)
    reply = post(stack.url + path, body)
    assert reply.status == status
    assert reply.headers["content-type"] == "application/json"
    error = reply.json()["error"]
    assert message in error["message"] and error["code"] == status and error["type"]
    assert stats(stack) == before


def test_body_beyond_envoys_buffer_is_413_json_too(stack: GatewayStack) -> None:
    before = stats(stack)
    reply = post(stack.url + "/v1/completions", b'{"prompt": "' + b"a" * (3 * LIMIT) + b'"}')
    assert reply.status == 413
    assert reply.json()["error"]["code"] == 413
    assert stats(stack) == before


def test_streaming_responses_arrive_incrementally(stack: GatewayStack) -> None:
    assert_streams_as_generated(stack.url, CHAT)


def _in_flight(stack: GatewayStack) -> float:
    text = request(f"http://127.0.0.1:{stack.metrics_port}/metrics").body.decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("prefix_router_worker_in_flight{")
    )


def test_in_flight_slot_is_released_when_the_client_goes_away(stack: GatewayStack) -> None:
    _wait_until(lambda: _in_flight(stack) == 0)  # earlier streams end just after their last byte
    body = {**CHAT, "max_tokens": 400, "stream": True, "ignore_eos": True}
    lines = stream_lines(stack.url + "/v1/chat/completions", body)
    next(lines)  # the stream has started: the router counts it
    assert _in_flight(stack) == 1
    lines.close()  # the client hangs up mid-stream; Envoy resets, the ext_proc stream ends
    _wait_until(lambda: _in_flight(stack) == 0)


def test_client_destination_header_never_chooses_the_upstream(stack: GatewayStack) -> None:
    with SpoofTarget() as spoof:
        for _ in range(4):
            reply = post(
                stack.url + "/v1/chat/completions", CHAT, headers={"x-gateway-destination-endpoint": spoof.address}
            )
            assert reply.status == 200
            assert reply.headers["x-upstream-host"] in workers(stack)
        reply = request(stack.url + "/v1/models", headers={"x-gateway-destination-endpoint": spoof.address})
        assert reply.status == 200
    assert spoof.connections == 0


def _wait_until(predicate, timeout: float = 8.0) -> None:  # type: ignore[no-untyped-def]
    """Poll ``predicate``; a request that times out (sent to a hung worker) counts as not yet."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if predicate():
                return
        except OSError:  # includes socket timeouts
            pass
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.1)


def _served_by(stack: GatewayStack, count: int) -> set[str]:
    return {post(stack.url + "/v1/chat/completions", CHAT, timeout=1).headers["x-upstream-host"] for _ in range(count)}


def test_unhealthy_worker_leaves_and_comes_back(stack: GatewayStack) -> None:
    hung, other = stack.sim_processes
    os.kill(hung.process.pid, signal.SIGSTOP)  # a hung worker: /health times out
    try:
        # 2 failed checks (0.2 s apart, 1.5 s timeout: SGLang answers /health after 1 s); then only the other serves.
        _wait_until(lambda: _served_by(stack, 4) == {other.url.removeprefix("http://")})
    finally:
        os.kill(hung.process.pid, signal.SIGCONT)
    _wait_until(lambda: _served_by(stack, 2) == workers(stack))


def test_no_healthy_worker_is_503_json(stack: GatewayStack) -> None:
    for sim in stack.sim_processes:
        os.kill(sim.process.pid, signal.SIGSTOP)
    try:
        _wait_until(lambda: post(stack.url + "/v1/chat/completions", CHAT, timeout=1).status == 503)
        reply = post(stack.url + "/v1/chat/completions", CHAT)
        assert reply.status == 503
        error = reply.json()["error"]
        assert error["code"] == 503 and "no healthy worker" in error["message"]
    finally:
        for sim in stack.sim_processes:
            os.kill(sim.process.pid, signal.SIGCONT)
    _wait_until(lambda: post(stack.url + "/v1/chat/completions", CHAT, timeout=1).status == 200)


def test_fail_open_when_the_router_is_slower_than_its_timeout(stack: GatewayStack) -> None:
    router = stack.router_process
    assert router is not None
    before = envoy_stats(stack.admin_url).get("http.gateway.ext_proc.message_timeouts", 0)
    os.kill(router.pid, signal.SIGSTOP)  # connected but silent: every ext_proc message times out
    try:
        started = time.monotonic()
        reply = post(stack.url + "/v1/chat/completions", CHAT)
        elapsed = time.monotonic() - started
    finally:
        os.kill(router.pid, signal.SIGCONT)
    assert reply.status == 200 and reply.headers["x-upstream-host"] in workers(stack)
    assert 0.4 < elapsed < 3.0  # waited for the 500 ms message timeout, then went on without the router
    assert envoy_stats(stack.admin_url)["http.gateway.ext_proc.message_timeouts"] == before + 1
    _wait_until(lambda: _in_flight(stack) == 0)  # the late decision was released when its stream ended


def test_fail_open_when_the_router_dies_mid_run(stack: GatewayStack) -> None:
    results: list[int] = []
    stop = threading.Event()

    def client() -> None:
        while not stop.is_set():
            results.append(post(stack.url + "/v1/chat/completions", CHAT).status)

    threads = [threading.Thread(target=client) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        time.sleep(0.5)
        asyncio.run(stack.stop_router())  # SIGKILL, with requests in flight
        time.sleep(0.8)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert len(results) > 10 and set(results) == {200}
    s = envoy_stats(stack.admin_url)
    assert s[FAILOPEN] > 0 and s.get("http.gateway.ext_proc.failure_mode_allowed", 0) > 0

    # While the router is down, a spoofed destination still chooses nothing.
    with SpoofTarget() as spoof:
        for _ in range(3):
            reply = post(
                stack.url + "/v1/chat/completions", CHAT, headers={"x-gateway-destination-endpoint": spoof.address}
            )
            assert reply.status == 200 and reply.headers["x-upstream-host"] in workers(stack)
    assert spoof.connections == 0

    asyncio.run(stack.start_router())
    picked_before, _ = stats(stack)
    assert post(stack.url + "/v1/chat/completions", CHAT).status == 200
    assert stats(stack)[0] == picked_before + 1


async def test_health_checker_discovers_model_and_page_size(stack: GatewayStack) -> None:
    from extproc.config import HealthConfig, WorkerConfig
    from extproc.fleet.workers import WorkerRegistry
    from extproc.sync.health import HealthChecker
    from extproc.sync.http import WorkerHttp

    registry = WorkerRegistry.from_configs(
        [WorkerConfig(url=url) for url in stack.worker_urls] + [WorkerConfig(url=f"http://127.0.0.1:{free_port()}")]
    )
    http = WorkerHttp()
    checker = HealthChecker(registry, HealthConfig(timeout_s=1.5), http)
    await checker.start()
    try:
        *alive, dead = registry.workers
        assert not dead.healthy and registry.candidates() == alive  # never routed to, even at start-up
        for worker in alive:
            assert worker.model == "meta-llama/Llama-3.1-8B-Instruct"  # the sim worker's served name
            assert worker.info["page_size"] == 16 and worker.info["model_info"]["is_generation"] is True
        assert registry.candidates("some-other-name") == alive  # unknown names are served anyway
    finally:
        await checker.stop()
        await http.close()

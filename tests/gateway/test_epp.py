"""The Endpoint Picker protocol through the real Envoy, in both body modes (BUFFERED and FULL_DUPLEX_STREAMED).

One stack per body mode: real Envoy, the router process, two sim-worker processes and a third
"worker" that passes every health check but resets every generation request it gets (a real HTTP
server on loopback), so Envoy falls back to the router's next endpoint and the served endpoint
differs from the primary. Subset hints are set the way a gateway sets them, as filter metadata
before ext_proc (Envoy's ``set_metadata`` filter), in a second Envoy over the same router.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from prefix_common.addresses import free_port
from prefix_router import envoy_config
from prefix_router.stack import GatewayStack
from sglang_workers.sim.config import SimWorkerConfig
from tests.support.gateway_http import assert_streams_as_generated, envoy_stats, post, request, sse_data, stream_lines
from tests.support.waiting import wait_until

CHAT = {"model": SimWorkerConfig().model, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 4}
LIMIT = 9 * 1024 * 1024
CHUNK = 64 * 1024


class _ResettingWorker(BaseHTTPRequestHandler):
    """Healthy to every probe; resets the connection of every POST (dies while taking a request)."""

    def do_GET(self) -> None:
        # It serves the sim-workers' model: otherwise the router would keep it for requests naming no
        # model the sims serve (an unknown name falls back to every healthy worker, a known one does not).
        body = json.dumps({"model_path": SimWorkerConfig().model}).encode() if self.path == "/model_info" else b"{}"
        self.send_response(200 if self.path in ("/ready", "/health", "/model_info") else 404)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        self.connection.close()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def resetting_worker() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ResettingWorker)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


@pytest.fixture(scope="module", params=["buffered", "streamed"])
def stack(
    request: pytest.FixtureRequest, envoy_bin: str, resetting_worker: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayStack]:
    config = tmp_path_factory.mktemp("router") / "router.yaml"
    config.write_text(
        "health: {interval_s: 0.2, timeout_s: 1.5, unhealthy_after: 2, healthy_after: 1}\n"
        "events: {enabled: false}\nload: {poll_interval_s: 60}\n"
    )
    gateway = GatewayStack(
        worker_urls=[f"http://{resetting_worker}"],
        sim_workers=2,
        sim_worker_options={"no_kv_events": True},
        policy="round-robin",
        config=config,
        max_body_bytes=LIMIT,
        body_mode=request.param,
    )
    with gateway:
        yield gateway


def _sims(stack: GatewayStack) -> set[str]:
    return {sim.url.removeprefix("http://") for sim in stack.sim_processes}


def _metric(stack: GatewayStack, prefix: str) -> dict[str, float]:
    text = request(f"http://127.0.0.1:{stack.metrics_port}/metrics").body.decode()
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix)
    }


def _in_flight(stack: GatewayStack) -> dict[str, float]:
    return {key.split('"')[1]: value for key, value in _metric(stack, "prefix_router_worker_in_flight{").items()}


def test_every_request_is_served_by_a_real_worker_even_after_a_reset(stack: GatewayStack) -> None:
    """The primary is sometimes the resetting worker: Envoy retries the next endpoint of the router's list."""
    served = set()
    for _ in range(6):
        reply = post(stack.url + "/v1/chat/completions", CHAT)
        assert reply.status == 200, reply.body
        served.add(reply.headers["x-upstream-host"])
        assert "x-gateway-destination-endpoint-served" not in reply.headers  # turned into metadata, then removed
    assert served <= _sims(stack)
    assert _metric(stack, "prefix_router_served_elsewhere_total")["prefix_router_served_elsewhere_total"] >= 1


def test_served_endpoint_carries_the_in_flight_count(stack: GatewayStack, resetting_worker: str) -> None:
    wait_until(lambda: sum(_in_flight(stack).values()) == 0)
    body = {**CHAT, "max_tokens": 300, "stream": True, "ignore_eos": True}
    for _ in range(3):  # round-robin: one of three streams has the resetting worker as its primary
        lines = stream_lines(stack.url + "/v1/chat/completions", body)
        next(lines)
        counts = _in_flight(stack)
        assert counts[resetting_worker] == 0  # never left on the worker that did not serve
        assert sum(counts.values()) == 1
        lines.close()
        wait_until(lambda: sum(_in_flight(stack).values()) == 0)


def test_sse_tokens_arrive_as_the_worker_streams_them(stack: GatewayStack) -> None:
    assert_streams_as_generated(stack.url, CHAT)


def _chunked_post(url: str, pieces: Iterator[bytes], timeout: float = 60.0) -> tuple[int, bytes]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request(
            "POST", "/v1/completions", body=pieces, headers={"content-type": "application/json"}, encode_chunked=True
        )
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def test_an_8_mib_body_in_64_kib_chunks_reaches_the_worker_whole(stack: GatewayStack) -> None:
    padding = "x" * (8 * 1024 * 1024)
    # The field after the padding must survive: the worker generates exactly max_tokens tokens.
    raw = json.dumps({"model": "default", "prompt": "Once upon a time", "user": padding, "max_tokens": 3}).encode()
    status, data = _chunked_post(stack.url, (raw[i : i + CHUNK] for i in range(0, len(raw), CHUNK)))
    assert status == 200, data[:300]
    assert json.loads(data)["usage"]["completion_tokens"] == 3


def test_a_slow_upload_is_routed_by_the_router_not_failed_open(stack: GatewayStack) -> None:
    """The decision waits for the last chunk, longer than Envoy's 500 ms message timeout, without failing open."""
    raw = json.dumps({"model": "default", "prompt": "Once upon a time " * 2000, "max_tokens": 2}).encode()

    def slowly() -> Iterator[bytes]:
        for i in range(0, len(raw), 4096):
            time.sleep(0.1)
            yield raw[i : i + 4096]

    before = envoy_stats(stack.admin_url)
    status, data = _chunked_post(stack.url, slowly())
    after = envoy_stats(stack.admin_url)
    assert status == 200, data[:300]
    assert len(raw) // 4096 >= 8  # at least 0.8 s of upload
    failopen = "cluster.prefix_router_workers.upstream_rq_total"
    picked = "cluster.prefix_router_picked.upstream_rq_total"
    assert after.get(failopen, 0) == before.get(failopen, 0)
    assert after[picked] > before.get(picked, 0)


def test_model_name_rewrite_reaches_the_worker(stack: GatewayStack) -> None:
    reply = post(
        stack.url + "/v1/chat/completions", CHAT, headers={"x-gateway-model-name-rewrite": "a-rewritten-model-name"}
    )
    assert reply.status == 200, reply.body
    assert reply.json()["model"] == "a-rewritten-model-name"  # the worker answers with the model it was asked for


def test_client_gone_mid_body_leaves_nothing_behind(stack: GatewayStack) -> None:
    wait_until(lambda: sum(_in_flight(stack).values()) == 0)
    host, port = stack.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        piece = b'{"prompt": "' + b"a" * CHUNK
        sock.sendall(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
        time.sleep(0.3)
    time.sleep(0.3)
    assert sum(_in_flight(stack).values()) == 0
    assert post(stack.url + "/v1/chat/completions", CHAT).status == 200


def test_client_gone_mid_stream_releases_the_slot(stack: GatewayStack) -> None:
    wait_until(lambda: sum(_in_flight(stack).values()) == 0)
    body = {**CHAT, "max_tokens": 400, "stream": True, "ignore_eos": True}
    lines = stream_lines(stack.url + "/v1/chat/completions", body)
    next(lines)
    assert sum(_in_flight(stack).values()) == 1
    lines.close()
    wait_until(lambda: sum(_in_flight(stack).values()) == 0)


def test_no_5xx_and_nothing_lost_under_concurrent_streams(stack: GatewayStack) -> None:
    body = {**CHAT, "max_tokens": 24, "stream": True, "ignore_eos": True}
    results: list[int] = []

    def client() -> None:
        results.append(len(sse_data(stack.url + "/v1/chat/completions", body)))

    threads = [threading.Thread(target=client) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(results) == 12 and all(n >= 24 for n in results)


# -- the subset hint, set as a gateway sets it -----------------------------------------------------


def _subset_envoy(stack: GatewayStack, subset: list[str], log_dir: Path) -> tuple[subprocess.Popen[bytes], str]:
    """A second Envoy over the same router and workers whose filter chain sets the subset hint first."""
    spec = stack.spec()
    spec.listen = ("127.0.0.1", free_port())
    spec.admin = ("127.0.0.1", free_port())
    config = envoy_config.bootstrap(spec)
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"].insert(
        1,
        {
            "name": "envoy.filters.http.set_metadata",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config",
                "metadata": [
                    {
                        "metadata_namespace": "envoy.lb.subset_hint",
                        "value": {"x-gateway-destination-endpoint-subset": subset},
                    }
                ],
            },
        },
    )
    path = log_dir / f"envoy-subset-{len(subset)}.yaml"
    path.write_text(envoy_config.dump(config))
    binary = envoy_config_binary()
    process = subprocess.Popen(
        [binary, "-c", str(path), "--disable-hot-restart", "--concurrency", "1", "--base-id", str(free_port())],
        stdout=subprocess.DEVNULL,
        stderr=(log_dir / f"envoy-subset-{len(subset)}.log").open("wb"),
    )
    url = f"http://127.0.0.1:{spec.listen[1]}"
    deadline = time.monotonic() + 30
    while True:
        try:
            envoy_stats(f"http://127.0.0.1:{spec.admin[1]}")
            request(url + "/v1/models", timeout=2)
            return process, url
        except OSError:
            if time.monotonic() > deadline or process.poll() is not None:
                process.kill()
                process.wait()
                raise AssertionError("the subset Envoy did not start") from None
            time.sleep(0.1)


def envoy_config_binary() -> str:
    from prefix_router.stack import find_envoy

    binary = find_envoy()
    assert binary is not None
    return binary


def test_subset_hint_is_honoured_and_an_empty_one_is_503(stack: GatewayStack, tmp_path: Path) -> None:
    allowed = sorted(_sims(stack))[0]
    # Earlier tests load the workers; a busy sim-worker may have missed its probes for a moment.
    wait_until(lambda: _metric(stack, f'prefix_router_worker_healthy{{worker="{allowed}"}}').popitem()[1] == 1)
    process, url = _subset_envoy(stack, [allowed], tmp_path)
    try:
        for _ in range(4):  # round-robin would visit all three workers
            reply = post(url + "/v1/chat/completions", CHAT)
            assert reply.status == 200 and reply.headers["x-upstream-host"] == allowed
    finally:
        process.terminate()
        process.wait(10)
    process, url = _subset_envoy(stack, [], tmp_path)
    try:
        reply = post(url + "/v1/chat/completions", CHAT)
        assert reply.status == 503
        assert "subset" in reply.json()["error"]["message"]
    finally:
        process.terminate()
        process.wait(10)


def test_with_the_router_down_buffered_fails_open_and_streamed_says_so_in_a_503(stack: GatewayStack) -> None:
    import asyncio

    asyncio.run(stack.stop_router())  # SIGKILL: the ext_proc stream cannot even start
    try:
        reply = post(stack.url + "/v1/chat/completions", CHAT)
    finally:
        asyncio.run(stack.start_router())
    if stack.body_mode == "buffered" or reply.status == 200:
        assert reply.status == 200, reply.body  # failure_mode_allow: served without the router
    else:
        # Envoy 1.40 mostly does not fail open in FULL_DUPLEX_STREAMED: its bare 500 becomes a 503 that says why.
        assert reply.status == 503, reply.body
        assert "the router (ext_proc) failed" in reply.json()["error"]["message"]
    wait_until(lambda: post(stack.url + "/v1/chat/completions", CHAT).status == 200)


# -- flow control behind the real Envoy ------------------------------------------------------------


@pytest.fixture(scope="module", params=["buffered", "streamed"])
def flow_stack(
    request: pytest.FixtureRequest, envoy_bin: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayStack]:
    config = tmp_path_factory.mktemp("flow") / "router.yaml"
    config.write_text(
        "events: {enabled: false}\n"
        "flow_control:\n"
        "  enabled: true\n  max_in_flight_per_worker: 1\n  queue_ttl_s: 4\n  retry_after_s: 2\n"
        "  objectives: {critical: {priority: 10}, batch: {priority: -1}}\n"
    )
    gateway = GatewayStack(
        sim_workers=2,
        sim_worker_options={"no_kv_events": True},
        policy="least-load",
        config=config,
        body_mode=request.param,
        max_message_timeout_ms=6000,  # above queue_ttl_s: a waiting request is never failed open
    )
    with gateway:
        yield gateway


def _post_objective(url: str, objective: str, body: dict[str, Any] | None = None) -> Any:
    return post(
        url + "/v1/chat/completions", body or CHAT, headers={"x-gateway-inference-objective": objective}, timeout=20
    )


def test_flow_control_holds_critical_and_sheds_sheddable_past_saturation(flow_stack: GatewayStack) -> None:
    long = {**CHAT, "max_tokens": 2000, "stream": True, "ignore_eos": True}
    held = [stream_lines(flow_stack.url + "/v1/chat/completions", long) for _ in range(2)]
    for lines in held:
        next(lines)  # both workers at their bound of one request now
    failopen_before = envoy_stats(flow_stack.admin_url).get("cluster.prefix_router_workers.upstream_rq_total", 0)
    shed = _post_objective(flow_stack.url, "batch")
    assert shed.status == 429
    assert shed.headers["retry-after"] == "2" and shed.json()["error"]["code"] == 429
    waited: list[tuple[int, float]] = []

    def critical() -> None:
        start = time.monotonic()
        waited.append((_post_objective(flow_stack.url, "critical").status, time.monotonic() - start))

    thread = threading.Thread(target=critical)
    thread.start()
    time.sleep(1.2)  # past Envoy's 500 ms message timeout: it waits because the router asked for more time
    assert not waited
    held[0].close()  # one worker has room again
    thread.join(10)
    assert waited and waited[0][0] == 200 and waited[0][1] > 1.0
    held[1].close()
    # Nothing went around the router (fail-open) while it waited.
    assert (
        envoy_stats(flow_stack.admin_url).get("cluster.prefix_router_workers.upstream_rq_total", 0) == failopen_before
    )
    shed_total = _metric(flow_stack, "prefix_router_flow_shed_total")
    assert shed_total == {'prefix_router_flow_shed_total{priority="-1",reason="sheddable"}': 1.0}
    waits = _metric(flow_stack, "prefix_router_flow_wait_seconds_count")
    assert waits['prefix_router_flow_wait_seconds_count{priority="10"}'] >= 1


# -- every worker misses its probes at once while it still serves -----------------------------------


@pytest.fixture(scope="module", params=["buffered", "streamed"])
def blip_stack(
    request: pytest.FixtureRequest, envoy_bin: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayStack]:
    config = tmp_path_factory.mktemp("blip") / "router.yaml"
    config.write_text(
        "health: {interval_s: 0.2, timeout_s: 1.5, unhealthy_after: 1, healthy_after: 1, keep_last_healthy_s: 10}\n"
        "events: {enabled: false}\nload: {poll_interval_s: 60}\n"
    )
    gateway = GatewayStack(
        sim_workers=2, sim_worker_options={"no_kv_events": True}, config=config, body_mode=request.param
    )
    with gateway:
        yield gateway


def test_the_last_healthy_set_serves_while_every_worker_misses_its_probes(blip_stack: GatewayStack) -> None:
    sims = blip_stack.sim_processes
    for sim in sims:
        os.kill(sim.process.pid, signal.SIGSTOP)  # alive (the kernel still accepts), but no probe answers
    replies: list[int] = []
    try:
        healthy = "prefix_router_worker_healthy{"
        wait_until(lambda: sum(_metric(blip_stack, healthy).values()) == 0)  # every worker out of the candidates
        thread = threading.Thread(
            target=lambda: replies.append(post(blip_stack.url + "/v1/chat/completions", CHAT, timeout=20).status)
        )
        thread.start()
        time.sleep(0.5)
    finally:
        for sim in sims:
            os.kill(sim.process.pid, signal.SIGCONT)
    thread.join(20)
    assert replies == [200]  # routed to the last healthy set, served once the workers answer again: not a 503

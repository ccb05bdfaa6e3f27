"""TLS on the ext_proc channel, and ``prefix-router up`` as a user runs it."""

from __future__ import annotations

import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from prefix_common.addresses import free_port
from prefix_router.stack import GatewayStack
from tests.support.gateway_http import envoy_stats, post
from tests.support.tls import self_signed
from tests.support.up import running_up

PICKED = "cluster.prefix_router_picked.upstream_rq_total"
CHAT = {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for the name ``prefix-router`` (it is its own CA)."""
    return self_signed(tmp_path_factory.mktemp("tls"), "prefix-router")


@pytest.fixture(scope="module")
def tls_stack(envoy_bin: str, certificate: tuple[Path, Path]) -> Iterator[GatewayStack]:
    cert, key = certificate
    with GatewayStack(
        sim_workers=2,
        sim_worker_options={"no_kv_events": True, "profile": "instant"},
        policy="round-robin",
        tls_cert=cert,
        tls_key=key,
        tls_ca=cert,
        tls_sni="prefix-router",
    ) as gateway:
        yield gateway


def test_router_decides_over_tls(tls_stack: GatewayStack) -> None:
    before = envoy_stats(tls_stack.admin_url).get(PICKED, 0)
    served = {post(tls_stack.url + "/v1/chat/completions", CHAT).headers["x-upstream-host"] for _ in range(2)}
    assert len(served) == 2  # round-robin: the router, not fail-open, chose
    stats = envoy_stats(tls_stack.admin_url)
    assert stats[PICKED] == before + 2
    assert stats.get("http.gateway.ext_proc.failure_mode_allowed", 0) == 0


def test_tls_router_refuses_plaintext(tls_stack: GatewayStack, certificate: tuple[Path, Path]) -> None:
    with grpc.insecure_channel(tls_stack.router_address) as channel, pytest.raises(grpc.RpcError):
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
    credentials = grpc.ssl_channel_credentials(certificate[0].read_bytes())
    with grpc.secure_channel(
        tls_stack.router_address, credentials, options=[("grpc.ssl_target_name_override", "prefix-router")]
    ) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def _port_open(url: str) -> bool:
    host, port = url.removeprefix("http://").split(":")
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, int(port))) == 0


@pytest.mark.parametrize("body_mode", ["buffered", "streamed"])
def test_up_prints_the_url_serves_and_stops_cleanly(envoy_bin: str, body_mode: str, tmp_path: Path) -> None:
    port = free_port()
    argv = ["--workers", "2", "--port", str(port), "--policy", "round-robin", "--body-mode", body_mode]
    with running_up(*argv, "--log-dir", str(tmp_path)) as (up, lines):
        assert up.stdout is not None and up.stderr is not None
        url = f"http://127.0.0.1:{port}"
        assert url in next(line for line in lines if "gateway is up" in line)
        banner = "".join(lines)
        workers = [line.strip() for line in lines if line.strip().startswith("http://") and str(port) not in line]
        assert len(workers) == 2
        reply = post(url + "/v1/chat/completions", CHAT)
        assert reply.status == 200 and "http://" + reply.headers["x-upstream-host"] in workers
        access_log = [up.stdout.readline() for _ in range(2)]  # a blank line, then that request's line
        assert any("router-picked" in line and reply.headers["x-upstream-host"] in line for line in access_log)
        mode = "FULL_DUPLEX_STREAMED" if body_mode == "streamed" else "BUFFERED"
        assert f"request_body_mode: {mode}" in (tmp_path / "envoy.yaml").read_text()
        up.send_signal(signal.SIGTERM)
        assert up.wait(30) == 0, banner + up.stderr.read()
        assert not _port_open(url) and not any(_port_open(w) for w in workers)

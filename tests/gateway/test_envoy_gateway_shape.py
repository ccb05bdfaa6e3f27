"""The router behind Envoy configured the way Envoy Gateway configures an InferencePool's endpoint picker.

The router and two sim-workers come from a ``GatewayStack``; in front of them runs a second real
Envoy whose bootstrap is ``prefix_router.gie_envoy_config`` (ORIGINAL_DST on the destination header,
every phase sent, bodies FULL_DUPLEX_STREAMED or BUFFERED, fail closed). Nothing of our own Envoy
config helps here: no fallbacks, no metadata options, no header stripping.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from prefix_common.addresses import free_port
from prefix_router import gie_envoy_config
from prefix_router.stack import GatewayStack, find_envoy
from sglang_workers.sim.config import SimWorkerConfig
from tests.support.gateway_http import post, sse_data
from tests.support.gateway_http import request as http_request

ROOT = Path(__file__).resolve().parents[2]
CHAT = {"model": SimWorkerConfig().model, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 4}


def test_the_kept_file_matches_the_generator() -> None:
    path, content = gie_envoy_config.example_file()
    assert (ROOT / path).read_text() == content, "stale: run `python -m prefix_router.gie_envoy_config`"


@pytest.fixture(scope="module")
def router_stack(envoy_bin: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayStack]:
    # ORIGINAL_DST parses one ip:port: behind this shape the router names no fallbacks.
    config = tmp_path_factory.mktemp("router") / "router.yaml"
    config.write_text("server: {fallback_endpoints: 0}\nevents: {enabled: false}\n")
    with GatewayStack(
        sim_workers=2,
        sim_worker_options={"no_kv_events": True},
        policy="round-robin",
        max_body_bytes=9 * 1024 * 1024,
        config=config,
    ) as stack:
        yield stack


@pytest.fixture(scope="module", params=["FULL_DUPLEX_STREAMED", "BUFFERED"])
def shaped(
    request: pytest.FixtureRequest, router_stack: GatewayStack, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str]]:
    listen, admin = free_port(), free_port()
    config = gie_envoy_config.bootstrap(
        ("127.0.0.1", router_stack.router_port), ("127.0.0.1", listen), ("127.0.0.1", admin), body_mode=request.param
    )
    path = tmp_path_factory.mktemp("eg") / "envoy.yaml"
    path.write_text(json.dumps(config))
    binary = find_envoy()
    assert binary is not None
    log = (path.parent / "envoy.log").open("wb")
    process = subprocess.Popen(
        [binary, "-c", str(path), "--disable-hot-restart", "--concurrency", "1", "--base-id", str(free_port())],
        stdout=subprocess.DEVNULL,
        stderr=log,
    )
    url = f"http://127.0.0.1:{listen}"
    deadline = time.monotonic() + 30
    try:
        while True:
            try:
                http_request(f"http://127.0.0.1:{admin}/ready", timeout=1)
                break
            except OSError:
                assert time.monotonic() < deadline and process.poll() is None, "Envoy did not start"
                time.sleep(0.1)
        yield url, request.param
    finally:
        process.terminate()
        process.wait(10)


def test_generation_requests_reach_the_router_picked_worker(shaped: tuple[str, str]) -> None:
    seen = set()
    for _ in range(4):
        reply = post(shaped[0] + "/v1/chat/completions", CHAT)
        assert reply.status == 200, reply.body
        assert reply.json()["choices"][0]["message"]["content"]
        seen.add(reply.json()["id"])
    assert len(seen) == 4


def test_sse_streams_through(shaped: tuple[str, str]) -> None:
    url, mode = shaped
    body = {**CHAT, "max_tokens": 48, "stream": True, "ignore_eos": True}
    events = sse_data(url + "/v1/chat/completions", body)
    assert events[-1][1].strip() == b"data: [DONE]" and len(events) >= 40
    if mode == "FULL_DUPLEX_STREAMED":  # tokens arrive as the worker makes them (BUFFERED: Envoy holds the response)
        assert events[-1][0] - events[0][0] > 0.15


def test_bad_input_is_answered_by_the_router(shaped: tuple[str, str]) -> None:
    reply = post(shaped[0] + "/v1/chat/completions", b"{not json")
    assert reply.status == 400 and "not valid JSON" in reply.json()["error"]["message"]


def test_other_paths_pass_through(shaped: tuple[str, str]) -> None:
    # Every path goes through the picker in this shape: ORIGINAL_DST has no upstream without its header,
    # so the router names the least busy worker for requests it does not route by prompt.
    reply = http_request(shaped[0] + "/v1/models")
    assert reply.status == 200 and reply.json()["object"] == "list"

"""Prefill/decode pairs end to end: real Envoy, the router process, simulated prefill and decode workers.

One stack per body mode (BUFFERED and FULL_DUPLEX_STREAMED): two prefill and one decode simulated
worker, whose roles the router discovers from their ``/server_info``. The router sends the prefill
leg itself; Envoy proxies the decode side, whose response the client reads. The test that kills a
prefill worker comes last in each module run.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from prefix_common.addresses import free_port
from prefix_router.stack import GatewayStack
from tests.support.cli import run_cli
from tests.support.gateway_http import assert_streams_as_generated, post, request
from tests.support.up import running_up
from tests.support.waiting import wait_until

GENERATE = {"text": "The quick brown fox jumps over the lazy dog. " * 12, "sampling_params": {"max_new_tokens": 8}}


@pytest.fixture(scope="module", params=["buffered", "streamed"])
def stack(
    request: pytest.FixtureRequest, envoy_bin: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayStack]:
    config = tmp_path_factory.mktemp("router") / "router.yaml"
    # A /health answers after 1 s at the earliest: 3 s leaves a loaded machine room (nothing here hangs a worker;
    # a killed one refuses at once). At 1.5 s one CI run saw a prefill worker unhealthy all through (cause not found).
    config.write_text(
        "health: {interval_s: 0.2, timeout_s: 3.0, unhealthy_after: 2, healthy_after: 1, keep_last_healthy_s: 0}\n"
        "load: {poll_interval_s: 0.2}\n"
    )
    gateway = GatewayStack(
        pd=(2, 1),
        sim_worker_options={"profile": "llama-3.1-8b-h100", "page_size": 16},
        config=config,
        body_mode=request.param,
    )
    with gateway:
        yield gateway


def _metrics(stack: GatewayStack) -> str:
    return request(f"http://127.0.0.1:{stack.metrics_port}/metrics").body.decode()


def _sample(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and line.split(" ")[0] != name:
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _roles(stack: GatewayStack) -> tuple[list[Any], Any]:
    workers = stack.sim_processes
    return workers[:2], workers[2]


def _label(worker: Any) -> str:
    return worker.url.removeprefix("http://")


def test_a_pd_request_is_answered_by_decode_and_prefilled_by_a_prefill_worker(stack: GatewayStack) -> None:
    _prefill, decode = _roles(stack)
    wait_until(lambda: _sample(_metrics(stack), "prefix_router_worker_healthy") == 3)
    before = _metrics(stack)
    reply = post(stack.url + "/generate", GENERATE, timeout=30)
    assert reply.status == 200, reply.body
    assert reply.headers.get("x-upstream-host") == _label(decode)  # the client reads the decode worker's answer
    data = reply.json()
    assert data["meta_info"]["completion_tokens"] == 8
    after = _metrics(stack)
    assert _sample(after, "prefix_router_pd_routed_total", role="decode", worker=_label(decode)) == (
        _sample(before, "prefix_router_pd_routed_total", role="decode", worker=_label(decode)) + 1
    )
    assert _sample(after, "prefix_router_pd_routed_total", role="prefill") == (
        _sample(before, "prefix_router_pd_routed_total", role="prefill") + 1
    )
    for path, body in (
        (
            "/v1/chat/completions",
            {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
        ),
        ("/v1/completions", {"model": "default", "prompt": "Once upon a time", "max_tokens": 4}),
    ):
        reply = post(stack.url + path, body, timeout=30)
        assert reply.status == 200, reply.body
        assert reply.json()["usage"]["completion_tokens"] == 4


def test_a_repeat_hits_the_prefill_workers_cache_and_only_prefill_workers_feed_the_index(stack: GatewayStack) -> None:
    prefill, decode = _roles(stack)
    body = {"text": "A long shared system prompt about routing. " * 20, "sampling_params": {"max_new_tokens": 2}}
    first = post(stack.url + "/generate", body, timeout=30)
    assert first.status == 200, first.body
    time.sleep(0.5)  # the prefill worker's KV events reach the index
    second = post(stack.url + "/generate", body, timeout=30)
    assert second.status == 200, second.body
    prompt = second.json()["meta_info"]["prompt_tokens"]
    cached = second.json()["meta_info"]["cached_tokens"]
    assert cached >= prompt // 16 * 16 - 16 > 0  # the same prefill worker again: its radix cache held the prompt
    text = _metrics(stack)
    assert _sample(text, "prefix_router_index_blocks", worker=_label(decode)) == 0
    assert sum(_sample(text, "prefix_router_index_blocks", worker=_label(p)) for p in prefill) > 0


def test_streamed_tokens_pass_through_as_decode_makes_them(stack: GatewayStack) -> None:
    chat = {"model": "default", "messages": [{"role": "user", "content": "Tell me a story"}]}
    assert_streams_as_generated(stack.url, chat, timeout=30)


def _queued_on(worker: Any) -> int:
    """Requests the worker itself reports, in its scheduler or waiting in its PD bootstrap queue."""
    loads = request(worker.url + "/v1/loads?include=all&format=json").json()["loads"]
    return sum(
        r["num_running_reqs"] + r["num_waiting_reqs"] + r["disaggregation"]["prefill_bootstrap_queue_reqs"]
        for r in loads
    )


def test_a_request_the_router_did_not_pair_is_a_503_at_once_not_a_workers_400(stack: GatewayStack) -> None:
    asyncio.run(stack.stop_router())  # SIGKILL: Envoy fails open at once
    try:
        began = time.monotonic()
        reply = post(stack.url + "/generate", GENERATE, timeout=30)
        elapsed = time.monotonic() - began
    finally:
        asyncio.run(stack.start_router())
    # Fail-open would hand the body, without bootstrap fields, to a PD worker: SGLang's 400 blames the client.
    # In FULL_DUPLEX_STREAMED Envoy mostly does not fail open; its own 500 for the failed stream becomes a 503 too.
    assert reply.status == 503, reply.body
    error = json.loads(reply.body)["error"]
    expected = ["prefill/decode fleet"] + (["the router (ext_proc) failed"] if stack.body_mode == "streamed" else [])
    assert any(e in error["message"] for e in expected) and error["type"] == "service_unavailable", error
    assert elapsed < 3.0
    wait_until(lambda: post(stack.url + "/generate", GENERATE, timeout=30).status == 200, timeout=20)


def test_a_dead_decode_worker_stops_the_prefill_leg_it_was_paired_with(stack: GatewayStack) -> None:
    prefill, decode = _roles(stack)
    decode.process.send_signal(signal.SIGKILL)
    decode.process.wait()
    try:
        began = time.monotonic()
        reply = post(stack.url + "/generate", GENERATE, timeout=30)
        assert reply.status >= 500, reply.body  # Envoy could not reach the decode side (or the router knew it dead)
        assert time.monotonic() - began < 5
        # A prefill leg would otherwise wait out the bootstrap timeout (300 s) for a decode worker that never comes.
        # 15 s, not 5: on a loaded 2-core CI machine (after the compose test) the abort took longer than 5 s once.
        wait_until(lambda: sum(_queued_on(p) for p in prefill) == 0, timeout=15)
    finally:
        decode.restart(60)
        wait_until(lambda: _sample(_metrics(stack), "prefix_router_worker_healthy") == 3, timeout=20)


def test_a_killed_prefill_worker_fails_its_request_fast_and_the_next_go_to_the_other(stack: GatewayStack) -> None:
    prefill, _decode = _roles(stack)
    # A prompt long enough that its prefill is still running when the worker dies (8k tokens on the simulated GPU).
    long_body = {"text": " ".join(f"w{i}" for i in range(6000)), "sampling_params": {"max_new_tokens": 4}}
    result: dict[str, Any] = {}

    def send() -> None:
        began = time.monotonic()
        result["reply"] = post(stack.url + "/generate", long_body, timeout=60)
        result["seconds"] = time.monotonic() - began

    before = _metrics(stack)
    sender = threading.Thread(target=send)
    sender.start()
    # Whichever prefill worker took it: find it by its in-flight count, then kill it mid-prefill.
    victim: Any = None

    def busy() -> bool:
        nonlocal victim
        text = _metrics(stack)
        victim = next((p for p in prefill if _sample(text, "prefix_router_worker_in_flight", worker=_label(p))), None)
        return victim is not None

    wait_until(busy, timeout=10)
    victim.process.send_signal(signal.SIGKILL)
    sender.join(60)
    reply = result["reply"]
    assert result["seconds"] < 10  # seconds, never SGLang's 300 s bootstrap wait
    assert reply.status >= 500, reply.body
    # Who answers depends on when the kill lands: the router (the prefill leg failed or was aborted) or the decode
    # worker, whose handshake with the dead prefill's bootstrap server was refused or reset.
    assert re.search(rb"prefill|abort|bootstrap", reply.body, re.IGNORECASE), reply.body
    after = _metrics(stack)
    assert _sample(after, "prefix_router_pd_prefill_failures_total", retried="false") > _sample(
        before, "prefix_router_pd_prefill_failures_total", retried="false"
    )
    # The next requests find the surviving prefill worker (a refused leg is retried before Envoy is answered).
    for _ in range(3):
        again = post(stack.url + "/generate", GENERATE, timeout=30)
        assert again.status == 200, again.body
    victim.restart(60)
    wait_until(lambda: _sample(_metrics(stack), "prefix_router_worker_healthy") == 3, timeout=20)


def test_up_pd_runs_a_prefill_decode_fleet_behind_the_gateway(envoy_bin: str) -> None:
    port = free_port()
    with running_up("--pd", "1P1D", "--port", str(port), "--quiet") as (_, banner):
        text = "".join(banner)
        assert text.count("(prefill)") == 1 and text.count("(decode)") == 1, text
        decode_url = next(line.split()[0] for line in banner if "(decode)" in line)
        reply = post(f"http://127.0.0.1:{port}/generate", GENERATE, timeout=30)
        assert reply.status == 200, reply.body
        assert reply.headers.get("x-upstream-host") == decode_url.removeprefix("http://")


def test_up_refuses_a_bad_pd_shape() -> None:
    done = run_cli("up", "--pd", "0P1D")
    assert done.returncode == 2 and "not a PD fleet shape like 1P1D" in done.stderr

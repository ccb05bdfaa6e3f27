"""The gateway on a real SGLang 0.5.23 prefill/decode pair on this CPU: real Envoy, the router, one real
prefill and one real decode worker (``GatewayStack(pd=(1, 1))``, mooncake over TCP).

The router discovers both roles and the bootstrap port from ``/server_info``, sends the prefill leg
itself and lets Envoy proxy the decode side. Checked against what the workers say: the decode worker
answers, a repeat reports the prefill worker's ``cached_tokens``, only the prefill worker's KV events
feed the index, a streamed chat arrives in pieces, and a killed prefill worker costs a fast, clean
error. A pair takes ~7 GB and ~80 s to start; the module keeps its requests few and short.
"""

from __future__ import annotations

import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from prefix_router.stack import GatewayStack
from tests.support.gateway_http import post, sse_data
from tests.support.real_sglang import CPU_EXTRA_FLAGS, CPU_POOL_TOKENS, streamed_chat, tiny_model_config
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.real_sglang, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def stack(envoy_bin: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayStack]:
    from sglang_workers.real.installation import find_install, missing_install_reason

    reason = missing_install_reason()
    if reason is not None:
        pytest.skip(reason)
    install = find_install()
    assert install is not None
    config = tmp_path_factory.mktemp("router") / "router.yaml"
    config.write_text(
        tiny_model_config(install)
        + "health: {interval_s: 0.5, timeout_s: 5.0, unhealthy_after: 2, keep_last_healthy_s: 0}\n"
    )
    gateway = GatewayStack(
        pd=(1, 1),
        sglang_cpu_workers=1,
        sglang_cpu_options={"capacity_tokens": CPU_POOL_TOKENS, "extra_args": CPU_EXTRA_FLAGS},
        config=config,
        startup_timeout_s=400,
    )
    with gateway:
        yield gateway


def _metric(stack: GatewayStack, name: str, **labels: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{stack.metrics_port}/metrics", timeout=5) as response:
        text = response.read().decode()
    total = 0.0
    for line in text.splitlines():
        head = line.split(" ")[0]
        if head.split("{")[0] == name and all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _label(worker: Any) -> str:
    return f"127.0.0.1:{worker.port}"


def test_a_pd_request_through_the_gateway_is_paired_cached_and_indexed_from_prefill(stack: GatewayStack) -> None:
    prefill, decode = stack.sglang_cpu_processes
    wait_until(lambda: _metric(stack, "prefix_router_worker_healthy") == 2, timeout=30)
    # ignore_eos: the tiny random model may sample its end-of-sequence token early (a CI run got 2 of 8 tokens).
    sampling = {"max_new_tokens": 8, "ignore_eos": True}
    body = {"text": "Routing prefill and decode apart on one machine. " * 12, "sampling_params": sampling}
    first = post(stack.url + "/generate", body, timeout=120)
    assert first.status == 200, first.body
    assert first.headers.get("x-upstream-host") == _label(decode)  # the client reads the decode worker's answer
    assert first.json()["meta_info"]["completion_tokens"] == 8
    assert _metric(stack, "prefix_router_pd_routed_total", role="prefill", worker=_label(prefill)) == 1
    # The prefill worker's BlockStored events reach the index; the decode worker publishes none.
    wait_until(lambda: _metric(stack, "prefix_router_index_blocks", worker=_label(prefill)) > 0, timeout=10)
    assert _metric(stack, "prefix_router_index_blocks", worker=_label(decode)) == 0
    second = post(stack.url + "/generate", body, timeout=120)
    assert second.status == 200, second.body
    meta = second.json()["meta_info"]
    assert meta["cached_tokens"] >= meta["prompt_tokens"] - 16 > 0  # the prefill side's radix cache held it

    events = sse_data(stack.url + "/v1/chat/completions", streamed_chat("Say something long.", 24), 120)
    assert events[-1][1].strip() == b"data: [DONE]" and len(events) >= 20


def test_a_killed_prefill_worker_fails_requests_fast_and_clean(stack: GatewayStack) -> None:
    prefill, decode = stack.sglang_cpu_processes
    # Frozen first, so that the request is in flight on both sides when the prefill worker dies: its
    # kernel still accepts the leg's connection, the decode worker waits for KV that never comes.
    prefill.process.send_signal(signal.SIGSTOP)
    result: dict[str, Any] = {}

    def send() -> None:
        body = {"text": "The prefill worker dies while this waits. " * 8, "sampling_params": {"max_new_tokens": 4}}
        result["reply"] = post(stack.url + "/generate", body, timeout=120)

    sender = threading.Thread(target=send)
    sender.start()
    try:
        wait_until(lambda: _metric(stack, "prefix_router_worker_in_flight", worker=_label(decode)) == 1, timeout=10)
        time.sleep(1.0)  # the decode worker has the request by now, waiting in its bootstrap queue
    finally:
        prefill.process.send_signal(signal.SIGKILL)
        prefill.process.wait()
    killed = time.monotonic()
    sender.join(120)
    assert time.monotonic() - killed < 15  # seconds, never the 300 s a decode worker waits for its KV
    reply = result["reply"]
    assert reply.status == 502, reply.body
    assert b"prefill" in reply.body
    assert _metric(stack, "prefix_router_pd_decode_aborts_total") >= 1
    # The dead worker is out of the candidates: the next request is refused at once, naming the missing side.
    began = time.monotonic()
    again = post(stack.url + "/generate", {"text": "And after.", "sampling_params": {"max_new_tokens": 4}}, timeout=60)
    assert time.monotonic() - began < 5
    assert again.status == 503, again.body
    assert b"prefill" in again.body
    # The decode worker is still well: it was aborted, not wedged.
    assert _metric(stack, "prefix_router_worker_healthy", worker=_label(decode)) == 1

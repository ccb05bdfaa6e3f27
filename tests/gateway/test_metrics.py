"""The gateway's own ``/metrics`` and the router's memory budget, over real sockets."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from prefix_router.stack import GatewayStack
from tests.support.gateway_http import post, request

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def stack(envoy_bin: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayStack]:
    config = tmp_path_factory.mktemp("metrics") / "router.yaml"
    config.write_text("memory: {budget_bytes: 1048576}\n")  # 1 MiB: small enough to fill in a test
    with GatewayStack(sim_workers=2, sim_worker_options={"profile": "instant"}, config=config) as gw:
        yield gw


def _series(text: str, name: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) :].rsplit(" ", 1)
            out[labels] = float(value)
    return out


def test_gateway_metrics_is_the_router_and_every_worker_labelled(stack: GatewayStack) -> None:
    post(stack.url + "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    pages = [request(stack.url + "/metrics") for _ in range(3)]
    assert all(p.status == 200 for p in pages)
    texts = [p.body.decode() for p in pages]
    workers = {w.removeprefix("http://") for w in stack.worker_urls}
    for text in texts:
        assert "prefix_router_decisions_total" in text  # the router's own figures
        running = _series(text, "sglang:num_running_reqs")
        assert {re.search(r'worker="([^"]+)"', k).group(1) for k in running} == workers  # type: ignore[union-attr]
    # Every scrape shows the same series: no worker-of-the-moment, so no phantom counter resets.
    assert len({frozenset(_series(t, "sglang:prompt_tokens_total")) for t in texts}) == 1
    assert sum(_series(texts[-1], "sglang:prompt_tokens_total").values()) > 0


def test_gateway_without_the_routers_metrics_refuses_clearly(envoy_bin: str) -> None:
    with GatewayStack(sim_workers=1, sim_worker_options={"profile": "instant"}, metrics_port=None) as gw:
        reply = request(gw.url + "/metrics")
    assert reply.status == 404
    error = json.loads(reply.body)["error"]
    assert "scrape the router's metrics port" in error["message"]


def test_one_memory_budget_bounds_every_cache_and_metrics_show_each_part(stack: GatewayStack, tmp_path: Path) -> None:
    for i in range(30):  # distinct ~1.5k-token prompts: more blocks than the 1 MiB budget's index share holds
        text = " ".join(f"document {i} sentence {j} about topic {i * 31 + j}." for j in range(150))
        reply = post(stack.url + "/v1/completions", {"model": "m", "prompt": text, "max_tokens": 1})
        assert reply.status == 200
    text = request(f"http://127.0.0.1:{stack.metrics_port}/metrics").body.decode()
    held = _series(text, "prefix_router_memory_bytes")
    limits = _series(text, "prefix_router_memory_limit_bytes")
    parts = {"index", "engine_hashes", "speculative", "key_cache", "piece_cache", "shared_state", "policy"}
    assert {k.split('"')[1] for k in held} == parts == {k.split('"')[1] for k in limits}
    for key, value in held.items():
        assert 0 <= value <= limits[key], (key, value, limits[key])
    assert sum(limits.values()) <= 1048576
    # The index and the caches filled up to their shares: bounded, not merely small.
    assert held['{part="index"}'] > 0.8 * limits['{part="index"}']
    assert held['{part="piece_cache"}'] > 0.5 * limits['{part="piece_cache"}']
    assert held['{part="key_cache"}'] > 0.5 * limits['{part="key_cache"}']

"""Data-parallel ranks end to end: a ``--dp-size 2`` simulated worker, the router and Envoy, real sockets.

The worker runs two schedulers with their own radix caches and publishers (ports base, base + 1),
as SGLang does. The router must subscribe to both, index each rank on its own, and pin the rank that
holds a prompt's prefix: a repeated prompt then hits that rank's cache every time, where SGLang's own
round robin would alternate between a warm and a cold rank.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from prefix_router.fleet import start_fleet
from prefix_router.stack import GatewayStack
from sglang_workers.real.launch_command import DP_ENV
from tests.support.gateway_http import post, request
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(120)

DOC_A = " ".join(f"alpha section {i} describes item {i * 7}." for i in range(120))
DOC_B = " ".join(f"bravo chapter {i} lists entry {i * 11}." for i in range(120))


def _chat(doc: str, question: str) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [{"role": "system", "content": doc}, {"role": "user", "content": question}],
        "max_tokens": 2,
    }


def _cached(reply: Any) -> int:
    return int(reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def _index_blocks(stack: GatewayStack) -> dict[str, float]:
    text = request(f"http://127.0.0.1:{stack.metrics_port}/metrics").body.decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("prefix_router_index_blocks{") and 'tier="gpu"' in line:
            rank = line.split('dp_rank="')[1].split('"')[0]
            out[rank] = float(line.rsplit(" ", 1)[1])
    return out


@pytest.fixture(scope="module")
def stack(envoy_bin: str) -> Iterator[GatewayStack]:
    options = {"profile": "instant", "dp_size": 2, "env": DP_ENV}
    with GatewayStack(sim_workers=1, sim_worker_options=options) as gw:
        yield gw


def test_the_worker_has_two_ranks_as_sglang_does() -> None:
    with start_fleet("sim", 1, profile="instant", dp_size=2)[0] as worker:
        with urllib.request.urlopen(worker.url + "/server_info", timeout=5) as r:
            info = json.load(r)
        assert info["dp_size"] == 2 and info["kv_events"]["dp_size"] == 2
        assert info["kv_events"]["replay_endpoint_port_base"] == worker.kv_events_port + 2
        with urllib.request.urlopen(worker.url + "/v1/loads", timeout=5) as r:
            assert [load["dp_rank"] for load in json.load(r)["loads"]] == [0, 1]
        # Unpinned requests go round robin (SGLang's default): the same prompt is cold on each rank once.
        body = _chat(DOC_A, "q")
        cached = [_cached(post(worker.url + "/v1/chat/completions", body)) for _ in range(4)]
        assert cached[:2] == [0, 0] and min(cached[2:]) > 400, cached
        pinned = [_cached(post(worker.url + "/v1/chat/completions", body, {"x-data-parallel-rank": "1"})) for _ in "ab"]
        assert pinned[0] > 0 and pinned[1] > 0  # rank 1 holds it now (it took every other request above)
        bad = post(worker.url + "/v1/chat/completions", body, {"x-data-parallel-rank": "2"})
        assert bad.status == 400 and "out of range [0, 2)" in bad.json()["message"]


def test_a_profile_list_is_cycled_over_the_ranks() -> None:
    """One worker, mixed GPUs: ``--profile a,b`` gives rank 0 the first profile and rank 1 the second."""
    with (
        start_fleet("sim", 1, profile="llama-3.1-70b-tp4-h200,llama-3.1-8b-h100", dp_size=2)[0] as worker,
        urllib.request.urlopen(worker.url + "/v1/loads", timeout=5) as r,
    ):
        loads = json.load(r)["loads"]
    weights = [load["memory"]["weight_gb"] for load in loads]
    assert weights[0] > 2 * weights[1]  # a 70B shard (one GPU of TP4) against a whole 8B model


def test_both_ranks_are_subscribed_and_indexed_on_their_own(stack: GatewayStack) -> None:
    worker = stack.worker_urls[0]
    # Warm each rank with its own document, directly (the router did not send these): only KV events tell it.
    for doc, rank in ((DOC_A, 0), (DOC_B, 1)):
        reply = post(worker + "/v1/chat/completions", {**_chat(doc, "warm"), "routed_dp_rank": rank})
        assert reply.status == 200
    wait_until(
        lambda: all(v > 50 for v in _index_blocks(stack).values()) and len(_index_blocks(stack)) == 2, "both ranks"
    )
    blocks = _index_blocks(stack)
    assert set(blocks) == {"0", "1"}


def test_requests_are_pinned_to_the_rank_holding_their_prefix(stack: GatewayStack) -> None:
    wait_until(lambda: len(_index_blocks(stack)) == 2 and min(_index_blocks(stack).values()) > 50, "both ranks indexed")
    for doc in (DOC_B, DOC_A, DOC_B, DOC_A, DOC_B, DOC_A):
        reply = post(stack.url + "/v1/chat/completions", _chat(doc, f"question {time.monotonic()}"))
        assert reply.status == 200
        # The document's blocks (hundreds of tokens) came from the rank that holds them, every time.
        assert _cached(reply) > 400, reply.body

    # /generate honours the pin too (x-override-routed-dp-rank, with SGLang's header overrides enabled):
    # round robin would send the second of two identical prompts to the other, cold rank.
    text = DOC_A.replace("alpha", "charlie")
    replies = [post(stack.url + "/generate", {"text": text, "sampling_params": {"max_new_tokens": 1}}) for _ in "abc"]
    assert [r.status for r in replies] == [200] * 3
    assert min(r.json()["meta_info"]["cached_tokens"] for r in replies[1:]) > 400


def test_a_client_cannot_pick_the_rank(stack: GatewayStack) -> None:
    """Envoy strips client copies of the rank headers, as it does the destination header."""
    wait_until(lambda: len(_index_blocks(stack)) == 2 and min(_index_blocks(stack).values()) > 50, "both ranks indexed")
    for header in ("x-data-parallel-rank", "x-override-routed-dp-rank"):
        reply = post(stack.url + "/v1/chat/completions", _chat(DOC_A, "spoof"), {header: "5"})
        assert reply.status == 200 and _cached(reply) > 400  # not a 400 for rank 5: the router's pin won

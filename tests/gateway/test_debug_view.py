"""The decisions view and index drift through the real gateway: Envoy, the router process, simulated workers.

The view (``/debug/workers``, ``/debug/decisions``, ``/debug/explain`` and the page, the page read by a real
headless Chromium) and the drift counters are checked against what the requests sent through Envoy did.
Every response is sampled here (``observability.drift_sample_rate: 1``); simulated workers report their
``cached_tokens`` as SGLang does, so in steady state the router's predictions match them exactly.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from prefix_router.stack import GatewayStack
from tests.support.gateway_http import Reply, envoy_stats, flush_cache, post, request, stream_lines

SYSTEMS = [f"You are assistant number {i}, careful and brief, answering in full sentences. " * 12 for i in range(3)]
MSGS_SENT = "http.gateway.ext_proc.stream_msgs_sent"
KEPT = 32  # debug.decisions: fewer than the workload sends
# The prompts whose routing these tests check carry a long document of their own: what its cached prefix saves
# (~3,500 tokens) outweighs what two identical simulated workers' learned costs differ by. On a prompt of ~350
# tokens a prefill's fixed cost dominates, and a learned per-token slope of 0.005 ms on one worker and 0.014 on the
# other (seen in runs of this module) can make recomputing the prompt elsewhere the cheaper choice.
DOCUMENTS = [" ".join(f"clause {i}.{k} of document {i} applies" for k in range(300)) for i in range(2)]


@pytest.fixture(scope="module")
def stack(envoy_bin: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayStack]:
    config = tmp_path_factory.mktemp("router") / "router.yaml"
    # speculative_ttl_s: the router's record of a send outlives an AllBlocksCleared that long (see the flush test).
    config.write_text(
        f"observability: {{drift_sample_rate: 1.0}}\ndebug: {{decisions: {KEPT}}}\nindex: {{speculative_ttl_s: 0.5}}\n"
    )
    with GatewayStack(sim_workers=2, config=config, max_body_bytes=64 * 1024) as gateway:
        yield gateway


def debug(stack: GatewayStack, path: str, body: dict[str, Any] | bytes | None = None) -> Reply:
    url = f"http://127.0.0.1:{stack.metrics_port}/debug/{path}"
    return request(url, "GET" if body is None else "POST", body)


def counters(stack: GatewayStack) -> dict[tuple[str, str], float]:
    """The router's counters by (sample name, worker label)."""
    text = request(f"http://127.0.0.1:{stack.metrics_port}/metrics").body.decode()
    return {
        (s.name, s.labels.get("worker", "")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def total(stack: GatewayStack, name: str) -> float:
    return sum(v for (n, _), v in counters(stack).items() if n == name)


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, what: Callable[[], str] = str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out: {what()}"
        time.sleep(0.05)


def chat(system: str, user: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": "default",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": 4,
        **extra,
    }


def send_workload(stack: GatewayStack) -> int:
    """Every API, streamed or not, over three shared system prompts; returns how many report usage."""
    reporting = 0
    for turn in range(3):
        for i, system in enumerate(SYSTEMS):
            user = f"question {turn} about topic {i}"
            requests: list[tuple[str, dict[str, Any], bool]] = [
                ("/v1/chat/completions", chat(system, user), True),
                ("/v1/chat/completions", chat(system, user, stream=True, stream_options={"include_usage": True}), True),
                ("/v1/chat/completions", chat(system, user + "?", stream=True), False),  # no usage: never sampled
                ("/v1/completions", {"model": "default", "prompt": system + user, "max_tokens": 3}, True),
                ("/generate", {"text": system + user, "sampling_params": {"max_new_tokens": 3}}, True),
                ("/generate", {"text": system + user + "!", "stream": True}, True),
            ]
            for k, (path, body, reports) in enumerate(requests):
                reply = post(stack.url + path, body, {"x-request-id": f"workload-{turn}-{i}-{k}"})
                assert reply.status == 200, reply.body
                reporting += reports
    return reporting


@pytest.fixture(scope="module")
def workload(stack: GatewayStack) -> int:
    before = total(stack, "prefix_router_drift_samples_total")
    reporting = send_workload(stack)
    wait_until(
        lambda: total(stack, "prefix_router_drift_samples_total") - before >= reporting,
        what=lambda: f"{total(stack, 'prefix_router_drift_samples_total')} samples of {reporting}",
    )
    return reporting


# -- index drift -----------------------------------------------------------------------------------------------
def test_drift_is_zero_in_steady_state_and_counted_per_worker(stack: GatewayStack, workload: int) -> None:
    samples = total(stack, "prefix_router_drift_samples_total")
    assert samples == workload  # every response that reports usage, none of those that do not
    assert total(stack, "prefix_router_drift_mismatched_total") == 0
    assert total(stack, "prefix_router_drift_unread_total") == 0
    by_worker = counters(stack)
    workers = {w for (n, w) in by_worker if n == "prefix_router_drift_samples_total"}
    assert len(workers) == 2  # both workers served some
    for worker in workers:
        predicted = by_worker[("prefix_router_predicted_cached_tokens_total", worker)]
        served = by_worker[("prefix_router_served_cached_tokens_total", worker)]
        assert predicted == served > 0  # later turns hit their system prompt, as predicted


def test_only_sampled_responses_reach_the_router(stack: GatewayStack, workload: int) -> None:
    """A response that is not sampled costs no message beyond the three every request has."""
    system = SYSTEMS[0]
    before = envoy_stats(stack.admin_url)[MSGS_SENT]
    post(stack.url + "/v1/chat/completions", chat(system, "unsampled", stream=True))  # no include_usage
    wait_until(lambda: envoy_stats(stack.admin_url)[MSGS_SENT] - before >= 3)
    time.sleep(0.2)
    assert envoy_stats(stack.admin_url)[MSGS_SENT] - before == 3  # request headers, request body, response headers
    before = envoy_stats(stack.admin_url)[MSGS_SENT]
    post(
        stack.url + "/v1/chat/completions", chat(system, "sampled", stream=True, stream_options={"include_usage": True})
    )
    wait_until(lambda: envoy_stats(stack.admin_url)[MSGS_SENT] - before > 3)  # and its body chunks


def test_a_sampled_stream_still_arrives_incrementally(stack: GatewayStack) -> None:
    body = chat(SYSTEMS[1], "tell a long story", max_tokens=48, ignore_eos=True, stream=True)
    body["stream_options"] = {"include_usage": True}
    before = total(stack, "prefix_router_drift_samples_total")
    events = [
        (t, line) for t, line in stream_lines(stack.url + "/v1/chat/completions", body) if line.startswith(b"data")
    ]
    assert events[-1][1].strip() == b"data: [DONE]" and len(events) >= 40
    assert events[-1][0] - events[0][0] > 0.15  # 48 decode steps (~0.35 s) spread out, not held back
    wait_until(lambda: total(stack, "prefix_router_drift_samples_total") > before)


def test_a_flush_the_events_report_is_no_drift(stack: GatewayStack, workload: int) -> None:
    """The worker says it dropped its cache (AllBlocksCleared): the index follows, predictions stay right."""
    body = chat(SYSTEMS[2], "after a flush")
    post(stack.url + "/v1/chat/completions", body)
    holder = debug(stack, "decisions?limit=1").json()["decisions"][0]["worker"]
    flush_cache(f"http://{holder}")
    wait_until(lambda: _blocks(stack, holder) == 0)
    # AllBlocksCleared takes the router's record of its sends to the worker with it; wait out
    # index.speculative_ttl_s anyway, so that only the cleared index can explain a right prediction.
    time.sleep(0.6)
    mismatched = total(stack, "prefix_router_drift_mismatched_total")
    samples = total(stack, "prefix_router_drift_samples_total")
    post(stack.url + "/v1/chat/completions", body)
    wait_until(lambda: total(stack, "prefix_router_drift_samples_total") > samples)
    assert total(stack, "prefix_router_drift_mismatched_total") == mismatched


def _blocks(stack: GatewayStack, worker: str) -> int:
    view = debug(stack, "workers").json()
    return int(next(w for w in view["workers"] if w["id"] == worker)["index"]["blocks"]["gpu"])


def test_cut_events_show_up_as_drift(envoy_bin: str, tmp_path: Path) -> None:
    """Without KV events the router trusts its own record of sends; the worker flushes, the record is wrong."""
    config = tmp_path / "router.yaml"
    config.write_text("observability: {drift_sample_rate: 1.0}\nevents: {enabled: false}\n")
    with GatewayStack(sim_workers=1, config=config) as gateway:
        body = chat(SYSTEMS[0], "who holds this?")
        for _ in range(2):
            assert post(gateway.url + "/v1/chat/completions", body).status == 200
        flush_cache(gateway.worker_urls[0])
        assert post(gateway.url + "/v1/chat/completions", body).status == 200
        wait_until(lambda: total(gateway, "prefix_router_drift_samples_total") == 3)
        assert total(gateway, "prefix_router_drift_mismatched_total") == 1  # the request after the flush
        predicted = total(gateway, "prefix_router_predicted_cached_tokens_total")
        served = total(gateway, "prefix_router_served_cached_tokens_total")
        assert predicted > served * 1.5  # the router believed in a prefix the worker no longer had
        last = request(f"http://127.0.0.1:{gateway.metrics_port}/debug/decisions?limit=1").json()["decisions"][0]
        assert last["served"]["mismatched"] and last["served"]["cached_tokens"] < last["predicted_cached_tokens"]


def test_drift_in_full_duplex_streamed_mode(envoy_bin: str, tmp_path: Path) -> None:
    """As GIE gateways run the exchange: the response chunks come to the router anyway, sampled ones are read."""
    config = tmp_path / "router.yaml"
    config.write_text("observability: {drift_sample_rate: 1.0}\n")
    with GatewayStack(sim_workers=1, config=config, body_mode="streamed") as gateway:
        for turn in range(2):
            user = f"turn {turn}"
            stream = chat(SYSTEMS[0], user, stream=True, stream_options={"include_usage": True})
            for path, body in (
                ("/v1/chat/completions", chat(SYSTEMS[0], user)),
                ("/v1/chat/completions", stream),
                ("/generate", {"text": SYSTEMS[0] + user, "stream": True}),
            ):
                reply = post(gateway.url + path, body)
                assert reply.status == 200 and reply.body, reply.body
        wait_until(lambda: total(gateway, "prefix_router_drift_samples_total") == 6)
        assert total(gateway, "prefix_router_drift_mismatched_total") == 0
        served = total(gateway, "prefix_router_served_cached_tokens_total")
        assert served == total(gateway, "prefix_router_predicted_cached_tokens_total") > 0


# -- the decisions view --------------------------------------------------------------------------------------
def test_workers_view_shows_health_load_learned_costs_and_blocks(stack: GatewayStack, workload: int) -> None:
    view = debug(stack, "workers").json()
    assert view["policy"] == "prefix-aware"
    assert {w["id"] for w in view["workers"]} == {u.removeprefix("http://") for u in stack.worker_urls}
    for worker in view["workers"]:
        assert worker["healthy"] is True and worker["role"] == "aggregated"
        assert worker["index"]["state"] == "synced" and worker["index"]["page_size"] == 16
        assert set(worker["index"]["blocks"]) == {"gpu", "host", "disk"}
        assert worker["load"]["max_total_num_tokens"] > 0
        assert worker["learned"]["prefill_per_token_s"] > 0
        assert 0 < worker["learned"]["decode_share"] <= 1  # the share of time its prefills leave to decode
        # A small fleet's pools fit whole in the default budget's ledgers: every key of the order of use kept.
        assert worker["learned"]["ledger_sample_every"] == 1 and worker["learned"]["ledger_keys"] > 0
        assert worker["drift"]["samples"] > 0 and worker["drift"]["unread"] == 0
    assert sum(w["index"]["blocks"]["gpu"] for w in view["workers"]) > 0


def test_decisions_view_names_the_choice_the_runner_up_and_what_the_engine_said(
    stack: GatewayStack, workload: int
) -> None:
    body = chat(SYSTEMS[0], DOCUMENTS[0])
    post(stack.url + "/v1/chat/completions", body)  # held somewhere whatever earlier tests flushed
    post(stack.url + "/v1/chat/completions", body, {"x-request-id": "mine-1"})
    wait_until(lambda: debug(stack, "decisions?limit=1").json()["decisions"][0]["served"] is not None)
    view = debug(stack, "decisions?limit=5").json()
    assert view["capacity"] == view["kept"] == KEPT and len(view["decisions"]) == 5
    newest = view["decisions"][0]
    assert newest["request_id"] == "mine-1"  # Envoy keeps the client's x-request-id
    assert newest["reason"] == "prefix-hit" and newest["predicted_cached_tokens"] > 0
    assert newest["predicted_ttft_s"] > 0 and newest["prompt_tokens"] > newest["predicted_cached_tokens"]
    assert newest["served"] == {
        "worker": newest["worker"],
        "predicted_cached_tokens": newest["predicted_cached_tokens"],
        "cached_tokens": newest["predicted_cached_tokens"],
        "prompt_tokens": newest["prompt_tokens"],
        "mismatched": False,
    }
    runner = newest["runner_up"]
    assert runner["worker"] != newest["worker"] and "cached_tokens" in runner["why_lost"]
    times = [d["at"] for d in view["decisions"]]
    assert times == sorted(times, reverse=True)


def test_explain_ranks_without_routing_and_the_next_decision_follows_it(stack: GatewayStack, workload: int) -> None:
    body = chat(SYSTEMS[1], DOCUMENTS[1])
    post(stack.url + "/v1/chat/completions", body)  # held somewhere whatever earlier tests flushed
    wait_until(lambda: _in_flight(stack) == 0)  # the router has seen that reply end (read below as a baseline)
    before = (debug(stack, "decisions?limit=1").json()["decisions"][0]["request_id"], _in_flight(stack))
    explained = debug(stack, "explain?path=/v1/chat/completions", body)
    assert explained.status == 200, explained.body
    view = explained.json()
    assert view["routed"] is False and view["reason"] == "prefix-hit"
    winner = view["candidates"][0]
    assert winner["worker"] == view["would_choose"] and winner["rank"] == 0
    assert winner["matched_tokens"] > 0 and winner["matched_tokens"] == winner["figures"]["cached_tokens"]
    assert [c["rank"] for c in view["candidates"]] == [0, 1]
    assert (debug(stack, "decisions?limit=1").json()["decisions"][0]["request_id"], _in_flight(stack)) == before
    post(stack.url + "/v1/chat/completions", body, {"x-request-id": "after-explain"})
    routed = debug(stack, "decisions?limit=1").json()["decisions"][0]
    assert routed["request_id"] == "after-explain" and routed["worker"] == view["would_choose"]
    assert routed["predicted_cached_tokens"] == winner["matched_tokens"]


def _in_flight(stack: GatewayStack) -> int:
    return sum(w["in_flight"] for w in debug(stack, "workers").json()["workers"])


@pytest.mark.parametrize(
    ("path", "body", "status", "says"),
    [
        ("explain", b"{not json", 400, "not valid JSON"),
        ("explain?path=/v1/embeddings", {"input": "x"}, 400, "cannot explain path '/v1/embeddings'"),
        ("explain?path=/generate", {"sampling_params": {}}, 400, "one of 'text' or 'input_ids' is required"),
        ("explain", b"x" * (64 * 1024 + 1), 413, "over 65536 bytes"),
        ("decisions?limit=abc", None, 400, "limit must be a positive whole number"),
        ("nothing-here", None, 404, "no debug endpoint /debug/nothing-here"),
        ("explain", None, 405, "GET /debug/explain"),
    ],
)
def test_bad_input_gets_a_clear_json_error(
    stack: GatewayStack, path: str, body: dict[str, Any] | bytes | None, status: int, says: str
) -> None:
    reply = debug(stack, path, body)
    assert reply.status == status
    assert reply.headers["content-type"].startswith("application/json")
    error = reply.json()["error"]
    assert says in error["message"] and error["code"] == status
    assert "Traceback" not in reply.body.decode()


# -- the page, in a real browser ------------------------------------------------------------------------------
def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("headless Chromium not installed (Debian: apt-get install chromium)")


def test_the_page_draws_the_fleet_and_the_recent_decisions(stack: GatewayStack, workload: int, tmp_path: Path) -> None:
    post(stack.url + "/generate", {"text": SYSTEMS[0] + "for the page"}, {"x-request-id": "page-check"})
    argv = [
        _chromium(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--virtual-time-budget=5000",
        "--dump-dom",
        f"http://127.0.0.1:{stack.metrics_port}/debug/",
    ]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=90)
    dom = result.stdout
    assert '<div id="problem" class="error"></div>' in dom, dom[:3000]  # no error drawn
    for worker in stack.worker_urls:
        assert f'data-worker="{worker.removeprefix("http://")}"' in dom, result.stderr[-2000:]
    assert dom.count('class="worker"') == 2
    assert 'data-request-id="page-check"' in dom  # the newest decision is drawn as a row
    assert dom.count('class="decision"') == KEPT  # every kept decision
    assert "prefix-hit" in dom and "(policy prefix-aware)" in dom

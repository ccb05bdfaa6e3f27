"""The sim-worker's HTTP API over real sockets: SGLang/OpenAI response shapes, errors, cache reports."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from sim_fixtures import get_json, http, post_json, sse_events

from sglang_workers.process import SimWorkerProcess, start_sim_worker

PAGE = 4


@pytest.fixture(scope="module")
def worker() -> Iterator[SimWorkerProcess]:
    with start_sim_worker(profile="instant", page_size=PAGE, context_length=4096, seed=7, model="sim-llama") as w:
        yield w


def test_generate_with_input_ids_reports_cached_prefix_rounded_to_pages(worker: SimWorkerProcess) -> None:
    shared = list(range(100, 143))  # 43 tokens: 10 whole pages + 3
    status, first = post_json(
        worker, "/generate", {"input_ids": shared + [1, 2], "sampling_params": {"max_new_tokens": 3}}
    )
    assert status == 200
    assert first["meta_info"]["prompt_tokens"] == 45
    assert first["meta_info"]["completion_tokens"] == 3 == len(first["output_ids"])
    assert first["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    assert isinstance(first["text"], str) and first["text"]
    status, second = post_json(
        worker, "/generate", {"input_ids": shared + [9, 9, 9], "sampling_params": {"max_new_tokens": 3}}
    )
    assert status == 200
    assert second["meta_info"]["cached_tokens"] == 40  # the 43 shared tokens rounded down to pages
    status, again = post_json(
        worker, "/generate", {"input_ids": shared + [9, 9, 9], "sampling_params": {"max_new_tokens": 3}}
    )
    # Identical prompt: everything but the last token may come from cache (SGLang computes >= 1 token).
    assert again["meta_info"]["cached_tokens"] == (46 - 1) // PAGE * PAGE
    assert again["output_ids"] == second["output_ids"]  # deterministic for a given seed and prompt


def test_generate_text_and_stream(worker: SimWorkerProcess) -> None:
    status, body = http(
        "POST",
        worker.url + "/generate",
        {"text": "The quick brown fox", "stream": True, "sampling_params": {"max_new_tokens": 4}},
    )
    assert status == 200
    chunks = sse_events(body)
    assert chunks[-1] == "[DONE]"
    parsed = [json.loads(c) for c in chunks[:-1]]
    assert [len(p["output_ids"]) for p in parsed] == [1, 2, 3, 4]
    assert parsed[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(p["meta_info"]["finish_reason"] is None for p in parsed[:-1])


def test_chat_completion_and_usage(worker: SimWorkerProcess) -> None:
    messages = [{"role": "system", "content": "You are terse. " * 20}, {"role": "user", "content": "Hi"}]
    status, body = post_json(
        worker, "/v1/chat/completions", {"model": "sim-llama", "messages": messages, "max_tokens": 5}
    )
    assert status == 200
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["choices"][0]["finish_reason"] == "length"
    usage = body["usage"]
    assert usage["completion_tokens"] == 5
    assert usage["total_tokens"] == usage["prompt_tokens"] + 5
    messages[1]["content"] = "Hello again"
    status, body2 = post_json(worker, "/v1/chat/completions", {"messages": messages, "max_tokens": 5})
    cached = body2["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 40 and cached % PAGE == 0


def test_chat_stream_ends_with_done_and_usage(worker: SimWorkerProcess) -> None:
    status, raw = http(
        "POST",
        worker.url + "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "stream please"}],
            "max_tokens": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert status == 200
    chunks = sse_events(raw)
    assert chunks[-1] == "[DONE]"
    parsed = [json.loads(c) for c in chunks[:-1]]
    assert parsed[0]["choices"][0]["delta"]["role"] == "assistant"
    content = [p["choices"][0]["delta"].get("content") for p in parsed[1:4]]
    assert all(content)
    assert parsed[4]["choices"][0]["finish_reason"] == "length"
    assert parsed[5]["choices"] == [] and parsed[5]["usage"]["completion_tokens"] == 3


def test_completions_prompt_forms(worker: SimWorkerProcess) -> None:
    status, body = post_json(worker, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 2})
    assert status == 200 and body["object"] == "text_completion" and body["usage"]["completion_tokens"] == 2
    status, body = post_json(worker, "/v1/completions", {"prompt": [5, 6, 7, 8, 9], "max_tokens": 2})
    assert status == 200 and body["usage"]["prompt_tokens"] == 5
    status, raw = http("POST", worker.url + "/v1/completions", {"prompt": "x y z", "max_tokens": 2, "stream": True})
    chunks = sse_events(raw)
    assert chunks[-1] == "[DONE]" and json.loads(chunks[-2])["choices"][0]["finish_reason"] == "length"


def test_info_endpoints(worker: SimWorkerProcess) -> None:
    status, models = get_json(worker, "/v1/models")
    assert status == 200 and models["data"][0]["id"] == "sim-llama"
    for path in ("/server_info", "/get_server_info"):
        status, info = get_json(worker, path)
        assert status == 200
        assert info["page_size"] == PAGE
        assert info["kv_events"] == {
            "publisher": "zmq",
            "endpoint_host": "127.0.0.1",
            "endpoint_port_base": worker.kv_events_port,
            "topic": "",
            "block_size": PAGE,
            "dp_size": 1,
            "replay_endpoint_port_base": worker.replay_port,
        }
    for path in ("/model_info", "/get_model_info"):
        status, info = get_json(worker, path)
        assert status == 200 and info["model_path"] == "sim-llama" and info["is_generation"] is True
    for path in ("/health", "/health_generate", "/ready"):
        assert http("GET", worker.url + path)[0] == 200


def test_loads_and_metrics(worker: SimWorkerProcess) -> None:
    post_json(worker, "/generate", {"input_ids": list(range(1, 30)), "sampling_params": {"max_new_tokens": 2}})
    status, loads = get_json(worker, "/v1/loads?include=core&format=json")
    assert status == 200
    (load,) = loads["loads"]
    assert set(load) >= {
        "num_running_reqs",
        "num_waiting_reqs",
        "num_used_tokens",
        "num_total_tokens",
        "max_total_num_tokens",
        "token_usage",
        "cache_hit_rate",
        "gen_throughput",
    }
    assert load["num_running_reqs"] == 0 and load["max_total_num_tokens"] > 0
    status, old = get_json(worker, "/get_load")
    assert status == 200 and old[0]["num_reqs"] == 0
    status, raw = http("GET", worker.url + "/metrics")
    text = raw.decode()
    for name in (
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:token_usage",
        "sglang:cache_hit_rate",
        "sglang:prompt_tokens_total",
        "sglang:cached_tokens_total",
        "sglang:generation_tokens_total",
        "sglang:max_total_num_tokens",
        "sglang:time_to_first_token_seconds_bucket",
    ):
        assert f"\n{name}{{" in text, name
    prompt_total = next(line for line in text.splitlines() if line.startswith("sglang:prompt_tokens_total{"))
    assert float(prompt_total.split()[-1]) >= 29


@pytest.mark.parametrize(
    ("method", "path", "raw", "status", "fragment"),
    [
        ("POST", "/generate", b"{not json", 400, "Invalid JSON"),
        ("POST", "/generate", b"{}", 400, "text"),
        ("POST", "/generate", b'{"input_ids": []}', 400, "input_ids"),
        ("POST", "/generate", b'{"input_ids": [1, -2]}', 400, "input_ids"),
        ("POST", "/generate", b'{"text": "a", "sampling_params": {"max_new_tokens": -1}}', 400, "max_new_tokens"),
        ("POST", "/v1/completions", b'{"max_tokens": 3}', 400, "prompt"),
        ("POST", "/v1/chat/completions", b'{"messages": []}', 400, "messages"),
        ("POST", "/v1/chat/completions", b"[1, 2]", 400, "object"),
        (
            "POST",
            "/generate",
            json.dumps({"input_ids": [1] * 4000, "sampling_params": {"max_new_tokens": 200}}).encode(),
            413,
            "context length",
        ),
        ("GET", "/no/such/path", None, 404, "Not Found"),
        ("GET", "/generate", None, 405, "Method"),
    ],
)
def test_errors_are_openai_style_json(
    worker: SimWorkerProcess, method: str, path: str, raw: bytes | None, status: int, fragment: str
) -> None:
    got, body = http(method, worker.url + path, raw=raw)
    assert got == status
    err = json.loads(body)
    assert err["object"] == "error" and err["code"] == status and fragment in err["message"]


def test_not_ready_answers_503() -> None:
    with start_sim_worker(profile="instant", load_time=30, wait_ready=False) as w:
        assert http("GET", w.url + "/health")[0] == 503
        status, body = http("POST", w.url + "/generate", {"input_ids": [1, 2, 3]})
        assert status == 503 and json.loads(body)["code"] == 503
        assert http("GET", w.url + "/server_info")[0] == 200  # info is served while loading, as in SGLang


def test_latency_follows_the_timing_profile_over_http() -> None:
    """8B on H100 at real speed: a 4096-token prefill (~118 ms) then 10 decode steps (~7 ms each)."""
    with start_sim_worker(profile="llama-3.1-8b-h100", page_size=16) as w:
        status, body = post_json(
            w, "/generate", {"input_ids": list(range(10, 4106)), "sampling_params": {"max_new_tokens": 11}}
        )
        assert status == 200
        expected = (0.015 + 23e-6 * 4096 + 0.52e-9 * 4096**2) + 10 * (0.007 + 0.06e-3 + 49e-9 * 4100)
        assert expected * 0.95 <= body["meta_info"]["e2e_latency"] <= expected * 3
        # The same prompt again: all but its last page is cached, so it is much faster.
        status, again = post_json(
            w, "/generate", {"input_ids": list(range(10, 4106)), "sampling_params": {"max_new_tokens": 11}}
        )
        assert again["meta_info"]["cached_tokens"] == 4080
        assert again["meta_info"]["e2e_latency"] < body["meta_info"]["e2e_latency"] - 0.05

"""The sim-worker's HTTP API over real sockets: SGLang/OpenAI response shapes, errors, cache reports."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from prefix_router.fleet import start_fleet
from sglang_workers.process import WorkerProcess
from tests.support.pd import DISAGGREGATION_LOAD_KEYS
from tests.support.sim_fixtures import get_json, http, post_json, sse_events

PAGE = 4


@pytest.fixture(scope="module")
def worker() -> Iterator[WorkerProcess]:
    with start_fleet("sim", 1, profile="instant", page_size=PAGE, context_length=4096, seed=7, model="sim-llama")[
        0
    ] as w:
        yield w


def test_generate_with_input_ids_reports_cached_prefix_rounded_to_pages(worker: WorkerProcess) -> None:
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


def test_generate_text_and_stream(worker: WorkerProcess) -> None:
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


def test_chat_completion_and_usage(worker: WorkerProcess) -> None:
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


def test_chat_stream_ends_with_done_and_usage(worker: WorkerProcess) -> None:
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


def test_completions_prompt_forms(worker: WorkerProcess) -> None:
    status, body = post_json(worker, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 2})
    assert status == 200 and body["object"] == "text_completion" and body["usage"]["completion_tokens"] == 2
    status, body = post_json(worker, "/v1/completions", {"prompt": [5, 6, 7, 8, 9], "max_tokens": 2})
    assert status == 200 and body["usage"]["prompt_tokens"] == 5
    status, raw = http("POST", worker.url + "/v1/completions", {"prompt": "x y z", "max_tokens": 2, "stream": True})
    chunks = sse_events(raw)
    assert chunks[-1] == "[DONE]" and json.loads(chunks[-2])["choices"][0]["finish_reason"] == "length"


def test_info_endpoints(worker: WorkerProcess) -> None:
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
    assert http("GET", worker.url + "/ready")[0] == 200  # /health and /health_generate: the next test


def test_health_takes_a_second_like_sglang_and_ready_is_a_flag(worker: WorkerProcess) -> None:
    """SGLang's /health runs a generation and looks for its answer after 1 s; /ready answers at once."""

    def timed(path: str) -> tuple[int, float]:
        start = time.monotonic()
        return http("GET", worker.url + path)[0], time.monotonic() - start

    _, loads = get_json(worker, "/v1/loads")
    before = loads["loads"][0]["total_prefill_uncached_tokens"]
    with ThreadPoolExecutor(3) as pool:  # concurrent probes: each waits its own second
        results = dict(zip(PROBES, pool.map(timed, PROBES)))
    for path, (status, seconds) in results.items():
        at_least, at_most = (0.0, 0.5) if path == "/ready" else (1.0, 3.0)
        assert status == 200 and at_least <= seconds <= at_most, (path, seconds)
    # The health checks' own generations are counted nowhere (SGLang sends them with log_metrics=False).
    _, loads = get_json(worker, "/v1/loads")
    assert loads["loads"][0]["total_prefill_uncached_tokens"] == before


PROBES = ("/health", "/health_generate", "/ready")


# Every key of SGLang 0.5.23's /v1/loads (sglang.srt.managers.load_snapshot.LoadSnapshot and the
# endpoint's envelope), in its order; the sections a CPU/GPU worker without LoRA or speculation reports.
LOADS_TOP_KEYS = ["timestamp", "version", "accelerator", "num_accelerators", "loads"]
LOADS_CORE_KEYS = [
    "timestamp",
    "dp_rank",
    "num_running_reqs",
    "num_waiting_reqs",
    "num_waiting_uncached_tokens",
    "num_used_tokens",
    "num_total_tokens",
    "num_active_tokens",
    "num_prealloc_ready_tokens",
    "max_total_num_tokens",
    "max_running_requests",
    "token_usage",
    "gen_throughput",
    "cache_hit_rate",
    "utilization",
    "total_prefill_uncached_tokens",
    "total_prefill_busy_us",
    "decode_moments",
]
LOADS_SECTIONS = {
    "memory": ["weight_gb", "kv_cache_gb", "graph_gb", "token_capacity"],
    "disaggregation": DISAGGREGATION_LOAD_KEYS,
    "queues": ["waiting", "grammar", "paused", "retracted", "prealloc_ready"],
}
RECORDED_LOADS = Path(__file__).resolve().parents[2].parent / "shared" / "sglang-http" / "v1_loads.json"


def test_loads_have_every_key_of_sglang_0_5_23(worker: WorkerProcess) -> None:
    post_json(worker, "/generate", {"input_ids": list(range(1, 30)), "sampling_params": {"max_new_tokens": 2}})
    status, loads = get_json(worker, "/v1/loads")
    assert status == 200
    assert list(loads) == LOADS_TOP_KEYS and loads["version"] == "0.5.23"
    (load,) = loads["loads"]
    assert list(load) == LOADS_CORE_KEYS + list(LOADS_SECTIONS)
    for section, keys in LOADS_SECTIONS.items():
        assert list(load[section]) == keys, section
    assert load["num_running_reqs"] == 0 and load["max_total_num_tokens"] > 0 and load["utilization"] == 0.0
    if RECORDED_LOADS.exists():  # the recorded answer of a real 0.5.23 worker, when ../shared is there
        real = json.loads(RECORDED_LOADS.read_text().split("\n", 1)[1])
        assert list(real) == list(loads)
        assert list(real["loads"][0]) == list(load)
        for section in LOADS_SECTIONS:
            assert list(real["loads"][0][section]) == list(load[section])
    # include=core: the flat keys only (what the router polls); sections by name; unknown: a bare 500.
    _, core = get_json(worker, "/v1/loads?include=core&format=json")
    assert list(core["loads"][0]) == LOADS_CORE_KEYS
    _, queues = get_json(worker, "/v1/loads?include=queues")
    assert list(queues["loads"][0]) == [*LOADS_CORE_KEYS, "queues"]
    assert http("GET", worker.url + "/v1/loads?include=bogus") == (500, b"Internal Server Error")
    _, other_rank = get_json(worker, "/v1/loads?dp_rank=5")
    assert other_rank["loads"] == []
    status, prom = http("GET", worker.url + "/v1/loads?format=prometheus")
    assert status == 200 and 'sglang_total_prefill_uncached_tokens{dp_rank="0"} ' in prom.decode()
    assert 'sglang_queues_waiting{dp_rank="0"} 0' in prom.decode()
    assert http("GET", worker.url + "/get_load")[0] == 404  # gone in 0.5.23


def test_metrics_names(worker: WorkerProcess) -> None:
    post_json(worker, "/generate", {"input_ids": list(range(1, 30)), "sampling_params": {"max_new_tokens": 2}})
    status, raw = http("GET", worker.url + "/metrics")
    assert status == 200
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


# Each refusal in the shape SGLang 0.5.23 gives it (checked against a real worker by the conformance test):
# validation = pydantic ("Bad Request"), openai = the OpenAI layer, generate = native /generate, detail = routing.
SHAPES = {
    "validation": lambda e: e["object"] == "error" and e["type"] == "Bad Request" and e["code"] == 400,
    "openai": lambda e: e["object"] == "error" and e["type"] == "BadRequestError" and e["code"] == 400,
    "generate": lambda e: set(e) == {"error"} and isinstance(e["error"]["message"], str),
    "detail": lambda e: set(e) == {"detail"},
}


@pytest.mark.parametrize(
    ("method", "path", "raw", "status", "kind", "fragment"),
    [
        ("POST", "/generate", b"{not json", 400, "validation", "JSON"),
        ("POST", "/generate", b"{}", 400, "generate", "text, input_ids"),
        ("POST", "/generate", b'{"input_ids": []}', 400, "generate", "input_ids cannot be empty"),
        ("POST", "/generate", b'{"input_ids": [1, -2]}', 400, "generate", "negative"),
        (
            "POST",
            "/generate",
            b'{"text": "a", "sampling_params": {"max_new_tokens": -1}}',
            400,
            "generate",
            "at least 0",
        ),
        ("POST", "/v1/completions", b'{"max_tokens": 3}', 400, "validation", "prompt"),
        ("POST", "/v1/chat/completions", b'{"messages": []}', 400, "openai", "Messages cannot be empty"),
        ("POST", "/v1/chat/completions", b"[1, 2]", 400, "validation", "dictionary"),
        (
            "POST",
            "/generate",
            json.dumps({"input_ids": [1] * 4096, "sampling_params": {"max_new_tokens": 200}}).encode(),
            400,
            "generate",
            "context length",
        ),
        ("GET", "/no/such/path", None, 404, "detail", "Not Found"),
        ("GET", "/generate", None, 405, "detail", "Method Not Allowed"),
    ],
)
def test_errors_have_sglangs_shapes(
    worker: WorkerProcess, method: str, path: str, raw: bytes | None, status: int, kind: str, fragment: str
) -> None:
    got, body = http(method, worker.url + path, raw=raw)
    assert got == status
    err = json.loads(body)
    assert SHAPES[kind](err), err
    assert fragment in json.dumps(err)


def test_not_ready_answers_503() -> None:
    with start_fleet("sim", 1, profile="instant", load_time=30, wait_ready=False)[0] as w:
        for path in ("/health", "/health_generate", "/ready"):
            assert http("GET", w.url + path)[0] == 503
        status, body = http("POST", w.url + "/generate", {"input_ids": [1, 2, 3]})
        assert status == 503 and json.loads(body)["code"] == 503
        assert http("GET", w.url + "/server_info")[0] == 200  # info is served while loading, as in SGLang


def test_latency_follows_the_timing_profile_over_http() -> None:
    """8B on H100 at real speed: a 4096-token prefill (~118 ms) then 10 decode steps (~7 ms each)."""
    with start_fleet("sim", 1, profile="llama-3.1-8b-h100", page_size=16)[0] as w:
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

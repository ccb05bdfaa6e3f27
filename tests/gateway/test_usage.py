"""Reading the engine's cached tokens out of response bodies, however they are split into chunks."""

from __future__ import annotations

import json

import pytest

from extproc.decision.request import GENERATION_PATHS, parse_request
from extproc.exchange.usage import ServedUsage, UsageReader, usage_of
from extproc.routing.drift import reports_usage
from sglang_workers.sim.responses import usage


def _sse(*events: object) -> bytes:
    return b"".join(b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n" for e in events)


CHAT_JSON = json.dumps(
    {"id": "c", "object": "chat.completion", "choices": [], "usage": usage(382, 4, 368)}, indent=1
).encode()
CHAT_STREAM = _sse(
    {"id": "c", "choices": [{"index": 0, "delta": {"content": "hi"}}]},
    {"id": "c", "choices": [], "usage": usage(382, 4, 368)},
    b"[DONE]",
)
GENERATE_JSON = json.dumps({"text": "x", "meta_info": {"prompt_tokens": 364, "cached_tokens": 352}}).encode()
GENERATE_STREAM = _sse(
    {"text": "a", "meta_info": {"prompt_tokens": 364, "cached_tokens": 352}},
    {"text": "ab", "meta_info": {"prompt_tokens": 364, "cached_tokens": 352, "completion_tokens": 2}},
    b"[DONE]",
)


@pytest.mark.parametrize(
    ("body", "stream", "expected"),
    [
        (CHAT_JSON, False, ServedUsage(368, 382)),
        (CHAT_STREAM, True, ServedUsage(368, 382)),
        (GENERATE_JSON, False, ServedUsage(352, 364)),
        (GENERATE_STREAM, True, ServedUsage(352, 364)),
    ],
)
def test_usage_is_read_whatever_the_chunking(body: bytes, stream: bool, expected: ServedUsage) -> None:
    for size in (1, 3, 7, 64, len(body)):
        reader = UsageReader(event_stream=stream)
        for start in range(0, len(body), size):
            reader.feed(body[start : start + size])
        assert reader.result() == expected, size


def test_a_body_without_figures_or_too_long_yields_none() -> None:
    stream = UsageReader(event_stream=True)
    stream.feed(_sse({"id": "c", "choices": [{"delta": {"content": "hi"}}]}, b"[DONE]"))  # no include_usage
    assert stream.result() is None
    broken = UsageReader(event_stream=False)
    broken.feed(b'{"usage": {"prompt_tokens_details": {"cached_tokens": 3}')  # cut short
    assert broken.result() is None
    long = UsageReader(event_stream=False, max_bytes=100)
    long.feed(b" " * 101 + GENERATE_JSON)
    assert long.result() is None
    assert usage_of([{"meta_info": {"cached_tokens": 1}}]) is None  # a batch's answers: not one prompt's
    assert usage_of({"usage": {"prompt_tokens_details": {"cached_tokens": -1}}}) is None
    assert usage_of({"usage": {"prompt_tokens_details": None}, "meta_info": {"cached_tokens": 0}}) == ServedUsage(0)


@pytest.mark.parametrize(
    ("path", "body", "reported"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, True),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True}, False),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "hi"}],
                "stream": True,
                "stream_options": {"include_usage": True},
            },
            True,
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2}, False),
        ("/v1/completions", {"prompt": ["a", "b"]}, False),
        ("/v1/completions", {"prompt": ["a"]}, True),
        ("/generate", {"text": "hi", "stream": True}, True),
        ("/generate", {"text": ["a", "b"]}, False),
        ("/generate", {"input_ids": [[1, 2], [3]]}, False),
        ("/generate", {"input_ids": [1, 2]}, True),
        ("/generate", {"text": "hi", "sampling_params": {"n": 3}}, False),
    ],
)
def test_which_responses_report_one_prompts_usage(path: str, body: dict[str, object], reported: bool) -> None:
    parsed = parse_request(GENERATION_PATHS[path], path, json.dumps(body).encode())
    assert reports_usage(parsed) is reported

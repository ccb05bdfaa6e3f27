"""Request parsing: which requests are routed, what routing gets from them, and what is refused."""

from __future__ import annotations

import pytest

from extproc.request import RequestError, generation_kind, parse_request


@pytest.mark.parametrize(
    "method, path, kind",
    [
        ("POST", "/v1/chat/completions", "chat"),
        ("POST", "/v1/completions?x=1", "completion"),
        ("POST", "/generate", "generate"),
        ("GET", "/v1/chat/completions", None),
        ("POST", "/v1/embeddings", None),
        ("GET", "/v1/models", None),
    ],
)
def test_generation_kind(method: str, path: str, kind: str | None) -> None:
    assert generation_kind(method, path) == kind


def test_chat() -> None:
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": true, "tools": []}'
    parsed = parse_request("chat", "/v1/chat/completions", body, {"x-session-id": "s"})
    assert parsed.model == "m" and parsed.messages == [{"role": "user", "content": "hi"}]
    assert parsed.stream and parsed.tools == [] and parsed.headers == {"x-session-id": "s"}
    assert parsed.body_bytes == len(body)


@pytest.mark.parametrize(
    "body, text, ids",
    [
        (b'{"prompt": "hello"}', "hello", None),
        (b'{"prompt": [1, 2, 3]}', None, [1, 2, 3]),
        (b'{"prompt": ["first", "second"]}', "first", None),
        (b'{"prompt": [[4, 5], [6]]}', None, [4, 5]),
    ],
)
def test_completion_prompt_forms(body: bytes, text: str | None, ids: list[int] | None) -> None:
    parsed = parse_request("completion", "/v1/completions", body)
    assert (parsed.prompt_text, parsed.input_ids) == (text, ids)


@pytest.mark.parametrize(
    "body, text, ids",
    [
        (b'{"text": "hello", "lora_path": "a"}', "hello", None),
        (b'{"input_ids": [7, 8]}', None, [7, 8]),
        (b'{"input_ids": [[7, 8], [9]]}', None, [7, 8]),
    ],
)
def test_generate_forms(body: bytes, text: str | None, ids: list[int] | None) -> None:
    parsed = parse_request("generate", "/generate", body)
    assert (parsed.prompt_text, parsed.input_ids) == (text, ids)


@pytest.mark.parametrize(
    "kind, body, status, param",
    [
        ("chat", b"", 400, None),
        ("chat", b"{", 400, None),
        ("chat", b'"\xff"', 400, None),
        ("chat", b"[]", 400, None),
        ("chat", b'{"messages": []}', 400, "messages"),
        ("chat", b'{"messages": "hi"}', 400, "messages"),
        ("completion", b'{"prompt": 5}', 400, "prompt"),
        ("completion", b'{"prompt": [1, "a"]}', 400, "prompt"),
        ("completion", b'{"prompt": "x", "model": 3}', 400, "model"),
        ("generate", b'{"input_ids": [1.5]}', 400, "input_ids"),
        # Found by tests/test_gateway_fuzz.py: a negative id once reached the hashing and cost a 500.
        ("completion", b'{"prompt": [0, 0, -1]}', 400, "prompt"),
        ("generate", b'{"input_ids": [18446744073709551616]}', 400, "input_ids"),
        ("generate", b'{"text": 1}', 400, "text"),
        ("generate", b'{"text": "' + b"a" * 100 + b'"}', 413, None),
    ],
)
def test_refused(kind: str, body: bytes, status: int, param: str | None) -> None:
    with pytest.raises(RequestError) as caught:
        parse_request(kind, "/x", body, max_body_bytes=64)  # type: ignore[arg-type]
    assert caught.value.status == status and caught.value.param == param and caught.value.message

"""Request parsing: which requests are routed, what routing gets from them, and what is refused."""

from __future__ import annotations

import pytest

from extproc.decision.request import RequestError, generation_kind, parse_request


@pytest.mark.parametrize(
    ("method", "path", "kind"),
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
    ("kind", "body", "limit"),
    [
        ("chat", b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 32}', 32),
        (
            "chat",
            b'{"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 8, "max_tokens": 32}',
            8,
        ),  # the newer name wins
        ("chat", b'{"messages": [{"role": "user", "content": "hi"}]}', None),
        (
            "chat",
            b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": "32"}',
            None,
        ),  # not ours to refuse: the worker answers it
        ("chat", b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": true}', None),
        ("chat", b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}', None),
        ("completion", b'{"prompt": "a", "max_tokens": 16}', 16),
        ("generate", b'{"text": "a", "sampling_params": {"max_new_tokens": 64}}', 64),
        ("generate", b'{"text": "a", "max_tokens": 64}', None),  # /generate reads sampling_params only
        ("generate", b'{"text": "a", "sampling_params": 3}', None),
    ],
)
def test_the_output_limit_is_read_where_each_api_puts_it(kind: str, body: bytes, limit: int | None) -> None:
    path = {"chat": "/v1/chat/completions", "completion": "/v1/completions", "generate": "/generate"}[kind]
    assert parse_request(kind, path, body).max_new_tokens == limit  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("body", "text", "ids"),
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
    ("body", "text", "ids"),
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
    ("kind", "body", "status", "param"),
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
        # Negative ids kill a real SGLang 0.5.23 worker (its embedding lookup raises in the scheduler).
        ("generate", b'{"input_ids": [1, -2]}', 400, "input_ids"),
        ("generate", b'{"input_ids": [[1, 2], [3, -1]]}', 400, "input_ids"),
        ("completion", b'{"prompt": [-5]}', 400, "prompt"),
        ("completion", b'{"prompt": [[1], [2, -3]]}', 400, "prompt"),
        ("generate", b'{"input_ids": [true]}', 400, "input_ids"),
        # Found by tests/gateway/test_fuzz.py: an id past 64 bits reached the hashing and cost a 500.
        ("generate", b'{"input_ids": [18446744073709551616]}', 400, "input_ids"),
        ("generate", b'{"text": 1}', 400, "text"),
        ("generate", b'{"text": "' + b"a" * 100 + b'"}', 413, None),
    ],
)
def test_refused(kind: str, body: bytes, status: int, param: str | None) -> None:
    with pytest.raises(RequestError) as caught:
        parse_request(kind, "/x", body, max_body_bytes=64)  # type: ignore[arg-type]
    assert caught.value.status == status and caught.value.param == param and caught.value.message


def test_the_largest_token_id_of_every_batch_item_is_known() -> None:
    assert parse_request("generate", "/generate", b'{"input_ids": [[7, 8], [9000]]}').max_token_id == 9000
    assert parse_request("completion", "/v1/completions", b'{"prompt": [3, 99]}').max_token_id == 99
    assert parse_request("completion", "/v1/completions", b'{"prompt": "text"}').max_token_id is None


def test_ids_outside_a_configured_vocabulary_are_refused_before_routing() -> None:
    from extproc.config import ModelConfig, RouterConfig
    from extproc.fleet.workers import Worker, WorkerRegistry
    from extproc.serving.app import RouterApp

    config = RouterConfig(models=[ModelConfig(name="tiny", vocab_size=8192)])
    app = RouterApp(config, WorkerRegistry([Worker(id="w0", url="http://127.0.0.1:1", ip="127.0.0.1", port=1)]))
    ok = parse_request("generate", "/generate", b'{"model": "tiny", "input_ids": [8191]}')
    assert app.router.route(ok).worker.id == "w0"
    with pytest.raises(RequestError) as caught:
        app.router.route(parse_request("generate", "/generate", b'{"model": "tiny", "input_ids": [[1], [8192]]}'))
    assert caught.value.status == 400 and caught.value.param == "input_ids" and "8192" in caught.value.message
    # A model without a configured vocabulary is not checked above zero (its tokenizer may be smaller).
    assert app.router.route(parse_request("generate", "/generate", b'{"input_ids": [99999]}')).worker.id == "w0"

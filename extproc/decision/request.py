"""Envoy request -> a parsed generation request, or a client error.

Only the three generation APIs are parsed (``/v1/chat/completions``, ``/v1/completions``,
``/generate``); anything else passes through to ordinary routing. Errors carry the HTTP status and
an OpenAI-style message so the server can answer with an ImmediateResponse instead of forwarding
garbage to a worker.

The body is parsed once with orjson (validates UTF-8 and JSON in one pass, ~3x faster than the
stdlib) and never re-serialized: Envoy forwards the client's bytes untouched.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

__all__ = ["GENERATION_PATHS", "ParsedRequest", "RequestError", "RequestKind", "generation_kind", "parse_request"]

RequestKind = Literal["chat", "completion", "generate"]

# Path (without query string) -> kind. Only POSTs to these are parsed and routed by the policy.
GENERATION_PATHS: dict[str, RequestKind] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completion",
    "/generate": "generate",
}


class RequestError(Exception):
    """A client error: ``status`` (400/413/...) and an OpenAI-style ``message``/``type``/``param``."""

    def __init__(
        self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param


@dataclass
class ParsedRequest:
    """What routing needs from one generation request. Prompt text is never logged or traced."""

    path: str
    kind: RequestKind
    model: str | None = None
    messages: list[dict[str, Any]] | None = None  # chat
    tools: list[dict[str, Any]] | None = None  # chat
    chat_template_kwargs: dict[str, Any] | None = None  # chat
    prompt_text: str | None = None  # completion / generate text
    input_ids: list[int] | None = None  # token ids given by the client
    max_token_id: int | None = None  # the largest id of every prompt in the body (all batch items)
    stream: bool = False
    stream_usage: bool = False  # a stream whose client asked for usage (``stream_options.include_usage``)
    single: bool = True  # one prompt, one answer (no batch, no ``n`` > 1): its usage is that prompt's
    max_new_tokens: int | None = None  # the output the client allows (None: the body names none)
    lora: str | None = None
    cache_salt: str | None = None
    headers: dict[str, str] = field(default_factory=dict)  # lower-cased request headers
    body_bytes: int = 0


def generation_kind(method: str, path: str) -> RequestKind | None:
    """The kind of a generation request, or None when the request passes through unparsed."""
    if method != "POST":
        return None
    return GENERATION_PATHS.get(path.split("?", 1)[0])


_ID_LIMIT = 2**64


def _is_token_ids(value: Any) -> bool:
    # Negative ids are refused here: SGLang 0.5.23 indexes its embedding with them and its scheduler dies.
    # Past 64 bits no worker takes an id either (and the block keys could not be hashed).
    return isinstance(value, list) and bool(value) and all(type(t) is int and 0 <= t < _ID_LIMIT for t in value)


def _token_batch(value: Any, param: str) -> list[list[int]]:
    """Every prompt of a token-id body (one list or a batch of lists), each checked; 400 otherwise."""
    batch = value if isinstance(value, list) and value and isinstance(value[0], list) else [value]
    if not all(_is_token_ids(ids) for ids in batch):
        raise RequestError(400, f"'{param}' must be a non-empty array of non-negative token ids", param=param)
    return batch


def _optional_str(body: dict[str, Any], key: str) -> str | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise RequestError(400, f"'{key}' must be a string", param=key)
    return value


def _parse_chat(body: dict[str, Any], parsed: ParsedRequest) -> None:
    messages = body.get("messages")
    if messages is None:
        raise RequestError(400, "'messages' is a required property", param="messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise RequestError(400, "'messages' must be a non-empty array of message objects", param="messages")
    parsed.messages = messages
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise RequestError(400, "'tools' must be an array", param="tools")
        parsed.tools = tools
    kwargs = body.get("chat_template_kwargs")
    if isinstance(kwargs, dict):
        parsed.chat_template_kwargs = kwargs


def _parse_completion(body: dict[str, Any], parsed: ParsedRequest) -> None:
    prompt = body.get("prompt")
    if prompt is None:
        raise RequestError(400, "'prompt' is a required property", param="prompt")
    # OpenAI also allows a batch (list of strings / list of id lists); route on the first item,
    # since every item of a batch goes to the same worker.
    if (isinstance(prompt, list) and prompt and isinstance(prompt[0], list)) or _is_token_ids(prompt):
        batch = _token_batch(prompt, "prompt")
        parsed.input_ids = batch[0]
        parsed.max_token_id = max(max(ids) for ids in batch)
        parsed.single = len(batch) == 1
        return
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        parsed.single = len(prompt) == 1
        prompt = prompt[0]
    if isinstance(prompt, str):
        parsed.prompt_text = prompt
    else:
        raise RequestError(400, "'prompt' must be a string or an array of non-negative token ids", param="prompt")


def _parse_generate(body: dict[str, Any], parsed: ParsedRequest) -> None:
    text, input_ids = body.get("text"), body.get("input_ids")
    if text is None and input_ids is None:
        raise RequestError(400, "one of 'text' or 'input_ids' is required", param="text")
    if isinstance(text, list) and text:  # SGLang batch form: route on the first prompt
        parsed.single = False  # answered with a list, one answer per prompt
        text = text[0]
    if input_ids is not None:
        batch = _token_batch(input_ids, "input_ids")
        parsed.input_ids = batch[0]
        parsed.max_token_id = max(max(ids) for ids in batch)
        parsed.single = parsed.single and batch[0] is input_ids  # a list of lists is a batch, answered with a list
    elif isinstance(text, str):
        parsed.prompt_text = text
    else:
        raise RequestError(400, "'text' must be a string", param="text")


def _max_new_tokens(data: dict[str, Any], kind: RequestKind) -> int | None:
    """The output limit the body gives (OpenAI's names, or SGLang's ``sampling_params.max_new_tokens``).

    Only read, never checked: the worker answers a bad value itself. The router counts it as KV room the
    request may fill (``InFlightBook``).
    """
    names: tuple[str, ...]
    if kind == "generate":
        params = data.get("sampling_params")
        names, source = ("max_new_tokens",), params if isinstance(params, dict) else {}
    else:
        names, source = ("max_completion_tokens", "max_tokens"), data
    for name in names:
        value = source.get(name)
        if type(value) is int and value >= 0:
            return value
    return None


_PARSERS = {"chat": _parse_chat, "completion": _parse_completion, "generate": _parse_generate}


def parse_request(
    kind: RequestKind,
    path: str,
    body: bytes,
    headers: Mapping[str, str] | None = None,
    max_body_bytes: int | None = None,
) -> ParsedRequest:
    """Parse a generation request body; raise RequestError (400/413) for anything a worker must not see."""
    if max_body_bytes is not None and len(body) > max_body_bytes:
        raise RequestError(
            413, f"request body is {len(body)} bytes; the limit is {max_body_bytes} bytes", type_="request_too_large"
        )
    if not body:
        raise RequestError(400, "request body is empty; expected a JSON object")
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        if "UTF-8" in str(exc):
            raise RequestError(400, "request body is not valid UTF-8") from None
        raise RequestError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise RequestError(400, "request body must be a JSON object")
    parsed = ParsedRequest(path=path.split("?", 1)[0], kind=kind, headers=dict(headers or {}), body_bytes=len(body))
    _PARSERS[kind](data, parsed)
    parsed.model = _optional_str(data, "model")
    parsed.stream = data.get("stream") is True
    options = data.get("stream_options")
    parsed.stream_usage = parsed.stream and isinstance(options, dict) and options.get("include_usage") is True
    params = data.get("sampling_params") if kind == "generate" else data
    if isinstance(params, dict) and params.get("n") not in (None, 1):
        parsed.single = False
    parsed.max_new_tokens = _max_new_tokens(data, kind)
    parsed.lora = _optional_str(data, "lora_path") or _optional_str(data, "lora")
    parsed.cache_salt = _optional_str(data, "cache_salt")
    return parsed

"""Reading and checking HTTP request bodies as SGLang 0.5.23 does, with its error messages.

Each refusal is an ``ApiError`` of the shape SGLang gives it (``responses``): a body that does not parse into
SGLang's pydantic request model is a ``validation`` error; the OpenAI layer's and ``/generate``'s own refusals
have theirs. Nothing here queues work: the handlers in ``http_generation`` call these before ``submit``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal

from aiohttp import web

from prefix_common.tokenization import ModelTokenizer

from .responses import ApiError, ErrorKind

__all__ = [
    "cache_salt",
    "check_input_ids",
    "choices",
    "completion_prompts",
    "max_tokens",
    "model_name",
    "read_json",
    "routed_rank",
    "validation_error",
]

Api = Literal["generate", "completions", "chat"]


def validation_error(field: str, problem: str) -> ApiError:
    """What SGLang's pydantic request models answer for a body that does not parse (400, "Bad Request")."""
    return ApiError(400, f"1 validation error:\n  {{'loc': ('body', {field!r}), 'msg': {problem!r}}}", "validation")


async def read_json(request: web.Request) -> dict[str, Any]:
    """The request body as a JSON object, or the validation error SGLang answers."""
    raw = await request.read()
    try:
        body = json.loads(raw or b"null")
    except ValueError as exc:
        raise validation_error("body", f"JSON decode error: {exc}") from None
    if not isinstance(body, dict):
        raise validation_error("body", "Input should be a valid dictionary or object")
    return body


def check_input_ids(ids: list[Any], field: str, kind: ErrorKind) -> list[int]:
    """Integer ids (else a validation error), none negative.

    A negative id kills a real SGLang 0.5.23 worker (its embedding lookup raises in the scheduler); the
    simulator refuses it instead. Ids beyond a vocabulary are served: the simulator has no embedding
    table, and synthetic workloads use any ids (the router refuses them where ``models[].vocab_size``
    says so).
    """
    if not all(type(t) is int for t in ids):
        raise validation_error(field, "Input should be a valid integer")
    if ids and min(ids) < 0:
        raise ApiError(400, f"token id {min(ids)} is negative.", kind)
    return ids


def max_tokens(value: Any, field: str, default: int, kind: ErrorKind) -> int:
    """A ``max_tokens`` / ``max_new_tokens`` value: ``default`` when absent, else a non-negative integer."""
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool):
        raise validation_error(field, "Input should be a valid integer")
    if value < 0:
        raise ApiError(400, f"max_new_tokens must be at least 0, got {value}.", kind)
    return value


def cache_salt(body: Mapping[str, Any]) -> str | None:
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise validation_error("cache_salt", "Input should be a valid string")
    return salt or None


def choices(body: Mapping[str, Any]) -> int:
    """``n``: how many choices to generate for each prompt."""
    n = body.get("n", 1)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise validation_error("n", "Input should be greater than or equal to 1")
    return n


def model_name(body: Mapping[str, Any]) -> str:
    """The ``model`` a response names: the request's, as SGLang echoes it."""
    model = body.get("model")
    return model if isinstance(model, str) else "default"


def completion_prompts(tokenizer: ModelTokenizer, prompt: Any) -> list[list[int]]:
    """``prompt`` as SGLang's CompletionRequest accepts it: str, [str], [int] or [[int]]; one list per item."""
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        items = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        items = prompt
    else:
        raise validation_error("prompt", "Input should be a valid string or list")
    out = []
    for item in items:
        if isinstance(item, str):
            ids = tokenizer.encode_text(item)
        elif isinstance(item, list) and item and all(type(t) is int for t in item):
            ids = check_input_ids(item, "prompt", "openai")
        else:
            raise validation_error("prompt", "Input should be a valid list of integers")
        if not ids:
            raise ApiError(400, "The prompt is empty.")
        out.append(ids)
    return out


def routed_rank(
    request: web.Request, body: Mapping[str, Any], api: Api, ranks: int, header_overrides: bool
) -> int | None:
    """The DP rank a request names, read as SGLang 0.5.23 reads it; None lets the worker choose.

    Body ``routed_dp_rank`` (or the deprecated ``data_parallel_rank``); on the OpenAI APIs the
    ``X-Data-Parallel-Rank`` header wins over it; on /generate and chat the header-override mechanism's
    ``x-override-routed-dp-rank`` wins over both, only with SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES=1
    (``header_overrides``). A rank out of range (``ranks``) is a 400; rank 0 on a single-rank worker is ignored.
    """
    value: Any = body.get("routed_dp_rank", body.get("data_parallel_rank"))
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
        raise ApiError(400, "'routed_dp_rank' must be an integer.")
    headers: list[tuple[str, str]] = []
    if api in ("chat", "completions"):
        headers.append(("x-data-parallel-rank", "Invalid X-Data-Parallel-Rank header: must be an integer"))
    if api in ("chat", "generate") and header_overrides:
        headers.append(("x-override-routed-dp-rank", "invalid x-override-routed-dp-rank header"))
    for name, problem in headers:
        raw = request.headers.get(name)
        if raw is not None:
            try:
                value = int(raw)
            except ValueError:
                raise ApiError(400, f"{problem}, got {raw!r}") from None
    if value is None:
        return None
    if ranks <= 1 and value == 0:
        return None
    if not 0 <= value < ranks:
        raise ApiError(400, f"routed_dp_rank={value} out of range [0, {ranks})")
    return int(value)

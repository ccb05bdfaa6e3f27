"""Envoy request -> a parsed generation request, or a client error.

Only the three generation APIs are parsed (``/v1/chat/completions``, ``/v1/completions``,
``/generate``); anything else passes through to ordinary routing. Errors carry the HTTP status and
an OpenAI-style message so the server can answer with an ImmediateResponse instead of forwarding
garbage to a worker.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["ParsedRequest", "RequestError", "RequestKind"]

RequestKind = Literal["chat", "completion", "generate"]


class RequestError(Exception):
    """A client error: ``status`` (400/413/...) and an OpenAI-style ``message``/``type``/``param``."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None) -> None:
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
    stream: bool = False
    lora: str | None = None
    cache_salt: str | None = None
    headers: dict[str, str] = field(default_factory=dict)  # lower-cased request headers
    body_bytes: int = 0

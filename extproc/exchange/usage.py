"""The engine's own count of cached prompt tokens, read out of a response body as it streams past.

SGLang reports it in three shapes (0.5.23, with ``--enable-cache-report`` for the OpenAI ones):

- ``/v1/chat/completions`` and ``/v1/completions``: ``usage.prompt_tokens_details.cached_tokens`` in
  the JSON answer, or in the last SSE chunk of a stream when the client asked for
  ``stream_options.include_usage`` (no usage otherwise);
- ``/generate``: ``meta_info.cached_tokens`` in the JSON answer, and in every SSE chunk of a stream
  (fixed once the prompt is admitted; the last one is read).

Only sampled responses are read (``extproc.routing.drift``). The reader never raises on what it is
fed: a body it cannot read yields no figures, and the response goes on untouched either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

__all__ = ["MAX_USAGE_BODY_BYTES", "ServedUsage", "UsageReader", "usage_of"]

# A JSON answer is parsed whole at its end; past this many bytes it is not read (a sample lost, no more).
MAX_USAGE_BODY_BYTES = 4 * 1024 * 1024
_KEY = b"cached_tokens"


@dataclass(frozen=True)
class ServedUsage:
    """What the engine reported for one prompt: tokens found cached, and the prompt's length (if given)."""

    cached_tokens: int
    prompt_tokens: int | None = None


def _count(value: Any) -> int | None:
    return value if type(value) is int and value >= 0 else None


def usage_of(data: Any) -> ServedUsage | None:
    """The usage in one decoded answer or SSE chunk (OpenAI ``usage`` or SGLang ``meta_info``), if any."""
    if not isinstance(data, dict):
        return None  # a batch's list of answers: not one prompt's figures
    usage = data.get("usage")
    if isinstance(usage, dict):
        details = usage.get("prompt_tokens_details")
        cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else None
        if cached is not None:
            return ServedUsage(cached, _count(usage.get("prompt_tokens")))
    meta = data.get("meta_info")
    if isinstance(meta, dict):
        cached = _count(meta.get("cached_tokens"))
        if cached is not None:
            return ServedUsage(cached, _count(meta.get("prompt_tokens")))
    return None


class UsageReader:
    """Fed a response body chunk by chunk; ``result`` is the usage it held (None: none found).

    ``feed`` only keeps bytes, so that a chunk goes on at once: for SSE (``event_stream``) the last
    complete ``data:`` line that mentions ``cached_tokens``, for a JSON answer the whole body (up to
    ``max_bytes``). ``result`` decodes what was kept, once, when the response is over.
    """

    def __init__(self, event_stream: bool, max_bytes: int = MAX_USAGE_BODY_BYTES) -> None:
        self.event_stream = event_stream
        self.max_bytes = max_bytes
        self._buffer = bytearray()  # a JSON answer, or the SSE line not yet complete
        self._last = b""  # SSE: the newest complete data line that carries the figures
        self._overflow = False

    def feed(self, chunk: bytes) -> None:
        if self._overflow or not chunk:
            return
        self._buffer += chunk
        if self.event_stream:
            end = self._buffer.rfind(b"\n")
            if end >= 0:
                self._keep_last(bytes(self._buffer[: end + 1]))
                del self._buffer[: end + 1]
        if len(self._buffer) > self.max_bytes:  # one line (or a JSON answer) too long to keep
            self._overflow = True
            self._buffer.clear()

    def result(self) -> ServedUsage | None:
        """The engine's figures: the last seen in a stream, or the JSON answer's."""
        if not self.event_stream:
            return None if self._overflow else _decode(bytes(self._buffer))
        if self._buffer and not self._overflow:  # a last line without its newline
            self._keep_last(bytes(self._buffer))
            self._buffer.clear()
        return _decode(self._last[5:].strip()) if self._last else None

    def _keep_last(self, lines: bytes) -> None:
        at = lines.rfind(_KEY)
        if at < 0:
            return
        start = lines.rfind(b"\n", 0, at) + 1
        end = lines.find(b"\n", at)
        line = lines[start : end if end >= 0 else len(lines)]
        if line.startswith(b"data:"):
            self._last = line


def _decode(payload: bytes) -> ServedUsage | None:
    try:
        return usage_of(orjson.loads(payload))
    except orjson.JSONDecodeError:
        return None

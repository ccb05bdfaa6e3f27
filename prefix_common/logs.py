"""Log set-up shared by the long-running commands (``serve``, ``up``, ``sim-worker``): level and format.

``--log-format text`` (the default) is one readable line per record. ``--log-format json`` is one JSON object
per line, for log pipelines (Loki, Elasticsearch, Cloud Logging) that would otherwise have to parse text:
``time`` (ISO 8601 in UTC, milliseconds, ``Z``), ``level``, ``logger``, ``message``, ``exception`` (the traceback, when
the record carries one) and any ``extra=`` fields the caller attached. This module lives in ``extproc`` (it
imports nothing of the project) so the router, the simulated worker and the ``prefix-router`` command can all
use it without an import arrow pointing the wrong way.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from datetime import datetime, timezone
from typing import Any, TextIO

__all__ = ["LEVELS", "LOG_FORMATS", "JsonFormatter", "add_log_flags", "configure_logging", "json_line"]

LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# Attributes every LogRecord has; anything else on a record came from ``extra=`` and is emitted as a field.
_RECORD_FIELDS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


def _utc(created: float) -> str:
    """``2026-12-05T00:09:45.793Z``: the form Envoy's JSON access log writes too (``up --log-format json``)."""
    return datetime.fromtimestamp(created, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (newlines inside strings are escaped by JSON itself)."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": _utc(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["exception"] = record.exc_text
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        for key, value in vars(record).items():
            if key not in _RECORD_FIELDS and key not in entry:
                entry[key] = value
        return json.dumps(entry, default=str, ensure_ascii=False)


def json_line(logger: str, message: str, level: str = "info", **fields: Any) -> str:
    """One JSON log line built outside ``logging`` (what stdout carries besides the records, e.g. a banner)."""
    record = logging.makeLogRecord({"name": logger, "msg": message, "levelname": level.upper(), **fields})
    return JsonFormatter().format(record)


def add_log_flags(parser: argparse.ArgumentParser) -> None:
    """``--log-level`` and ``--log-format``, worded the same in every command."""
    parser.add_argument("--log-level", choices=LEVELS, default="info", help="Log verbosity.")
    parser.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default="text",
        help="text: one readable line per record; json: one JSON object per line (time, level, logger, message, "
        "exception when there is one), for log pipelines.",
    )


def configure_logging(
    level: str = "info", fmt: str = "text", stream: TextIO | None = None, text_format: str = TEXT_FORMAT
) -> None:
    """Route every logger's records to ``stream`` (stderr) at ``level``, as text lines or JSON objects.

    ``text_format`` is the line of the text format (a foreground command such as ``up`` prints its own
    messages without a timestamp); the JSON format has no variants.

    Replaces handlers set earlier (``logging.basicConfig`` would silently keep them), so calling it again,
    as a restarted ``serve --processes`` child does, leaves exactly one handler.
    """
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format {fmt!r}: one of {', '.join(LOG_FORMATS)}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(text_format))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())

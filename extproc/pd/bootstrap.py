"""Prefill/decode disaggregation: which workers play which part, and the bootstrap fields of a pair.

SGLang's PD protocol (0.5.23): the same JSON body goes to one prefill and one decode server at
once, carrying ``bootstrap_host`` (the prefill server's address), ``bootstrap_port`` (its KV
bootstrap server's port, ``/server_info`` ``disaggregation_bootstrap_port``) and ``bootstrap_room``
(a random id in [0, 2^63) that lets the two find each other). A batch body may carry scalars:
SGLang numbers the items' rooms ``room + i``. The router also gives the request a ``rid`` when the
client gave none, so that the decode side can be aborted by name (``/abort_request``) when the
prefill leg fails, and tells decode which prefill DP rank holds the KV (``disagg_prefill_dp_rank``)
when it pinned one.

Pure functions and values only: the router chooses the pair, ``extproc.pd.prefill_leg`` sends the
prefill leg, Envoy proxies the decode side.
"""

from __future__ import annotations

import secrets
import uuid
from dataclasses import dataclass
from typing import Any

import orjson

from extproc.decision.request import RequestError, RequestKind

__all__ = ["ROOM_LIMIT", "PairPlan", "bootstrap_body", "new_room"]

ROOM_LIMIT = 2**63  # SGLang draws rooms with random.randint(0, 2**63 - 1)


def new_room() -> int:
    """A fresh bootstrap room, uniform in [0, 2^63) from the OS's randomness (rooms of replicas never collide)."""
    return secrets.randbelow(ROOM_LIMIT)


@dataclass
class PairPlan:
    """One pair's bootstrap: where decode fetches the KV from, the room, the request ids to abort by."""

    bootstrap_host: str
    bootstrap_port: int
    bootstrap_room: int
    rids: list[str]
    prefill_dp_rank: int | None = None


def _batch_size(kind: RequestKind, data: dict[str, Any]) -> int | None:
    """How many prompts a batch body holds (None: a single prompt)."""
    if kind == "generate":
        text, ids = data.get("text"), data.get("input_ids")
        if isinstance(text, list):
            return len(text)
        if isinstance(ids, list) and ids and isinstance(ids[0], list):
            return len(ids)
        return None
    if kind == "completion":
        prompt = data.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            return len(prompt)
    return None


def bootstrap_body(
    body: bytes, kind: RequestKind, host: str, port: int, room: int, prefill_dp_rank: int | None = None
) -> tuple[bytes, PairPlan]:
    """The body both sides of a pair receive, and the plan it encodes.

    The client's own ``rid`` is kept (a string, or one per batch item); otherwise one is made per
    prompt. Client copies of the bootstrap fields are overwritten: the pair is the router's choice.
    """
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:  # parse_request has accepted it; this is only a guard
        raise RequestError(400, f"request body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise RequestError(400, "request body must be a JSON object")
    given = data.get("rid")
    if isinstance(given, str) and given:
        rids = [given]
    elif isinstance(given, list) and given and all(isinstance(r, str) for r in given):
        rids = list(given)
    else:
        count = _batch_size(kind, data)
        rids = [uuid.uuid4().hex for _ in range(count or 1)]
        data["rid"] = rids if count is not None else rids[0]
    data["bootstrap_host"] = host
    data["bootstrap_port"] = port
    data["bootstrap_room"] = room
    if prefill_dp_rank is not None:
        data["disagg_prefill_dp_rank"] = prefill_dp_rank
    plan = PairPlan(host, port, room, rids, prefill_dp_rank)
    return orjson.dumps(data), plan

"""Helpers for prefill/decode pairs: a PD request's body, and sending it to both workers at once as a PD client does."""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from sglang_workers.process import WorkerProcess
from tests.support.sim_fixtures import get_json, http

# The ``disaggregation`` block of a 0.5.23 ``/v1/loads`` entry, in order (../shared/sglang-http/v1_loads.json).
DISAGGREGATION_LOAD_KEYS = [
    "mode",
    "prefill_bootstrap_queue_reqs",
    "prefill_inflight_queue_reqs",
    "decode_prealloc_queue_reqs",
    "decode_transfer_queue_reqs",
    "decode_retracted_queue_reqs",
    "kv_transfer_speed_gb_s",
    "kv_transfer_latency_ms",
]


def pd_load(worker: WorkerProcess) -> dict[str, Any]:
    """The ``disaggregation`` block of the worker's (rank 0) ``/v1/loads`` entry."""
    _, loads = get_json(worker, "/v1/loads")
    block: dict[str, Any] = loads["loads"][0]["disaggregation"]
    return block


def pd_body(body: dict[str, Any], prefill: WorkerProcess, room: int | None = None) -> dict[str, Any]:
    """``body`` with the bootstrap fields naming ``prefill`` and a fresh (or the given) room."""
    return body | {
        "bootstrap_host": prefill.host,
        "bootstrap_port": prefill.bootstrap_port,
        "bootstrap_room": random.randrange(2**63) if room is None else room,
    }


def _parse(raw: bytes) -> Any:
    return json.loads(raw) if raw and not raw.startswith(b"data:") else raw


def send_pd(
    prefill: WorkerProcess, decode: WorkerProcess, path: str, body: dict[str, Any], timeout: float = 30.0
) -> tuple[tuple[int, Any], tuple[int, Any]]:
    """POST the same PD body to both workers concurrently, read both to the end: ((status, body) prefill, decode).

    Bodies are parsed JSON, or the raw bytes of an SSE stream."""
    with ThreadPoolExecutor(2) as pool:
        p = pool.submit(http, "POST", prefill.url + path, body, None, timeout)
        d = pool.submit(http, "POST", decode.url + path, body, None, timeout)
        (ps, pb), (ds, db) = p.result(), d.result()
    return (ps, _parse(pb)), (ds, _parse(db))

"""What a worker says about itself: served model, page size, KV-event publishers per DP rank.

The one place that reads ``/model_info`` and ``/server_info`` (``/get_*`` on older SGLang) and
interprets them. Health checks call ``discover`` when a worker joins or rejoins (it may have
restarted with other settings); the event hub calls it for a worker it cannot subscribe to yet.
Configured values always win over discovered ones, and discovered values are never written back
into the configured fields: a worker started with ``--dp-size N`` publishes on N ports, all of
which ``event_endpoints`` derives from ``/server_info`` each time.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from extproc.addresses import substitute_wildcard
from extproc.sync.http import WorkerHttp
from extproc.sync.workers import Worker

__all__ = [
    "bootstrap_port",
    "disaggregation_role",
    "discover",
    "dp_size",
    "event_endpoints",
    "page_size",
    "storage_group",
]

DEFAULT_FILE_STORAGE_DIR = "/tmp/hicache"  # SGLang HiCacheFile's default directory


async def _get_json(http: WorkerHttp, worker: Worker, timeout_s: float, *paths: str) -> dict[str, Any] | None:
    for path in paths:  # newer name first, then the older alias
        try:
            async with http.get(worker.url + path, timeout_s) as response:
                if response.status == 200:
                    data = await response.json(content_type=None)
                    if isinstance(data, dict):
                        return data
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
            continue
    return None


async def discover(http: WorkerHttp, worker: Worker, timeout_s: float) -> bool:
    """Refresh ``worker.info`` (and ``worker.model`` unless configured); True if ``/server_info`` answered.

    ``timeout_s`` bounds each request: SGLang's ``/server_info`` asks the scheduler, so a busy worker is slow.
    """
    model_info = await _get_json(http, worker, timeout_s, "/model_info", "/get_model_info")
    server_info = await _get_json(http, worker, timeout_s, "/server_info", "/get_server_info")
    if server_info is None and model_info is None:
        return False
    info: dict[str, Any] = dict(server_info or {})
    if model_info is not None:
        info["model_info"] = model_info
    worker.info = info
    if worker.model is None:
        served = info.get("served_model_name") or (model_info or {}).get("model_path")
        if isinstance(served, str) and served:
            worker.model = served
    return server_info is not None


def dp_size(worker: Worker) -> int:
    """How many data-parallel ranks (caches, publishers) the worker runs; 1 when unknown.

    ``/server_info``'s ``kv_events.dp_size`` (the publishers) first, then its top-level ``dp_size``.
    """
    info = worker.info if isinstance(worker.info, dict) else {}
    events = info.get("kv_events")
    for value in (events.get("dp_size") if isinstance(events, dict) else None, info.get("dp_size")):
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 1


def event_endpoints(worker: Worker) -> list[tuple[str, str | None]]:
    """``(events, replay)`` endpoints, one pair per DP rank: from config, else from ``/server_info``.

    A configured endpoint is rank 0's; rank ``r`` listens on its port + ``r``, as SGLang offsets
    each rank's publisher (and replay socket) from the configured one.
    """
    if worker.kv_events_endpoint:
        ranks = dp_size(worker)
        return [
            (
                _offset(worker.kv_events_endpoint, r),
                _offset(worker.replay_endpoint, r) if worker.replay_endpoint else None,
            )
            for r in range(ranks)
        ]
    info = worker.info.get("kv_events") if isinstance(worker.info, dict) else None
    if not isinstance(info, dict):
        return []
    publisher = info.get("publisher", "zmq")
    base = info.get("endpoint_port_base")
    if publisher not in (None, "zmq") or not isinstance(base, int):
        return []
    host = substitute_wildcard(info.get("endpoint_host"), worker.ip)
    replay_base = info.get("replay_endpoint_port_base")
    ranks = dp_size(worker)
    out = []
    for rank in range(ranks):
        replay = f"tcp://{host}:{replay_base + rank}" if isinstance(replay_base, int) else None
        out.append((f"tcp://{host}:{base + rank}", replay))
    return out


def _offset(endpoint: str, rank: int) -> str:
    """``tcp://host:port`` with the port moved up by ``rank`` (unchanged for rank 0 or no port)."""
    if rank == 0:
        return endpoint
    head, sep, port = endpoint.rpartition(":")
    return f"{head}:{int(port) + rank}" if sep and port.isdigit() else endpoint


def page_size(worker: Worker) -> int | None:
    """The worker's page size (= KV-event ``block_size``) as its ``/server_info`` reports it."""
    info = worker.info if isinstance(worker.info, dict) else {}
    events = info.get("kv_events")
    for value in (info.get("page_size"), events.get("block_size") if isinstance(events, dict) else None):
        if isinstance(value, int) and value > 0:
            return value
    return None


def storage_group(worker: Worker) -> str | None:
    """Which shared storage tier the worker's HiCache writes to, from its ``/server_info``; None: none.

    Workers name one tier when they report the same backend and location and serve the same model
    with the same tensor-parallel layout (SGLang's ``file`` backend names each page's file by its
    hash, the model and the TP rank and size, so only such workers read each other's pages). For
    ``file`` the location is ``file_storage_path`` in the extra config, else ``--file-storage-path``,
    else SGLang's default; a worker whose directory is overridden by the environment
    (``SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR``) cannot say so, and the directory must be one
    filesystem the workers share. Other backends are grouped by their whole extra config.
    """
    info = worker.info if isinstance(worker.info, dict) else {}
    backend = info.get("hicache_storage_backend")
    if not info.get("enable_hierarchical_cache") or not isinstance(backend, str) or not backend:
        return None
    raw = info.get("hicache_storage_backend_extra_config")
    extra: dict[str, Any] = {}
    if isinstance(raw, str) and raw.startswith("{"):
        try:
            parsed = json.loads(raw)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            extra = parsed
    if backend == "file":
        path = extra.get("file_storage_path") or info.get("file_storage_path") or DEFAULT_FILE_STORAGE_DIR
        location = str(path)
    else:
        location = json.dumps(extra, sort_keys=True)
    model = info.get("served_model_name") or worker.model or ""
    tp = info.get("tp_size") if isinstance(info.get("tp_size"), int) else 1
    return f"{backend}:{location}:{model}:tp{tp}"


def disaggregation_role(worker: Worker) -> str:
    """``aggregated``, ``prefill`` or ``decode``: configured, else ``/server_info``'s ``disaggregation_mode``.

    SGLang reports ``"null"`` for an aggregated server; a worker that has not answered yet (or an
    older SGLang without the field) counts as aggregated until it says otherwise.
    """
    if worker.role is not None:
        return worker.role
    info = worker.info if isinstance(worker.info, dict) else {}
    mode = info.get("disaggregation_mode")
    return mode if mode in ("prefill", "decode") else "aggregated"


def bootstrap_port(worker: Worker, default: int) -> int:
    """The port of a prefill worker's KV bootstrap server: configured, else ``/server_info``, else ``default``."""
    if worker.bootstrap_port is not None:
        return worker.bootstrap_port
    info = worker.info if isinstance(worker.info, dict) else {}
    value = info.get("disaggregation_bootstrap_port")
    if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 65536:
        return value
    return default

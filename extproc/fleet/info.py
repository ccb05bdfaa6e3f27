"""What a worker says of itself, read from its ``/server_info`` as ``extproc.sync.discovery`` stored it.

Pure readers of ``Worker.info`` (configured values first): page size, data-parallel ranks and their
KV-event publishers, HiCache storage group and prefetch threshold, prefill/decode role and bootstrap
port. The request path and the sync path both read them; only discovery does the I/O that fills them.
"""

from __future__ import annotations

import json
from typing import Any

from extproc.fleet.reports import DEFAULT_PREFETCH_THRESHOLD
from extproc.fleet.workers import Worker, disaggregation_role
from prefix_common.addresses import substitute_wildcard

__all__ = [
    "DP_RANK_HEADERS",
    "bootstrap_port",
    "disaggregation_role",
    "dp_size",
    "event_endpoints",
    "page_size",
    "prefetch_threshold",
    "storage_group",
]

# SGLang 0.5.23 reads the data-parallel rank a request must run on from either header:
# ``x-override-routed-dp-rank`` (its header-override mechanism for routers, on /generate and chat, when the
# worker runs with SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES=1) and ``x-data-parallel-rank`` (always, on
# /v1/completions and /v1/chat/completions). The router sets both; Envoy strips client copies of both.
DP_RANK_HEADERS = ("x-override-routed-dp-rank", "x-data-parallel-rank")


DEFAULT_FILE_STORAGE_DIR = "/tmp/hicache"  # SGLang HiCacheFile's default directory


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


def bootstrap_port(worker: Worker, default: int) -> int:
    """The port of a prefill worker's KV bootstrap server: configured, else ``/server_info``, else ``default``."""
    if worker.bootstrap_port is not None:
        return worker.bootstrap_port
    info = worker.info if isinstance(worker.info, dict) else {}
    value = info.get("disaggregation_bootstrap_port")
    if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 65536:
        return value
    return default


def prefetch_threshold(worker: Worker) -> int:
    """The worker's storage prefetch threshold in tokens (its extra config, else SGLang's default)."""
    raw = worker.info.get("hicache_storage_backend_extra_config") if isinstance(worker.info, dict) else None
    if isinstance(raw, str) and raw.startswith("{"):
        try:
            value = json.loads(raw).get("prefetch_threshold")
        except (ValueError, AttributeError):
            value = None
        if isinstance(value, int) and value >= 0:
            return value
    return DEFAULT_PREFETCH_THRESHOLD

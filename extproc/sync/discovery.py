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
from typing import Any

import aiohttp

from extproc.fleet.workers import Worker
from extproc.sync.http import WorkerHttp

__all__ = ["discover"]


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

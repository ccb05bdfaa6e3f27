"""NVIDIA Dynamo 1.6.1's real KV router as the ``dynamo`` contender (needs the optional ``dynamo`` extra).

``python -m dynamo.select_service`` (PyPI ``ai-dynamo-runtime``: its own indexer subscribed to every
worker's ZMQ KV events, its cost function, its bookings) and ``benchmarks/fleet/dynamo_proxy.py`` in
front (tokenize, select and reserve, forward, report the lifecycle). Each worker is registered with
the endpoints its ``/server_info`` ``kv_events`` block names and its page size.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import sys
from collections.abc import Sequence
from typing import Any

import aiohttp

from benchmarks.fleet.process import ContenderError, ProcessContender, wait_http
from prefix_common.addresses import free_port

__all__ = ["DYNAMO_INSTALL_HINT", "DynamoRouter"]

DYNAMO_INSTALL_HINT = "pip install -e '.[dynamo]' in the prefix-router checkout (ai-dynamo-runtime 1.6.1)"


async def _server_info(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(url + "/server_info", timeout=aiohttp.ClientTimeout(total=5)) as resp:
        data = await resp.json(content_type=None)
    if not isinstance(data, dict):
        raise ContenderError(f"{url}/server_info is not a JSON object")
    return data


def _events_endpoints(info: dict[str, Any], url: str) -> tuple[str, str | None]:
    """The worker's ZMQ publisher and replay endpoints, wildcard hosts replaced by the worker's address."""
    block = info.get("kv_events") or {}
    host = url.split("://", 1)[-1].rsplit(":", 1)[0]
    endpoint, replay = block.get("endpoint"), block.get("replay_endpoint")
    if not endpoint and block.get("endpoint_port_base"):
        endpoint = f"tcp://{block.get('endpoint_host') or host}:{block['endpoint_port_base']}"
        if block.get("replay_endpoint_port_base"):
            replay = f"tcp://{block.get('endpoint_host') or host}:{block['replay_endpoint_port_base']}"
    if not endpoint:
        raise ContenderError(f"{url} publishes no KV events (/server_info has no kv_events endpoint)")
    for wildcard in ("*", "0.0.0.0", "[::]"):
        endpoint = str(endpoint).replace(f"//{wildcard}:", f"//{host}:")
        replay = str(replay).replace(f"//{wildcard}:", f"//{host}:") if replay else None
    return str(endpoint), replay


class _DynamoProxyProcess(ProcessContender):
    """A helper process the contender owns (the proxy): started by its owner, stopped with it."""

    name = "dynamo-proxy"

    async def start(self, worker_urls: Sequence[str]) -> str:
        raise NotImplementedError("started by DynamoRouter")


class DynamoRouter(ProcessContender):
    """Dynamo's selection service + the thin proxy, in front of ``worker_urls``."""

    name = "dynamo"

    def __init__(self, page_size: int = 16) -> None:
        super().__init__()
        self.page_size = page_size
        self._proxy: _DynamoProxyProcess | None = None

    async def start(self, worker_urls: Sequence[str]) -> str:
        if importlib.util.find_spec("dynamo") is None or importlib.util.find_spec("dynamo.select_service") is None:
            raise ContenderError(f"Dynamo's selection service is not installed ({DYNAMO_INSTALL_HINT})")
        select_port, proxy_port = free_port(), free_port()
        env = {**os.environ, "DYN_LOG": "warn"}
        proc = self._spawn([sys.executable, "-m", "dynamo.select_service", "--port", str(select_port)], env=env)
        select_url = f"http://127.0.0.1:{select_port}"
        try:
            await wait_http(select_url + "/health", 30, proc)
            async with aiohttp.ClientSession() as session:
                model = "default"
                for worker_id, url in enumerate(worker_urls, start=1):
                    info = await _server_info(session, url)
                    endpoint, replay = _events_endpoints(info, url)
                    body: dict[str, Any] = {
                        "worker_id": worker_id,
                        "model_name": model,
                        "routing_group": "default",
                        "endpoint": url,
                        "block_size": int(info.get("page_size") or self.page_size),
                        "data_parallel_start_rank": 0,
                        "data_parallel_size": 1,
                        "kv_events_endpoints": {"0": endpoint},
                    }
                    if replay:
                        body["replay_endpoint"] = replay
                    async with session.post(select_url + "/workers", json=body) as resp:
                        if resp.status >= 300:
                            raise ContenderError(f"registering {url}: HTTP {resp.status} {await resp.text()}")
            await wait_http(select_url + "/ready", 30, proc)
            proxy = _DynamoProxyProcess()
            argv = [
                sys.executable,
                "-m",
                "benchmarks.fleet.dynamo_proxy",
                "--port",
                str(proxy_port),
                "--select-url",
                select_url,
                "--block-size",
                str(self.page_size),
                "--model",
                model,
            ]
            for worker_id, url in enumerate(worker_urls, start=1):
                argv += ["--worker", f"{worker_id}={url}"]
            proxy_proc = proxy._spawn(argv)
            self._proxy = proxy
            await wait_http(f"http://127.0.0.1:{proxy_port}/health", 30, proxy_proc)
        except (ContenderError, aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            failure = self._failure(exc)
            await self.stop()
            raise failure from None
        return f"http://127.0.0.1:{proxy_port}"

    async def stop(self) -> None:
        proxy, self._proxy = self._proxy, None
        if proxy is not None:
            await proxy.stop()
        await super().stop()

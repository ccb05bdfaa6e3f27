"""The worker set: who can serve, at which ``ip:port``, and whether they are healthy now.

Envoy's ORIGINAL_DST cluster needs a literal ``ip:port`` in the destination header, so host names
are resolved once here. Health checking (``/health``) lives in the registry so every consumer (the
router, the load poller, the event subscriber) sees one consistent candidate set. When a worker
turns healthy its ``/model_info`` and ``/server_info`` are read once: the served model name, the
page size and the KV-event publisher come from the worker itself instead of being configured twice.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from extproc.config import HealthConfig, WorkerConfig

__all__ = ["HealthChecker", "Worker", "WorkerRegistry", "parse_worker_url", "resolve_endpoint"]

log = logging.getLogger(__name__)

_WILDCARD_HOSTS = {"", "*", "0.0.0.0", "::", "[::]"}


def parse_worker_url(value: str) -> str:
    """``host:port`` or a URL -> a normalized base URL (``http://`` by default, no trailing slash)."""
    value = value.strip().rstrip("/")
    return value if value.startswith(("http://", "https://")) else "http://" + value


def resolve_endpoint(url: str) -> tuple[str, int]:
    """``http://host:port`` -> (ip, port); Envoy's ORIGINAL_DST accepts only IP literals."""
    parts = urlsplit(url)
    if not parts.hostname:
        raise ValueError(f"worker URL {url!r} has no host")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    ip = socket.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)[0][4][0]
    return ip, port


@dataclass(eq=False)
class Worker:
    """One worker as the router sees it. Identity is the object; ``id`` is its label."""

    id: str
    url: str
    ip: str
    port: int
    model: str | None = None
    kv_events_endpoint: str | None = None
    replay_endpoint: str | None = None
    healthy: bool = True
    in_flight: int = 0
    # Last /server_info (page_size, kv_events, ...) plus "model_info": the last /model_info.
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def endpoint(self) -> str:
        """The ``ip:port`` Envoy connects to (IPv6 bracketed)."""
        return f"[{self.ip}]:{self.port}" if ":" in self.ip else f"{self.ip}:{self.port}"

    @classmethod
    def from_config(cls, config: WorkerConfig) -> Worker:
        ip, port = resolve_endpoint(config.url)
        parts = urlsplit(config.url)
        label = config.name or f"{parts.hostname}:{port}"
        return cls(id=label, url=config.url, ip=ip, port=port, model=config.model,
                   kv_events_endpoint=config.kv_events_endpoint, replay_endpoint=config.replay_endpoint)


HealthListener = Callable[[Worker, bool], None]


class WorkerRegistry:
    """All configured workers; ``candidates()`` is the healthy subset routing may choose from."""

    def __init__(self, workers: list[Worker]) -> None:
        self.workers = workers
        self._listeners: list[HealthListener] = []

    @classmethod
    def from_configs(cls, configs: Iterable[WorkerConfig]) -> WorkerRegistry:
        return cls([Worker.from_config(c) for c in configs])

    def candidates(self, model: str | None = None) -> list[Worker]:
        """Healthy workers serving ``model``.

        A model name no worker reports falls back to every healthy worker: SGLang serves its one
        model whatever name the client sends, so an unknown name is not a reason to refuse.
        """
        healthy = [w for w in self.workers if w.healthy]
        if model is None:
            return healthy
        matching = [w for w in healthy if w.model is None or w.model == model]
        return matching or healthy

    def subscribe(self, listener: HealthListener) -> None:
        """Call ``listener(worker, healthy)`` whenever a worker leaves or rejoins the candidate set."""
        self._listeners.append(listener)

    def set_healthy(self, worker: Worker, healthy: bool) -> None:
        if worker.healthy == healthy:
            return
        worker.healthy = healthy
        log.warning("worker %s is now %s", worker.id, "healthy" if healthy else "UNHEALTHY")
        for listener in self._listeners:
            listener(worker, healthy)


class HealthChecker:
    """Polls each worker's ``/health``; thresholds from ``HealthConfig`` decide when it leaves/returns."""

    def __init__(self, registry: WorkerRegistry, config: HealthConfig) -> None:
        self.registry = registry
        self.config = config
        self._fails: dict[Worker, int] = {}
        self._oks: dict[Worker, int] = {}
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Check every worker once (so a dead worker is never routed to at start-up), then poll."""
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.config.timeout_s))
        results = await asyncio.gather(*(self._probe(w) for w in self.registry.workers))
        for worker, ok in zip(self.registry.workers, results):
            if ok:
                await self._discover(worker)
            self.registry.set_healthy(worker, ok)
        self._task = asyncio.create_task(self._loop(), name="worker-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval_s)
            await asyncio.gather(*(self.check(w) for w in self.registry.workers))

    async def check(self, worker: Worker) -> None:
        """One health probe, applied through the consecutive-result thresholds."""
        ok = await self._probe(worker)
        if ok:
            self._fails[worker] = 0
            self._oks[worker] = self._oks.get(worker, 0) + 1
            if not worker.healthy and self._oks[worker] >= self.config.healthy_after:
                await self._discover(worker)  # it may have restarted with other settings
                self.registry.set_healthy(worker, True)
        else:
            self._oks[worker] = 0
            self._fails[worker] = self._fails.get(worker, 0) + 1
            if worker.healthy and self._fails[worker] >= self.config.unhealthy_after:
                self.registry.set_healthy(worker, False)

    async def _probe(self, worker: Worker) -> bool:
        assert self._session is not None
        try:
            async with self._session.get(worker.url + "/health") as response:
                return response.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    async def _get_json(self, worker: Worker, *paths: str) -> dict[str, Any] | None:
        assert self._session is not None
        for path in paths:  # newer name first, then the older alias
            try:
                async with self._session.get(worker.url + path) as response:
                    if response.status == 200:
                        data = await response.json(content_type=None)
                        if isinstance(data, dict):
                            return data
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
                continue
        return None

    async def _discover(self, worker: Worker) -> None:
        """Read the served model and the server's settings (page size, KV-event publisher)."""
        model_info = await self._get_json(worker, "/model_info", "/get_model_info")
        server_info = await self._get_json(worker, "/server_info", "/get_server_info")
        info: dict[str, Any] = dict(server_info or {})
        if model_info is not None:
            info["model_info"] = model_info
        worker.info = info
        if worker.model is None:
            served = info.get("served_model_name") or (model_info or {}).get("model_path")
            if isinstance(served, str) and served:
                worker.model = served
        events = info.get("kv_events")
        if isinstance(events, dict):
            host = str(events.get("endpoint_host") or "")
            host = worker.ip if host in _WILDCARD_HOSTS else host
            if worker.kv_events_endpoint is None and events.get("endpoint_port_base"):
                worker.kv_events_endpoint = f"tcp://{host}:{events['endpoint_port_base']}"
            if worker.replay_endpoint is None and events.get("replay_endpoint_port_base"):
                worker.replay_endpoint = f"tcp://{host}:{events['replay_endpoint_port_base']}"

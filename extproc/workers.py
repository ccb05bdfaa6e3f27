"""The worker set: who can serve, at which ``ip:port``, and whether they are healthy now.

Envoy's ORIGINAL_DST cluster needs a literal ``ip:port`` in the destination header, so host names
are resolved once here. Health checking (``/health``) lives in the registry so every consumer (the
router, the load poller, the event subscriber) sees one consistent candidate set.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from extproc.config import WorkerConfig

__all__ = ["Worker", "WorkerRegistry", "resolve_endpoint"]


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
    info: dict[str, object] = field(default_factory=dict)  # last /server_info, for block size and events

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


class WorkerRegistry:
    """All configured workers; ``candidates()`` is the healthy subset routing may choose from."""

    def __init__(self, workers: list[Worker]) -> None:
        self.workers = workers

    def candidates(self, model: str | None = None) -> list[Worker]:
        """Healthy workers, serving ``model`` when the worker's model is known."""
        return [w for w in self.workers if w.healthy and (model is None or w.model is None or w.model == model)]

"""The worker set: who can serve, at which ``ip:port``, and whether they are healthy now.

Envoy's ORIGINAL_DST cluster needs a literal ``ip:port`` in the destination header, so host names
are resolved once here. Everything the router learns about a worker hangs off its ``Worker``:
health (``extproc.sync.health``), what it reports about itself (``extproc.sync.discovery``), its
load (``extproc.sync.load``) and its KV events (``extproc.sync.hub``), so every consumer sees one
consistent candidate set.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from extproc.config import WorkerConfig
from prefix_common.addresses import resolve_endpoint, url_port

__all__ = ["Worker", "WorkerRegistry", "disaggregation_role"]

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Worker:
    """One worker as the router sees it. Identity is the object; ``id`` is its label."""

    id: str
    url: str
    ip: str
    port: int
    model: str | None = None
    # Set only by configuration; otherwise the publisher endpoints come from ``info`` (discovery).
    kv_events_endpoint: str | None = None
    replay_endpoint: str | None = None
    # Set only by configuration; otherwise discovery reads them from ``info`` (``disaggregation_role``).
    role: str | None = None  # aggregated | prefill | decode
    bootstrap_port: int | None = None  # a prefill worker's KV bootstrap port
    healthy: bool = True
    # When it last left the candidates after failed health probes (None: healthy, or never was), and
    # whether a refused connection proved it dead: a worker that only missed probes may still serve.
    unhealthy_since: float | None = None
    unreachable: bool = False
    in_flight: int = 0
    rank_in_flight: dict[int, int] = field(default_factory=dict)  # the router's in-flight per DP rank it pinned
    # Last /server_info (page_size, kv_events, ...) plus "model_info": the last /model_info.
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def endpoint(self) -> str:
        """The ``ip:port`` Envoy connects to (IPv6 bracketed)."""
        return f"[{self.ip}]:{self.port}" if ":" in self.ip else f"{self.ip}:{self.port}"

    @classmethod
    def from_config(cls, config: WorkerConfig, ip: str | None = None) -> Worker:
        """The worker a ``workers:`` entry names, at ``ip`` (a resolved address of its host; default: resolved now)."""
        if ip is None:
            ip, port = resolve_endpoint(config.url)
        else:
            port = url_port(config.url)
        return cls(
            id=config.name or f"{urlsplit(config.url).hostname}:{port}",
            url=config.url,
            ip=ip,
            port=port,
            model=config.model,
            kv_events_endpoint=config.kv_events_endpoint,
            replay_endpoint=config.replay_endpoint,
            role=config.role,
            bootstrap_port=config.bootstrap_port,
        )


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


class WorkerRegistry:
    """All known workers; ``candidates()`` is the healthy subset routing may choose from.

    The set changes only through ``reconcile`` (``extproc.sync.sources``: DNS, config reload,
    Kubernetes); every consumer reads ``workers`` afresh each time, so a change shows everywhere at once.
    """

    def __init__(self, workers: list[Worker]) -> None:
        self.workers = workers
        self.listeners: list[Callable[[], None]] = []  # called after the set changed (health checks follow it)

    @classmethod
    def from_configs(cls, configs: Iterable[WorkerConfig]) -> WorkerRegistry:
        return cls([Worker.from_config(c) for c in configs])

    def candidates(self, model: str | None = None) -> list[Worker]:
        """Healthy workers serving ``model``.

        A model name no worker reports falls back to every healthy worker: SGLang serves its one
        model whatever name the client sends, so an unknown name is not a reason to refuse.
        """
        return self._for_model([w for w in self.workers if w.healthy], model)

    def recently_healthy(self, model: str | None, within_s: float) -> list[Worker]:
        """The last healthy set, for when no worker is healthy: those that left less than ``within_s`` ago.

        Like Envoy's panic threshold: when every worker misses a probe at once (a busy fleet answers
        ``/health`` late) they most likely still serve, and refusing every request would turn a blip
        into an outage. Workers that refused a connection are left out.
        """
        now = time.monotonic()
        recent = [
            w
            for w in self.workers
            if not w.healthy
            and not w.unreachable
            and w.unhealthy_since is not None
            and now - w.unhealthy_since < within_s
        ]
        return self._for_model(recent, model)

    @staticmethod
    def _for_model(workers: list[Worker], model: str | None) -> list[Worker]:
        if model is None:
            return workers
        matching = [w for w in workers if w.model is None or w.model == model]
        return matching or workers

    def reconcile(self, desired: list[Worker]) -> tuple[list[Worker], list[Worker]]:
        """Make the set equal to ``desired``; returns (added, removed).

        A worker whose id, URL and address are unchanged keeps its object (health, load, in-flight
        counts, index). A new worker, or one that moved to another address, starts out of the
        candidates: the health checker takes it in after its first good ``/health`` (and reads its
        ``/server_info`` then).
        """
        current = {w.id: w for w in self.workers}
        kept: list[Worker] = []
        added: list[Worker] = []
        removed: list[Worker] = []
        for worker in desired:
            old = current.pop(worker.id, None)
            if old is not None and (old.url, old.ip, old.port) == (worker.url, worker.ip, worker.port):
                kept.append(old)
                continue
            if old is not None:
                removed.append(old)
            worker.healthy = False
            kept.append(worker)
            added.append(worker)
        removed.extend(current.values())
        self.workers = kept
        if added or removed:
            for listener in list(self.listeners):
                listener()
        return added, removed

    def set_healthy(self, worker: Worker, healthy: bool, why: str = "", may_still_serve: bool = False) -> None:
        """Change a worker's health; ``may_still_serve``: it only missed liveness probes (see ``recently_healthy``)."""
        if worker.healthy != healthy:
            worker.healthy = healthy
            worker.unhealthy_since = time.monotonic() if may_still_serve and not healthy else None
            if healthy:
                worker.unreachable = False
            suffix = f" ({why})" if why else ""
            log.warning("worker %s is now %s%s", worker.id, "healthy" if healthy else "UNHEALTHY", suffix)

    def mark_unreachable(self, worker: Worker, why: str) -> None:
        """A sign of death seen outside the health checks (e.g. a refused load poll): out of the candidates now.

        The health checker keeps polling it and brings it back after ``health.healthy_after`` successes.
        """
        worker.unreachable = True
        self.set_healthy(worker, False, why)

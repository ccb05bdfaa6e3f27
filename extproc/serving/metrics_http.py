"""The router's metrics port: ``/metrics`` (its own figures) and ``/metrics/fleet`` (its own plus every worker's).

``/metrics/fleet`` is what the gateway serves as its own ``GET /metrics`` (``envoy_config.metrics_route``):
a client that scrapes the endpoint it benchmarks (aiperf does by default) gets one consistent page
instead of whichever worker Envoy picked, which it would read as counter resets. Each worker's page
is fetched at scrape time (concurrently, ``timeout_s`` each) and every one of its samples gains a
``worker`` label; families of one name are merged so the page stays valid Prometheus text. A worker
that does not answer is left out and counted in ``prefix_router_fleet_scrape_errors``.

Served by aiohttp on the router's event loop, so collectors read the index on the thread that writes it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from extproc.fleet.workers import Worker, WorkerRegistry
from extproc.sync.http import WorkerHttp

__all__ = ["MetricsServer", "merge_families"]

log = logging.getLogger(__name__)

WORKER_LABEL = "worker"


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def merge_families(own: Iterable[Metric], workers: Iterable[tuple[str, Iterable[Metric]]]) -> list[Metric]:
    """The router's families, then each worker's with ``worker=<id>`` on every sample, merged by name.

    A worker family whose type disagrees with one already seen under its name is dropped (a page
    may not declare one name twice).
    """
    merged: dict[str, Metric] = {}
    for family in own:
        merged[family.name] = family
    for worker_id, families in workers:
        for family in families:
            labelled = [
                Sample(s.name, {**s.labels, WORKER_LABEL: worker_id}, s.value, s.timestamp, s.exemplar)
                for s in family.samples
            ]
            existing = merged.get(family.name)
            if existing is None:
                copy = Metric(family.name, family.documentation, family.type, family.unit)
                copy.samples = labelled
                merged[family.name] = copy
            elif existing.type == family.type:
                existing.samples = [*existing.samples, *labelled]
    return list(merged.values())


class MetricsServer:
    """aiohttp server of the router's own registry and the fleet view."""

    def __init__(
        self,
        registry: CollectorRegistry,
        workers: WorkerRegistry,
        host: str,
        port: int,
        http: WorkerHttp,
        timeout_s: float = 2.0,
        extra_routes: Sequence[Callable[[web.Application], None]] = (),
    ) -> None:
        """``extra_routes``: more routes to serve on this port, each added by a call with the application
        (the debug view, ``extproc.serving.debug_http``)."""
        self.registry = registry
        self.workers = workers
        self.host = host
        self.port = port
        self.http = http
        self.timeout_s = timeout_s
        self.scrape_errors = 0
        self.extra_routes = list(extra_routes)
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._own)
        app.router.add_get("/metrics/fleet", self._fleet)
        for add in self.extra_routes:
            add(app)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port, reuse_address=True).start()

    @property
    def bound_port(self) -> int:
        """The port it listens on: ``port``, or the one the kernel picked when ``port`` was 0."""
        if self._runner is not None:
            for address in self._runner.addresses:
                return int(address[1])
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _own(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _fleet(self, request: web.Request) -> web.Response:
        pages = await asyncio.gather(*(self._scrape(w) for w in self.workers.workers))
        workers: list[tuple[str, list[Metric]]] = []
        for worker, text in zip(self.workers.workers, pages):
            if text is None:
                continue
            try:
                workers.append((worker.id, list(text_string_to_metric_families(text))))
            except ValueError as exc:  # a page that is not Prometheus text: leave it out, say so once per scrape
                self.scrape_errors += 1
                log.warning("worker %s: /metrics is not Prometheus text: %s", worker.id, exc)
        families = merge_families(self.registry.collect(), workers)
        families.append(self._errors_family())
        view = CollectorRegistry(auto_describe=False)
        view.register(_Families(families))
        return web.Response(body=generate_latest(view), headers={"Content-Type": CONTENT_TYPE_LATEST})

    def _errors_family(self) -> Metric:
        family = Metric(
            "prefix_router_fleet_scrape_errors", "Worker /metrics pages the fleet view could not include.", "counter"
        )
        family.add_sample("prefix_router_fleet_scrape_errors_total", {}, float(self.scrape_errors))
        return family

    async def _scrape(self, worker: Worker) -> str | None:
        try:
            async with self.http.get(worker.url + "/metrics", self.timeout_s) as response:
                if response.status == 200:
                    return await response.text()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, UnicodeDecodeError):
            pass
        self.scrape_errors += 1
        return None

"""The composition root: every collaborator of one router process, built, started and stopped here.

``RouterApp`` is the router's working parts over a worker registry: the block index and the sync
path that keeps it (KV events, load and tier polling, the replicas' shared state), the decision
pipeline, flow control, telemetry, the router that runs them per request and the launcher of
prefill/decode pairs. ``serve`` adds the process around it: where the workers come from, their
health checks, the gRPC server (ext_proc + health) and the metrics port. Nothing else constructs
these parts, so the order in which they start and stop is written once, here.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from prometheus_client import CollectorRegistry

from extproc.clock import MONOTONIC, Clock
from extproc.config import ConfigError, RouterConfig
from extproc.decision.pipeline import DecisionPipeline
from extproc.exchange.servicer import ExtProcServicer, add_services, mark_ready, mark_serving
from extproc.fleet.index import BlockIndex
from extproc.fleet.workers import WorkerRegistry
from extproc.memory import SHARED_KEY_BYTES, MemoryPlan, SharedBound
from extproc.pd.launch import PairLauncher
from extproc.pd.prefill_leg import PrefillClient
from extproc.routing.decision_log import DecisionLog
from extproc.routing.drift import DriftMeter
from extproc.routing.flow_control import FlowController
from extproc.routing.router import Router
from extproc.routing.telemetry import Telemetry
from extproc.serving.debug_http import DebugRoutes
from extproc.serving.metrics_http import MetricsServer
from extproc.sync.health import HealthChecker
from extproc.sync.http import WorkerHttp
from extproc.sync.hub import EventHub
from extproc.sync.load import LoadTracker
from extproc.sync.shared_state import SharedDecisions
from extproc.sync.sources import WorkerSources
from extproc.sync.tier_stats import TierStatsTracker
from prefix_common.addresses import is_loopback, port_in_use

__all__ = ["RouterApp", "serve"]

log = logging.getLogger("prefix_router")


class RouterApp:
    """The router's parts over ``registry``, wired; ``start``/``stop`` run and end their background work."""

    def __init__(
        self,
        config: RouterConfig,
        registry: WorkerRegistry,
        metrics: CollectorRegistry | None = None,
        http: WorkerHttp | None = None,
        clock: Clock = MONOTONIC,
    ) -> None:
        """``http``: the sync path's client, shared with the caller's health checks (one is made if not given)."""
        self.config = config
        self.registry = registry
        self._owns_http = http is None
        self.http = http or WorkerHttp()
        self.memory = MemoryPlan.from_budget(config.memory.budget_bytes)
        # What the workers' caches hold, and the sync path that keeps it so.
        self.index = BlockIndex(
            config.index, clock=clock, max_blocks=self.memory.index_blocks, max_recent=self.memory.recent_keys
        )
        self.events = EventHub(config.events, registry, self.index, self.http, SharedBound(self.memory.engine_hashes))
        self.loads = LoadTracker(config.load, registry, self.http, clock)
        self.tier_stats = TierStatsTracker(config.load, registry, self.http)
        self.telemetry = Telemetry(config.observability, config.policy.name, metrics)
        self.telemetry.watch_fleet(registry, self.index, self.events)
        self.shared: SharedDecisions | None = None
        if config.shared_state.backend != "none":
            self.shared = SharedDecisions(
                config.shared_state, self.index, metrics=self.telemetry.metrics, max_keys=self.memory.shared_keys
            )
        # The decision, over what the sync path reports.
        self.pipeline = DecisionPipeline.build(
            config, registry, self.index, self.memory, self.loads, self.events, self.tier_stats, clock
        )
        self.loads.listeners.append(self.pipeline.on_load)
        self.index.eviction_listeners.append(self.pipeline.on_evicted)
        registry.listeners.append(self.pipeline.forget_departed)
        self.telemetry.watch_memory(self.memory_usage, self.memory.limits())
        self.flow = FlowController(config.flow_control, self.telemetry.metrics) if config.flow_control.enabled else None
        self._pool = ThreadPoolExecutor(config.server.tokenize_threads, thread_name_prefix="tokenize")
        # What the debug view shows of recent decisions, and the measure of the index's drift.
        self.decisions = DecisionLog(config.debug.decisions)
        self.drift = DriftMeter(config.observability.drift_sample_rate, self.telemetry, self.decisions, registry)
        self.router = Router(
            config,
            registry,
            self.pipeline,
            self.loads,
            self.telemetry,
            self._pool,
            self.flow,
            self.shared,
            self.decisions,
            self.drift,
        )
        # Prefill/decode pairs: entered only for a decision that is disaggregated.
        self.prefill_client = PrefillClient(config.pd)
        self.pairs = PairLauncher(
            self.router, registry, self.telemetry, self.prefill_client, config.pd, config.server.fallback_endpoints
        )

    def memory_usage(self) -> dict[str, int]:
        """Estimated bytes each part of the memory budget holds now (``/metrics`` reads it at scrape time)."""
        usage = self.index.memory()
        usage["engine_hashes"] = self.events.memory()
        usage["key_cache"] = self.pipeline.prompts.key_cache_bytes
        usage["piece_cache"] = self.pipeline.prompts.piece_cache_bytes
        usage["shared_state"] = self.shared.queued_keys * SHARED_KEY_BYTES if self.shared is not None else 0
        usage["policy"] = self.pipeline.policy.memory_bytes() + self.pipeline.decode_policy.memory_bytes()
        return usage

    def servicer(self) -> ExtProcServicer:
        """The ext_proc servicer over this router, with pairs launched by this app."""
        return ExtProcServicer(self.config, self.router, self.pairs.launch)

    async def start(self) -> None:
        """Start background work (event subscriptions, load and tier polling, shared state)."""
        await self.events.start()
        await self.loads.start()
        await self.tier_stats.start()
        if self.shared is not None:
            await self.shared.start()

    async def stop(self) -> None:
        """Stop background work, close the clients and flush spans."""
        if self.shared is not None:
            await self.shared.stop()
        await self.tier_stats.stop()
        await self.loads.stop()
        await self.events.stop()
        await self.prefill_client.close()
        if self._owns_http:
            await self.http.close()
        if self.flow is not None:
            self.flow.stop()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.telemetry.shutdown()


def _credentials(config: RouterConfig) -> grpc.ServerCredentials | None:
    server = config.server
    if server.tls_cert is None or server.tls_key is None:
        return None
    try:
        key, cert = server.tls_key.read_bytes(), server.tls_cert.read_bytes()
        client_ca = server.tls_client_ca.read_bytes() if server.tls_client_ca else None
    except OSError as exc:
        raise ConfigError(f"cannot read TLS file {exc.filename}: {exc.strerror}") from exc
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


async def serve(
    config: RouterConfig,
    stop: asyncio.Event | None = None,
    config_path: Path | None = None,
    reload: Callable[[], RouterConfig] | None = None,
    reload_now: asyncio.Event | None = None,
) -> None:
    """Serve until ``stop`` is set.

    ``reload`` re-reads the configuration (``config_path`` is watched for changes; setting
    ``reload_now``, as SIGHUP does, forces a reload). Start order: the worker set (resolved once),
    the gRPC server's health service (alive, not ready), the metrics port, health checks, the
    router's sync path, the gRPC server, then ready; shutdown runs it backwards after
    ``server.grace_period_s`` for in-flight streams.
    """
    stop = stop or asyncio.Event()
    registry = WorkerRegistry([])
    sources = WorkerSources(config, registry, config_path, reload)
    await sources.start()  # resolve every worker once before health checks and subscriptions start
    http = WorkerHttp()  # one client for every request the router itself sends to the workers
    health = HealthChecker(registry, config.health, http)
    app = RouterApp(config, registry, http=http)
    # A buffered body arrives in one message, a streamed one in chunks as large as Envoy has buffered:
    # gRPC's 4 MiB default would refuse bodies the router accepts (the headers and framing add a little).
    message_limit = 2 * config.server.max_body_bytes + 1024 * 1024
    server = grpc.aio.server(
        options=[
            ("grpc.so_reuseport", 0),
            ("grpc.max_receive_message_length", message_limit),
            ("grpc.max_send_message_length", message_limit),
        ]
    )
    health_servicer = add_services(server, app.servicer())
    await mark_serving(health_servicer, True)  # liveness: alive from the first answer on
    await mark_ready(health_servicer, False)  # readiness: once workers, health checks and sync have started
    address = f"{config.server.host}:{config.server.port}"
    credentials = _credentials(config)
    if port_in_use(config.server.host, config.server.port):
        raise ConfigError(f"cannot listen on {address}: address already in use")
    try:
        bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError as exc:
        raise ConfigError(f"cannot listen on {address}: {exc}") from exc
    if not bound:
        raise ConfigError(f"cannot listen on {address}")
    address = f"{config.server.host}:{bound}"  # the port itself when port 0 asked for any free one
    if credentials is None and not is_loopback(config.server.host):
        log.warning(
            "ext_proc on %s is plaintext and reachable from other hosts: prompts cross the network in clear text "
            "and whoever reaches the port can ask for routing decisions. Keep it on a private network only Envoy "
            "reaches (a compose network, a pod network with a NetworkPolicy), or set server.tls_cert and "
            "server.tls_key (--tls-cert, --tls-key; tls_client_ca for mTLS)",
            address,
        )
    metrics: MetricsServer | None = None
    if config.server.metrics_port is not None:
        debug = DebugRoutes(app, config.server.host)
        metrics = MetricsServer(
            app.telemetry.metrics,
            registry,
            config.server.host,
            config.server.metrics_port,
            http,
            extra_routes=[debug.install],
        )
        try:
            await metrics.start()
        except OSError as exc:
            raise ConfigError(
                f"cannot serve metrics on {config.server.host}:{config.server.metrics_port}: {exc}"
            ) from exc
    await health.start()
    await app.start()
    await server.start()
    await mark_ready(health_servicer, True)
    app.telemetry.set_ready(True)
    healthy = sum(w.healthy for w in registry.workers)
    log.info(
        "ext_proc listening on %s (%s, policy %s, %d/%d workers healthy); metrics %s",
        address,
        "TLS" if credentials else "plaintext",
        config.policy.name,
        healthy,
        len(registry.workers),
        f"http://{config.server.host}:{metrics.bound_port}/metrics" if metrics is not None else "off",
    )
    forward = asyncio.create_task(_forward(reload_now, sources)) if reload_now is not None else None
    try:
        await stop.wait()
    finally:
        if forward is not None:
            forward.cancel()
        await sources.stop()
        log.info("shutting down: %.1fs grace for in-flight requests", config.server.grace_period_s)
        await mark_ready(health_servicer, False)
        app.telemetry.set_ready(False)
        await mark_serving(health_servicer, False)
        await server.stop(config.server.grace_period_s)
        await app.stop()
        await health.stop()
        if metrics is not None:
            await metrics.stop()
        await http.close()


async def _forward(reload_now: asyncio.Event, sources: WorkerSources) -> None:
    while True:
        await reload_now.wait()
        reload_now.clear()
        sources.reload_soon()

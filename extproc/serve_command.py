"""``prefix-router serve``: run the ext_proc routing service for an Envoy.

Wires the pieces and owns the process lifecycle: config (file < env < flags), the worker set (kept
live by ``extproc.sync.sources``: DNS, config reload, Kubernetes) with health checks, the router,
the gRPC server (ext_proc + health) and the metrics port. SIGTERM or Ctrl-C marks the health
service NOT_SERVING and gives in-flight streams ``grace_period_s`` to end; SIGHUP reloads the config.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from extproc.addresses import parse_worker_url
from extproc.config import ConfigError, RouterConfig, WorkerConfig, load_config
from extproc.metrics_http import MetricsServer
from extproc.policies import PolicyError
from extproc.router import Router
from extproc.serve_processes import supervise
from extproc.servicer import ExtProcServicer, add_services, mark_ready, mark_serving
from extproc.sync.health import HealthChecker
from extproc.sync.http import WorkerHttp
from extproc.sync.sources import WorkerSources
from extproc.sync.workers import WorkerRegistry

__all__ = ["build_config", "configure", "main", "run", "serve_one"]

log = logging.getLogger("prefix_router")


def configure(parser: argparse.ArgumentParser) -> None:
    # Flags left out do not override the config file or environment (hence SUPPRESS, not None).
    unset = argparse.SUPPRESS
    parser.add_argument(
        "--config",
        type=Path,
        default=unset,
        help="YAML router config (sections as in docs/gateway.md); environment and flags override it.",
    )
    parser.add_argument(
        "--worker",
        action="append",
        default=[],
        metavar="URL",
        help="Worker base URL or host:port; repeat for each worker (added to the config's workers).",
    )
    parser.add_argument(
        "--host",
        default=unset,
        help="Bind address of the gRPC port (default 127.0.0.1: only a local Envoy can connect).",
    )
    parser.add_argument("--port", type=int, default=unset, help="gRPC port for ext_proc + health (default 9002).")
    parser.add_argument(
        "--metrics-port", type=int, default=unset, help="Prometheus /metrics port (default 9102; 0 disables)."
    )
    parser.add_argument(
        "--policy", default=unset, help="Routing policy: prefix-aware (default), session, least-load, round-robin, ..."
    )
    parser.add_argument(
        "--max-body-bytes", type=int, default=unset, help="Larger request bodies are answered 413 (default 8 MiB)."
    )
    parser.add_argument("--tls-cert", type=Path, default=unset, help="PEM certificate: serve the gRPC port over TLS.")
    parser.add_argument("--tls-key", type=Path, default=unset, help="PEM private key for --tls-cert.")
    parser.add_argument(
        "--tls-client-ca", type=Path, default=unset, help="Require client certificates signed by this CA (mTLS)."
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        metavar="N",
        help=(
            "Run N router processes, one per core, on --port, --port + 1, ... (metrics ports likewise); list them "
            "all to Envoy with `prefix-router envoy-config --router-processes N`. A process that dies is restarted."
        ),
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def build_config(args: argparse.Namespace) -> RouterConfig:
    """Flags -> ``load_config`` overrides (only the ones given, so file and env values survive)."""
    server: dict[str, Any] = {}
    for flag, key in (
        ("host", "host"),
        ("port", "port"),
        ("max_body_bytes", "max_body_bytes"),
        ("tls_cert", "tls_cert"),
        ("tls_key", "tls_key"),
        ("tls_client_ca", "tls_client_ca"),
    ):
        value = getattr(args, flag, None)
        if value is not None:
            server[key] = value
    if getattr(args, "metrics_port", None) is not None:
        server["metrics_port"] = args.metrics_port or None
    overrides: dict[str, Any] = {"server": server} if server else {}
    if getattr(args, "policy", None):
        overrides["policy"] = {"name": args.policy}
    config = load_config(getattr(args, "config", None), overrides)
    if args.worker:
        config.workers = [*config.workers, *(WorkerConfig(url=parse_worker_url(w)) for w in args.worker)]
    if (config.server.tls_cert is None) != (config.server.tls_key is None):
        raise ConfigError("server.tls_cert and server.tls_key must be given together")
    if config.server.tls_client_ca is not None and config.server.tls_cert is None:
        raise ConfigError("server.tls_client_ca needs server.tls_cert and server.tls_key")
    return config


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


async def run(
    config: RouterConfig,
    stop: asyncio.Event | None = None,
    config_path: Path | None = None,
    reload: Callable[[], RouterConfig] | None = None,
    reload_now: asyncio.Event | None = None,
) -> None:
    """Serve until ``stop`` is set (or SIGTERM/SIGINT when running as the main program).

    ``reload`` re-reads the configuration (``config_path`` is watched for changes; setting
    ``reload_now``, as SIGHUP does, forces a reload).
    """
    stop = stop or asyncio.Event()
    registry = WorkerRegistry([])
    sources = WorkerSources(config, registry, config_path, reload)
    await sources.start()  # resolve every worker once before health checks and subscriptions start
    http = WorkerHttp()  # one client for every request the router itself sends to the workers
    health = HealthChecker(registry, config.health, http)
    router = Router(config, registry, http=http)
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
    health_servicer = add_services(server, ExtProcServicer(config, router))
    await mark_serving(health_servicer, True)  # liveness: alive from the first answer on
    await mark_ready(health_servicer, False)  # readiness: once workers, health checks and sync have started
    address = f"{config.server.host}:{config.server.port}"
    credentials = _credentials(config)
    try:
        bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError as exc:
        raise ConfigError(f"cannot listen on {address}: {exc}") from exc
    if not bound:
        raise ConfigError(f"cannot listen on {address}")
    metrics: MetricsServer | None = None
    if config.server.metrics_port:
        metrics = MetricsServer(
            router.telemetry.metrics, registry, config.server.host, config.server.metrics_port, http
        )
        try:
            await metrics.start()
        except OSError as exc:
            raise ConfigError(
                f"cannot serve metrics on {config.server.host}:{config.server.metrics_port}: {exc}"
            ) from exc
    await health.start()
    await router.start()
    await server.start()
    await mark_ready(health_servicer, True)
    router.telemetry.set_ready(True)
    healthy = sum(w.healthy for w in registry.workers)
    log.info(
        "ext_proc listening on %s (%s, policy %s, %d/%d workers healthy)",
        address,
        "TLS" if credentials else "plaintext",
        config.policy.name,
        healthy,
        len(registry.workers),
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
        router.telemetry.set_ready(False)
        await mark_serving(health_servicer, False)
        await server.stop(config.server.grace_period_s)
        await router.stop()
        await health.stop()
        if metrics is not None:
            await metrics.stop()
        await http.close()


async def _forward(reload_now: asyncio.Event, sources: WorkerSources) -> None:
    while True:
        await reload_now.wait()
        reload_now.clear()
        sources.reload_soon()


def main(args: argparse.Namespace) -> int:
    processes = getattr(args, "processes", 1)
    if processes < 1:
        print("prefix-router serve: --processes must be at least 1", file=sys.stderr)
        return 2
    if processes == 1:
        return serve_one(args, 0)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = build_config(args)
    except ConfigError as exc:
        print(f"prefix-router serve: {exc}", file=sys.stderr)
        return 2
    return supervise(serve_one, args, processes, config.server.port)


def serve_one(args: argparse.Namespace, index: int) -> int:
    """One router process; ``index`` > 0 (``--processes``) moves its ports up by ``index``."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def configured() -> RouterConfig:
        config = build_config(args)
        config.server.port += index
        if config.server.metrics_port:
            config.server.metrics_port += index
        return config

    try:
        config = configured()
    except ConfigError as exc:
        print(f"prefix-router serve: {exc}", file=sys.stderr)
        return 2
    if not (config.workers or config.discovery.dns or config.discovery.kubernetes):
        print(
            "prefix-router serve: no workers; give --worker URL (repeatable), or 'workers:', 'discovery.dns' or "
            "'discovery.kubernetes' in --config",
            file=sys.stderr,
        )
        return 2
    path = getattr(args, "config", None)

    async def _main() -> None:
        stop, reload_now = asyncio.Event(), asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        loop.add_signal_handler(signal.SIGHUP, reload_now.set)  # reload the config file (workers, DNS names)
        await run(config, stop, path, configured, reload_now)

    try:
        asyncio.run(_main())
    except (ConfigError, PolicyError, ValueError, OSError) as exc:
        print(f"prefix-router serve: {exc}", file=sys.stderr)
        return 2
    return 0

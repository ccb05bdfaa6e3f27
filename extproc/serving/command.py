"""``prefix-router serve``: run the ext_proc routing service for an Envoy.

Owns the process: flags and the config (file < env < flags), logging, signals, ``--processes N``.
What runs is ``extproc.serving.app.serve`` (the composition root). SIGTERM or Ctrl-C marks the health
service NOT_SERVING and gives in-flight streams ``grace_period_s`` to end; SIGHUP reloads the config.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path
from typing import Any

from extproc.config import ConfigError, RouterConfig, WorkerConfig, load_config
from extproc.decision.policies import PolicyError
from extproc.serving.app import serve
from extproc.serving.processes import supervise
from prefix_common.addresses import parse_worker_url
from prefix_common.logs import add_log_flags, configure_logging, json_line

__all__ = ["build_config", "configure", "main", "serve_one"]

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
        help="A worker (host:port or URL); repeat for each (added to the config's workers).",
    )
    parser.add_argument(
        "--host",
        default=unset,
        help="Bind address of the gRPC port (default 127.0.0.1: only a local Envoy can connect).",
    )
    parser.add_argument(
        "--port", type=int, default=unset, help="gRPC port for ext_proc + health (default 9002; 0: any free port)."
    )
    metrics = parser.add_mutually_exclusive_group()
    metrics.add_argument(
        "--metrics-port", type=int, default=unset, help="Prometheus /metrics port (default 9102; 0: any free port)."
    )
    metrics.add_argument(
        "--no-metrics", action="store_true", default=unset, help="Serve no metrics port (server.metrics_port: null)."
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
    add_log_flags(parser)


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
    if getattr(args, "no_metrics", False):
        server["metrics_port"] = None
    elif getattr(args, "metrics_port", None) is not None:
        server["metrics_port"] = args.metrics_port
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


def main(args: argparse.Namespace) -> int:
    processes = getattr(args, "processes", 1)
    if processes < 1:
        return _refuse(args, "--processes must be at least 1")
    if processes == 1:
        return serve_one(args, 0)
    configure_logging(args.log_level, args.log_format)
    try:
        config = build_config(args)
    except ConfigError as exc:
        return _refuse(args, str(exc))
    if config.server.port == 0:  # Envoy lists the N ports: they must be known, not picked by the kernel
        return _refuse(args, "--processes needs a fixed --port (the N ports from it), not 0")
    return supervise(serve_one, args, processes, config.server.port)


def serve_one(args: argparse.Namespace, index: int) -> int:
    """One router process; ``index`` > 0 (``--processes``) moves its ports up by ``index``."""
    configure_logging(args.log_level, args.log_format)

    def configured() -> RouterConfig:
        config = build_config(args)
        config.server.port += index
        if config.server.metrics_port:
            config.server.metrics_port += index
        return config

    try:
        config = configured()
    except ConfigError as exc:
        return _refuse(args, str(exc))
    if not (config.workers or config.discovery.dns or config.discovery.kubernetes):
        return _refuse(
            args,
            "no workers; give --worker URL (repeatable), or 'workers:', 'discovery.dns' or "
            "'discovery.kubernetes' in --config",
        )
    path = getattr(args, "config", None)

    async def _main() -> None:
        stop, reload_now = asyncio.Event(), asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        loop.add_signal_handler(signal.SIGHUP, reload_now.set)  # reload the config file (workers, DNS names)
        await serve(config, stop, path, configured, reload_now)

    try:
        asyncio.run(_main())
    except (ConfigError, PolicyError, ValueError, OSError) as exc:
        return _refuse(args, str(exc))
    return 0


def _refuse(args: argparse.Namespace, message: str) -> int:
    """Say why the router will not run, in the log format asked for (a pipeline fed ``--log-format json`` must
    not meet a bare line), and give the exit status for a bad setup."""
    if getattr(args, "log_format", "text") == "json":
        print(json_line(log.name, message, "error"), file=sys.stderr)
    else:
        print(f"prefix-router serve: {message}", file=sys.stderr)
    return 2

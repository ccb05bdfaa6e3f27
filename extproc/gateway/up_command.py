"""``prefix-router up``: the local gateway stack (simulated workers + router + Envoy) in the foreground.

Starts a ``GatewayStack``, prints where everything listens, then one access-log line per request
until Ctrl-C or SIGTERM, and stops Envoy, the router and the workers in that order. Meanwhile it
supervises them: a child that dies is restarted (on the same ports, with back-off) and said so on
stderr; only a crash loop (one child dying again and again) stops the stack, naming the child.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from pathlib import Path
from typing import Any

from extproc.addresses import LOOPBACK, split_host_port
from extproc.gateway.stack import CrashLoopError, GatewayStack

__all__ = ["configure", "main"]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sim-workers", type=int, default=4, help="How many simulated SGLang workers to start.")
    parser.add_argument(
        "--worker",
        action="append",
        default=[],
        metavar="URL",
        help="Front this running worker instead (repeatable; then no simulated workers start).",
    )
    parser.add_argument("--port", type=int, default=8080, help="Gateway port (Envoy's listener).")
    parser.add_argument("--host", default=LOOPBACK, help="Gateway bind address.")
    parser.add_argument("--policy", help="Routing policy (default: the config's, prefix-aware).")
    parser.add_argument("--config", type=Path, help="Router YAML config (see docs/gateway.md).")
    parser.add_argument("--router-port", type=int, default=0, help="Router gRPC port (0: any free port).")
    parser.add_argument("--metrics-port", type=int, default=0, help="Router /metrics port (0: any free port).")
    parser.add_argument("--admin-port", type=int, default=0, help="Envoy admin port (0: any free port).")
    parser.add_argument(
        "--timeout-ms",
        type=int,
        default=500,
        help="Envoy's ext_proc message timeout: a slower router is bypassed (fail-open).",
    )
    parser.add_argument(
        "--sim-speedup",
        type=float,
        default=1.0,
        help="Simulated workers run this many times faster than the GPU they model.",
    )
    parser.add_argument(
        "--sim-profile",
        default="llama-3.1-8b-h100",
        help="Timing profile of the simulated workers, or a comma-separated list cycled over them "
        "(a mixed fleet, e.g. llama-3.1-8b-h100,llama-3.1-8b-a100); see `prefix-router sim-worker --help`.",
    )
    parser.add_argument("--quiet", action="store_true", help="Do not print one access-log line per request.")
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=5,
        help="A child that dies this many times within a minute is a crash loop: the stack stops, saying which.",
    )
    parser.add_argument("--log-dir", type=Path, help="Keep the children's logs here (default: a temp dir).")


def _banner(stack: GatewayStack) -> str:
    workers = "\n".join(f"    {url}" for url in stack.worker_urls)
    return (
        f"""
prefix-router gateway is up: {stack.url}

  workers ({len(stack.worker_urls)}):
{workers}
  router:  {stack.router_address} (ext_proc gRPC)  metrics: http://{LOOPBACK}:{stack.metrics_port}/metrics
  envoy:   admin {stack.admin_url}   logs: {stack.log_dir}

Try it (the x-upstream-host response header names the worker that served):
  curl -i {stack.url}/v1/chat/completions -H 'content-type: application/json' \\
    -d '{{"model": "default", "messages": [{{"role": "user", "content": "Hello!"}}]}}'

Below, one line per request: METHOD PATH -> WORKER STATUS TIME (ROUTE, DETAILS). ROUTE is router-picked
when the router chose the worker, fail-open when Envoy's least-request route served a generation request
(router down or slow), pass-through for other paths. DETAILS is via_upstream when a worker answered; a
worker of "-" with DETAILS prefix_router means the router answered itself (400/413/503 errors), so the
request never reached a worker. A part that dies is restarted (said below). Ctrl-C stops everything.
""".rstrip()
        + "\n"
    )


def _say(line: str) -> None:
    print(f"prefix-router up: {line}", file=sys.stderr, flush=True)


async def _run_up(args: argparse.Namespace) -> int:
    options: dict[str, Any] = {}
    if args.sim_speedup != 1.0:
        options["speedup"] = args.sim_speedup
    if args.sim_profile:
        options["profile"] = args.sim_profile
    stack = GatewayStack(
        worker_urls=args.worker,
        sim_workers=0 if args.worker else args.sim_workers,
        sim_worker_options=options,
        port=args.port,
        host=args.host,
        policy=args.policy,
        config=args.config,
        router_port=args.router_port,
        metrics_port=args.metrics_port,
        admin_port=args.admin_port,
        timeout_ms=args.timeout_ms,
        access_log=not args.quiet,
        log_dir=args.log_dir,
        own_sessions=True,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # SIGHUP: the terminal went away
        loop.add_signal_handler(sig, stop.set)
    starting = asyncio.create_task(stack.start())
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():  # Ctrl-C during start-up
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await starting
        await stack.stop()
        return 130
    if starting.exception() is not None:
        stopping.cancel()
        print(f"prefix-router up: {starting.exception()}", file=sys.stderr)
        return 1
    print(_banner(stack), flush=True)
    status = 0
    try:
        await stack.supervise(stop, _say, max_restarts=args.max_restarts)
    except CrashLoopError as exc:
        print(f"prefix-router up: {exc}", file=sys.stderr, flush=True)
        status = 1
    print("\nstopping: envoy, router, workers ...", file=sys.stderr, flush=True)
    stopping.cancel()
    await stack.stop()
    print("stopped.", file=sys.stderr)
    return status


def main(args: argparse.Namespace) -> int:
    if args.worker:
        try:
            [split_host_port(w) for w in args.worker]
        except ValueError as exc:
            print(f"prefix-router up: {exc}", file=sys.stderr)
            return 2
    elif args.sim_workers < 1:
        print("prefix-router up: --sim-workers must be at least 1 (or give --worker URL)", file=sys.stderr)
        return 2
    else:
        from sglang_workers.timing import profile_list

        try:
            args.sim_profile = ",".join(profile_list(args.sim_profile))
        except ValueError as exc:
            print(f"prefix-router up: --sim-profile: {exc}", file=sys.stderr)
            return 2
    return asyncio.run(_run_up(args))

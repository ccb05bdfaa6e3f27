"""``prefix-router up``: the local gateway stack (workers + router + Envoy) in the foreground.

The workers are simulated (``--engine sim``, the default), real SGLang 0.5.23 on this machine's CPU
(``--engine sglang-cpu``, after ``make sglang-cpu``) or ones you run (``--worker URL``). Starts a
``GatewayStack``, prints where everything listens, then one access-log line per request until Ctrl-C
or SIGTERM, and stops Envoy, the router and the workers in that order. Meanwhile it supervises them: a
child that dies is restarted (on the same ports, with back-off) and said so on stderr; only a crash
loop (one child dying again and again) stops the stack, naming the child.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import re
import signal
import tempfile
from pathlib import Path
from typing import Any

from prefix_common.addresses import LOOPBACK, split_host_port
from prefix_common.logs import add_log_flags, configure_logging, json_line
from prefix_router.stack import CrashLoopError, GatewayStack

__all__ = ["configure", "main"]


log = logging.getLogger(__name__)

ENGINES = ("sim", "sglang-cpu")
DEFAULT_WORKERS = {"sim": 4, "sglang-cpu": 2}  # a CPU worker takes ~4 GB and a core while busy


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--engine",
        choices=ENGINES,
        default="sim",
        help=(
            "What the workers are: sim = simulated SGLang workers (no GPU, starts in a second); sglang-cpu = real "
            "SGLang 0.5.23 serving a tiny random-weight Llama on this CPU (needs `make sglang-cpu`; ~40-100 s to "
            "start, ~4 GB each)."
        ),
    )
    parser.add_argument(
        "--workers", type=int, default=None, help="How many workers to start (default: 4 simulated, 2 sglang-cpu)."
    )
    parser.add_argument(
        "--pd",
        metavar="PxD",
        type=pd_shape,
        default=None,
        help=(
            "Start a prefill/decode disaggregated fleet instead: e.g. 1P1D (one prefill, one decode worker), 2P2D, "
            "3P1D, of the chosen --engine (sglang-cpu: ~3.5 GB and ~40 s per worker). The router pairs them."
        ),
    )
    parser.add_argument(
        "--worker",
        action="append",
        default=[],
        metavar="URL",
        help="Front this running worker instead (host:port or URL; repeatable; then no workers start).",
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
        "--body-mode",
        choices=["buffered", "streamed"],
        default="buffered",
        help="Envoy's ext_proc body mode: buffered, or streamed (FULL_DUPLEX_STREAMED, as GIE gateways run it).",
    )
    # --speedup and --profile shape simulated workers only: None (not given) lets up refuse them for other fleets.
    parser.add_argument(
        "--speedup",
        type=float,
        help="Simulated workers run this many times faster than the GPU they model (as sim-worker's --speedup; "
        "default 1).",
    )
    parser.add_argument(
        "--profile",
        help="Timing profile of the simulated workers, or a comma-separated list cycled over them "
        "(a mixed fleet, e.g. llama-3.1-8b-h100,llama-3.1-8b-a100); see `prefix-router sim-worker --help` "
        "(default llama-3.1-8b-h100).",
    )
    # The names these flags had before they matched sim-worker's and bench's: accepted, not advertised.
    legacy: tuple[tuple[str, str, type], ...] = (
        ("--sim-workers", "workers", int),
        ("--sim-speedup", "speedup", float),
        ("--sim-profile", "profile", str),
    )
    for flag, dest, kind in legacy:
        parser.add_argument(flag, dest=dest, type=kind, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    parser.add_argument("--quiet", action="store_true", help="Do not print one access-log line per request.")
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=5,
        help="A child that dies this many times within a minute is a crash loop: the stack stops, saying which.",
    )
    parser.add_argument("--log-dir", type=Path, help="Keep the children's logs here (default: a temp dir).")
    add_log_flags(parser)
    parser.epilog = (
        "--log-level and --log-format apply to up's own messages and are passed on to the router and the "
        "simulated workers (their logs are in --log-dir); with --log-format json the banner and each access-log "
        "line are JSON objects too, one per line on stdout."
    )


ENGINE_LABELS = {"sim": "simulated SGLang", "sglang-cpu": "real SGLang 0.5.23 on CPU (tiny random-weight Llama)"}


def _banner(stack: GatewayStack, engine: str) -> str:
    roles = _pd_roles(stack)
    workers = "\n".join(f"    {url}{roles.get(url, '')}" for url in stack.worker_urls)
    label = ENGINE_LABELS[engine] if stack.sim_workers or stack.sglang_cpu_workers else "yours"
    model = '"tiny-llama"' if engine == "sglang-cpu" else '"default"'
    return (
        f"""
prefix-router gateway is up: {stack.url}

  workers ({len(stack.worker_urls)}, {label}):
{workers}
  router:  {stack.router_address} (ext_proc gRPC)  metrics: http://{LOOPBACK}:{stack.metrics_port}/metrics
  envoy:   admin {stack.admin_url}   logs: {stack.log_dir}

Try it (the x-upstream-host response header names the worker that served):
  curl -i {stack.url}/v1/chat/completions -H 'content-type: application/json' \\
    -d '{{"model": {model}, "messages": [{{"role": "user", "content": "Hello!"}}]}}'

Below, one line per request: METHOD PATH -> WORKER STATUS TIME (ROUTE, DETAILS). ROUTE is router-picked
when the router chose the worker, fail-open when Envoy's least-request route served a generation request
(router down or slow), pass-through for other paths. DETAILS is via_upstream when a worker answered; a
worker of "-" with DETAILS prefix_router means the router answered itself (400/413/503 errors), so the
request never reached a worker. A part that dies is restarted (said below). Ctrl-C stops everything.
""".rstrip()
        + "\n"
    )


_PD_SHAPE = re.compile(r"(\d+)P(\d+)D", re.IGNORECASE)


def pd_shape(text: str) -> tuple[int, int]:
    """``2P1D`` -> (2, 1): prefill and decode workers; at least one of each."""
    match = _PD_SHAPE.fullmatch(text.strip())
    if match is None or min(int(match[1]), int(match[2])) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a PD fleet shape like 1P1D or 2P2D (at least 1 of each)")
    return int(match[1]), int(match[2])


def worker_count(args: argparse.Namespace) -> int:
    """--workers, else the engine's default."""
    return int(args.workers) if args.workers is not None else DEFAULT_WORKERS[args.engine]


def sglang_cpu_router_config(path: Path, model_dir: str) -> Path:
    """The router's view of the CPU workers' model: its tokenizer (the model's own) and vocabulary size."""
    from sglang_workers.real.installation import TINY_MODEL_NAME, TINY_MODEL_VOCAB

    path.write_text(
        f"models:\n  - name: {TINY_MODEL_NAME}\n    tokenizer: {model_dir}\n    vocab_size: {TINY_MODEL_VOCAB}\n"
    )
    return path


def _pd_roles(stack: GatewayStack) -> dict[str, str]:
    """`` (prefill)`` / `` (decode)`` after each started worker's URL in a PD stack."""
    if stack.pd is None:
        return {}
    started = [*stack.sim_processes, *stack.sglang_cpu_processes]
    prefill = stack.pd[0]
    return {w.url: " (prefill)" if i < prefill else " (decode)" for i, w in enumerate(started)}


def _say(line: str) -> None:
    """A child's death, restart or return: worth a warning (a healthy stack says nothing)."""
    log.warning(line)


def _announce(stack: GatewayStack, args: argparse.Namespace) -> None:
    """The banner on stdout: text for a person, or one JSON object with the same addresses for a log pipeline."""
    if args.log_format == "text":
        print(_banner(stack, args.engine), flush=True)
        return
    line = json_line(
        log.name,
        f"prefix-router gateway is up: {stack.url}",
        url=stack.url,
        workers=stack.worker_urls,
        router=stack.router_address,
        metrics=f"http://{LOOPBACK}:{stack.metrics_port}/metrics",
        admin=stack.admin_url,
        log_dir=str(stack.log_dir),
    )
    print(line, flush=True)


async def _run_up(args: argparse.Namespace) -> int:
    options: dict[str, Any] = {}
    if args.speedup is not None:
        options["speedup"] = args.speedup
    if args.profile is not None:
        options["profile"] = args.profile
    options["log_level"], options["log_format"] = args.log_level, args.log_format
    count = 0 if args.worker else worker_count(args)
    config = args.config
    cpu_config: Path | None = None
    if args.engine == "sglang-cpu" and not args.worker and config is None:
        from sglang_workers.real.installation import find_install

        install = find_install()
        assert install is not None  # main() checked
        fd, name = tempfile.mkstemp(prefix="prefix-router-sglang-cpu-", suffix=".yaml")
        os.close(fd)
        cpu_config = config = sglang_cpu_router_config(Path(name), str(install.model_dir))
    try:
        return await _serve(args, options, count, config)
    finally:
        if cpu_config is not None:
            cpu_config.unlink(missing_ok=True)


async def _serve(args: argparse.Namespace, options: dict[str, Any], count: int, config: Path | None) -> int:
    cpu = args.engine == "sglang-cpu"
    stack = GatewayStack(
        worker_urls=args.worker,
        sim_workers=0 if cpu else count,
        sim_worker_options=options,
        sglang_cpu_workers=count if cpu else 0,
        pd=args.pd,
        port=args.port,
        host=args.host,
        policy=args.policy,
        config=config,
        router_port=args.router_port,
        metrics_port=args.metrics_port,
        admin_port=args.admin_port,
        timeout_ms=args.timeout_ms,
        access_log=not args.quiet,
        access_log_json=args.log_format == "json",
        router_args=["--log-level", args.log_level, "--log-format", args.log_format],
        log_dir=args.log_dir,
        own_sessions=True,
        body_mode=args.body_mode,
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
        log.error("%s", starting.exception())
        return 1
    _announce(stack, args)
    status = 0
    try:
        await stack.supervise(stop, _say, max_restarts=args.max_restarts)
    except CrashLoopError as exc:
        log.error("%s", exc)
        status = 1
    log.info("stopping: envoy, router, workers ...")
    stopping.cancel()
    await stack.stop()
    log.info("stopped.")
    return status


def main(args: argparse.Namespace) -> int:
    configure_logging(args.log_level, args.log_format, text_format="prefix-router up: %(message)s")
    if args.pd is not None and (args.worker or args.workers is not None):
        log.error("--pd sets the fleet itself; give it without --worker / --workers")
        return 2
    sim_only = [flag for flag, value in (("--profile", args.profile), ("--speedup", args.speedup)) if value is not None]
    if sim_only and (args.worker or args.engine != "sim"):
        log.error(
            "%s: only simulated workers take it, and with --worker or --engine sglang-cpu none start",
            " and ".join(sim_only),
        )
        return 2
    if args.worker:
        try:
            [split_host_port(w) for w in args.worker]
        except ValueError as exc:
            log.error("%s", exc)
            return 2
    elif worker_count(args) < 1:
        log.error("--workers must be at least 1 (or give --worker URL)")
        return 2
    elif args.engine == "sglang-cpu":
        from sglang_workers.real.installation import missing_install_reason

        reason = missing_install_reason()
        if reason is not None:
            log.error("%s", reason)
            return 1
    elif args.profile is not None:
        from sglang_workers.sim.timing import profile_list

        try:
            args.profile = ",".join(profile_list(args.profile))
        except ValueError as exc:
            log.error("--profile: %s", exc)
            return 2
    return asyncio.run(_run_up(args))

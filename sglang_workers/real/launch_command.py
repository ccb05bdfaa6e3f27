"""``prefix-router sglang-launch``: the launch command of a real SGLang worker wired for this router.

The router needs four things from each SGLang worker, all off by default in SGLang: KV events over
ZMQ (``--kv-events-config`` with a replay socket, so a restarted router can catch up), a page size
equal to the router's block size (``--page-size``; SGLang's CUDA default is 1), Prometheus metrics
(``--enable-metrics``) and ``cached_tokens`` in OpenAI responses (``--enable-cache-report``). With
``--dp-size N`` it also sets ``SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES=1``, so that the rank the router pins
(``x-override-routed-dp-rank``) holds on ``/generate`` too, and puts the replay ports after the N event
ports. This command prints that command line (default) or replaces itself with it (``--run``). With
``--cpu`` it launches from the ``make sglang-cpu`` install instead: its Python, its tiny Llama, the CPU
flags (``--sleep-on-idle`` among them) and the environment (``SGLANG_USE_CPU_ENGINE=1``, the libcuda.so.1
stand-in on ``LD_LIBRARY_PATH``, no downloads).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import sys
from pathlib import Path

from .flags import kv_events_config, sglang_flags

__all__ = ["DP_ENV", "build_command", "build_env", "configure", "kv_events_config", "main", "sglang_flags"]

# SGLang 0.5.23 applies x-override-* request headers (the router's DP rank pin on /generate and chat) only with this.
DP_ENV = {"SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES": "1"}


def build_command(args: argparse.Namespace) -> list[str]:
    """argv of ``python -m sglang.launch_server`` for these options."""
    cmd = [args.python, "-m", "sglang.launch_server", "--model-path", args.model_path]
    flags = sglang_flags(
        args.host,
        args.port,
        args.page_size,
        args.kv_events_port,
        args.kv_replay_port,
        args.kv_topic,
        replay=not args.no_replay,
        events_host=args.kv_events_host,
        dp_size=args.dp_size,
    )
    for flag, value in flags.items():
        cmd += [flag] if value is True else [flag, str(value)]
    cmd += ["--schedule-policy", args.schedule_policy]
    if args.served_model_name:
        cmd += ["--served-model-name", args.served_model_name]
    if args.tp_size != 1:
        cmd += ["--tp-size", str(args.tp_size)]
    if args.dp_size != 1:
        cmd += ["--dp-size", str(args.dp_size)]
    if args.mem_fraction_static is not None:
        cmd += ["--mem-fraction-static", str(args.mem_fraction_static)]
    if args.dummy_weights:
        cmd += ["--load-format", "dummy"]
    if args.cpu:
        from .cpu_launch import cpu_flags

        cmd += cpu_flags(args.max_total_tokens)
    return cmd + list(args.extra)


def build_env(args: argparse.Namespace) -> dict[str, str]:
    """Environment variables the worker needs beyond the flags (the DP rank pin with ``--dp-size``)."""
    return dict(DP_ENV) if args.dp_size > 1 else {}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Print (or, with --run, execute) the launch command of a real SGLang worker set up for this router: "
        "KV events over ZMQ with a replay socket, --page-size equal to the router's block size, "
        "--enable-metrics and --enable-cache-report. Needs a GPU host with SGLang installed "
        "(pip install -e '.[sglang]' in the prefix-router checkout, or the lmsysorg/sglang image)."
    )
    parser.add_argument(
        "--cpu",
        action="store_true",
        help=(
            "Serve on this machine's CPU from the `make sglang-cpu` install: its Python and tiny Llama (unless "
            "--python / --model-path say otherwise), the CPU flags and environment."
        ),
    )
    parser.add_argument(
        "--model-path",
        default=None,
        help="HF model id or local directory (SGLang --model-path); required without --cpu.",
    )
    parser.add_argument(
        "--max-total-tokens",
        type=int,
        default=8192,
        help="With --cpu: the KV pool size in tokens (SGLang --max-total-tokens).",
    )
    parser.add_argument("--served-model-name", default=None, help="Name clients send in 'model' (default: the path).")
    parser.add_argument("--host", default="0.0.0.0", help="HTTP bind address of the worker.")
    parser.add_argument("--port", type=int, default=30000, help="HTTP port of the worker.")
    parser.add_argument(
        "--page-size",
        type=int,
        default=16,
        help="KV page size = block_size of KV events; must equal the router's block size.",
    )
    parser.add_argument(
        "--kv-events-port", type=int, default=5557, help="ZMQ PUB port (DP rank r publishes on port + r)."
    )
    parser.add_argument(
        "--kv-replay-port",
        type=int,
        default=None,
        help="ZMQ ROUTER replay port (default: --kv-events-port + --dp-size; DP rank r uses port + r).",
    )
    parser.add_argument(
        "--kv-events-host",
        default="*",
        help="Address the ZMQ sockets bind ('*' = every interface; a concrete one adds \"bind\": true).",
    )
    parser.add_argument("--no-replay", action="store_true", help="Do not open a replay socket.")
    parser.add_argument("--kv-topic", default="", help="Topic frame of KV-event batches.")
    parser.add_argument(
        "--schedule-policy",
        default="fcfs",
        choices=["fcfs", "lpm", "dfs-weight", "lof", "random"],
        help="SGLang's waiting-queue policy (lpm favours cached prefixes).",
    )
    parser.add_argument("--tp-size", type=int, default=1, help="Tensor parallelism (GPUs per replica).")
    parser.add_argument("--dp-size", type=int, default=1, help="Data parallelism (replicas in this server).")
    parser.add_argument(
        "--mem-fraction-static",
        type=float,
        default=None,
        help="Fraction of GPU memory for weights + KV pool (SGLang picks one when omitted).",
    )
    parser.add_argument(
        "--dummy-weights",
        action="store_true",
        help="--load-format dummy: random weights, no download (load tests only).",
    )
    parser.add_argument(
        "--python",
        default=None,
        help="Python interpreter that has sglang installed (default: this one; with --cpu the install's).",
    )
    parser.add_argument("--run", action="store_true", help="Execute the command instead of printing it.")
    parser.add_argument("extra", nargs="*", help="Further SGLang flags, after '--' (passed through unchanged).")


def main(args: argparse.Namespace) -> int:
    if args.page_size < 1 or not 0 < args.port < 65536 or not 0 < args.kv_events_port < 65536:
        print("prefix-router sglang-launch: --page-size must be >= 1 and ports within 1-65535", file=sys.stderr)
        return 2
    env: dict[str, str] | None = None
    run_env: dict[str, str] | None = None
    if args.cpu:
        from .cpu_launch import cpu_environment
        from .installation import TINY_MODEL_NAME, CpuInstall, find_install, missing_install_reason

        install = find_install()
        if install is None and (args.python is None or args.model_path is None):
            print(f"prefix-router sglang-launch: {missing_install_reason()}", file=sys.stderr)
            return 1
        install = install or CpuInstall(Path(args.python).resolve().parent.parent)
        args.python = args.python or str(install.python)
        if args.model_path is None:
            args.model_path = str(install.model_dir)
            args.served_model_name = args.served_model_name or TINY_MODEL_NAME
        env = cpu_environment(install, {})
        run_env = cpu_environment(install)
    elif args.model_path is None:
        print(
            "prefix-router sglang-launch: --model-path is required (or --cpu for the local tiny Llama)", file=sys.stderr
        )
        return 2
    args.python = args.python or sys.executable
    cmd = build_command(args)
    dp_env = build_env(args)
    if not args.run:
        prefix = [f"{k}={shlex.quote(v)}" for k, v in {**(env or {}), **dp_env}.items() if k != "PYTHONUNBUFFERED"]
        print(" ".join([*prefix, shlex.join(cmd)]))
        return 0
    if run_env is not None:
        sys.stdout.flush()
        os.execve(cmd[0], cmd, {**run_env, **dp_env})
    if args.python == sys.executable and importlib.util.find_spec("sglang") is None:
        print(
            "prefix-router sglang-launch: SGLang is not installed in this environment; on a GPU host run "
            "pip install -e '.[sglang]' in the prefix-router checkout (brings torch and CUDA), or use the "
            "lmsysorg/sglang image.",
            file=sys.stderr,
        )
        return 1
    sys.stdout.flush()
    os.environ.update(dp_env)
    os.execvp(cmd[0], cmd)
    return 0  # not reached

"""Spawn one ``prefix-router sim-worker`` process on free loopback ports (behind ``sglang_workers.process``).

Keyword options map one-to-one onto ``prefix-router sim-worker`` flags (``page_size=4`` -> ``--page-size 4``;
``True`` -> a bare flag such as ``no_kv_events=True``; ``None`` and ``False`` -> left out).
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

from prefix_common.addresses import free_ports

from ..process import Launch, WorkerProcess, WorkerStartError, spawn

__all__ = ["SimOption", "sim_worker_argv", "spawn_sim_worker"]

SimOption = str | int | float | bool | None
STARTUP_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 5.0


def sim_flags(options: Mapping[str, SimOption]) -> list[str]:
    """``prefix-router sim-worker`` flags for keyword options."""
    args: list[str] = []
    for key, value in options.items():
        if value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        args += [flag] if value is True else [flag, str(value)]
    return args


def sim_worker_argv(host: str, port: int, kv_port: int, replay_port: int, *flags: str) -> list[str]:
    """The command line of one ``prefix-router sim-worker`` on ``host``: its HTTP port, KV-event and replay ports
    (DP rank r: ``+ r``), then ``flags``."""
    return [
        sys.executable,
        "-m",
        "prefix_router",
        "sim-worker",
        "--host",
        host,
        "--port",
        str(port),
        "--kv-events-host",
        host,
        "--kv-events-port",
        str(kv_port),
        "--kv-replay-port",
        str(replay_port),
        *flags,
    ]


def port_runs(host: str, ranks: int) -> tuple[int, int, int]:
    """An HTTP port and the first of ``2 * ranks`` consecutive free ports (event ports, then replay ports)."""
    if ranks == 1:
        port, kv_port, replay_port = free_ports(3, host)
        return port, kv_port, replay_port
    for _ in range(200):
        base = random.randrange(20000, 60000)
        try:
            with contextlib.ExitStack() as stack:
                for candidate in range(base, base + 2 * ranks):
                    sock = stack.enter_context(socket.socket())
                    sock.bind((host, candidate))
        except OSError:
            continue
        port = free_ports(1, host)[0]
        if not base <= port < base + 2 * ranks:
            return port, base, base + ranks
    raise WorkerStartError(f"no run of {2 * ranks} free ports on {host}")


def spawn_sim_worker(
    options: Mapping[str, SimOption],
    *,
    host: str = "127.0.0.1",
    env: Mapping[str, str] | None = None,
    grpc: bool = False,
    startup_timeout_s: float = STARTUP_TIMEOUT_S,
) -> WorkerProcess:
    """Start one sim worker with ``options`` (sim-worker flags); returns at once (see ``wait_ready``)."""
    ranks = int(options.get("dp_size") or 1)
    port, kv_port, replay_port = port_runs(host, ranks)
    taken = {port, *range(kv_port, kv_port + ranks), *range(replay_port, replay_port + ranks)}
    grpc_port: int | None = None
    while grpc and (grpc_port is None or grpc_port in taken):
        grpc_port = free_ports(1, host)[0]
    if grpc_port is not None:
        taken.add(grpc_port)
    mode = str(options.get("disaggregation_mode") or "null")
    if mode not in ("null", "prefill", "decode"):
        raise ValueError(f"disaggregation_mode {mode!r}: one of null, prefill, decode")
    bootstrap_port = options.get("disaggregation_bootstrap_port")
    while mode == "prefill" and (bootstrap_port is None or bootstrap_port in taken):
        bootstrap_port = free_ports(1, host)[0]  # each prefill worker of a fleet its own bootstrap server
    pd_flags = ["--disaggregation-bootstrap-port", str(bootstrap_port)] if mode == "prefill" else []
    options = {k: v for k, v in options.items() if k != "disaggregation_bootstrap_port" or mode != "prefill"}
    grpc_flags = ["--grpc-port", str(grpc_port)] if grpc_port is not None else []
    argv = sim_worker_argv(host, port, kv_port, replay_port, *grpc_flags, *pd_flags, *sim_flags(options))
    launch = Launch(
        engine="sim",
        argv=argv,
        env={**os.environ, **(env or {})},
        own_group=False,
        startup_timeout_s=startup_timeout_s,
        stop_timeout_s=STOP_TIMEOUT_S,
        ready_poll_s=0.05,
        keep_log=False,
    )
    fd, log_name = tempfile.mkstemp(prefix=f"sim-worker-{port}-", suffix=".log")
    os.close(fd)
    log_path = Path(log_name)
    return WorkerProcess(
        launch,
        host,
        port,
        kv_port,
        replay_port,
        spawn(launch, log_path),
        log_path,
        grpc_port,
        disaggregation_mode=mode,  # type: ignore[arg-type]  # checked above
        bootstrap_port=int(bootstrap_port) if mode == "prefill" and bootstrap_port is not None else None,
    )

"""Start simulated workers as real child processes on free loopback ports.

Tests, benchmarks and ``prefix-router up`` all need the same thing: N sim-workers listening on
ports nobody else uses, healthy before the caller goes on, and killed for sure afterwards::

    with start_sim_worker(page_size=16, profile="instant") as worker:
        httpx.post(worker.url + "/generate", ...)
        zmq_sub.connect(worker.kv_events_endpoint)

Keyword options map one-to-one onto ``prefix-router sim-worker`` flags (``page_size=4`` ->
``--page-size 4``; ``True`` -> a bare flag such as ``no_kv_events=True``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from extproc.addresses import free_ports

__all__ = ["SimWorkerError", "SimWorkerProcess", "die_with_parent", "start_sim_worker", "start_sim_workers"]

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that has Linux SIGKILL the child when the spawning thread's process dies.

    Whatever ends the parent (even SIGKILL, which runs no cleanup), the kernel then kills the child,
    so a supervisor's children never outlive it. The signal follows the *thread* that forks: spawn from
    a thread that lives as long as the parent (the main thread, or an executor's). None off Linux.
    """
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork, not in the child
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before the prctl: nobody will send the signal
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


class SimWorkerError(RuntimeError):
    """A sim-worker process failed to start; the message carries the end of its log."""


@dataclass
class SimWorkerProcess:
    """A running ``prefix-router sim-worker`` child process."""

    host: str
    port: int
    kv_events_port: int
    replay_port: int
    process: subprocess.Popen[bytes]
    log_path: Path
    args: list[str] = field(default_factory=list)
    env: dict[str, str] | None = None
    grpc_port: int | None = None  # SGLang's gRPC scheduler API, when started with grpc=True
    dies_with_parent: bool = False  # killed by the kernel when the process that started it dies

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def grpc_url(self) -> str:
        """``grpc://host:port`` of the gRPC scheduler API (what smg takes as a gRPC worker URL)."""
        if self.grpc_port is None:
            raise SimWorkerError("this sim-worker was started without a gRPC port (grpc=True)")
        return f"grpc://{self.host}:{self.grpc_port}"

    @property
    def kv_events_endpoint(self) -> str:
        return f"tcp://{self.host}:{self.kv_events_port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://{self.host}:{self.replay_port}"

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.process.poll() is None

    def wait_healthy(self, timeout: float = 30.0, ready: bool = True) -> None:
        """Wait until ``/ready`` answers 200 (or, with ``ready=False``, answers at all).

        ``/ready`` rather than ``/health``: like SGLang's, the simulator's ``/health`` runs a generation and
        answers after a second at the earliest, while ``/ready`` is a flag that turns 200 when start-up is
        over, which is what a caller waits for.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise SimWorkerError(f"sim-worker exited with {self.process.returncode}:\n{self.log()[-2000:]}")
            try:
                with urllib.request.urlopen(self.url + "/ready", timeout=1) as resp:
                    if resp.status == 200 and self._grpc_listening():
                        return
            except urllib.error.HTTPError:
                if not ready:  # serving, but still loading (503)
                    return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.05)
        self.stop()
        raise SimWorkerError(f"sim-worker not healthy after {timeout:.0f}s:\n{self.log()[-2000:]}")

    def restart(self, timeout: float = 30.0) -> None:
        """Run the same command again, on the same ports, after the process exited; wait until healthy.

        What a supervisor does for a crashed worker: its address (and so the router's and Envoy's
        view of it) stays valid, and it starts empty, as a restarted SGLang worker does.
        """
        if self.alive():
            return
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                self.args,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                preexec_fn=die_with_parent() if self.dies_with_parent else None,  # noqa: PLW1509
            )
        self.wait_healthy(timeout)

    def _grpc_listening(self) -> bool:
        """The gRPC port accepts connections (it opens just after HTTP); True without one."""
        if self.grpc_port is None:
            return True
        try:
            with socket.create_connection((self.host, self.grpc_port), timeout=1):
                return True
        except OSError:
            return False

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM, then SIGKILL if it does not exit within ``timeout``; idempotent."""
        if self.alive():
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        with contextlib.suppress(OSError):
            self.log_path.unlink()

    def __enter__(self) -> SimWorkerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _flags(opts: dict[str, Any]) -> list[str]:
    args: list[str] = []
    for key, value in opts.items():
        if value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        args += [flag] if value is True else [flag, str(value)]
    return args


def _port_runs(host: str, ranks: int) -> tuple[int, int, int]:
    """An HTTP port and the first of ``2 * ranks`` consecutive free ports (event ports, then replay ports)."""
    if ranks == 1:
        port, kv_port, replay_port = free_ports(3, host)
        return port, kv_port, replay_port
    import random

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
    raise SimWorkerError(f"no run of {2 * ranks} free ports on {host}")


def _spawn(
    host: str, opts: dict[str, Any], env: dict[str, str] | None, grpc: bool, dies_with_parent: bool = False
) -> SimWorkerProcess:
    ranks = int(opts.get("dp_size", 1))
    port, kv_port, replay_port = _port_runs(host, ranks)
    taken = {port, *range(kv_port, kv_port + ranks), *range(replay_port, replay_port + ranks)}
    grpc_port: int | None = None
    while grpc and (grpc_port is None or grpc_port in taken):
        grpc_port = free_ports(1, host)[0]
    args = [
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
        *(["--grpc-port", str(grpc_port)] if grpc else []),
        *_flags(opts),
    ]
    fd, log_name = tempfile.mkstemp(prefix=f"sim-worker-{port}-", suffix=".log")
    full_env = {**os.environ, **(env or {})}
    with os.fdopen(fd, "wb") as log:
        process = subprocess.Popen(
            args,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=full_env,
            preexec_fn=die_with_parent() if dies_with_parent else None,  # noqa: PLW1509
        )
    return SimWorkerProcess(
        host,
        port,
        kv_port,
        replay_port,
        process,
        Path(log_name),
        args,
        env=full_env,
        grpc_port=grpc_port,
        dies_with_parent=dies_with_parent,
    )


def start_sim_workers(
    count: int,
    *,
    host: str = "127.0.0.1",
    startup_timeout: float = 30.0,
    env: dict[str, str] | None = None,
    wait_ready: bool = True,
    grpc: bool = False,
    dies_with_parent: bool = False,
    **opts: Any,
) -> list[SimWorkerProcess]:
    """Start ``count`` workers in parallel and wait until all answer ``/ready`` with 200
    (``wait_ready=False``: until their HTTP port answers at all, e.g. with ``load_time``).
    ``grpc=True`` also serves SGLang's gRPC scheduler API on a free port of each (``grpc_url``).
    ``dies_with_parent=True``: the kernel kills them when this process dies (``die_with_parent``);
    only from a thread that lives as long as this process.

    A worker that loses a port race (another process took a port between the check and the bind)
    is started again on new ports, up to three times.
    """
    # ``profile="a,b"`` cycles the named timing profiles over the workers (a mixed fleet); workers with
    # several DP ranks get the whole list and cycle it over their ranks.
    ranked = int(opts.get("dp_size", 1)) > 1
    profiles = str(opts["profile"]).split(",") if opts.get("profile") and not ranked else []
    per_worker = [{**opts, "profile": profiles[i % len(profiles)].strip()} if profiles else opts for i in range(count)]
    workers = [_spawn(host, per_worker[i], env, grpc, dies_with_parent) for i in range(count)]
    try:
        for i in range(count):
            for attempt in range(3):
                try:
                    workers[i].wait_healthy(startup_timeout, ready=wait_ready)
                    break
                except SimWorkerError as exc:
                    workers[i].stop()
                    if attempt == 2 or "in use" not in str(exc).lower():
                        raise
                    workers[i] = _spawn(host, per_worker[i], env, grpc, dies_with_parent)
    except BaseException:
        for worker in workers:
            worker.stop()
        raise
    return workers


def start_sim_worker(
    *,
    host: str = "127.0.0.1",
    startup_timeout: float = 30.0,
    env: dict[str, str] | None = None,
    wait_ready: bool = True,
    grpc: bool = False,
    **opts: Any,
) -> SimWorkerProcess:
    """Start one worker on free ports and wait until it is healthy (usable as a context manager)."""
    return start_sim_workers(
        1, host=host, startup_timeout=startup_timeout, env=env, wait_ready=wait_ready, grpc=grpc, **opts
    )[0]

"""One handle for a worker process of either engine: the simulator or real SGLang on this CPU.

Tests, benchmarks and ``prefix-router up`` need the same things from a worker whichever engine runs it: its
addresses (HTTP, KV events, replay), its log, whether it runs, a wait until ``/ready`` says 200, a stop that
always takes everything it started down, a crash (``kill``) and a restart on the same ports. What differs per
engine is how it is spawned (``sglang_workers.sim.launch``, ``sglang_workers.real.cpu_launch``), and that is
described by a :class:`Launch`; ``prefix_router.fleet.start_fleet`` starts fleets of either.

Every worker dies with the process that started it, even when that one is SIGKILLed: the child's ``PYTHONPATH``
starts with ``guard/`` (its ``sitecustomize`` asks Linux for SIGKILL when the parent goes, in the worker and in
every Python process it starts). The kernel ties that signal to the *thread* that forked, so workers are forked by
one thread that lives as long as this process (callers start workers from ``asyncio.to_thread``, whose threads
end when their loop closes: a worker forked there would die with the thread).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

__all__ = ["GUARD_DIR", "DisaggregationMode", "Engine", "Launch", "WorkerProcess", "WorkerStartError", "spawn"]

Engine = Literal["sim", "sglang-cpu"]
DisaggregationMode = Literal["null", "prefill", "decode"]
GUARD_DIR = Path(__file__).resolve().parent / "guard"  # its sitecustomize.py makes children die with us
PARENT_ENV = "PREFIX_ROUTER_WORKER_PARENT"  # read (and removed) by guard/sitecustomize.py


class WorkerStartError(RuntimeError):
    """A worker process failed to start (exited, or not ready in time); the message carries the end of its log.

    ``port_lost`` says its log (the whole of it, not only the end quoted) reports a port already in use: a worker
    picks free ports before it binds them, so another process can take one in between, and a fresh start on new
    ports is then the cure.
    """

    def __init__(self, message: str, *, port_lost: bool = False) -> None:
        super().__init__(message)
        self.port_lost = port_lost


@dataclass(frozen=True)
class Launch:
    """How one worker is (re)started and treated: what its engine's spawner decided."""

    engine: Engine
    argv: list[str]
    env: dict[str, str]
    # Real SGLang runs three processes (HTTP/tokenizer, scheduler, detokenizer): it leads a process group of its
    # own, and signals go to the whole group. The simulator is one process.
    own_group: bool
    startup_timeout_s: float  # the default wait for /ready
    stop_timeout_s: float  # SIGTERM's grace before SIGKILL
    ready_poll_s: float
    keep_log: bool  # a log in a caller's log directory stays; a temporary one is deleted by stop()


class _Spawner:
    """The one long-lived thread that forks every worker (see the module docstring: PR_SET_PDEATHSIG is per thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: list[tuple[Launch, Path, Future[subprocess.Popen[bytes]]]] = []
        self._wake = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None

    def popen(self, launch: Launch, log_path: Path) -> subprocess.Popen[bytes]:
        future: Future[subprocess.Popen[bytes]] = Future()
        with self._lock:
            if self._thread is None:
                # A daemon thread: it never blocks interpreter exit, and lives exactly as long as this process.
                self._thread = threading.Thread(target=self._run, name="worker-spawner", daemon=True)
                self._thread.start()
            self._jobs.append((launch, log_path, future))
            self._wake.notify()
        return future.result()

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._jobs:
                    self._wake.wait()
                launch, log_path, future = self._jobs.pop(0)
            try:
                future.set_result(_popen(launch, log_path))
            except BaseException as exc:
                future.set_exception(exc)


def _popen(launch: Launch, log_path: Path) -> subprocess.Popen[bytes]:
    python_path = launch.env.get("PYTHONPATH")
    env = {
        **launch.env,
        "PYTHONPATH": f"{GUARD_DIR}{os.pathsep}{python_path}" if python_path else str(GUARD_DIR),
        PARENT_ENV: str(os.getpid()),
    }
    with log_path.open("ab") as log:
        return subprocess.Popen(
            launch.argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=launch.own_group,
        )


_SPAWNER = _Spawner()


def spawn(launch: Launch, log_path: Path) -> subprocess.Popen[bytes]:
    """Start ``launch`` with its output appended to ``log_path``; the child dies with this process."""
    return _SPAWNER.popen(launch, log_path)


@dataclass
class WorkerProcess:
    """A running worker of either engine (a context manager: ``stop()`` on exit)."""

    launch: Launch
    host: str
    port: int
    kv_events_port: int  # rank r of a multi-rank sim worker publishes on kv_events_port + r
    replay_port: int
    process: subprocess.Popen[bytes]
    log_path: Path
    grpc_port: int | None = None  # SGLang's gRPC scheduler API (sim workers started with grpc=True)
    disaggregation_mode: DisaggregationMode = "null"  # a PD worker: "prefill" or "decode"
    bootstrap_port: int | None = None  # a prefill worker's bootstrap port (what a PD request's bootstrap_port names)

    @property
    def engine(self) -> Engine:
        return self.launch.engine

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def grpc_url(self) -> str:
        """``grpc://host:port`` of the gRPC scheduler API (what smg takes as a gRPC worker URL)."""
        if self.grpc_port is None:
            raise WorkerStartError("this worker was started without a gRPC port (grpc=True)")
        return f"grpc://{self.host}:{self.grpc_port}"

    @property
    def kv_events_endpoint(self) -> str:
        return f"tcp://{self.host}:{self.kv_events_port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://{self.host}:{self.replay_port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.process.poll() is None

    def wait_ready(self, timeout: float | None = None, ready: bool = True) -> None:
        """Wait until ``/ready`` answers 200 (``ready=False``: until the HTTP port answers at all, e.g. 503 while
        a sim worker's ``load_time`` runs); on failure stop the worker and raise :class:`WorkerStartError`.

        ``/ready`` rather than ``/health``: on SGLang (and the simulator) ``/health`` runs a generation and answers
        after a second at the earliest, while ``/ready`` is a flag that turns 200 once start-up is over (for SGLang:
        once its warm-up request has been served).
        """
        limit = self.launch.startup_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            if not self.alive():
                log = self.log()
                self.stop()
                raise WorkerStartError(
                    f"{self.engine} worker exited with status {self.process.returncode} while starting:\n{log[-3000:]}",
                    port_lost=reports_port_in_use(log),
                )
            try:
                with urllib.request.urlopen(self.url + "/ready", timeout=2) as response:
                    if response.status == 200 and self._grpc_listening():
                        return
            except urllib.error.HTTPError:
                if not ready:  # serving, but still loading (503)
                    return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(self.launch.ready_poll_s)
        log = self.log()
        self.stop()
        raise WorkerStartError(
            f"{self.engine} worker not ready after {limit:.0f}s:\n{log[-3000:]}", port_lost=reports_port_in_use(log)
        )

    def _grpc_listening(self) -> bool:
        """The gRPC port accepts connections (the simulator opens it just after HTTP); True without one."""
        if self.grpc_port is None:
            return True
        try:
            with socket.create_connection((self.host, self.grpc_port), timeout=1):
                return True
        except OSError:
            return False

    def _signal(self, sig: signal.Signals) -> None:
        """``sig`` to the worker: its whole process group when it leads one (real SGLang's three processes)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if self.launch.own_group:
                os.killpg(self.process.pid, sig)
            elif self.alive():
                self.process.send_signal(sig)

    def _terminate(self, timeout: float | None) -> None:
        if self.alive():
            self._signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(self.launch.stop_timeout_s if timeout is None else timeout)
        self._signal(signal.SIGKILL)  # what outlived the grace (for a group: children SGLang left behind)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(10)

    def stop(self, timeout: float | None = None) -> None:
        """SIGTERM, then SIGKILL what is left after ``timeout`` (default: the engine's grace); idempotent."""
        self._terminate(timeout)
        if not self.launch.keep_log:
            with contextlib.suppress(OSError):
                self.log_path.unlink()

    def kill(self) -> None:
        """A crash, not a goodbye: SIGKILL at once (the whole group for real SGLang); tests of restarts use it."""
        self._signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(10)

    def restart(self, timeout: float | None = None) -> None:
        """Start the same command again on the same ports (stopping what is left of the old one) and wait
        until it is ready: what a supervisor does for a crashed worker. Its addresses, and so the router's and
        Envoy's view of it, stay valid; it starts empty, as a restarted SGLang worker does."""
        self._terminate(None)
        self.process = spawn(self.launch, self.log_path)
        self.wait_ready(timeout)

    def __enter__(self) -> WorkerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def reports_port_in_use(log: str) -> bool:
    """The log says a bind failed on a taken port (uvicorn, ZMQ and gRPC each word it their own way)."""
    text = log.lower()
    return "address already in use" in text or "errno 98" in text or "is in use" in text

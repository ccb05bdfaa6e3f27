"""The matrix: every workload x offered load x fleet, every contender (``--suite matrix``).

For each fleet and workload the bench first finds the knee of round robin itself: it runs ``envoy-rr``
at a low probe rate and reads how long the workers spent prefilling (``/v1/loads``
``total_prefill_busy_us``, the counter SGLang 0.5.23 reports). Round robin's prefill work per request
does not depend on the load, so that gives the offered load at which its fleet would prefill without
pause: its capacity, past which every queue grows (decode steps batch, and SGLang runs a prefill
before any decode, so prefill time is what saturates first). Each cell then offers ``load x knee``
requests per second (0.5: half of round robin's capacity; 1.3: past it) to every contender, each on
its own fresh identical cluster with the same request bytes at the same arrival times.

Per cell: TTFT p50 and p99 of ours as ratios to the best peer that ran (the lowest of the peers,
per metric) and to round robin, hit rate over the pooled-cache oracle, max/mean requests per worker,
and goodput: requests per second that finished with TTFT within the SLO. The SLO is MLPerf's
server-scenario TTFT limit for Llama-3.1-8B and Llama-2-70B, 2 s of GPU time (divided by the fleet's
``speedup`` in wall time). Where round robin's knee would exceed ``max_rate`` requests per second the
simulated GPUs are slowed down (a lower ``speedup``) until it does not: past that the 2-core machine
running every process, not the simulated GPUs, would set the pace. The JSON is checkpointed after
every knee and cell, so a resumed run continues where one stopped; ``matrix.report`` renders it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.client import ClientOptions, run_load
from benchmarks.fleet.cluster import Cluster, ClusterError, ClusterSpec
from benchmarks.fleet.contenders import create_contender
from benchmarks.fleet.shapes import FLEETS, Fleet
from benchmarks.metrics import Summary
from benchmarks.oracle import oracle_hit_rate
from benchmarks.report import json_safe
from benchmarks.workloads.base import Workload, iter_token_ids
from benchmarks.workloads.cells import WORKLOADS, CellSize
from benchmarks.workloads.trace import TraceError

__all__ = [
    "LOADS",
    "ROUND_ROBIN",
    "SLO_GPU_S",
    "MatrixOptions",
    "cell_figures",
    "find_knee",
    "load_matrix",
    "records_path",
    "run_matrix",
    "save_matrix",
]

SLO_GPU_S = 2.0  # MLPerf server-scenario TTFT limit (Llama-3.1-8B, Llama-2-70B)
LOADS = (0.5, 0.8, 1.0, 1.3)
ROUND_ROBIN = "envoy-rr"


@dataclass(frozen=True)
class MatrixOptions(CellSize):
    """A cell's size, and how the matrix runs it."""

    max_rate: float = 10.0  # the knee is kept at or below this (req/s) by slowing the simulated GPUs
    page_size: int = 16
    request_timeout_s: float = 300.0


RunOne = Callable[
    [str, Workload, ClusterSpec, ClientOptions, float | None, bool], "asyncio.Future[tuple[Summary, list[float]]] | Any"
]


async def fleet_prefill_busy_seconds(urls: Sequence[str]) -> float | None:
    """Seconds the workers have spent in prefill steps so far (SGLang 0.5.23 ``/v1/loads``), or None."""
    total = 0.0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        for url in urls:
            try:
                async with session.get(url + "/v1/loads?include=core&format=json") as resp:
                    body = await resp.json(content_type=None)
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                return None
            for rank in body.get("loads", []) if isinstance(body, dict) else []:
                busy = rank.get("total_prefill_busy_us")
                if not isinstance(busy, (int, float)):
                    return None
                total += busy / 1e6
    return total


def _spec(fleet: Fleet, o: MatrixOptions) -> ClusterSpec:
    return ClusterSpec(
        workers=fleet.workers,
        profile=fleet.profile,
        speedup=fleet.speedup,
        capacity_tokens=fleet.capacity_tokens,
        page_size=o.page_size,
        seed=o.seed,
    )


async def find_knee(
    fleet: Fleet,
    workload: str,
    o: MatrixOptions,
    run_load_on: Any,
    log: Callable[[str], None],
) -> tuple[float, dict[str, Any]]:
    """Round robin's capacity in req/s: probe at a low rate, scale by how busy prefilling kept the fleet."""
    build = WORKLOADS[workload]
    rate = 0.5 * fleet.workers
    probes = []
    for _ in range(4):
        # The cells' size: the offered load per nominal rate is the same (multiturn's ramp).
        w = build(rate, dataclasses.replace(o, gpu_slowdown=1.0 / fleet.speedup))
        busy, wall = await run_load_on(ROUND_ROBIN, w, _spec(fleet, o))
        if busy is None or wall <= 0:
            raise ClusterError("the workers do not report prefill busy time (/v1/loads total_prefill_busy_us)")
        utilization = busy / (wall * fleet.workers)
        probes.append({"rate": rate, "utilization": utilization, "busy_s": busy, "wall_s": wall})
        log(f"  knee probe {workload} on {fleet.name}: {rate:.2f} req/s -> utilization {utilization:.2f}")
        if 0.15 <= utilization <= 0.7:
            break
        rate = rate * min(4.0, max(0.25, 0.4 / max(utilization, 1e-3)))
    knee = rate / max(probes[-1]["utilization"], 1e-3)
    # Past a few dozen requests per second the 2-core machine running every process, not the
    # simulated GPUs, would set the pace: slow the GPUs down instead (the knee scales with them).
    speedup = fleet.speedup * min(1.0, o.max_rate / knee)
    return knee * speedup / fleet.speedup, {
        "probes": probes,
        "knee_rate": knee * speedup / fleet.speedup,
        "speedup": speedup,
        "probe_knee_rate": knee,
    }


def _best(summaries: Sequence[Summary], key: Callable[[Summary], float]) -> Summary | None:
    ran = [s for s in summaries if s.start_error is None and not math.isnan(key(s))]
    return min(ran, key=key) if ran else None


def _goodput(ttfts: Sequence[float], duration: float, slo: float) -> float:
    return sum(1 for t in ttfts if t <= slo) / duration if duration > 0 else math.nan


def cell_figures(
    summaries: Sequence[Summary], ttfts: dict[str, list[float]], oracle: float, slo: float, ours: str
) -> dict[str, Any]:
    """The figures of one cell: ours against the best peer (per metric) and round robin."""
    by_name = {s.name: s for s in summaries}
    mine = by_name.get(ours)
    peers = [s for s in summaries if s.name not in (ours, ROUND_ROBIN)]
    rr = by_name.get(ROUND_ROBIN)

    def p50(s: Summary) -> float:
        return s.ttft_s["p50"]

    def p99(s: Summary) -> float:
        return s.ttft_s["p99"]

    def mean(s: Summary) -> float:
        return s.ttft_s["mean"]

    best50, best99, best_mean = _best(peers, p50), _best(peers, p99), _best(peers, mean)
    goodput = {s.name: _goodput(ttfts.get(s.name, []), s.duration_s, slo) for s in summaries}
    peer_goodput = [
        (goodput[s.name], s.name) for s in peers if s.start_error is None and math.isfinite(goodput[s.name])
    ]
    best_good = max(peer_goodput) if peer_goodput else (math.nan, None)

    def ratio(a: Summary | None, b: Summary | None, f: Callable[[Summary], float]) -> float:
        return f(a) / f(b) if a is not None and b is not None and f(b) > 0 else math.nan

    return {
        "ours": ours,
        "best_peer_p50": best50.name if best50 else None,
        "best_peer_p99": best99.name if best99 else None,
        "p50_vs_best_peer": ratio(mine, best50, p50),
        "p99_vs_best_peer": ratio(mine, best99, p99),
        "best_peer_mean": best_mean.name if best_mean else None,
        "mean_vs_best_peer": ratio(mine, best_mean, mean),
        "best_peer_goodput": best_good[1],
        "goodput_vs_best_peer": goodput[mine.name] / best_good[0]
        if mine is not None and math.isfinite(best_good[0]) and best_good[0] > 0
        else math.nan,
        "p50_vs_rr": ratio(mine, rr, p50),
        "p99_vs_rr": ratio(mine, rr, p99),
        "hit_vs_oracle": (mine.hit_rate / oracle) if mine is not None and oracle > 0 else math.nan,
        "max_mean": mine.max_mean_requests if mine is not None else math.nan,
        "goodput": goodput,
        "slo_s": slo,
        "oracle_hit_rate": oracle,
        "contenders": [s.to_json() for s in summaries],
    }


def records_path(records_dir: Path, cell: str, contender: str) -> Path:
    """Where one contender's per-request records of one cell go: ``fleet_workload_load_contender.jsonl``."""
    return records_dir / f"{cell.replace('/', '_')}_{contender.replace(':', '-')}.jsonl"


def save_matrix(path: Path, data: dict[str, Any]) -> None:
    """Checkpoint: the JSON is rewritten after every knee and cell."""
    path.write_text(json.dumps(json_safe(data), indent=1, default=str))


def load_matrix(path: Path) -> dict[str, Any] | None:
    """A previous run's checkpoint (``--resume``), or None."""
    if not path.is_file():
        return None
    data: dict[str, Any] = json.loads(path.read_text())
    return data


async def run_matrix(
    contenders: Sequence[str],
    fleets: Sequence[str],
    workloads: Sequence[str],
    loads: Sequence[float],
    o: MatrixOptions,
    run_one: Any,
    out_json: Path,
    previous: dict[str, Any] | None = None,
    progress: bool = False,
    records_dir: Path | None = None,
) -> dict[str, Any]:
    """Run every cell not already in ``previous`` (a resumed run); returns the whole result. ``records_dir``: each
    contender's per-request records of each cell go there (``records_path``)."""
    ours = next((c for c in contenders if c.startswith("ours:")), None)
    if ours is None or ROUND_ROBIN not in contenders:
        raise ValueError(f"the matrix needs {ROUND_ROBIN} and one ours:<policy> among the contenders")
    data: dict[str, Any] = previous or {"cells": {}, "knees": {}}
    data.update(
        {
            "contenders": list(contenders),
            "loads": list(loads),
            "slo_gpu_s": SLO_GPU_S,
            "fleets": {f: FLEETS[f].__dict__ for f in fleets},
            "workloads": list(workloads),
            "options": {k: str(v) for k, v in o.__dict__.items()},
        }
    )

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    options = ClientOptions(request_timeout_s=o.request_timeout_s)

    async def load_on(name: str, workload: Workload, spec: ClusterSpec) -> tuple[float | None, float]:
        """Run ``name`` over a fresh cluster and measure the fleet's busy seconds and the wall time."""
        contender = create_contender(name)
        cluster = Cluster(spec)
        try:
            await cluster.start()
            url = await contender.start(cluster.urls)
            model = await cluster.served_model()
            opts = ClientOptions(request_timeout_s=o.request_timeout_s, model=model) if model else options
            before = await fleet_prefill_busy_seconds(cluster.urls)
            start = time.monotonic()
            await run_load(url, workload.requests, opts)
            wall = time.monotonic() - start
            after = await fleet_prefill_busy_seconds(cluster.urls)
            busy = after - before if after is not None and before is not None else None
            return busy, wall
        finally:
            await contender.stop()
            await cluster.stop()

    for fleet_name in fleets:
        fleet = FLEETS[fleet_name]
        for workload in workloads:
            knee_key = f"{fleet_name}/{workload}"
            knee_info = data["knees"].get(knee_key)
            if knee_info is None:
                try:
                    knee, knee_info = await find_knee(fleet, workload, o, load_on, log)
                except (ClusterError, TraceError) as exc:
                    data["knees"][knee_key] = {"error": str(exc)}
                    log(f"  {knee_key}: no knee: {exc}")
                    save_matrix(out_json, data)
                    continue
                data["knees"][knee_key] = knee_info
                save_matrix(out_json, data)
            if "error" in knee_info:
                continue
            knee = float(knee_info["knee_rate"])
            fleet_here = Fleet(
                fleet.name,
                fleet.profile,
                fleet.workers,
                float(knee_info.get("speedup", fleet.speedup)),
                fleet.capacity_tokens,
            )
            spec = _spec(fleet_here, o)
            for load in loads:
                key = f"{fleet_name}/{workload}/{load:g}"
                if key in data["cells"]:
                    continue
                rate = load * knee
                w = WORKLOADS[workload](rate, dataclasses.replace(o, gpu_slowdown=1.0 / fleet_here.speedup))
                oracle = oracle_hit_rate(
                    iter_token_ids(w.requests),
                    spec.workers * spec.capacity_tokens,
                    spec.page_size,
                    max_prompt_tokens=spec.capacity_tokens,
                )
                log(f"# {key}: {len(w.requests)} requests at {rate:.2f} req/s (knee {knee:.2f}); oracle {oracle:.3f}")
                summaries: list[Summary] = []
                ttfts: dict[str, list[float]] = {}
                for name in contenders:
                    where = {"records": records_path(records_dir, key, name)} if records_dir else {}
                    summary, values = await run_one(name, w, spec, options, rate, progress, **where)
                    summaries.append(summary)
                    ttfts[name] = values
                    status = (
                        f"did not start: {summary.start_error}"
                        if summary.start_error
                        else f"p50 {summary.ttft_s['p50'] * 1000:.0f} ms p99 {summary.ttft_s['p99'] * 1000:.0f} ms "
                        f"hit {summary.hit_rate:.3f}"
                    )
                    log(f"  {name}: {status}")
                cell = cell_figures(summaries, ttfts, oracle, SLO_GPU_S / fleet_here.speedup, ours)
                cell.update(
                    {
                        "fleet": fleet_name,
                        "workload": workload,
                        "load": load,
                        "rate": rate,
                        "knee": knee,
                        "speedup": fleet_here.speedup,
                        "offered_rate": w.offered_rate,
                    }
                )
                data["cells"][key] = cell
                save_matrix(out_json, data)
    return data

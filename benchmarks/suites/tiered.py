"""``prefix-router bench --suite tiered``: the tiered-KV-cache scenario through every contender.

Once per tier setting (no HiCache, a host tier per worker, a host tier plus a storage tier all workers
share): the ``longctx`` workload (long-document QA and multi-turn chat whose working set exceeds the
fleet's GPU memory) through every contender, each on a fresh identical cluster, reporting TTFT, hit
rate per tier, goodput at a TTFT SLO and GPU-seconds per request, and checking the targets of
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

from benchmarks.client import ClientOptions
from benchmarks.cluster import HICACHE_SETTINGS
from benchmarks.contenders import create_contender
from benchmarks.metrics import Summary
from benchmarks.oracle import oracle_hit_rate
from benchmarks.report import TieredReport, tiered_table
from benchmarks.runs import run_one
from benchmarks.suites.shared import add_fleet_arguments, add_run_arguments, fleet_spec, positive, versions
from benchmarks.workloads import iter_token_ids, longctx_workload

__all__ = ["TIERED_CONTENDERS", "configure", "main", "run_tiered", "tiered_contenders"]

TIERED_SPEEDUP = 0.5  # the long prompts need less stretching than the routing suite's to load the fleet
# The tiered suite's peers: round robin, sgl-router, smg (when this build has it), Dynamo's cost, ours.
TIERED_CONTENDERS = ("envoy-rr", "sgl-router", "smg", "ours:dynamo-cost", "ours:prefix-aware")
_DEFAULT_CONTENDERS = ",".join(TIERED_CONTENDERS)


def configure(parser: argparse.ArgumentParser) -> None:
    lc = parser.add_argument_group("workload longctx and tiers")
    lc.add_argument(
        "--tiers",
        default=",".join(HICACHE_SETTINGS),
        help="Comma-separated tier settings: none (GPU only), host (a HiCache host tier per worker, 2x its GPU "
        "pool, write-through), host+shared (plus SGLang's file storage tier in one directory all workers share).",
    )
    lc.add_argument("--lc-docs", type=positive(int), default=24, help="Documents of the QA part.")
    lc.add_argument("--lc-doc-len", type=positive(int), default=8192, help="Tokens per document.")
    lc.add_argument("--lc-questions", type=positive(int), default=5, help="Questions asked about each document.")
    lc.add_argument("--lc-question-len", type=positive(int), default=64, help="Tokens per question.")
    lc.add_argument("--lc-sessions", type=positive(int), default=16, help="Multi-turn chat sessions.")
    lc.add_argument("--lc-turns", type=positive(int), default=5, help="Turns per chat session.")
    lc.add_argument(
        "--lc-system-len", type=positive(int), default=1024, help="Tokens of the system prompt all sessions share."
    )
    lc.add_argument(
        "--lc-turn-len", type=positive(int), default=256, help="Tokens of each turn's question and of its answer."
    )
    lc.add_argument(
        "--lc-duration",
        type=positive(float),
        default=48.0,
        help="Seconds over which the requests arrive (Poisson): sets the offered load.",
    )
    lc.add_argument("--output-len", type=positive(int), default=32, help="Output tokens per request.")
    lc.add_argument("--max-requests", type=positive(int), default=None, help="Keep only the first N arrivals.")
    lc.add_argument(
        "--slo-ttft-ms",
        type=positive(float),
        default=1000.0,
        help="TTFT service level (wall ms): goodput counts the requests that met it.",
    )
    add_fleet_arguments(parser, TIERED_SPEEDUP)
    add_run_arguments(
        parser,
        _DEFAULT_CONTENDERS,
        "The gateways to compare; those this build lacks (e.g. smg) are reported and skipped unless named here.",
    )


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
    explicit = args.contenders if args.contenders != _DEFAULT_CONTENDERS else None
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
        spec = fleet_spec(args, hicache=tier)  # checked against HICACHE_SETTINGS above
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
        "versions": versions(),
    }
    return TieredReport(workload.name, dict(workload.params), oracle, rows, args.slo_ttft_ms / 1000.0, setup)


def main(args: argparse.Namespace) -> int:
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

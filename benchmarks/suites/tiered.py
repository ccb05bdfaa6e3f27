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
import math
import sys
import time
from collections.abc import Sequence
from typing import Any

from benchmarks.argtypes import positive
from benchmarks.client import ClientOptions
from benchmarks.fleet.cluster import HICACHE_SETTINGS
from benchmarks.fleet.contenders import create_contender
from benchmarks.metrics import Summary
from benchmarks.oracle import oracle_hit_rate
from benchmarks.report import fmt, json_safe, ms, ratio
from benchmarks.runs import run_one
from benchmarks.suites.shared import add_fleet_arguments, add_run_arguments, fleet_spec, versions
from benchmarks.workloads.base import iter_token_ids
from benchmarks.workloads.flags import add_workload_arguments, workload_from_args

__all__ = [
    "TIERED_CONTENDERS",
    "TieredReport",
    "configure",
    "gpu_seconds_per_request",
    "main",
    "run_tiered",
    "tiered_contenders",
    "tiered_table",
]

TIERED_SPEEDUP = 0.5  # the long prompts need less stretching than the routing suite's to load the fleet
# The tiered suite's peers: round robin, sgl-router, smg (when this build has it), Dynamo's cost, ours.
TIERED_CONTENDERS = ("envoy-rr", "sgl-router", "smg", "ours:dynamo-cost", "ours:prefix-aware")
_DEFAULT_CONTENDERS = ",".join(TIERED_CONTENDERS)


def configure(parser: argparse.ArgumentParser) -> None:
    g = add_workload_arguments(parser, ("longctx",))
    g.add_argument(
        "--tiers",
        default=",".join(HICACHE_SETTINGS),
        help="Comma-separated tier settings: none (GPU only), host (a HiCache host tier per worker, 2x its GPU "
        "pool, write-through), host+shared (plus SGLang's file storage tier in one directory all workers share).",
    )
    g.add_argument(
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
    workload = workload_from_args(args)
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


# -- the report ----------------------------------------------------------------------------------------------
OURS = "ours:prefix-aware"
TIER_LABELS = {"none": "no HiCache", "host": "host tier", "host+shared": "host + shared storage tier"}


class TieredReport:
    """``--suite tiered``: per tier setting, every contender's figures (and each request's TTFT)."""

    def __init__(
        self,
        workload: str,
        params: dict[str, Any],
        oracle: float,
        rows: Sequence[tuple[str, Summary, list[float]]],
        slo_s: float,
        setup: dict[str, Any],
    ) -> None:
        self.workload = workload
        self.params = params
        self.oracle = oracle
        self.rows = list(rows)
        self.slo_s = slo_s
        self.setup = setup

    def tiers(self) -> list[str]:
        return list(dict.fromkeys(tier for tier, _s, _t in self.rows))

    def find(self, tier: str, name: str) -> Summary | None:
        for t, s, _ttfts in self.rows:
            if t == tier and s.name == name and s.start_error is None:
                return s
        return None

    def goodput(self, summary: Summary, ttfts: Sequence[float]) -> tuple[float, float]:
        """(requests/s that met the TTFT SLO, their share of all requests)."""
        met = sum(1 for t in ttfts if t <= self.slo_s)
        rate = met / summary.duration_s if summary.duration_s else math.nan
        return rate, met / summary.requests if summary.requests else math.nan

    def targets(self) -> list[tuple[str, bool | None, str]]:
        """The scenario's targets (docs/benchmarks.md): (what, met or None when not measurable, figures)."""
        out: list[tuple[str, bool | None, str]] = []
        ours_host, rr_none = self.find("host", OURS), self.find("none", "envoy-rr")
        if ours_host is not None and rr_none is not None:
            cut = 1 - ratio(ours_host.ttft_s["p50"], rr_none.ttft_s["p50"])
            out.append(
                ("ours (host tier) TTFT p50 >= 40% below round robin without HiCache", cut >= 0.40, f"{cut:.0%} lower")
            )
            ours_gpu, rr_gpu = gpu_seconds_per_request(ours_host), gpu_seconds_per_request(rr_none)
            saved = 1 - ratio(ours_gpu, rr_gpu)
            out.append(
                (
                    "ours (host tier) >= 25% fewer GPU-seconds per request than round robin without HiCache",
                    saved >= 0.25 if math.isfinite(saved) else None,
                    f"{saved:.0%} fewer ({fmt(ours_gpu)} vs {fmt(rr_gpu)} s)",
                )
            )
        else:
            out.append(("ours (host tier) vs round robin without HiCache", None, "a run is missing"))
        for tier in self.tiers():
            ours = self.find(tier, OURS)
            peers = [s for t, s, _ in self.rows if t == tier and s.name != OURS and s.start_error is None]
            if ours is None or not peers:
                out.append((f"{TIER_LABELS.get(tier, tier)}: ours at or below every peer", None, "a run is missing"))
                continue
            worse = [
                f"{p.name} {q} {ms(p.ttft_s[q])} < ours {ms(ours.ttft_s[q])} ms"
                for p in peers
                for q in ("p50", "p99")
                if ours.ttft_s[q] > p.ttft_s[q]
            ]
            out.append(
                (
                    f"{TIER_LABELS.get(tier, tier)}: ours TTFT p50 and p99 at or below every peer's",
                    not worse,
                    "; ".join(worse) if worse else f"peers: {', '.join(p.name for p in peers)}",
                )
            )
        return out

    def to_json(self) -> dict[str, Any]:
        rows = []
        for tier, summary, ttfts in self.rows:
            rate, share = self.goodput(summary, ttfts)
            fleet = summary.fleet
            rows.append(
                summary.to_json()
                | {
                    "tier": tier,
                    "goodput_req_s": rate,
                    "goodput_share": share,
                    "gpu_seconds_per_request": gpu_seconds_per_request(summary),
                    "hit_rate_by_tier": {src: fleet.hit_rate(src) for src in ("device", "host", "storage")}
                    if fleet
                    else None,
                }
            )
        out: dict[str, Any] = json_safe(
            {
                "suite": "tiered",
                "workload": self.workload,
                "params": self.params,
                "setup": self.setup,
                "slo_ttft_s": self.slo_s,
                "gpu_only_oracle_hit_rate": self.oracle,
                "rows": rows,
                "targets": [{"target": t, "met": m, "figures": f} for t, m, f in self.targets()],
            }
        )
        return out


def gpu_seconds_per_request(summary: Summary) -> float:
    """Simulated GPU seconds (prefill + decode, whole fleet) per successful request."""
    done = summary.requests - summary.errors
    if summary.fleet is None or done <= 0:
        return math.nan
    return summary.fleet.gpu_seconds / done


def tiered_table(report: TieredReport) -> str:
    """One table per tier setting, then the targets; ratios are against round robin without HiCache."""
    slo_ms = report.slo_s * 1000
    rr = report.find("none", "envoy-rr")
    lines: list[str] = []
    for tier in report.tiers():
        lines += [
            f"**{report.workload}, {TIER_LABELS.get(tier, tier)}** (TTFT SLO {slo_ms:.0f} ms; GPU-only pooled "
            f"oracle hit rate {fmt(report.oracle)})",
            "",
            "| contender | requests | errors | TTFT p50 ms | TTFT p99 ms | hit GPU | hit host | hit storage "
            f"| goodput req/s (share) @{slo_ms:.0f} ms | GPU-s / req | p50 / RR-none | GPU-s / RR-none |",
            "|" + "---|" * 12,
        ]
        for t, s, ttfts in report.rows:
            if t != tier:
                continue
            if s.start_error is not None:
                lines.append(f"| {s.name} | did not start: {s.start_error[:160].replace('|', '/')} |" + " |" * 10)
                continue
            fleet = s.fleet
            hits = [fleet.hit_rate(src) if fleet else math.nan for src in ("device", "host", "storage")]
            rate, share = report.goodput(s, ttfts)
            gpu = gpu_seconds_per_request(s)
            lines.append(
                f"| {s.name} | {s.requests} | {s.errors} | {ms(s.ttft_s['p50'])} | {ms(s.ttft_s['p99'])} "
                f"| {fmt(hits[0])} | {fmt(hits[1])} | {fmt(hits[2])} | {fmt(rate, 2)} ({fmt(share, 2)}) "
                f"| {fmt(gpu)} | {fmt(ratio(s.ttft_s['p50'], rr.ttft_s['p50']) if rr else math.nan, 2)} "
                f"| {fmt(ratio(gpu, gpu_seconds_per_request(rr)) if rr else math.nan, 2)} |"
            )
        lines.append("")
    lines += ["**Targets**", ""]
    for target, met, figures in report.targets():
        mark = "n/a" if met is None else ("met" if met else "NOT met")
        lines.append(f"- {target}: **{mark}** ({figures})")
    missing = report.setup.get("missing_contenders") or []
    if missing:
        lines.append(f"- not in this build, not run: {', '.join(missing)}")
    return "\n".join(lines) + "\n"

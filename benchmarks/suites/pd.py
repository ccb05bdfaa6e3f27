"""``prefix-router bench --suite pd``: prefill/decode disaggregated fleets against the same fleet aggregated.

For each layout (``--layouts 2P2D,3P1D``: prefill x decode simulated workers) the workload (``--workload``: gsp,
or multiturn chat sessions whose history grows) runs through every
PD contender (``--contenders``: smg in PD mode, sgl-router's mini-lb, ours), each on a fresh identical PD
fleet, and through every aggregated contender (``--aggregated-contenders``) on a fresh aggregated fleet of the
same size beside it. Reported per row: TTFT p50/p99, TPOT (time per output token after the first, each
request's mean inter-token latency) p50/p99, goodput (requests/s that met ``--slo-ttft-ms``), the hit rate the
clients saw (decode reports the prefill worker's cached tokens), errors.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import sys
import time
from dataclasses import dataclass
from typing import Any

from benchmarks.argtypes import positive
from benchmarks.client import ClientOptions
from benchmarks.fleet.contenders import create_contender
from benchmarks.fleet.pd_contenders import PD_CONTENDERS, create_pd_contender
from benchmarks.metrics import Summary
from benchmarks.runs import run_one
from benchmarks.suites.shared import add_fleet_arguments, add_run_arguments, fleet_spec, versions
from benchmarks.workloads.flags import add_workload_arguments, workload_from_args

__all__ = ["Layout", "PdRow", "configure", "layouts", "main", "pd_table", "run_pd"]

DEFAULT_PD = "smg-pd,sgl-router-minilb,ours-pd:prefix-aware"
DEFAULT_AGGREGATED = "smg,ours:prefix-aware"
DEFAULT_SPEEDUP = 0.25


@dataclass(frozen=True)
class Layout:
    """A PD fleet's shape: ``prefill`` prefill workers and ``decode`` decode workers (written ``2P2D``)."""

    prefill: int
    decode: int

    @property
    def name(self) -> str:
        return f"{self.prefill}P{self.decode}D"

    @property
    def workers(self) -> int:
        return self.prefill + self.decode


def layouts(text: str) -> list[Layout]:
    """``2P2D,3P1D`` -> layouts (an argparse type)."""
    out = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        match = re.fullmatch(r"(\d+)P(\d+)D", item, re.IGNORECASE)
        if match is None or min(int(match[1]), int(match[2])) < 1:
            raise argparse.ArgumentTypeError(f"a layout is like 2P2D (at least 1P1D), got {item!r}")
        out.append(Layout(int(match[1]), int(match[2])))
    if not out:
        raise argparse.ArgumentTypeError("no layout given")
    return out


@dataclass
class PdRow:
    """One contender on one fleet: its figures and the TTFTs goodput is counted from."""

    layout: str
    fleet: str  # "PD" or "aggregated"
    summary: Summary
    ttfts: list[float]

    def goodput(self, slo_s: float) -> float:
        met = sum(1 for t in self.ttfts if t <= slo_s)
        return met / self.summary.duration_s if self.summary.duration_s else math.nan

    def to_json(self, slo_s: float) -> dict[str, Any]:
        return {
            "layout": self.layout,
            "disaggregated": self.fleet == "PD",
            "goodput_req_s": self.goodput(slo_s),
            **self.summary.to_json(),  # its "fleet" is what the workers counted
        }


def configure(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("PD fleets")
    g.add_argument("--layouts", type=layouts, default=layouts("2P2D,3P1D"), help="PD fleet shapes, e.g. 2P2D,3P1D.")
    g.add_argument(
        "--aggregated-contenders",
        default=DEFAULT_AGGREGATED,
        help="Gateways in front of the aggregated fleet of the same size beside each PD fleet (any routing-suite "
        "contender; empty: none).",
    )
    g.add_argument(
        "--slo-ttft-ms", type=positive(float), default=1000.0, help="TTFT service level for goodput (wall ms)."
    )
    add_workload_arguments(parser, ("gsp", "multiturn"), defaults={"rate": 4.0, "gsp_groups": 8})
    add_fleet_arguments(parser, DEFAULT_SPEEDUP)
    add_run_arguments(
        parser,
        DEFAULT_PD,
        "The gateways in front of each PD fleet, in this order.",
        ", ".join(PD_CONTENDERS),
    )


def _names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


async def run_pd(args: argparse.Namespace) -> tuple[list[PdRow], dict[str, Any]]:
    """Every PD contender on a fresh PD fleet, every aggregated one on a fresh aggregated fleet, per layout."""
    pd_names, agg_names = _names(args.contenders), _names(args.aggregated_contenders)
    for name in pd_names:
        create_pd_contender(name)  # typos fail before any fleet starts
    for name in agg_names:
        create_contender(name)
    workload = workload_from_args(args)
    options = ClientOptions(request_timeout_s=args.request_timeout, prefix_chars=args.ringhash_prefix_chars)
    print(
        f"# {workload.name}: {len(workload.requests)} requests over {workload.duration_s:.1f} s "
        f"(offered {workload.offered_rate:.2f} req/s)",
        file=sys.stderr,
    )
    rows: list[PdRow] = []
    for layout in args.layouts:
        args.workers = layout.workers
        runs = [(name, "PD", fleet_spec(args, prefill=layout.prefill)) for name in pd_names]
        runs += [(name, "aggregated", fleet_spec(args)) for name in agg_names]
        for name, fleet, spec in runs:
            summary, ttfts = await run_one(name, workload, spec, options, args.rate, not args.no_progress)
            rows.append(PdRow(layout.name, fleet, summary, ttfts))
            status = (
                f"did not start: {summary.start_error}"
                if summary.start_error
                else f"TTFT p50 {summary.ttft_s['p50'] * 1000:.0f} ms, p99 {summary.ttft_s['p99'] * 1000:.0f} ms, "
                f"TPOT p50 {summary.tpot_s['p50'] * 1000:.1f} ms, hit {summary.hit_rate:.3f}, errors {summary.errors}"
            )
            print(f"  [{layout.name} {fleet}] {name}: {status}", file=sys.stderr)
    setup = {
        "layouts": [layout.name for layout in args.layouts],
        "profile": args.profile,
        "speedup": args.speedup,
        "capacity_tokens": args.capacity_tokens,
        "page_size": args.page_size,
        "seed": args.seed,
        "rate": args.rate,
        "slo_ttft_ms": args.slo_ttft_ms,
        "workload": dict(workload.params),
        "argv": sys.argv[1:],
        "versions": versions(),
    }
    return rows, setup


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value * 1000:.1f}"


def pd_table(rows: list[PdRow], slo_s: float) -> str:
    """The Markdown table: one line per layout x fleet x contender."""
    lines = [
        f"| layout | fleet | contender | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | goodput req/s "
        f"@{slo_s * 1000:.0f} ms | hit rate | errors |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        s = row.summary
        if s.start_error:
            lines.append(f"| {row.layout} | {row.fleet} | {s.name} | did not start: {s.start_error[:120]} |||||||")
            continue
        hit = "-" if math.isnan(s.hit_rate) else f"{s.hit_rate:.3f}"
        lines.append(
            f"| {row.layout} | {row.fleet} | {s.name} | {_ms(s.ttft_s['p50'])} | {_ms(s.ttft_s['p99'])} | "
            f"{_ms(s.tpot_s['p50'])} | {_ms(s.tpot_s['p99'])} | {row.goodput(slo_s):.2f} | {hit} | "
            f"{s.errors}/{s.requests} |"
        )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    started = time.monotonic()
    try:
        rows, setup = asyncio.run(run_pd(args))
    except ValueError as exc:
        print(f"prefix-router bench: {exc}", file=sys.stderr)
        return 2
    slo_s = args.slo_ttft_ms / 1000.0
    print(pd_table(rows, slo_s))
    if args.json is not None:
        args.json.write_text(json.dumps({"setup": setup, "rows": [r.to_json(slo_s) for r in rows]}, indent=2) + "\n")
        print(f"results written to {args.json}", file=sys.stderr)
    print(f"bench finished in {time.monotonic() - started:.0f} s", file=sys.stderr)
    return 0 if any(r.summary.start_error is None for r in rows) else 1

"""``prefix-router bench --suite matrix``: every workload x offered load x fleet against every contender.

For each fleet and workload the suite first measures round robin's knee (the offered load at which its
fleet would prefill without pause), then runs every contender in every cell (``load x knee``), each on a
fresh identical simulated fleet. It writes ``matrix.json`` (checkpointed after every cell: ``--resume``
continues an interrupted run), ``records/`` (what the client saw of each request, a file per cell and
contender), ``matrix.md`` (ours against the best peer per figure, and every
contender's row with its bootstrap intervals) and a heatmap. What a cell runs: ``benchmarks/matrix/run.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from benchmarks.argtypes import names, positive, positive_list
from benchmarks.fleet.contenders import validate_contender_names
from benchmarks.fleet.shapes import DEFAULT_FLEETS, FLEETS
from benchmarks.matrix.report import matrix_markdown, plot_heatmap
from benchmarks.matrix.run import LOADS, MatrixOptions, load_matrix, run_matrix
from benchmarks.runs import run_one
from benchmarks.suites.shared import add_run_arguments, versions
from benchmarks.workloads.cells import DEFAULT_TRACE, WORKLOADS
from benchmarks.workloads.trace import TraceError

__all__ = ["configure", "main"]

MATRIX_CONTENDERS = "envoy-rr,sgl-router,smg,smg-grpc,ours:prefix-aware"


def configure(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("cells (workloads x loads x fleets)")
    g.add_argument(
        "--matrix-workloads",
        type=names(list(WORKLOADS)),
        default=",".join(WORKLOADS),
        help=f"Comma-separated subset of: {', '.join(WORKLOADS)}.",
    )
    g.add_argument(
        "--matrix-loads",
        type=positive_list(float),
        default=",".join(f"{x:g}" for x in LOADS),
        help="Offered loads as multiples of round robin's knee, comma-separated.",
    )
    g.add_argument(
        "--matrix-fleets",
        type=names(list(FLEETS)),
        default=",".join(DEFAULT_FLEETS),
        help=f"Comma-separated subset of: {', '.join(FLEETS)}.",
    )
    g.add_argument(
        "--matrix-requests", type=positive(int), default=160, help="Requests per run (each cell and contender)."
    )
    g.add_argument(
        "--matrix-max-rate",
        type=positive(float),
        default=10.0,
        help="Keep round robin's knee at or below this many req/s by slowing the simulated GPUs "
        "(the machine running every process must not be what saturates).",
    )
    g.add_argument(
        "--matrix-out",
        type=Path,
        default=Path("matrix"),
        help="Directory for matrix.json (checkpointed after each cell), matrix.md, matrix-heatmap.png and "
        "records/ (each request as the client saw it, a JSON-lines file per cell and contender).",
    )
    g.add_argument("--resume", action="store_true", help="Continue a matrix run from its matrix.json.")
    g.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="The Mooncake JSONL trace of the trace workload.")
    add_run_arguments(parser, MATRIX_CONTENDERS, "The gateways in every cell; envoy-rr also sets each cell's knee.")


def main(args: argparse.Namespace) -> int:
    try:
        contenders = [n.strip() for n in args.contenders.split(",") if n.strip()]
        validate_contender_names(contenders)
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
        trace=args.trace,
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
                list(args.matrix_fleets),
                list(args.matrix_workloads),
                list(args.matrix_loads),
                options,
                run_one,
                out / "matrix.json",
                previous=previous,
                progress=not args.no_progress,
                records_dir=out / "records",
            )
        )
    except (TraceError, ValueError) as exc:
        print(f"prefix-router bench: {exc}", file=sys.stderr)
        return 2
    data["versions"] = versions()
    (out / "matrix.json").write_text(json.dumps(data, indent=1, default=str))
    table = matrix_markdown(data)
    (out / "matrix.md").write_text(table)
    print(table)
    heatmap = plot_heatmap(data, out / "matrix-heatmap.png")
    print(
        f"matrix written to {out}/ (matrix.json, matrix.md{', matrix-heatmap.png' if heatmap else ''}, records/) "
        f"in {time.monotonic() - started:.0f} s",
        file=sys.stderr,
    )
    return 0

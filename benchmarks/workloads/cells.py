"""The standard workloads at a size: what the matrix and the virtual fleet run in each cell.

A cell is one workload at one offered load on one fleet; ``WORKLOADS`` builds each workload for a
rate and a ``CellSize`` (requests, seed, the trace file), with every other shape fixed, so that a
cell means the same thing in the real-time matrix and on the virtual clock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from benchmarks.workloads.base import Workload
from benchmarks.workloads.generated import docqa_workload, gsp_workload, hot_burst_workload, multiturn_workload
from benchmarks.workloads.trace import TraceWindow, read_trace, trace_workload

__all__ = ["DEFAULT_TRACE", "WORKLOADS", "CellSize", "WorkloadBuilder"]

# ../shared next to the repository (never committed; the trace workload says so when it is missing).
DEFAULT_TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "mooncake-conversation.jsonl"


@dataclass(frozen=True)
class CellSize:
    """How big a cell's workload is."""

    requests: int = 160  # per run (the matrix's knee probes too)
    seed: int = 0
    trace: Path = DEFAULT_TRACE


WorkloadBuilder = Callable[[float, CellSize], Workload]


def _gsp(rate: float, o: CellSize) -> Workload:
    groups = max(4, o.requests // 8)
    w = gsp_workload(
        groups=groups,
        prompts_per_group=8,
        system_prompt_len=2048,
        question_len=128,
        output_len=32,
        rate=rate,
        seed=o.seed,
    )
    w.requests = w.requests[: o.requests]
    return w


def _multiturn(rate: float, o: CellSize) -> Workload:
    turns = 5
    w = multiturn_workload(
        sessions=max(4, -(-o.requests // turns)),
        turns=turns,
        system_prompt_len=512,
        question_len=256,
        answer_len=256,
        output_len=32,
        # The whole schedule scales with 1/rate (think time included), so the offered load is
        # proportional to the rate at any size.
        turn_interval_s=12.0 / rate,
        rate=rate,
        seed=o.seed,
    )
    w.requests = w.requests[: o.requests]
    return w


def _hot_burst(rate: float, o: CellSize) -> Workload:
    return hot_burst_workload(
        prefixes=8,
        prefix_len=2048,
        question_len=64,
        output_len=32,
        burst_size=6,
        burst_spacing_s=0.02,
        zipf=1.2,
        rate=rate,
        count=o.requests,
        seed=o.seed,
    )


def _docqa(rate: float, o: CellSize) -> Workload:
    return docqa_workload(
        documents=24,
        document_len=6144,
        question_len=64,
        output_len=32,
        zipf=0.8,
        rate=rate,
        count=o.requests,
        seed=o.seed,
    )


def _trace(rate: float, o: CellSize) -> Workload:
    # The conversation trace's own arrival pattern, sampled to whole conversations, scaled to ``rate``.
    window = TraceWindow(sample=0.25, max_requests=o.requests, max_output=64, max_input=16384)
    records = read_trace(o.trace, 0, o.requests, window.sample)
    span_s = (records[-1].timestamp_ms - records[0].timestamp_ms) / 1000.0
    native = (len(records) - 1) / span_s if span_s > 0 and len(records) > 1 else rate
    window = TraceWindow(
        sample=window.sample, max_requests=o.requests, time_scale=rate / native, max_output=64, max_input=16384
    )
    return trace_workload(o.trace, block_size=512, window=window, seed=o.seed)


WORKLOADS: dict[str, WorkloadBuilder] = {
    "gsp": _gsp,
    "multiturn": _multiturn,
    "trace": _trace,
    "hot-burst": _hot_burst,
    "docqa": _docqa,
}

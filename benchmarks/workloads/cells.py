"""The standard workloads at a size: what the matrix and the virtual fleet run in each cell.

A cell is one workload at one offered load on one fleet; ``WORKLOADS`` builds each workload for a
rate and a ``CellSize`` (requests, seed, the trace file), with every other shape fixed, so that a
cell means the same thing in the real-time matrix and on the virtual clock.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from benchmarks.workloads.base import Workload
from benchmarks.workloads.generated import (
    agent_requests_per_session,
    agent_workload,
    docqa_workload,
    gsp_workload,
    hot_burst_workload,
    multiturn_workload,
)
from benchmarks.workloads.trace import TraceWindow, read_trace, trace_workload

__all__ = [
    "AGENT_STEP_S",
    "DEFAULT_TRACE",
    "MULTITURN_THINK_S",
    "MULTITURN_TURNS",
    "WORKLOADS",
    "CellSize",
    "WorkloadBuilder",
]

# ../shared next to the repository (never committed; the trace workload says so when it is missing).
DEFAULT_TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "mooncake-conversation.jsonl"


@dataclass(frozen=True)
class CellSize:
    """How big a cell's workload is."""

    requests: int = 160  # per run (the matrix's knee probes too)
    seed: int = 0
    trace: Path = DEFAULT_TRACE
    # How many times slower than its profile the simulated GPU runs (1 / speedup): multi-turn's think
    # time stretches with it, so a session's turns follow its answers at any speed.
    gpu_slowdown: float = 1.0


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


# Multi-turn cells: a session's turns arrive this many GPU-seconds apart at every fleet size and load, so a
# larger fleet (a higher rate) gets more sessions at once, not compressed think time; at light load a
# turn's answer (TTFT plus 32 decode steps, well under a second) exists before the next turn arrives.
MULTITURN_TURNS = 5
MULTITURN_THINK_S = 1.0


def _multiturn(rate: float, o: CellSize) -> Workload:
    turns = MULTITURN_TURNS
    think_s = MULTITURN_THINK_S * o.gpu_slowdown
    lifetime_s = (turns - 1) * think_s
    # Sessions start as a Poisson process at rate / turns; enough of them that the first ``requests``
    # arrivals (cut by time) are a steady stream: sessions begin until after the cut, so the run ends at
    # full load rather than ramping down (it ramps up over the first session lifetime).
    sessions = max(4, math.ceil(o.requests / turns + rate * lifetime_s / turns) + 8)
    w = multiturn_workload(
        sessions=sessions,
        turns=turns,
        system_prompt_len=512,
        question_len=256,
        answer_len=256,
        output_len=32,
        turn_interval_s=think_s,
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


# Agent cells: a step's tool runs this many GPU-seconds (0.5-1.5x) before the next step arrives, at every
# fleet size and load, so (like multi-turn) a larger fleet gets more sessions at once.
AGENT_STEP_S = 1.0
_AGENT_STEPS, _AGENT_FAN_OUT, _AGENT_FAN_OUT_SHARE = (2, 8), 3, 0.15


def _agent(rate: float, o: CellSize) -> Workload:
    step_s = AGENT_STEP_S * o.gpu_slowdown
    per_session = agent_requests_per_session(_AGENT_STEPS, _AGENT_FAN_OUT, _AGENT_FAN_OUT_SHARE)
    lifetime_s = (_AGENT_STEPS[1] - 1) * 1.5 * step_s
    # As multi-turn's: sessions begin until after the cut, so the run ends at full load.
    sessions = max(4, math.ceil(o.requests / per_session + rate * lifetime_s / per_session) + 8)
    w = agent_workload(
        sessions=sessions,
        tenants=16,
        tenant_zipf=1.0,
        docs_per_tenant=6,
        doc_zipf=1.0,
        doc_share=0.6,
        steps=_AGENT_STEPS,
        step_s=step_s,
        fan_out=_AGENT_FAN_OUT,
        fan_out_share=_AGENT_FAN_OUT_SHARE,
        output_len=32,
        rate=rate,
        seed=o.seed,
    )
    w.requests = w.requests[: o.requests]
    return w


def _trace(rate: float, o: CellSize) -> Workload:
    # The conversation trace's own arrival pattern, sampled to whole conversations, scaled to ``rate``. The
    # seed picks which quarter of the conversations is kept (its arrivals and sharing are the trace's own, so
    # without that every seed would replay the same requests).
    sample, salt = 0.25, o.seed
    records = read_trace(o.trace, 0, o.requests, sample, salt)
    span_s = (records[-1].timestamp_ms - records[0].timestamp_ms) / 1000.0
    native = (len(records) - 1) / span_s if span_s > 0 and len(records) > 1 else rate
    window = TraceWindow(
        sample=sample,
        sample_salt=salt,
        max_requests=o.requests,
        time_scale=rate / native,
        max_output=64,
        max_input=16384,
    )
    return trace_workload(o.trace, block_size=512, window=window, seed=o.seed)


WORKLOADS: dict[str, WorkloadBuilder] = {
    "gsp": _gsp,
    "multiturn": _multiturn,
    "trace": _trace,
    "hot-burst": _hot_burst,
    "docqa": _docqa,
    "agent": _agent,
}

"""The one workload builder from flags, and the one percentile definition every suite's figures use."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from benchmarks.stats import percentile
from benchmarks.workloads.flags import add_workload_arguments, workload_from_args
from benchmarks.workloads.generated import burst_workload, gsp_workload
from benchmarks.workloads.trace import TraceError


def _parser(kinds: tuple[str, ...], **defaults: object) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=0)
    add_workload_arguments(parser, kinds, defaults=dict(defaults))
    return parser


def test_the_flags_build_the_generator_s_workload_with_the_suite_s_defaults() -> None:
    parser = _parser(("gsp", "burst"), rate=4.0, gsp_groups=3, output_len=5)
    args = parser.parse_args(["--gsp-prompts-per-group", "2", "--gsp-system-len", "64", "--seed", "7"])
    built = workload_from_args(args)
    same = gsp_workload(
        groups=3, prompts_per_group=2, system_prompt_len=64, question_len=128, output_len=5, rate=4.0, seed=7
    )
    assert [r.messages for r in built.requests] == [r.messages for r in same.requests]
    assert [r.arrival_s for r in built.requests] == [r.arrival_s for r in same.requests]
    assert built.params == same.params
    burst = workload_from_args(parser.parse_args(["--workload", "burst", "--burst-groups", "2", "--burst-size", "3"]))
    expected = burst_workload(
        groups=2,
        burst_size=3,
        bursts_per_group=2,
        system_prompt_len=2048,
        question_len=64,
        output_len=5,
        gap_s=0.5,
        spacing_s=0.005,
        seed=0,
    )
    assert [r.messages for r in burst.requests] == [r.messages for r in expected.requests]


def test_a_rate_passed_in_overrides_the_flag_and_max_requests_cuts_the_arrivals() -> None:
    args = _parser(("gsp",), rate=2.0).parse_args(["--gsp-groups", "4", "--max-requests", "5"])
    slow, fast = workload_from_args(args), workload_from_args(args, rate=20.0)
    assert len(slow.requests) == len(fast.requests) == 5
    assert slow.params["rate"] == 2.0 and fast.params["rate"] == 20.0
    assert fast.duration_s < slow.duration_s


def test_flags_only_for_the_kinds_a_suite_takes_and_no_default_for_a_flag_it_lacks() -> None:
    parser = _parser(("longctx",))
    args = parser.parse_args(["--lc-docs", "2"])
    assert args.workload == "longctx" and args.lc_docs == 2
    with pytest.raises(SystemExit):
        parser.parse_args(["--gsp-groups", "2"])  # not a longctx flag
    with pytest.raises(ValueError, match="mt_sessions"):
        _parser(("gsp",), mt_sessions=3)
    with pytest.raises(SystemExit):
        _parser(("gsp",)).parse_args(["--gsp-groups", "0"])  # a clear usage error, not a generator's ValueError


def test_a_trace_keeps_its_own_times_unless_a_rate_is_given(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    records = [{"timestamp": 1000 * i, "input_length": 20, "output_length": 2, "hash_ids": [0, i]} for i in range(4)]
    trace.write_text("".join(json.dumps(r) + "\n" for r in records))
    parser = _parser(("trace",))
    args = parser.parse_args(["--trace", str(trace), "--trace-block-size", "16"])
    assert [r.arrival_s for r in workload_from_args(args).requests] == [0.0, 1.0, 2.0, 3.0]
    assert workload_from_args(args, rate=100.0).duration_s < 1.0
    with pytest.raises(TraceError, match="--trace FILE"):
        workload_from_args(parser.parse_args([]))


def test_percentiles_interpolate_between_ranks() -> None:
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert percentile(values, 50) == pytest.approx(50.5)  # the mean of the middle two, as statistics.median
    assert percentile(values, 99) == pytest.approx(99.01)  # 1 % of the way from the 99th to the 100th
    assert percentile(list(reversed(values)), 0) == 1.0 and percentile(values, 100) == 100.0

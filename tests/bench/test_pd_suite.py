"""``prefix-router bench --suite pd``: layouts, TPOT, and an end-to-end run through smg's PD mode and the mini-lb."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest

from benchmarks.metrics import RequestResult, summarize
from benchmarks.suites.pd import Layout, configure, layouts
from benchmarks.workloads.flags import workload_from_args
from prefix_router.cli import main as cli_main
from tests.support.bench import TINY_GSP, quick_run


def test_layouts_parse_and_refuse_bad_shapes() -> None:
    assert layouts("2P2D, 3p1d") == [Layout(2, 2), Layout(3, 1)]
    assert [layout.name for layout in layouts("1P4D")] == ["1P4D"]
    for bad in ("2P", "0P1D", "P2D", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            layouts(bad)


def test_the_workload_flag_picks_gsp_or_growing_chat_sessions() -> None:
    parser = argparse.ArgumentParser()
    configure(parser)
    gsp = workload_from_args(parser.parse_args(["--gsp-groups", "3", "--gsp-prompts-per-group", "2"]))
    assert gsp.name == "gsp" and len(gsp.requests) == 6
    chat = workload_from_args(parser.parse_args(["--workload", "multiturn", "--mt-sessions", "3", "--mt-turns", "4"]))
    assert chat.name == "multiturn" and len(chat.requests) == 12
    last = max(chat.requests, key=lambda r: len(r.messages or []))
    assert len(last.messages or []) == 1 + 4 + 3  # system, four questions, three answers in the history


def test_tpot_is_the_time_per_output_token_after_the_first() -> None:
    results = [
        RequestResult(0, 0.0, ttft_s=0.1, e2e_s=1.1, output_tokens=11),  # 1.0 s over 10 tokens
        RequestResult(1, 0.0, ttft_s=0.2, e2e_s=0.2, output_tokens=1),  # one token: no TPOT
    ]
    summary = summarize("x", 1.0, results, {}, 1)
    assert summary.tpot_s["p50"] == pytest.approx(0.1)
    assert summary.to_json()["tpot_s"]["mean"] == pytest.approx(0.1)
    assert math.isnan(summarize("x", 1.0, [], {}, 1).tpot_s["p50"])


@pytest.mark.timeout(180)
def test_pd_suite_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "pd.json"
    rc = cli_main(
        [
            "bench",
            "--suite",
            "pd",
            "--layouts",
            "1P1D",
            "--contenders",
            "smg-pd,sgl-router-minilb,ours-pd:prefix-aware",
            "--aggregated-contenders",
            "envoy-rr",
            *TINY_GSP,
            "--rate",
            "10",
            *quick_run(out, speedup="5"),
        ]
    )
    assert rc == 0
    table = capsys.readouterr().out
    assert "| 1P1D | PD | smg-pd |" in table and "| 1P1D | aggregated | envoy-rr |" in table
    rows = json.loads(out.read_text())["rows"]
    assert [(r["layout"], r["disaggregated"], r["name"]) for r in rows] == [
        ("1P1D", True, "smg-pd"),
        ("1P1D", True, "sgl-router-minilb"),
        ("1P1D", True, "ours-pd:prefix-aware"),
        ("1P1D", False, "envoy-rr"),
    ]
    for row in rows:
        assert row["start_error"] is None and row["errors"] == 0 and row["requests"] == 6, row
        assert row["tpot_s"]["p50"] > 0 and row["ttft_s"]["p50"] > 0
        assert row["hit_rate"] > 0  # decode reports the prefill worker's cached tokens (one prefill: all hits)

"""End-to-end smoke run of ``prefix-router bench``: real sim-workers, real gateways, few requests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefix_router.cli import main as cli_main
from tests.support.bench import TINY_GSP, quick_run


@pytest.mark.timeout(90)
def test_bench_two_contenders_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "results.json"
    rc = cli_main(
        [
            "bench",
            "--contenders",
            "envoy-rr,ours:prefix-aware,ours:no-such-policy",
            "--workers",
            "2",
            *TINY_GSP,
            "--rate",
            "20",
            *quick_run(out, speedup="5"),
            "--out-dir",
            str(tmp_path),
        ]
    )
    assert rc == 0
    table = capsys.readouterr().out
    assert "| envoy-rr | 6 | 0 |" in table
    data = json.loads(out.read_text())
    assert 0.5 < data["oracle_hit_rate"] < 0.9
    rows = {c["name"]: c for c in data["contenders"]}
    assert set(rows) == {"envoy-rr", "ours:prefix-aware", "ours:no-such-policy"}
    # A contender that cannot start is a row with its reason, not a silent omission.
    assert "no-such-policy" in rows["ours:no-such-policy"]["start_error"]
    assert "ours:no-such-policy | did not start" in table
    rr = rows["envoy-rr"]
    assert rr["requests"] == 6 and rr["errors"] == 0
    assert rr["ttft_s"]["p50"] > 0 and rr["e2e_s"]["p99"] >= rr["ttft_s"]["p99"]
    assert sum(rr["requests_per_worker"].values()) == 6  # read from the workers' own counters
    assert rr["max_mean_requests"] == pytest.approx(1.0)  # round robin over 2 workers, 6 requests
    assert 0.0 <= rr["hit_rate"] <= data["oracle_hit_rate"] + 1e-9
    ours = rows["ours:prefix-aware"]
    assert ours["start_error"] is None, ours["start_error"]
    assert ours["requests"] == 6 and ours["errors"] == 0
    assert sum(ours["requests_per_worker"].values()) == 6
    assert (tmp_path / "ttft-cdf-gsp-20rps.png").is_file()


def test_bench_rejects_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["bench", "--workload", "trace"]) == 2
    assert "--trace FILE" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["bench", "--rates", "1,x"])
    assert cli_main(["bench", "--contenders", "envoy-foo", "--max-requests", "1"]) == 2
    assert "unknown contender 'envoy-foo'" in capsys.readouterr().err


@pytest.mark.timeout(90)
def test_bench_tiered_suite_with_a_shared_storage_tier(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tiered.json"
    rc = cli_main(
        [
            "bench",
            "--suite",
            "tiered",
            "--contenders",
            "ours:prefix-aware",
            "--tiers",
            "host+shared",
            "--workers",
            "2",
            "--lc-docs",
            "2",
            "--lc-doc-len",
            "512",
            "--lc-questions",
            "3",
            "--lc-sessions",
            "2",
            "--lc-turns",
            "2",
            "--lc-system-len",
            "64",
            "--lc-turn-len",
            "32",
            "--lc-duration",
            "3",
            "--output-len",
            "2",
            *quick_run(out, speedup="20"),
        ]
    )
    assert rc == 0
    table = capsys.readouterr().out
    assert "**longctx, host + shared storage tier**" in table and "| ours:prefix-aware | 10 | 0 |" in table
    (row,) = json.loads(out.read_text())["rows"]
    assert row["tier"] == "host+shared" and row["errors"] == 0
    fleet = row["fleet"]
    assert fleet["busy_prefill_s"] > 0 and row["gpu_seconds_per_request"] > 0
    assert fleet["cached_tokens"]["device"] > 0  # the documents' repeat questions hit
    assert sum(row["hit_rate_by_tier"].values()) == pytest.approx(row["hit_rate"], abs=0.02)


@pytest.mark.timeout(120)
def test_bench_overhead_suite_measures_every_gateway(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "overhead.json"
    rc = cli_main(
        [
            "bench",
            "--suite",
            "overhead",
            "--requests",
            "4",
            "--warmup",
            "1",
            "--sizes",
            "128",
            "--policies",
            "round-robin",
            "--peers",
            "sgl-router",
            "--throughput-s",
            "0.5",
            "--throughput-concurrency",
            "2",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    table = capsys.readouterr().out
    assert "| ours:round-robin | cold | 128 | 4 |" in table and "| sgl-router | warm | 128 | 4 |" in table
    data = json.loads(out.read_text())
    rows = {(r["gateway"], r["case"]): r for r in data["rows"]}
    assert set(rows) == {(g, c) for g in ("ours:round-robin", "sgl-router") for c in ("cold", "warm")}
    for row in rows.values():
        assert 0 < row["direct_p50"] <= row["direct_p99"] and 0 < row["p50"] <= row["p99"]
    assert rows[("ours:round-robin", "cold")]["router_cpu_ms"] is not None  # our router's CPU, from /proc
    assert rows[("sgl-router", "cold")]["router_cpu_ms"] is None
    assert set(data["requests_per_s"]) == {"envoy-direct", "ours:round-robin", "sgl-router"}
    assert all(rate > 0 for rate in data["requests_per_s"].values())


def test_bench_suites_take_only_their_own_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli_main(["bench", "--suite", "overhead", "--lc-docs", "2"])  # a tiered flag
    assert "unrecognized arguments: --lc-docs" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["bench", "--suite", "no-such-suite"])
    assert "invalid choice: 'no-such-suite'" in capsys.readouterr().err

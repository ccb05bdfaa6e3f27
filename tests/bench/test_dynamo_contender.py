"""Dynamo's real KV router as a contender: its selection service fed by the workers' own KV events."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.fleet.dynamo_proxy import sequence_hashes
from prefix_router.cli import main as cli_main


def test_sequence_hashes_chain_and_fit_in_i64() -> None:
    a = sequence_hashes([1, 2, 3])
    assert len(a) == 3 and len(set(a)) == 3
    assert sequence_hashes([1, 2]) == a[:2]  # a prefix's identity does not depend on what follows
    assert sequence_hashes([9, 2])[1] != a[1]
    assert all(-(2**63) <= h < 2**63 for h in a + sequence_hashes([2**64 - 1]))


def test_dynamo_routes_repeated_prefixes_to_their_holders(tmp_path: Path) -> None:
    pytest.importorskip("dynamo.select_service", reason="needs the dynamo extra (ai-dynamo-runtime 1.6.1)")
    out = tmp_path / "results.json"
    rc = cli_main(
        [
            "bench",
            "--contenders",
            "envoy-rr,dynamo",
            "--workers",
            "2",
            "--gsp-groups",
            "3",
            "--gsp-prompts-per-group",
            "4",
            "--gsp-system-len",
            "512",
            "--gsp-question-len",
            "16",
            "--output-len",
            "4",
            "--rate",
            "4",
            "--speedup",
            "5",
            "--json",
            str(out),
            "--no-progress",
        ]
    )
    assert rc == 0
    rows = {c["name"]: c for c in json.loads(out.read_text())["contenders"]}
    dynamo, rr = rows["dynamo"], rows["envoy-rr"]
    assert dynamo["start_error"] is None, dynamo["start_error"]
    assert dynamo["requests"] == 12 and dynamo["errors"] == 0
    assert sum(dynamo["requests_per_worker"].values()) == 12
    # Its indexer sees the workers' events: shared system prompts are found where round robin scatters them.
    assert dynamo["hit_rate"] > rr["hit_rate"]


def test_dynamo_without_its_package_is_a_row_saying_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real_find_spec = importlib.util.find_spec

    def hide_dynamo(name: str, package: str | None = None) -> object:
        return None if name == "dynamo" or name.startswith("dynamo.") else real_find_spec(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", hide_dynamo)
    out = tmp_path / "results.json"
    argv = ["bench", "--contenders", "envoy-rr,dynamo", "--workers", "2", "--gsp-groups", "2"]
    argv += ["--gsp-prompts-per-group", "2", "--gsp-system-len", "64", "--gsp-question-len", "8", "--output-len", "2"]
    assert cli_main(argv + ["--rate", "8", "--speedup", "5", "--json", str(out), "--no-progress"]) == 0
    rows = {c["name"]: c for c in json.loads(out.read_text())["contenders"]}
    assert rows["envoy-rr"]["start_error"] is None and rows["envoy-rr"]["requests"] == 4
    reason = rows["dynamo"]["start_error"]
    assert reason is not None and "not installed" in reason and "ai-dynamo-runtime" in reason
    assert rows["dynamo"]["requests"] == 0 and rows["dynamo"]["ttft_s"]["p50"] is None

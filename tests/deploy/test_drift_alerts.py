"""The index-drift alerts: promtool checks and unit-tests them, and every series they read is one the router exports."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import generate_latest

from extproc.config import EventsConfig, ObservabilityConfig, RouterConfig
from extproc.decision.request import ParsedRequest
from extproc.fleet.workers import Worker, WorkerRegistry
from extproc.serving.app import RouterApp

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "compose" / "alerts" / "drift.yml"
RULE_TESTS = Path(__file__).with_name("drift_alerts.test.yml")


def _promtool() -> str:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package prometheus; .ci/run installs it)")
    return promtool


def test_the_drift_rules_are_valid_and_pass_their_unit_tests() -> None:
    promtool = _promtool()
    checked = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = subprocess.run(
        [promtool, "test", "rules", RULE_TESTS.name], cwd=RULE_TESTS.parent, capture_output=True, text=True, timeout=120
    )
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_every_series_the_rules_read_is_exported_by_the_router() -> None:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    recorded = {rule["record"] for rule in rules if "record" in rule}
    read = {
        name
        for rule in rules
        for name in re.findall(r"[a-z_:]+_total|prefix_router:[a-z_:0-9]+", rule["expr"])
        if name not in recorded
    }
    worker = Worker(id="w0", url="http://127.0.0.1:42200", ip="127.0.0.1", port=42200)
    config = RouterConfig(events=EventsConfig(enabled=False), observability=ObservabilityConfig(drift_sample_rate=1))
    app = RouterApp(config, WorkerRegistry([worker]))
    outcome = app.router.route(ParsedRequest(path="/generate", kind="generate", prompt_text="hello " * 50))
    assert app.router.drift is not None
    app.router.drift.observe(outcome, 0, None)
    app.router.drift.observe(outcome, 999, None)  # a mismatch: its counter appears
    app.router.drift.observe(outcome, None, None)
    exported = {line.split("{")[0] for line in generate_latest(app.telemetry.metrics).decode().splitlines()}
    assert read and read <= exported, read - exported

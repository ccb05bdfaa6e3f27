"""The alerts and the dashboard against the real things: ``promtool test rules`` for every alert, and every
metric that a dashboard query or an alert names is exported by a running stack.

The stack is real (simulated SGLang workers, ``prefix-router serve`` with flow control on, the Envoy
binary, as ``prefix-router up`` runs them); the exported names are scraped from the router's
``/metrics``, Envoy's admin ``/stats/prometheus`` and each worker's ``/metrics``, never listed by hand.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from prefix_router.stack import GatewayStack
from tests.support.gateway_http import post, request
from tests.support.monitoring import (
    DASHBOARD,
    RULES,
    dashboard_queries,
    exported_names,
    load_dashboard,
    metric_names,
    rules,
)

pytestmark = pytest.mark.timeout(120)

RULE_TESTS = Path(__file__).with_name("alerts.test.yml")
# Prometheus makes these per scrape target itself; no target exports them.
PROMETHEUS_SERIES = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}


def test_metric_names_finds_selectors_only() -> None:
    expr = (
        'histogram_quantile(0.95, sum by (le, worker) (rate(a_seconds_bucket{stream="true", x=~"b|c"}[1m]))) '
        '/ on (worker) group_left sum(b:rule:5m offset 15m) > 0.5 * 1e3 and absent(up{job="router"} == 1) '
        'or label_replace(sglang:num_queue_reqs, "d", "$1", "instance", "(.*)") unless vector(0)'
    )
    assert metric_names(expr) == {"a_seconds_bucket", "b:rule:5m", "up", "sglang:num_queue_reqs"}


# -- the alert rules ----------------------------------------------------------------------------------------
def test_alert_rules_pass_their_promtool_unit_tests() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package prometheus; .ci/run installs it)")
    result = subprocess.run(
        [promtool, "test", "rules", RULE_TESTS.name], cwd=RULE_TESTS.parent, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_is_tested_firing_and_quiet() -> None:
    alerts = {rule["alert"] for rule in rules() if "alert" in rule}
    assert len(alerts) >= 9
    fired: set[str] = set()
    quiet: set[str] = set()
    for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for check in case.get("alert_rule_test", []):
            (fired if check["exp_alerts"] else quiet).add(check["alertname"])
    assert alerts <= fired, f"never seen firing: {alerts - fired}"
    assert alerts <= quiet, f"never seen staying quiet: {alerts - quiet}"


# -- against a running stack -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def stack(envoy_bin: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayStack]:
    config = tmp_path_factory.mktemp("monitoring") / "router.yaml"
    config.write_text("flow_control: {enabled: true}\n")  # its families exist only when it is on
    with GatewayStack(sim_workers=2, sim_worker_options={"profile": "instant"}, config=config) as gw:
        prompt = "You are a careful assistant. " * 60
        for i in range(4):  # the same long prefix twice per worker at least: label-bearing series appear
            messages = [{"role": "system", "content": prompt}, {"role": "user", "content": f"question {i}"}]
            for stream in (False, True):
                body = {"model": "m", "messages": messages, "max_tokens": 4, "stream": stream}
                assert post(gw.url + "/v1/chat/completions", body).status == 200
        assert request(gw.url + "/v1/models").status == 200
        yield gw


def _page(url: str) -> str:
    reply = request(url)
    assert reply.status == 200, url
    return reply.body.decode()


def _pages(stack: GatewayStack) -> dict[str, str]:
    pages = {
        "router": _page(f"http://127.0.0.1:{stack.metrics_port}/metrics"),
        "envoy": _page(stack.admin_url + "/stats/prometheus"),
    }
    for url in stack.worker_urls:
        pages[url] = _page(url + "/metrics")
    return pages


def test_every_metric_the_dashboard_and_alerts_name_is_exported(stack: GatewayStack) -> None:
    pages = _pages(stack)
    exported = set().union(*(exported_names(page) for page in pages.values()))
    recorded = {rule["record"] for rule in rules() if "record" in rule}
    used: dict[str, set[str]] = {}
    for expr in dashboard_queries(load_dashboard()):
        used.setdefault(DASHBOARD.name, set()).update(metric_names(expr))
    for rule in rules():
        used.setdefault(RULES.name, set()).update(metric_names(rule["expr"]))
    for source, names in used.items():
        assert len(names) > 10, source  # the parse found the queries' metrics
        missing = names - exported - recorded - PROMETHEUS_SERIES
        assert not missing, f"{source} names metrics no part of the stack exports: {sorted(missing)}"
    # Each source is needed: the dashboard reads all three.
    dashboard_names = used[DASHBOARD.name]
    assert any(n.startswith("prefix_router_") for n in dashboard_names)
    assert any(n.startswith("envoy_") for n in dashboard_names)
    assert any(n.startswith("sglang:") for n in dashboard_names)


def _samples(page: str, name: str) -> dict[str, float]:
    """``name``'s samples on ``page``: label text -> value."""
    out = {}
    for line in page.splitlines():
        if line.startswith((name + "{", name + " ")):
            labels, value = line[len(name) :].rsplit(" ", 1)
            out[labels.strip()] = float(value)
    return out


def test_router_reports_readiness_routing_and_first_byte_per_worker(stack: GatewayStack) -> None:
    page = _pages(stack)["router"]
    assert _samples(page, "prefix_router_ready") == {"": 1.0}
    workers = {url.removeprefix("http://") for url in stack.worker_urls}
    routed = _samples(page, "prefix_router_routed_total")
    assert {re.search(r'worker="([^"]+)"', k).group(1) for k in routed} <= workers  # type: ignore[union-attr]
    assert sum(routed.values()) == 8
    tokens = sum(_samples(page, "prefix_router_routed_tokens_total").values())
    matched = sum(_samples(page, "prefix_router_matched_tokens_total").values())
    assert tokens > 8 * 300 and 0 < matched < tokens  # the shared system prompt was predicted cached
    counts = _samples(page, "prefix_router_time_to_first_byte_seconds_count")
    by_stream = {s: sum(v for k, v in counts.items() if f'stream="{s}"' in k) for s in ("true", "false")}
    assert by_stream == {"true": 4.0, "false": 4.0}
    assert {re.search(r'worker="([^"]+)"', k).group(1) for k in counts} <= workers  # type: ignore[union-attr]

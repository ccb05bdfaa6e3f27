"""The shipped dashboard and alert rules as the monitoring tests read them, and the metric names in PromQL."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

__all__ = [
    "DASHBOARD",
    "RULES",
    "dashboard_panels",
    "dashboard_queries",
    "exported_names",
    "load_dashboard",
    "metric_names",
    "rules",
]

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "prefix-router.json"
RULES = ROOT / "deploy" / "compose" / "alerts" / "prefix-router.yml"
# Grafana's own variables, as a query would see them (any valid duration does for parsing).
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "1m", "$__range": "1h"}


def load_dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def dashboard_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, those inside collapsed rows included."""
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []) if panel["type"] == "row" else [])
    return out


def dashboard_queries(dashboard: dict[str, Any]) -> list[str]:
    """Every query's PromQL, Grafana's variables replaced by what Grafana would put there."""
    out = []
    for panel in dashboard_panels(dashboard):
        for target in panel.get("targets", []):
            expr = target["expr"]
            for name, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(name, value)
            out.append(expr)
    return out


def rules() -> list[dict[str, Any]]:
    """Every rule of the shipped alerts file: alerts and recording rules."""
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


_QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^}]*\}")
_RANGES = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_NAME = re.compile(r"(?<![\w:.$])[A-Za-z_:][\w:]*")
_KEYWORDS = {"and", "or", "unless", "offset", "bool", "by", "without", "on", "ignoring", "group_left", "group_right"}
_KEYWORDS |= {"inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (function, aggregation and label names left out).

    Strings, label matchers, ranges and grouping clauses go first; what is left that looks like a
    name and is not followed by ``(`` (a call) or a keyword selects a metric.
    """
    text = _QUOTED.sub('""', expr)
    text = _MATCHERS.sub("", text)
    text = _RANGES.sub("", text)
    text = _GROUPING.sub("", text)
    names = set()
    for match in _NAME.finditer(text):
        called = text[match.end() :].lstrip().startswith("(")
        if not called and match.group().lower() not in _KEYWORDS:
            names.add(match.group())
    return names


_SUFFIXES = {"histogram": ("_bucket", "_sum", "_count"), "summary": ("", "_sum", "_count")}


def exported_names(page: str) -> set[str]:
    """The names a Prometheus text page exports: its samples', and for families with no sample yet the
    names their TYPE implies (a histogram's ``_bucket``, ``_sum`` and ``_count``)."""
    names: set[str] = set()
    for line in page.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            names.update(name + suffix for suffix in _SUFFIXES.get(kind, ("",)))
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{\s]", line, maxsplit=1)[0])
    return names

"""The Grafana dashboard as shipped (deploy/grafana): generated, well-formed, every query valid PromQL.

Grafana does not install here (no image registry, no Debian package), so the dashboard is checked
against Grafana's own published types for it (npm ``@grafana/schema``, compiled by ``tsc`` with
excess-property checks), against the rules its model sets that types cannot say (unique panel ids,
a 24-column grid with no overlap, a ``datasource`` variable every panel and query uses, a ``refId``
per query), and each query is parsed by Prometheus' own parser (``promtool check rules``). That every
metric a query names is exported by a running stack is tests/deploy/test_monitoring.py's job.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from tests.support.monitoring import DASHBOARD, dashboard_panels, dashboard_queries, load_dashboard

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "deploy" / "grafana"
GRID_WIDTH = 24
PANEL_TYPES = {"row", "timeseries", "stat"}
# Grafana's published dashboard types (npm @grafana/schema, Apache-2.0) and the compiler that checks against them.
SCHEMA_PACKAGES = ("@grafana/schema@13.2.3", "typescript@5.9.3")
SCHEMA_CACHE = Path.home() / ".cache" / "prefix-router" / "grafana-schema-13.2.3"
RAW = "@grafana/schema/dist/types/raw"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("grafana_dashboard", ROOT / "scripts" / "grafana_dashboard.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return load_dashboard()


def test_dashboard_is_the_scripts_output() -> None:
    assert DASHBOARD.read_text() == _script().render(), (
        "deploy/grafana/dashboards/prefix-router.json is stale: run `python scripts/grafana_dashboard.py`"
    )


def test_dashboard_has_what_grafana_requires(dashboard: dict[str, Any]) -> None:
    assert re.fullmatch(r"[A-Za-z0-9_-]{1,40}", dashboard["uid"])  # Grafana's uid limit
    assert dashboard["title"] and isinstance(dashboard["schemaVersion"], int)
    (variable,) = dashboard["templating"]["list"]
    assert (variable["name"], variable["type"], variable["query"]) == ("datasource", "datasource", "prometheus")
    every = dashboard_panels(dashboard)
    ids = [p["id"] for p in every]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) and i > 0 for i in ids)
    taken: set[tuple[int, int]] = set()
    for panel in every:
        assert panel["type"] in PANEL_TYPES, panel["title"]
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["w"] >= 1 and grid["x"] + grid["w"] <= GRID_WIDTH and grid["h"] >= 1, panel
        cells = {(grid["x"] + dx, grid["y"] + dy) for dx in range(grid["w"]) for dy in range(grid["h"])}
        assert not cells & taken, f"{panel['title']} overlaps another panel"
        taken |= cells
        if panel["type"] == "row":
            assert grid["w"] == GRID_WIDTH and grid["h"] == 1
            assert panel["collapsed"] or panel["panels"] == [], "an open row's panels follow it at the top level"
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["description"] and panel["fieldConfig"]["defaults"]["unit"]
        targets = panel["targets"]
        assert targets, panel["title"]
        assert len({t["refId"] for t in targets}) == len(targets)
        for target in targets:
            assert target["datasource"] == panel["datasource"] and target["expr"].strip()


def _typescript(dashboard: dict[str, Any]) -> str:
    """The dashboard, and each panel's options and field config, as constants of Grafana's types."""
    lines = [
        f"import type {{ Dashboard }} from '{RAW}/dashboard/x/types.gen';",
        f"import type {{ Options as Ts, FieldConfig as TsField }} from '{RAW}/composable/timeseries/panelcfg/x/"
        "types.gen';",
        f"import type {{ Options as Stat }} from '{RAW}/composable/stat/panelcfg/x/types.gen';",
        "// JSON spells a TypeScript enum member as its value.",
        "type J<T> = T extends string ? `${T}` : T extends number | boolean | null | undefined ? T"
        " : T extends Array<infer U> ? Array<J<U>> : T extends object ? { [K in keyof T]: J<T[K]> } : T;",
        f"export const dashboard: J<Dashboard> = {json.dumps(dashboard)};",
    ]
    for panel in dashboard_panels(dashboard):
        options = json.dumps(panel.get("options"))
        if panel["type"] == "timeseries":
            lines.append(f"export const options{panel['id']}: J<Ts> = {options};")
            custom = json.dumps(panel["fieldConfig"]["defaults"]["custom"])
            lines.append(f"export const custom{panel['id']}: J<TsField> = {custom};")
        elif panel["type"] == "stat":
            lines.append(f"export const options{panel['id']}: J<Stat> = {options};")
    return "\n".join(lines) + "\n"


@pytest.mark.timeout(300)  # the first run installs the two npm packages
def test_dashboard_type_checks_against_grafanas_schema(dashboard: dict[str, Any], tmp_path: Path) -> None:
    npm = shutil.which("npm")
    if npm is None or shutil.which("node") is None:
        pytest.skip("node and npm not installed (Debian packages nodejs, npm): Grafana's schema types need them")
    tsc = SCHEMA_CACHE / "node_modules" / ".bin" / "tsc"
    if not tsc.exists():
        install = [npm, "install", "--no-audit", "--no-fund", "--prefix", str(SCHEMA_CACHE), *SCHEMA_PACKAGES]
        result = subprocess.run(install, capture_output=True, text=True, timeout=240)
        if result.returncode != 0:
            pytest.skip(f"npm could not install {' '.join(SCHEMA_PACKAGES)}: {result.stderr[-500:]}")
    source = SCHEMA_CACHE / "prefix-router-dashboard.ts"  # beside node_modules, where imports resolve
    source.write_text(_typescript(dashboard))
    result = subprocess.run(
        [str(tsc), "--noEmit", "--strict", "--skipLibCheck", "--moduleResolution", "node", "--target", "es2020"]
        + [str(source)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout[-3000:]


def test_legends_name_only_labels_their_query_keeps(dashboard: dict[str, Any]) -> None:
    """A ``{{label}}`` in a legend must survive the query's aggregation, or every series reads the same."""
    for panel in dashboard_panels(dashboard):
        for target in panel.get("targets", []):
            kept = {
                label.strip() for group in re.findall(r"\bby \(([^)]*)\)", target["expr"]) for label in group.split(",")
            }
            named = set(re.findall(r"\{\{(\w+)\}\}", target["legendFormat"]))
            assert named <= kept, f"{panel['title']}: legend {target['legendFormat']!r}, query keeps {kept}"


def test_every_query_is_valid_promql(dashboard: dict[str, Any], tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package prometheus; .ci/run installs it)")
    exprs = dashboard_queries(dashboard)
    assert len(exprs) > 40
    rules = {"groups": [{"name": "dashboard", "rules": [{"record": f"q{i}", "expr": e} for i, e in enumerate(exprs)]}]}
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump(rules))
    result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_provisioning_loads_the_dashboard_folder_from_the_compose_prometheus() -> None:
    compose = yaml.safe_load((ROOT / "deploy" / "compose" / "grafana.yml").read_text())
    mounts = dict(v.removesuffix(":ro").split(":") for v in compose["services"]["grafana"]["volumes"])
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    (provider,) = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "prefix-router.yml").read_text())[
        "providers"
    ]
    assert mounts["./deploy/grafana/dashboards"] == provider["options"]["path"]
    assert (ROOT / "deploy" / "grafana" / "dashboards").resolve() == DASHBOARD.parent
    (source,) = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())["datasources"]
    main = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    port = main["services"]["prometheus"]["ports"][0].rsplit(":", 1)[1]
    assert source["type"] == "prometheus" and source["url"] == f"http://prometheus:{port}"


def test_grafana_overlay_is_accepted_by_docker_compose() -> None:
    tool = shutil.which("docker-compose")
    if tool is None:
        pytest.skip("docker-compose not installed (Debian package docker-compose; .ci/run installs it)")
    env = {"PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        [tool, "-f", "docker-compose.yml", "-f", "deploy/compose/grafana.yml", "--profile", "sim", "config"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    grafana = yaml.safe_load(result.stdout)["services"]["grafana"]
    for volume in grafana["volumes"]:
        source = volume.split(":")[0] if isinstance(volume, str) else volume["source"]
        assert Path(source).is_dir(), f"{source} is not in the repository"

"""The package's shape, checked: no import cycles, and the arrows between the paths point one way.

The graph is read from the source (``ast``), every ``import`` counted, including those inside
functions (a lazy import is still a dependency). docs/architecture.md draws the same picture.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("extproc", "sglang_workers", "benchmarks", "prefix_router")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                # ``from pkg import module`` depends on the module; ``from module import name`` on the module.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            for imported in targets:
                target = imported
                while target and target not in files:
                    target = target.rpartition(".")[0]  # a name inside a module: depend on the module
                if target and target != name:
                    graph[name].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return out


def _reaches(graph: dict[str, set[str]], module: str, prefixes: tuple[str, ...]) -> list[str]:
    return sorted(t for t in graph[module] if t.startswith(prefixes))


def test_the_graph_sees_the_known_edges() -> None:
    graph = _graph()  # a sanity check of the reader itself, so the tests below cannot pass vacuously
    assert "extproc.sync.hub" in graph["extproc.router"]
    assert "extproc.policies" in graph["extproc.policies.session"]  # a function-level import
    assert "extproc.addresses" in graph["sglang_workers.sim.launch"]


def test_no_import_cycles() -> None:
    assert _cycles(_graph()) == []


def test_the_router_never_imports_the_simulator_benchmarks_or_the_command() -> None:
    graph = _graph()  # extproc is the router and nothing else: no exemption
    offenders = {
        m: _reaches(graph, m, ("sglang_workers", "benchmarks", "prefix_router"))
        for m in graph
        if m.startswith("extproc")
    }
    assert {m: t for m, t in offenders.items() if t} == {}


REQUEST_PATH = (
    "extproc.router",
    "extproc.policies",
    "extproc.servicer",
    "extproc.request",
    "extproc.response",
    "extproc.prompt",
    "extproc.telemetry",
    "extproc.serve_command",
)


def test_sync_path_never_imports_the_request_path() -> None:
    graph = _graph()
    forbidden = (*REQUEST_PATH, "extproc.envoy_config")
    offenders = {m: _reaches(graph, m, forbidden) for m in graph if m.startswith("extproc.sync")}
    assert {m: t for m, t in offenders.items() if t} == {}


def test_request_path_never_imports_the_envoy_config_tooling() -> None:
    graph = _graph()
    offenders = {
        m: _reaches(graph, m, ("extproc.envoy_config",))
        for m in graph
        if m.startswith("extproc") and not m.startswith("extproc.envoy_config")
    }
    assert {m: t for m, t in offenders.items() if t} == {}


def test_the_workers_never_import_the_request_path_the_benchmarks_or_the_command() -> None:
    graph = _graph()
    forbidden = (*REQUEST_PATH, "benchmarks", "prefix_router")
    offenders = {m: _reaches(graph, m, forbidden) for m in graph if m.startswith("sglang_workers")}
    assert {m: t for m, t in offenders.items() if t} == {}


def test_only_the_entry_point_imports_the_commands() -> None:
    """prefix_router.cli is the top: it may import everything, nothing imports it or ``up``.

    The benchmarks may use the stack (``prefix_router.stack``) as a library; the command modules are
    wired only by the entry point, by import statements, so this graph sees each of them.
    """
    graph = _graph()
    importers = {
        m: sorted(t for t in ts if t in ("prefix_router.cli", "prefix_router.up_command")) for m, ts in graph.items()
    }
    assert {m: t for m, t in importers.items() if t and m not in ("prefix_router.cli", "prefix_router.__main__")} == {}
    commands = graph["prefix_router.cli"]
    for module in (
        "prefix_router.up_command",
        "extproc.serve_command",
        "extproc.envoy_config_command",
        "sglang_workers.sim.command",
        "sglang_workers.real.launch_command",
        "benchmarks.bench_command",
    ):
        assert module in commands, module

"""The package's shape, checked: no import cycles, and the arrows between the layers point one way.

The graph is read from the source (``ast``), every ``import`` counted, including those inside
functions (a lazy import is still a dependency). docs/architecture.md draws the same picture:

    prefix_common  <  extproc.{config,clock,memory}  <  extproc.fleet  <  extproc.sync, extproc.decision
        <  extproc.routing  <  extproc.exchange  <  extproc.pd  <  extproc.serving  <  prefix_router.cli

Each layer imports only layers to its left; the simulator (``sglang_workers``) imports only ``prefix_common``.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("extproc", "prefix_common", "sglang_workers", "benchmarks", "prefix_router")


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


def _external(module: str) -> set[str]:
    """Top-level names of the modules outside the project that ``module`` imports (``asyncio``, ``grpc``, ...)."""
    path = ROOT / (module.replace(".", "/") + ".py")
    if not path.exists():
        path = ROOT / module.replace(".", "/") / "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module.split(".")[0])
    return out - {*PACKAGES, "__future__"}


def _violations(
    graph: dict[str, set[str]], importers: tuple[str, ...], forbidden: tuple[str, ...]
) -> dict[str, list[str]]:
    """Modules under ``importers`` that import a module under ``forbidden``, with what they import."""
    found = {m: _reaches(graph, m, forbidden) for m in graph if m.startswith(importers)}
    return {m: t for m, t in found.items() if t}


def test_the_graph_sees_the_known_edges() -> None:
    graph = _graph()  # a sanity check of the reader itself, so the tests below cannot pass vacuously
    assert "extproc.sync.hub" in graph["extproc.serving.app"]
    assert "extproc.serving.command" in graph["prefix_router.cli"]  # a function-level import
    assert "prefix_common.addresses" in graph["sglang_workers.sim.launch"]
    assert "grpc" in _external("extproc.exchange.servicer")


def test_no_import_cycles() -> None:
    assert _cycles(_graph()) == []


def test_the_router_never_imports_the_simulator_benchmarks_or_the_command() -> None:
    # extproc is the router and nothing else: no exemption
    assert _violations(_graph(), ("extproc",), ("sglang_workers", "benchmarks", "prefix_router")) == {}


def test_the_shared_leaf_imports_nothing_of_the_project() -> None:
    assert _violations(_graph(), ("prefix_common",), ("extproc", "sglang_workers", "benchmarks", "prefix_router")) == {}


def test_the_workers_import_only_the_shared_leaf() -> None:
    """The simulator and the real-SGLang launcher are the router's peers, not its users: no ``extproc``."""
    assert _violations(_graph(), ("sglang_workers",), ("extproc", "benchmarks", "prefix_router")) == {}


# Each layer and what it may not import: everything above it.
LAYERS = (
    ("extproc.config", "extproc.clock", "extproc.memory"),
    ("extproc.fleet",),
    ("extproc.sync", "extproc.decision"),
    ("extproc.routing",),
    ("extproc.exchange",),
    ("extproc.pd",),
    ("extproc.serving",),
)


def test_each_layer_imports_only_the_layers_below_it() -> None:
    graph = _graph()
    for i, layer in enumerate(LAYERS):
        above = tuple(m for upper in LAYERS[i + 1 :] for m in upper)
        if above:
            assert _violations(graph, layer, above) == {}, layer


# What the decision may not import: anything that talks to the network, waits or exports (its inputs
# come in as values; the router around it does the I/O).
IO_MODULES = {"asyncio", "aiohttp", "grpc", "zmq", "redis", "socket", "http", "urllib", "subprocess", "opentelemetry"}


def test_the_decision_pipeline_does_no_io() -> None:
    graph = _graph()
    decision = [m for m in graph if m.startswith("extproc.decision")]
    assert "extproc.decision.pipeline" in decision
    assert {m: sorted(_external(m) & IO_MODULES) for m in decision if _external(m) & IO_MODULES} == {}
    # ... nor through the project's own modules: it reaches only the fleet model and the leaves.
    allowed = (
        "extproc.decision",
        "extproc.fleet",
        "extproc.config",
        "extproc.clock",
        "extproc.memory",
        "prefix_common",
    )
    assert {
        m: sorted(t for t in graph[m] if not t.startswith(allowed))
        for m in decision
        if any(not t.startswith(allowed) for t in graph[m])
    } == {}


def test_only_the_serving_layer_enters_prefill_decode() -> None:
    """PD after the decision: ``extproc.pd`` is plugged in by the app; the exchange calls it only for a pair."""
    graph = _graph()
    importers = sorted(m for m, ts in graph.items() if any(t.startswith("extproc.pd") for t in ts))
    assert [m for m in importers if not m.startswith(("extproc.pd", "extproc.serving"))] == []
    assert "extproc.pd.launch" in graph["extproc.serving.app"]


def test_the_sync_path_and_the_decision_never_import_each_other() -> None:
    graph = _graph()
    assert _violations(graph, ("extproc.sync",), ("extproc.decision",)) == {}
    assert _violations(graph, ("extproc.decision",), ("extproc.sync",)) == {}


def test_only_the_entry_point_imports_the_commands() -> None:
    """prefix_router.cli is the top: it may import everything, nothing imports it or ``up``.

    The benchmarks may use the stack (``prefix_router.stack``) and the Envoy config generator as
    libraries; the command modules are wired only by the entry point, by import statements, so this
    graph sees each of them.
    """
    graph = _graph()
    commands = (
        "prefix_router.up_command",
        "extproc.serving.command",
        "prefix_router.envoy_config_command",
        "sglang_workers.sim.command",
        "sglang_workers.real.launch_command",
        "benchmarks.bench_command",
    )
    importers = {m: sorted(t for t in ts if t in ("prefix_router.cli", *commands)) for m, ts in graph.items()}
    assert {m: t for m, t in importers.items() if t and m not in ("prefix_router.cli", "prefix_router.__main__")} == {}
    for module in commands:
        assert module in graph["prefix_router.cli"], module

"""``prefix-router bench`` as one tool: every suite is reachable by ``--suite NAME`` with its own ``--help``,
and no benchmark module is a command of its own that a user would have to know."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from benchmarks.suites import SUITES, suite_module
from prefix_router.cli import main as cli_main

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
# Files that run as processes of their own: the GPU script runs on a bare machine without this project,
# the two servers are child processes the suites start.
STANDALONE = {"gpu_timing.py", "fleet/floor_server.py", "fleet/dynamo_proxy.py"}


def test_every_catalogued_suite_is_a_module_with_its_own_flags_and_a_docstring() -> None:
    files = {p.stem.replace("_", "-") for p in (BENCHMARKS / "suites").glob("*.py")} - {"--init--", "shared"}
    assert files == set(SUITES)  # every suite module is catalogued, and every catalogued suite has a module
    for name in SUITES:
        module = suite_module(name)
        assert callable(module.configure) and callable(module.main), name
        assert (module.__doc__ or "").startswith(f"``prefix-router bench --suite {name}"), name


@pytest.mark.parametrize("name", list(SUITES))
def test_each_suite_has_a_help_that_lists_only_its_flags(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        cli_main(["bench", "--suite", name, "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert f"prefix-router bench --suite {name}" in out  # the suite's own description
    assert "sim-worker-throughput" in out and "decision-digest" in out  # the list of every suite
    # Another suite's flag is not this one's (the routing suite's --gsp-groups is the routing suite's).
    owns_gsp = name in ("routing", "pd", "replicas")
    assert ("--gsp-groups" in out) == owns_gsp, name


def test_no_benchmark_module_is_a_command_of_its_own() -> None:
    with_main = set()
    for path in BENCHMARKS.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            test = node.test if isinstance(node, ast.If) else None
            if isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "__name__":
                with_main.add(str(path.relative_to(BENCHMARKS)))
    assert with_main == STANDALONE


def test_an_unknown_suite_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        cli_main(["bench", "--suite", "matrixx"])
    assert done.value.code == 2
    assert "invalid choice: 'matrixx'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("option", "problem"),
    [
        ("nonsense=1", "invalid prefix-aware options: nonsense: Extra inputs are not permitted"),
        ("tie_rel=-1", "invalid prefix-aware options: tie_rel: Input should be greater"),
        ("sgl-cache-aware.balance_abs_threshold=2.5", "invalid sgl-cache-aware options: balance_abs_threshold"),
        ("dynamo-cost.overlap_weight=1", "--policies does not run 'dynamo-cost'"),
        ("max_work_price=high", "takes [POLICY.]KEY=NUMBER"),
    ],
)
def test_a_bad_policy_option_is_a_usage_error_before_anything_runs(
    option: str, problem: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A misspelt or out-of-range ``--option``, or one for a policy not run, is named at once (exit 2), not a
    traceback minutes into a run."""
    argv = ["bench", "--suite", "virtual-fleet", "--workloads", "gsp", "--sizes", "4", "--loads", "0.5"]
    policies = ["--policies", "prefix-aware,sgl-cache-aware"]
    assert cli_main([*argv, *policies, "--requests", "20", "--seeds", "0", "--option", option]) == 2
    err = capsys.readouterr().err
    assert err.startswith("prefix-router bench: --option") and problem in err
    assert "Traceback" not in err

"""The docs name what the code has: every module in docs/architecture.md's layout, every bench command real."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("extproc", "sglang_workers", "benchmarks", "prefix_router")


def test_every_module_is_named_in_the_architecture_doc() -> None:
    doc = (ROOT / "docs" / "architecture.md").read_text()
    modules = [
        path.relative_to(ROOT)
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        if path.name not in ("__init__.py", "__main__.py")
    ]
    assert len(modules) > 50  # the walk found the tree
    missing = [
        str(path)
        for path in modules
        if str(path) not in doc and f"`{path.name}`" not in doc and f"`{path.stem}`" not in doc
    ]
    assert missing == [], "modules docs/architecture.md does not name (add a row to its layout table)"


DOCS = (
    "README.md",
    "docs/benchmarks.md",
    "docs/benchmarks-log.md",
    "docs/deploy.md",
    "docs/gateway.md",
    "docs/routing.md",
    "docs/sim-worker.md",
    "docs/architecture.md",
)
# Placeholders the docs write for a value the reader picks.
_PLACEHOLDERS = {"S": "0", "W": "gsp", "FILE": "x.json", "NAME": "routing", "N": "2"}


def _bench_commands(text: str) -> list[list[str]]:
    """Every ``prefix-router bench ...`` command in ``text``'s code (blocks and inline, which may wrap lines)."""
    import re
    import shlex

    blocks = re.findall(r"^```[a-z]*\n(.*?)^```", text, flags=re.M | re.S)
    prose = re.sub(r"^```[a-z]*\n.*?^```", "", text, flags=re.M | re.S)
    lines = [line for block in blocks for line in block.replace("\\\n", " ").splitlines()]
    lines += [span.replace("\n", " ") for span in re.findall(r"`([^`]+)`", prose)]
    out = []
    for line in lines:
        for match in re.finditer(r"prefix-router bench(?: [^#]*)?", line):
            words = shlex.split(match.group(0).replace("[", "").replace("]", ""))[2:]
            if "..." in words:
                continue  # "the same command, with ..."
            out.append([_PLACEHOLDERS.get(w, w.split("|")[0]) for w in words])
    return out


def test_every_bench_command_in_the_docs_exists_with_its_flags() -> None:
    """A doc's ``prefix-router bench`` command names a suite that exists and flags that suite takes."""
    import argparse

    from benchmarks.bench_command import suite_for

    commands = [(doc, argv) for doc in DOCS for argv in _bench_commands((ROOT / doc).read_text())]
    assert len(commands) > 40  # the search found the docs' commands
    bad = []
    for doc, argv in commands:
        if "--help" in argv:
            continue
        try:
            parser = argparse.ArgumentParser(prog="prefix-router bench", exit_on_error=False)
            suite_for(argv).configure(parser)
            parser.parse_args(argv)
        except (argparse.ArgumentError, SystemExit) as exc:
            bad.append(f"{doc}: prefix-router bench {' '.join(argv)}: {exc}")
    assert bad == []

"""The docs name what the code has: every module appears in docs/architecture.md's layout."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("extproc", "prefix_common", "sglang_workers", "benchmarks", "prefix_router")


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

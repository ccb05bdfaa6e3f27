"""The docs name what the code has: every module appears in docs/architecture.md's layout, and every path,
module, ``python -m`` target, ``make`` target and ``prefix-router`` command with its flags that the docs, the
README, the comments, docstrings and strings of the code and the comments of the deploy files name exists.

A reference goes stale when a file moves or a flag is renamed; nothing else notices, and a reader who copies
the command gets an error. The checks read the real things: the files in this checkout, the modules' top-level
names (by ``ast``, importing nothing), the Makefile's targets and the argparse parsers ``prefix-router`` itself
builds. A failure lists every stale reference as ``file:line: what``.
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import re
import shlex
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("extproc", "prefix_common", "sglang_workers", "benchmarks", "prefix_router")
MODULE_ROOTS = (*PACKAGES, "tests", "scripts")  # dotted names starting with these are this project's modules
PATH_ROOTS = (*MODULE_ROOTS, "docs", "deploy", "envoy", ".ci")
FILE_SUFFIXES = frozenset({"md", "py", "yaml", "yml", "json", "txt", "toml", "sh", "csv", "png", "log", "c", "so"})
THIS_FILE = Path(__file__).resolve()


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


def test_the_license_is_the_one_pyproject_declares() -> None:
    declared = re.search(r'^license = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    assert declared is not None and declared[1] == "Apache-2.0"
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text.splitlines()[1] and "Version 2.0, January 2004" in text
    assert (
        "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text and "END OF TERMS AND CONDITIONS" in text
    )


# -- where references are read ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Text:
    """A piece of prose or code to check: ``code`` says whether commands may start at its line starts."""

    path: Path
    line: int
    text: str
    code: bool


def _sources() -> Iterator[Path]:
    yield ROOT / "README.md"
    yield from sorted((ROOT / "docs").rglob("*.md"))
    for name in ("Makefile", "Dockerfile", "docker-compose.yml", ".ci/run"):
        if (ROOT / name).exists():
            yield ROOT / name
    for folder in ("deploy", "envoy"):
        yield from sorted(p for p in (ROOT / folder).rglob("*") if p.suffix in (".yaml", ".yml"))
    for folder in MODULE_ROOTS:
        yield from sorted(p for p in (ROOT / folder).rglob("*.py") if p.resolve() != THIS_FILE)


def _joined(lines: list[str], first: int) -> Iterator[tuple[int, str]]:
    """Lines with shell continuations (a trailing backslash) joined, each with the number of its first line."""
    pending, start = "", first
    for number, line in enumerate(lines, first):
        if not pending:
            start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        yield start, pending + line
        pending = ""
    if pending:
        yield start, pending


def _inline_code(text: str, first_line: int, path: Path) -> Iterator[Text]:
    """Backtick spans (``x`` or `x`, possibly wrapped over lines) as code."""
    for match in re.finditer(r"(`+)(.+?)\1", text, re.DOTALL):
        line = first_line + text.count("\n", 0, match.start())
        yield Text(path, line, match[2].replace("\n", " "), True)


def _markdown(path: Path) -> Iterator[Text]:
    lines = path.read_text().splitlines()
    fenced, prose = [], []
    inside = False
    for line in lines:
        if line.lstrip().startswith("```"):
            inside = not inside
            fenced.append("")
            prose.append("")
            continue
        fenced.append(line if inside else "")
        prose.append("" if inside else line)
    for number, line in _joined(fenced, 1):
        if line.strip():
            yield Text(path, number, line, True)
    text = "\n".join(prose)
    yield Text(path, 1, text, False)
    yield from _inline_code(text, 1, path)


def _python(path: Path) -> Iterator[Text]:
    """Comments and string literals (docstrings, help texts, messages): what a reader or a user sees."""
    with path.open("rb") as handle:
        for token in tokenize.tokenize(handle.readline):
            if token.type == tokenize.COMMENT or token.type == tokenize.STRING:
                yield Text(path, token.start[0], token.string, False)
                yield from _inline_code(token.string, token.start[0], path)
            elif token.type == getattr(tokenize, "FSTRING_MIDDLE", -1):
                yield Text(path, token.start[0], token.string, False)


def _commented(path: Path) -> Iterator[Text]:
    """YAML and Dockerfile comments: a command there is written as on a shell line (``#   prefix-router ...``)."""
    lines = path.read_text().splitlines()
    comments = [line.split("#", 1)[1] if line.lstrip().startswith("#") or " #" in line else "" for line in lines]
    for number, line in _joined(comments, 1):
        if line.strip():
            yield Text(path, number, line, True)
            yield from _inline_code(line, number, path)


def _shell(path: Path) -> Iterator[Text]:
    """Makefile and .ci/run: every line is a command line."""
    for number, line in _joined(path.read_text().splitlines(), 1):
        yield Text(path, number, line, True)


def _texts() -> Iterator[Text]:
    for path in _sources():
        if path.suffix == ".md":
            yield from _markdown(path)
        elif path.suffix == ".py":
            yield from _python(path)
        elif path.name in ("Makefile", "run"):
            yield from _shell(path)
        else:
            yield from _commented(path)


# -- what a reference must match ----------------------------------------------------------------------------------


@cache
def _top_level_names(path: Path) -> frozenset[str]:
    """Names a module defines at its top level (classes, functions, assignments, imports)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return frozenset(names)


def _module_file(dotted: str) -> Path | None:
    base = ROOT.joinpath(*dotted.split("."))
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    return None


def _dotted_problem(dotted: str) -> str | None:
    """``pkg.module.Name``: the longest module prefix must exist and the next part be a name it defines."""
    parts = dotted.split(".")
    if parts[-1] in FILE_SUFFIXES:
        return None  # a file name such as benchmarks.md, not a module
    for cut in range(len(parts), 0, -1):
        module = _module_file(".".join(parts[:cut]))
        if module is None:
            continue
        if cut == len(parts):
            return None
        name = parts[cut]
        if name in _top_level_names(module) or (module.parent / name).is_dir():
            return None
        return f"{'.'.join(parts[:cut])} has no {name!r}"
    return f"no module {parts[0]}"


PATH = re.compile(r"(?<![\w/.~$-])((?:" + "|".join(re.escape(r) for r in PATH_ROOTS) + r")/[\w./*-]*[\w*])(?:::(\w+))?")
DOTTED = re.compile(r"(?<![\w/.-])((?:" + "|".join(MODULE_ROOTS) + r")(?:\.\w+)+)")
MARKDOWN_LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
RUN_MODULE = re.compile(r"python3? -m ([\w.]+)")
MAKE = re.compile(r"(?:^\s*(?:\$\s+)?|&&\s*)make ([a-z][\w-]*)", re.MULTILINE)
COMMAND = re.compile(
    r"(?:^\s*(?:\$\s+)?|[/\s(]|^)(?:prefix-router|python3? -m prefix_router) +([a-z][\w-]*)(.*)", re.MULTILINE
)
TERMINATORS = re.compile(r"\s(?:#|\||>|&&|;|\))|[`'\"\]]")


@cache
def _make_targets() -> frozenset[str]:
    return frozenset(re.findall(r"^([\w.-]+):", (ROOT / "Makefile").read_text(), re.MULTILINE))


def _path_problem(text: str, suffix_test: str | None, base: Path) -> str | None:
    """``text`` names a file or folder of the checkout (or, in a doc, one beside the doc: a relative link)."""
    if any(c in text for c in "<{$") or "..." in text:
        return None  # a placeholder, not a path
    text = text.rstrip(".")
    matches: list[Path] = []
    for folder in (ROOT, base):
        matches = sorted(folder.glob(text)) if "*" in text else [folder / text] if (folder / text).exists() else []
        if matches:
            break
    if not matches:
        return f"no file {text}"
    if suffix_test and matches[0].suffix == ".py" and suffix_test not in _top_level_names(matches[0]):
        return f"{text} has no {suffix_test}"
    return None


@cache
def _parser(name: str, suite: tuple[str, ...]) -> argparse.ArgumentParser:
    from prefix_router.cli import subcommand_parser

    return subcommand_parser(name, list(suite))[1]


def _parsers_for(name: str, words: list[str]) -> list[argparse.ArgumentParser]:
    """The parser(s) a command line is read by: a bench suite's own, all of them when the suite is a placeholder."""
    if name != "bench":
        return [_parser(name, ())]
    from benchmarks.bench_command import SUITES

    if "--matrix" in words:
        return [_parser("bench", ("--matrix",))]
    if "--suite" in words and words.index("--suite") + 1 < len(words):
        chosen = words[words.index("--suite") + 1]
        if chosen in SUITES:
            return [_parser("bench", ("--suite", chosen))]
        return [_parser("bench", ("--suite", s)) for s in SUITES] + [_parser("bench", ("--matrix",))]
    return [_parser("bench", ())]


def _looks_literal(word: str) -> bool:
    return bool(re.fullmatch(r"[a-z0-9][\w.:/-]*", word)) and not word.isupper()


def _command_problems(name: str, rest: str) -> list[str]:
    from prefix_router.cli import SUBCOMMANDS

    cut = TERMINATORS.search(rest)
    if name not in SUBCOMMANDS:
        after = (rest[: cut.start()] if cut else rest).split()
        if after and not after[0].startswith("-"):
            return []  # prose or output ("prefix-router gateway is up"), not a command line
        return [f"prefix-router has no command {name!r}"]
    try:
        words = shlex.split(rest[: cut.start()] if cut else rest, comments=False)
    except ValueError:
        words = rest.split()
    if "--" in words:
        words = words[: words.index("--")]  # the rest goes to another program (sglang-launch)
    parsers = _parsers_for(name, words)
    problems = []
    for i, word in enumerate(words):
        if not word.startswith("-") or word == "-":
            continue
        flag = word.split("=", 1)[0]
        actions = [
            p._option_string_actions[option]
            for p in parsers
            for option in p._option_string_actions
            if fnmatch.fnmatchcase(option, flag)
        ]
        shown = [a for a in actions if a.help != argparse.SUPPRESS]
        if not shown:
            legacy = " (a hidden legacy alias: use the current name)" if actions else ""
            problems.append(f"prefix-router {name} has no flag {flag}{legacy}")
            continue
        value = word.split("=", 1)[1] if "=" in word else words[i + 1] if i + 1 < len(words) else None
        choices = shown[0].choices
        if choices is not None and value is not None and _looks_literal(value) and value not in map(str, choices):
            problems.append(f"prefix-router {name} {flag}: {value!r} is not one of {', '.join(map(str, choices))}")
    return problems


def _module_problem(module: str) -> str | None:
    """``python -m module``: the module exists and runs (a ``__main__`` block, or a package's ``__main__.py``)."""
    found = _module_file(module)
    if found is None or (found.name == "__init__.py" and not (found.parent / "__main__.py").exists()):
        return f"python -m {module}: no such runnable module"
    if found.name != "__init__.py" and "__main__" not in found.read_text():
        return f"python -m {module}: the module has no __main__ block"
    return None


def _reference_problems(piece: Text) -> Iterator[tuple[re.Match[str], str]]:
    """Paths, dotted module names and (in a doc) relative links: wherever they are written."""
    text = piece.text
    for match in PATH.finditer(text):
        line_end = text.find("\n", match.end())
        line = text[text.rfind("\n", 0, match.start()) + 1 : None if line_end < 0 else line_end]
        if "kubectl " in line and re.fullmatch(r"deploy/[\w-]+", match[1]):
            continue  # kubectl's deploy/NAME: a Deployment, not this checkout's deploy/ folder
        problem = _path_problem(match[1], match[2], piece.path.parent)
        if problem:
            yield match, problem
    for match in DOTTED.finditer(text):
        problem = _dotted_problem(match[1])
        if problem:
            yield match, f"{match[1]}: {problem}"
    if piece.path.suffix == ".md" and not piece.code:
        for match in MARKDOWN_LINK.finditer(text):
            target = match[1]
            if "://" not in target and not target.startswith("mailto:") and not (piece.path.parent / target).exists():
                yield match, f"link to a missing file {target}"


def _command_line_problems(piece: Text) -> Iterator[tuple[re.Match[str], str]]:
    """``python -m``, ``make`` and ``prefix-router`` command lines: only where code is written."""
    for match in RUN_MODULE.finditer(piece.text):
        problem = _module_problem(match[1]) if match[1].split(".")[0] in MODULE_ROOTS else None
        if problem:
            yield match, problem
    for match in MAKE.finditer(piece.text):
        if match[1] not in _make_targets():
            yield match, f"make {match[1]}: the Makefile has no such target"
    for match in COMMAND.finditer(piece.text):
        for problem in _command_problems(match[1], match[2]):
            yield match, problem


def _problems(piece: Text) -> Iterator[tuple[int, str]]:
    """Every stale reference in ``piece``, with the line of the reference itself (group 1 of its match)."""
    found = [*_reference_problems(piece), *(_command_line_problems(piece) if piece.code else [])]
    for match, problem in found:
        yield piece.line + piece.text.count("\n", 0, match.start(1)), problem


def test_every_named_path_module_and_command_exists() -> None:
    """Files, ``pkg.module.Name``s, ``python -m`` modules, ``make`` targets, ``prefix-router`` commands and flags
    named in the docs, the README, the code's comments and strings, and the deploy files' comments."""
    found: set[str] = set()
    pieces = 0
    for piece in _texts():
        pieces += 1
        for line, problem in _problems(piece):
            found.add(f"{piece.path.relative_to(ROOT)}:{line}: {problem}")
    assert pieces > 1000  # the walk read the tree
    stale = sorted(found, key=lambda s: (s.split(":")[0], int(s.split(":")[1])))
    assert stale == [], f"{len(stale)} stale references:\n" + "\n".join(stale)


def test_the_checks_catch_what_they_are_for() -> None:
    """Each kind of stale reference is caught (so the test above cannot pass by reading nothing)."""
    piece = Text(
        ROOT / "docs" / "example.md",
        1,
        "prefix-router up --sim-workers 2 --engine gpu\n"
        "prefix-router serve --no-such-flag\n"
        "prefix-router frobnicate\n"
        "prefix-router bench --suite tiered --lc-docs 2\n"
        "prefix-router bench --lc-docs 2\n"
        "python -m benchmarks.no_such_module\n"
        "make no-such-target\n"
        "see tests/test_no_such_file.py and tests/test_cli.py::test_no_such_test and extproc.config.NoSuchName",
        True,
    )
    assert sorted(_problems(piece)) == [
        (1, "prefix-router up --engine: 'gpu' is not one of sim, sglang-cpu"),
        (1, "prefix-router up has no flag --sim-workers (a hidden legacy alias: use the current name)"),
        (2, "prefix-router serve has no flag --no-such-flag"),
        (3, "prefix-router has no command 'frobnicate'"),
        (5, "prefix-router bench has no flag --lc-docs"),  # a tiered flag, and bench's default suite is routing
        (6, "benchmarks.no_such_module: benchmarks has no 'no_such_module'"),
        (6, "python -m benchmarks.no_such_module: no such runnable module"),
        (7, "make no-such-target: the Makefile has no such target"),
        (8, "extproc.config.NoSuchName: extproc.config has no 'NoSuchName'"),
        (8, "no file tests/test_no_such_file.py"),
        (8, "tests/test_cli.py has no test_no_such_test"),
    ]
    prose = Text(ROOT / "README.md", 1, "prefix-router gateway is up: http://127.0.0.1:8080", True)
    assert list(_problems(prose)) == []  # output, not a command

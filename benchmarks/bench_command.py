"""``prefix-router bench``: every benchmark of this project, one suite per ``--suite NAME``.

This module only dispatches: ``--suite NAME`` (default ``routing``) picks ``benchmarks/suites/NAME.py``
(``benchmarks.suites.SUITES`` lists them), and the command's parser gets that suite's flags and no
other's, so ``prefix-router bench --suite tiered --help`` lists what the tiered suite takes and a flag
another suite owns is an error rather than silently ignored.
"""

from __future__ import annotations

import argparse
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

from benchmarks.suites import DEFAULT_SUITE, SUITES, suite_module

__all__ = ["BenchSuite", "suite_for"]


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The suite's docstring as written (its paragraphs and lists), and every flag's default that says something."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or "default" in (action.help or "").lower():
            return action.help  # "(default: None)" says nothing; a help that states its default needs no second
        return super()._get_help_string(action)


def _epilog() -> str:
    width = max(len(name) for name in SUITES) + 4
    lines = [
        textwrap.fill(text, 100, initial_indent=f"  {name:<{width - 2}}", subsequent_indent=" " * width)
        for name, text in SUITES.items()
    ]
    return "suites (`prefix-router bench --suite NAME --help` for each one's flags):\n" + "\n".join(lines)


@dataclass(frozen=True)
class BenchSuite:
    """The chosen suite as a subcommand: the selector flag plus the suite's own, and its ``main``."""

    name: str
    module: ModuleType

    def configure(self, parser: argparse.ArgumentParser) -> None:
        parser.formatter_class = _HelpFormatter
        doc = (self.module.__doc__ or "").strip().replace("``", "`")
        parser.description = f"{doc}\n\nSee docs/benchmarks.md for what the figures show and the latest results."
        parser.epilog = _epilog()
        selector = parser.add_argument_group("suite")
        selector.add_argument(
            "--suite",
            choices=list(SUITES),
            default=DEFAULT_SUITE,
            metavar="NAME",
            help="Which benchmark to run (the list below).",
        )
        self.module.configure(parser)

    def main(self, args: argparse.Namespace) -> int:
        return int(self.module.main(args))


def suite_for(argv: Sequence[str]) -> BenchSuite:
    """The suite ``argv`` selects (``--suite NAME``, else the default); its flags are its own."""
    selector = argparse.ArgumentParser(prog="prefix-router bench", add_help=False, allow_abbrev=False)
    selector.add_argument("--suite", choices=list(SUITES), default=DEFAULT_SUITE)
    chosen, _ = selector.parse_known_args(list(argv))
    return BenchSuite(chosen.suite, suite_module(chosen.suite))

"""``prefix-router``: one command, one subcommand per job.

Each subcommand lives in its own module exposing ``configure(parser)`` and ``main(args) -> int``;
this file maps names to those modules. The imports are real import statements (so the architecture
test sees every arrow) inside ``_command``, so a subcommand loads only its own module: ``prefix-router
sim-worker`` never pays for gRPC or Envoy imports and vice versa.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib import metadata
from typing import Protocol

__all__ = ["SUBCOMMANDS", "HelpFormatter", "build_parser", "main", "subcommand_parser", "version"]


class Command(Protocol):
    """What a subcommand module provides."""

    def configure(self, parser: argparse.ArgumentParser) -> None: ...

    def main(self, args: argparse.Namespace) -> int: ...


# name -> one-line help. Order is the order shown in --help.
SUBCOMMANDS: dict[str, str] = {
    "up": "Run the local gateway stack: simulated workers + router + Envoy.",
    "serve": "Run the ext_proc routing service for an Envoy.",
    "envoy-config": "Print Envoy config pieces (filter, clusters, routes) for your own Envoy.",
    "sim-worker": "Run an SGLang-faithful simulated worker (no GPU needed).",
    "sglang-launch": "Print or run the launch command of a real SGLang worker wired for this router.",
    "bench": "Side-by-side benchmarks of gateways and routing policies.",
}


def _command(name: str, argv: Sequence[str]) -> Command:
    """The module behind ``name``, imported now (``bench`` picks its suite's module from ``argv``)."""
    if name == "up":
        from prefix_router import up_command

        return up_command
    if name == "serve":
        from extproc.serving import command as serve_command

        return serve_command
    if name == "envoy-config":
        from prefix_router import envoy_config_command

        return envoy_config_command
    if name == "sim-worker":
        from sglang_workers.sim import command as sim_worker_command

        return sim_worker_command
    if name == "sglang-launch":
        from sglang_workers.real import launch_command

        return launch_command
    if name == "bench":
        from benchmarks import bench_command

        return bench_command.suite_for(argv)
    raise KeyError(name)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` to a flag's help unless the help already says its default or there is none.

    A default of None, False or an empty list means "not given": printing it would say nothing, and a help
    text that explains its own default ("default: 4 simulated, 2 sglang-cpu") must not get a second one.
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text.lower() or action.default in (None, False, [], argparse.SUPPRESS):
            return text
        if action.default == "":
            return f"{text} (default: empty)"
        return super()._get_help_string(action)


def version() -> str:
    """The installed distribution's version (``pyproject.toml``), or ``unknown`` when run from an uninstalled tree."""
    try:
        return metadata.version("prefix-router")
    except metadata.PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    """The top level: ``--help``, ``--version`` and the subcommand names (each subcommand parses its own flags)."""
    parser = argparse.ArgumentParser(
        prog="prefix-router",
        description="Prefix-aware routing gateway for SGLang fleets (Envoy ext_proc).",
        epilog="`prefix-router COMMAND --help` lists a command's flags.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, description=help_text, add_help=False)
    return parser


def subcommand_parser(name: str, argv: Sequence[str] = ()) -> tuple[Command, argparse.ArgumentParser]:
    """The module behind subcommand ``name`` and its parser, configured (``argv`` picks a bench suite)."""
    command = _command(name, argv)
    parser = argparse.ArgumentParser(
        prog=f"prefix-router {name}",
        description=SUBCOMMANDS[name],
        formatter_class=HelpFormatter,
        allow_abbrev=False,  # a flag abbreviated in a script today would break when a longer sibling arrives
    )
    command.configure(parser)
    return command, parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        build_parser().print_help()
        return 0
    if argv[0] not in SUBCOMMANDS:
        # --help and --version exit 0; an unknown option or command is an error (status 2, with the usage).
        parser = build_parser()
        parser.parse_args(argv)
        parser.error("give a command first, e.g. `prefix-router up`")  # e.g. a lone "--": exits 2
    name, rest = argv[0], argv[1:]
    command, parser = subcommand_parser(name, rest)
    args = parser.parse_args(rest)
    try:
        return int(command.main(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

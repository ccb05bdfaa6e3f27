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
from typing import Protocol

__all__ = ["main"]


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prefix-router",
        description="Prefix-aware routing gateway for SGLang fleets (Envoy ext_proc).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, description=help_text, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUBCOMMANDS:
        if argv and argv[0] not in ("-h", "--help") and not argv[0].startswith("-"):
            parser.print_usage(sys.stderr)
            print(f"prefix-router: unknown command {argv[0]!r}; see 'prefix-router --help'", file=sys.stderr)
            return 2
        parser.print_help()
        return 0
    name, rest = argv[0], argv[1:]
    command = _command(name, rest)
    sub_parser = argparse.ArgumentParser(
        prog=f"prefix-router {name}",
        description=SUBCOMMANDS[name],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    command.configure(sub_parser)
    args = sub_parser.parse_args(rest)
    try:
        return int(command.main(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

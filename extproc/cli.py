"""``prefix-router``: one command, one subcommand per job.

Each subcommand lives in its own module exposing ``configure(parser)`` and ``main(args) -> int``;
this file only maps names to modules (imported lazily, so ``prefix-router sim-worker`` never pays
for gRPC or Envoy imports and vice versa).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

__all__ = ["main"]

# name -> (module, one-line help). Order is the order shown in --help.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "up": ("extproc.gateway.up_command", "Run the local gateway stack: simulated workers + router + Envoy."),
    "serve": ("extproc.serve_command", "Run the ext_proc routing service for an Envoy."),
    "envoy-config": (
        "extproc.gateway.envoy_config_command",
        "Print Envoy config pieces (filter, clusters, routes) for your own Envoy.",
    ),
    "sim-worker": ("sglang_workers.sim.command", "Run an SGLang-faithful simulated worker (no GPU needed)."),
    "sglang-launch": (
        "sglang_workers.real.launch_command",
        "Print or run the launch command of a real SGLang worker wired for this router.",
    ),
    "bench": ("benchmarks.bench_command", "Side-by-side benchmarks of gateways and routing policies."),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prefix-router",
        description="Prefix-aware routing gateway for SGLang fleets (Envoy ext_proc).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in SUBCOMMANDS.items():
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
    module_name, help_text = SUBCOMMANDS[name]
    module = importlib.import_module(module_name)
    sub_parser = argparse.ArgumentParser(
        prog=f"prefix-router {name}", description=help_text, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    module.configure(sub_parser)
    args = sub_parser.parse_args(rest)
    try:
        return int(module.main(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

"""``prefix-router bench``: side-by-side benchmarks, one suite per module, picked by ``--suite`` or ``--matrix``.

This module only dispatches: ``--suite routing`` (the default) is ``benchmarks.suites.compare``,
``--suite tiered`` ``benchmarks.suites.tiered``, ``--suite pd`` ``benchmarks.suites.pd``, ``--suite overhead``
``benchmarks.router_overhead``
and ``--matrix`` ``benchmarks.suites.matrix_suite``. Each suite declares only its own flags, so
``prefix-router bench --suite tiered --help`` lists what the tiered suite takes, and a flag another
suite owns is an error rather than silently ignored.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from benchmarks import router_overhead
from benchmarks.suites import compare, matrix_suite, pd, tiered

__all__ = ["SUITES", "BenchSuite", "suite_for"]

# --suite name -> (its module's configure and main, one line of help)
SUITES = {
    "routing": (compare, "the workload through every contender, each on a fresh identical cluster (the default)"),
    "overhead": (
        router_overhead,
        "what each gateway adds to a request, on instant workers (Envoy direct vs ours vs peers)",
    ),
    "tiered": (
        tiered,
        "the tiered-KV-cache scenario (long-context QA + multi-turn chat, a GPU pool smaller than the working set) "
        "through every contender x {no HiCache, host tier, host + shared storage tier}",
    ),
    "pd": (
        pd,
        "prefill/decode disaggregated fleets (2P2D, 3P1D) through smg's PD mode, sgl-router's mini-lb and ours, "
        "beside the same fleet aggregated: TTFT, TPOT, goodput",
    ),
}
MATRIX_HELP = "every workload x offered load x fleet against every contender (a report of cells)"

DESCRIPTION = (
    "Side-by-side benchmarks of gateways and routing policies. Every contender gets its own fresh, identical "
    "cluster of simulated SGLang workers and the same request bytes at the same open-loop arrival times. The "
    "default suite prints a Markdown table (TTFT p50/p90/p99/mean, end-to-end latency, output tokens/s, cache "
    "hit rate, requests per worker max/mean, errors, ratios to round robin and to sgl-router) and the "
    "pooled-cache oracle hit rate. See docs/benchmarks.md."
)


@dataclass(frozen=True)
class BenchSuite:
    """The chosen suite as a subcommand: the selector flags plus its own, and its ``main``."""

    name: str  # a --suite name, or "matrix"
    configure_suite: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]

    def configure(self, parser: argparse.ArgumentParser) -> None:
        this = MATRIX_HELP if self.name == "matrix" else SUITES[self.name][1]
        parser.description = (
            f"{DESCRIPTION} This help is for --{'matrix' if self.name == 'matrix' else 'suite ' + self.name}: {this}."
        )
        parser.epilog = (
            "Suites (each takes only its own flags; see `prefix-router bench --suite NAME --help`): "
            + "; ".join(f"--suite {name}: {help_text}" for name, (_, help_text) in SUITES.items())
            + f"; --matrix: {MATRIX_HELP} (`prefix-router bench --matrix --help`)."
        )
        selector = parser.add_argument_group("suite")
        selector.add_argument("--suite", choices=list(SUITES), default="routing", help="Which benchmark to run.")
        if self.name != "matrix":  # the matrix suite's own flags include --matrix
            selector.add_argument("--matrix", action="store_true", help=f"Run the matrix instead: {MATRIX_HELP}.")
        self.configure_suite(parser)

    def main(self, args: argparse.Namespace) -> int:
        if self.name == "matrix" and args.suite != "routing":
            print(f"prefix-router bench: --matrix is a suite of its own; drop --suite {args.suite}", file=sys.stderr)
            return 2
        return self.run(args)


def suite_for(argv: Sequence[str]) -> BenchSuite:
    """The suite ``argv`` selects (``--matrix``, else ``--suite``, else routing); its flags are its own."""
    selector = argparse.ArgumentParser(prog="prefix-router bench", add_help=False, allow_abbrev=False)
    selector.add_argument("--suite", choices=list(SUITES), default="routing")
    selector.add_argument("--matrix", action="store_true")
    chosen, _ = selector.parse_known_args(list(argv))
    if chosen.matrix:
        return BenchSuite("matrix", matrix_suite.configure, matrix_suite.main)
    module, _ = SUITES[chosen.suite]
    return BenchSuite(chosen.suite, module.configure, module.main)

"""The one way a suite turns its command line into a workload: the workload flags, and the workload they name.

A suite says which workloads it takes (``kinds``) and its own defaults; the flags are the same in
every suite, so ``--gsp-groups`` means the same in ``--suite routing``, ``--suite pd`` and ``--suite
replicas``. ``add_workload_arguments`` declares them (only those of the kinds the suite takes) and
``workload_from_args`` builds the request list they describe, at the suite's rate or one it passes
(a sweep's).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.argtypes import positive
from benchmarks.workloads.base import Workload
from benchmarks.workloads.generated import burst_workload, gsp_workload, longctx_workload, multiturn_workload
from benchmarks.workloads.trace import TraceError, TraceWindow, trace_workload

__all__ = ["KINDS", "add_workload_arguments", "workload_from_args"]

KINDS: dict[str, str] = {
    "gsp": "generated shared prefix (groups of questions sharing a system prompt, Poisson arrivals)",
    "multiturn": "chat sessions whose history grows (a session is the prefix group)",
    "trace": "replay a Mooncake JSONL trace",
    "burst": "fan-out bursts of requests sharing a prefix, a few ms apart (an agent's parallel calls)",
    "longctx": "long-document QA plus multi-turn chat whose working set exceeds the fleet's GPU memory",
}


@dataclass(frozen=True)
class _Flag:
    dest: str  # the option is --dest with dashes
    param: str  # the generator's keyword it fills ("" for the trace's, which fill a window)
    type: Callable[[str], Any]
    default: Any
    help: str

    @property
    def option(self) -> str:
        return "--" + self.dest.replace("_", "-")


_INT, _FLOAT = positive(int), positive(float)

# kind -> its flags, with the defaults a suite gets unless it names others.
_FLAGS: dict[str, tuple[_Flag, ...]] = {
    "gsp": (
        _Flag("gsp_groups", "groups", _INT, 32, "gsp: number of shared system prompts."),
        _Flag("gsp_prompts_per_group", "prompts_per_group", _INT, 8, "gsp: questions per system prompt."),
        _Flag("gsp_system_len", "system_prompt_len", _INT, 2048, "gsp: system prompt length in tokens."),
        _Flag("gsp_question_len", "question_len", _INT, 128, "gsp: question length in tokens."),
    ),
    "multiturn": (
        _Flag("mt_sessions", "sessions", _INT, 24, "multiturn: number of chat sessions."),
        _Flag("mt_turns", "turns", _INT, 5, "multiturn: turns per session."),
        _Flag(
            "mt_system_len",
            "system_prompt_len",
            _INT,
            512,
            "multiturn: tokens of the system prompt every session shares.",
        ),
        _Flag("mt_question_len", "question_len", _INT, 256, "multiturn: user message tokens per turn."),
        _Flag("mt_answer_len", "answer_len", _INT, 256, "multiturn: assistant message tokens per turn in the history."),
        _Flag(
            "mt_turn_interval",
            "turn_interval_s",
            float,
            4.0,
            "multiturn: seconds between a session's turns (fixed, so arrivals stay open-loop).",
        ),
    ),
    "trace": (
        _Flag("trace", "", Path, None, "Trace file, e.g. ../shared/traces/mooncake-conversation.jsonl."),
        _Flag(
            "trace_block_size",
            "",
            _INT,
            512,
            "Tokens per hash id in the trace (Mooncake: 512); each id becomes this many one-token words.",
        ),
        _Flag(
            "trace_sample",
            "",
            _FLOAT,
            1.0,
            "Keep this fraction (0-1] of prefix families, i.e. whole conversations (keyed by each record's second "
            "hash id), so a long trace shrinks to a small cluster with its reuse intact.",
        ),
        _Flag("trace_start", "", int, 0, "Skip this many (sampled) records: the start of the window."),
        _Flag("time_scale", "", _FLOAT, 1.0, "Divide the trace's inter-arrival times by this (10 = ten times faster)."),
        _Flag(
            "max_input_tokens",
            "",
            _INT,
            None,
            "Truncate longer trace prompts to this many tokens (their leading blocks, and so their reuse, stay); "
            "keeps every prompt inside one worker's --capacity-tokens.",
        ),
        _Flag(
            "max_output_tokens",
            "",
            _INT,
            None,
            "Cap each trace request's output_length (decode length does not change routing, but streams cost "
            "client CPU).",
        ),
    ),
    "burst": (
        _Flag("burst_groups", "groups", _INT, 16, "burst: shared system prompts (prefix groups)."),
        _Flag("burst_size", "burst_size", _INT, 6, "burst: requests per burst."),
        _Flag(
            "bursts_per_group", "bursts_per_group", _INT, 2, "burst: bursts of each group (they cycle over the groups)."
        ),
        _Flag("burst_system_len", "system_prompt_len", _INT, 2048, "burst: system prompt tokens."),
        _Flag("burst_question_len", "question_len", _INT, 64, "burst: question tokens."),
        _Flag("burst_gap", "gap_s", _FLOAT, 0.5, "burst: seconds between burst starts."),
        _Flag("burst_spacing", "spacing_s", float, 0.005, "burst: seconds between the requests of a burst."),
    ),
    "longctx": (
        _Flag("lc_docs", "docs", _INT, 24, "longctx: documents of the QA part."),
        _Flag("lc_doc_len", "doc_len", _INT, 8192, "longctx: tokens per document."),
        _Flag("lc_questions", "questions_per_doc", _INT, 5, "longctx: questions asked about each document."),
        _Flag("lc_question_len", "question_len", _INT, 64, "longctx: tokens per question."),
        _Flag("lc_sessions", "sessions", _INT, 16, "longctx: multi-turn chat sessions."),
        _Flag("lc_turns", "turns", _INT, 5, "longctx: turns per chat session."),
        _Flag(
            "lc_system_len", "system_prompt_len", _INT, 1024, "longctx: tokens of the system prompt all sessions share."
        ),
        _Flag("lc_turn_len", "turn_len", _INT, 256, "longctx: tokens of each turn's question and of its answer."),
        _Flag(
            "lc_duration",
            "duration_s",
            _FLOAT,
            48.0,
            "longctx: seconds over which the requests arrive (Poisson): sets the offered load.",
        ),
    ),
}
_RATED = ("gsp", "multiturn", "trace")  # the kinds whose arrivals --rate sets


def add_workload_arguments(
    parser: argparse.ArgumentParser,
    kinds: Sequence[str],
    *,
    defaults: dict[str, Any] | None = None,
    rate_help: str = "Poisson arrival rate in req/s.",
) -> argparse._ArgumentGroup:
    """Declare ``--workload`` (when there is a choice), the common flags and each kind's own, as one group.

    ``defaults`` overrides a flag's default by its destination name (``{"gsp_groups": 8, "rate": 4.0}``).
    """
    unknown = [k for k in kinds if k not in _FLAGS]
    if unknown or not kinds:
        raise ValueError(f"unknown workload kinds {unknown}; choose from {', '.join(_FLAGS)}")
    given = dict(defaults or {})
    g = parser.add_argument_group("workload")
    if len(kinds) > 1:
        g.add_argument(
            "--workload",
            choices=list(kinds),
            default=given.pop("workload", kinds[0]),
            help="; ".join(f"{k}: {KINDS[k]}" for k in kinds) + ".",
        )
    else:
        parser.set_defaults(workload=kinds[0])
    if any(k in _RATED for k in kinds):
        g.add_argument("--rate", type=_FLOAT, default=given.pop("rate", None), help=rate_help)
    g.add_argument(
        "--output-len", type=_INT, default=given.pop("output_len", 32), help="Output tokens per request (max_tokens)."
    )
    g.add_argument(
        "--max-requests",
        type=_INT,
        default=given.pop("max_requests", None),
        help="Keep at most this many requests (trace: from --trace-start on; others: the first N arrivals).",
    )
    for kind in kinds:
        for f in _FLAGS[kind]:
            g.add_argument(f.option, dest=f.dest, type=f.type, default=given.pop(f.dest, f.default), help=f.help)
    if given:
        raise ValueError(f"defaults for flags these workloads do not have: {', '.join(sorted(given))}")
    return g


def workload_from_args(args: argparse.Namespace, rate: float | None = None) -> Workload:
    """The workload ``args`` describe; ``rate`` (else ``--rate``) sets the arrivals of gsp, multiturn, trace.

    A trace with no rate keeps its own timestamps; gsp and multiturn need one.
    """
    kind = args.workload
    rate = args.rate if rate is None and kind in _RATED else rate
    if kind == "trace":
        if args.trace is None:
            raise TraceError("--workload trace needs --trace FILE")
        window = TraceWindow(
            sample=args.trace_sample,
            start=args.trace_start,
            max_requests=args.max_requests,
            time_scale=args.time_scale,
            rate=rate,
            max_output=args.max_output_tokens,
            max_input=args.max_input_tokens,
        )
        return trace_workload(args.trace, block_size=args.trace_block_size, window=window, seed=args.seed)
    shape = {f.param: getattr(args, f.dest) for f in _FLAGS[kind]}
    if kind in _RATED:
        if rate is None:
            raise ValueError(f"the {kind} workload needs a rate (--rate)")
        shape["rate"] = rate
    workload = _GENERATORS[kind](**shape, output_len=args.output_len, seed=args.seed)
    if args.max_requests is not None:
        workload.requests = workload.requests[: args.max_requests]
    return workload


_GENERATORS: dict[str, Callable[..., Workload]] = {
    "gsp": gsp_workload,
    "multiturn": multiturn_workload,
    "burst": burst_workload,
    "longctx": longctx_workload,
}

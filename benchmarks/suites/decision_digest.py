"""``prefix-router bench --suite decision-digest``: a digest of every routing decision on a fixed workload,
to compare two commits' decisions (prints one digest per fleet size: 8, 16, 64, 256 workers).

Run it at two commits: equal digests mean the router took exactly the same decisions (chosen
worker, DP rank, ranking, reason, scores, and every candidate's matched blocks, in-flight count and
page size), step by step, on the same prompts, load reports, stored blocks and clock. The 64-worker
fleet is mixed: eight workers report page size 32 and four run two data-parallel ranks. No worker
runs; the decision pipeline decides in process (``LocalDecider``, built as the router builds it) on a
frozen clock that moves 20 ms a step.
"""

from __future__ import annotations

import argparse
import hashlib
import random

from benchmarks.argtypes import positive, positive_list
from extproc.config import EventsConfig, IndexConfig, PolicyConfig, RouterConfig
from extproc.decision.local import LocalDecider
from extproc.decision.pipeline import RouteOutcome
from extproc.decision.request import ParsedRequest
from extproc.fleet.index import rank_key
from extproc.fleet.reports import WorkerLoad
from extproc.fleet.workers import Worker, WorkerRegistry

__all__ = ["configure", "digest", "main"]


def _fleet(size: int) -> list[Worker]:
    fleet = [
        Worker(id=f"w{i}", url=f"http://127.0.0.1:{42000 + i}", ip="127.0.0.1", port=42000 + i) for i in range(size)
    ]
    if size == 64:  # mixed page sizes and data-parallel ranks
        for w in fleet[:8]:
            w.info = {"page_size": 32}
        for w in fleet[8:12]:
            w.info = {"dp_size": 2}
    return fleet


def _line(out: RouteOutcome) -> str:
    scores = sorted((k, sorted(v.items())) for k, v in out.decision.scores.items())
    candidates = [(c.worker.id, c.matched_blocks, c.in_flight, c.block_size) for c in out.candidates]
    ranked = [w.id for w in out.decision.ranked]
    return f"{out.worker.id} {out.dp_rank} {ranked} {candidates} {out.decision.reason} {scores}"


def digest(size: int, steps: int, max_candidates: int | None = None) -> str:
    """The hex digest of ``steps`` decisions on a ``size``-worker fleet (``max_candidates``: another shortlist)."""
    clock = [1000.0]
    fleet = _fleet(size)
    policy = PolicyConfig() if max_candidates is None else PolicyConfig(max_candidates=max_candidates)
    config = RouterConfig(events=EventsConfig(enabled=False), index=IndexConfig(default_block_size=16), policy=policy)
    router = LocalDecider(config, WorkerRegistry(fleet), clock=lambda: clock[0])
    rng = random.Random(size)
    sha = hashlib.sha256()
    outstanding: list[RouteOutcome] = []
    for step in range(steps):
        if step % 25 == 0:  # fresh load reports now and then
            for w in fleet:
                report = WorkerLoad(
                    num_running_reqs=rng.randrange(4),
                    num_waiting_reqs=rng.randrange(2),
                    num_used_tokens=rng.randrange(10_000),
                    max_total_num_tokens=100_000,
                )
                router.loads.set(w, report)
        prefix = rng.randrange(12)
        words = " ".join(f"w{rng.randrange(3000)}" for _ in range(rng.randint(30, 300)))
        text = f"shared system prompt number {prefix} " * 30 + words
        out = router.route(ParsedRequest(path="/generate", kind="generate", model="m", prompt_text=text))
        if step % 2 == 0:  # half the prompts are then reported cached where they went
            slot = out.worker.id if out.dp_rank is None else rank_key(out.worker.id, out.dp_rank)
            router.index.store(slot, out.request.block_keys)
        sha.update(_line(out).encode())
        outstanding.append(out)
        if step % 3 == 0:
            router.finish(outstanding.pop(0))
        clock[0] += 0.02
    return sha.hexdigest()[:16]


def configure(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("digest")
    g.add_argument("--steps", type=positive(int), default=300, help="Decisions per fleet.")
    g.add_argument("--fleets", type=positive_list(int), default="8,16,64,256", help="Comma-separated fleet sizes.")
    g.add_argument(
        "--max-candidates", type=positive(int), default=None, help="policy.max_candidates (default: the config's)."
    )


def main(args: argparse.Namespace) -> int:
    for size in args.fleets:
        print(f"{size:>4} workers, {args.steps} decisions: {digest(size, args.steps, args.max_candidates)}", flush=True)
    return 0

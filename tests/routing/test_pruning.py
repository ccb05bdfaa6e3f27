"""Candidate pruning: small fleets decide as before, large ones keep the best matches and the least loaded."""

from __future__ import annotations

import random

import pytest
from pydantic import ValidationError

from extproc.clock import MONOTONIC, Clock
from extproc.config import EventsConfig, IndexConfig, PolicyConfig, RouterConfig
from extproc.decision.policies import Candidate
from extproc.decision.pruning import CandidatePruner, load_of
from extproc.decision.request import ParsedRequest
from extproc.fleet.reports import WorkerLoad
from extproc.fleet.workers import Worker, WorkerRegistry
from extproc.serving.app import RouterApp
from tests.support.routing import loopback_workers


def _router(count: int, max_candidates: int, clock: Clock = MONOTONIC) -> RouterApp:
    config = RouterConfig(
        events=EventsConfig(enabled=False),
        index=IndexConfig(default_block_size=16),
        policy=PolicyConfig(max_candidates=max_candidates),
    )
    return RouterApp(config, WorkerRegistry(loopback_workers(count, 42000)), clock=clock)


def _prompt(rng: random.Random, prefix: int) -> ParsedRequest:
    words = " ".join(f"word{rng.randrange(5000)}" for _ in range(rng.randint(50, 400)))
    return ParsedRequest(
        path="/generate", kind="generate", model="m", prompt_text=f"system prompt {prefix} " * 40 + words
    )


def test_a_fleet_no_larger_than_the_shortlist_decides_exactly_as_without_pruning() -> None:
    # Scores read the clock: both routers see the same frozen one, moved on between steps.
    clock = [1000.0]
    pruned, unpruned = _router(8, 8, lambda: clock[0]), _router(8, 1_000_000, lambda: clock[0])
    rng_a, rng_b = random.Random(3), random.Random(3)
    outstanding: list[tuple[object, object]] = []
    for step in range(120):
        a = pruned.router.route(_prompt(rng_a, step % 5))
        b = unpruned.router.route(_prompt(rng_b, step % 5))
        assert a.worker.id == b.worker.id
        assert [w.id for w in a.decision.ranked] == [w.id for w in b.decision.ranked]
        assert a.decision.scores == b.decision.scores
        clock[0] += 0.05
        outstanding.append((a, b))
        if step % 3 == 0:  # some requests finish, some stay in flight: loads differ between workers
            done_a, done_b = outstanding.pop(0)
            pruned.router.finish(done_a)  # type: ignore[arg-type]
            unpruned.router.finish(done_b)  # type: ignore[arg-type]
    assert len({o[0].worker.id for o in outstanding}) > 1  # type: ignore[attr-defined]


def _no_loads_needed() -> list[int]:
    raise AssertionError("a fleet no larger than the shortlist needs no loads")


def test_the_pruner_passes_a_small_fleet_through_untouched() -> None:
    depths = [(i % 3, i % 3, 0) for i in range(16)]
    assert list(CandidatePruner(16).shortlist(depths, _no_loads_needed)) == list(range(16))
    assert len(CandidatePruner(15).shortlist(depths, lambda: [0] * 16)) == 15


def _candidate(worker: Worker, rng: random.Random) -> Candidate:
    gpu = rng.choice([0, 0, 0, 0, rng.randrange(1, 64)])
    host = gpu + rng.choice([0, 0, rng.randrange(0, 8)])
    return Candidate(
        worker=worker,
        in_flight=rng.randrange(0, 12),
        matched_blocks=gpu,
        host_matched_blocks=host,
        shared_matched_blocks=host + rng.choice([0, 0, rng.randrange(0, 8)]),
    )


@pytest.mark.parametrize("keep", [2, 3, 8, 16, 33])
def test_on_a_large_fleet_the_best_matches_and_the_least_loaded_always_survive(keep: int) -> None:
    rng = random.Random(keep)
    workers = loopback_workers(256, 42000)
    pruner = CandidatePruner(keep)
    for _ in range(200):
        candidates = [_candidate(w, rng) for w in workers]
        reports = {
            w.id: WorkerLoad(num_running_reqs=rng.randrange(0, 16), num_waiting_reqs=rng.randrange(0, 4))
            for w in workers
        }
        depth = [(c.shared_matched_blocks, c.host_matched_blocks, c.matched_blocks) for c in candidates]
        loads = [load_of(c.in_flight, reports[c.worker.id]) for c in candidates]
        positions = list(pruner.shortlist(depth, lambda loads=loads: loads))  # type: ignore[misc]
        assert len(positions) == keep
        assert positions == sorted(set(positions))  # the fleet's order is kept, nobody twice
        ranked = sorted(depth, reverse=True)
        # Every worker matching deeper than the ceil(K/2)-th best is kept, and the best one always.
        cut = ranked[(keep + 1) // 2 - 1]
        assert all(i in positions for i, d in enumerate(depth) if d > cut)
        assert max(depth) in [depth[i] for i in positions]
        assert min(loads) in [loads[i] for i in positions]


def test_equally_idle_workers_take_turns_on_the_shortlist() -> None:
    workers = loopback_workers(64, 42000)
    pruner = CandidatePruner(4)
    seen: set[str] = set()
    for _ in range(64):
        seen.update(workers[i].id for i in pruner.shortlist([(0, 0, 0)] * 64, lambda: [0] * 64))
    assert seen == {w.id for w in workers}


def test_the_holder_of_a_prompt_wins_on_a_pruned_large_fleet() -> None:
    app = _router(128, 8)
    rng = random.Random(11)
    first = app.router.route(_prompt(rng, 1))
    app.index.store(first.worker.id, first.request.block_keys)
    app.router.finish(first)
    for _ in range(20):
        again = app.router.route(_prompt(rng, 1))
        assert len(again.candidates) == 8
        assert again.worker.id == first.worker.id
        assert again.matched_blocks > 0
        app.router.finish(again)


def test_a_shortlist_below_two_is_refused() -> None:
    with pytest.raises(ValidationError, match="max_candidates"):
        PolicyConfig(max_candidates=1)
    with pytest.raises(ValueError, match="at least 2"):
        CandidatePruner(1)

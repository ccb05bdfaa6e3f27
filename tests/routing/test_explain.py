"""Explaining a prompt changes nothing: every policy's ``explain`` ranks as its next ``select`` will, and the
router's explain leaves the in-flight counts, the index's record and the policies' books as they were."""

from __future__ import annotations

import random

import pytest

from extproc.config import EventsConfig, RouterConfig
from extproc.decision.pipeline import RouteOutcome
from extproc.decision.policies import POLICIES, Candidate, Decision, Policy, RoutingRequest, create_policy
from extproc.decision.request import ParsedRequest
from extproc.fleet.blocks import block_keys
from extproc.fleet.reports import WorkerLoad
from extproc.fleet.workers import Worker, WorkerRegistry
from extproc.serving.app import RouterApp


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _workers(n: int) -> list[Worker]:
    return [Worker(id=f"w{i}", url=f"http://127.0.0.1:{41000 + i}", ip="127.0.0.1", port=41000 + i) for i in range(n)]


def _seeded(policy: Policy) -> Policy:
    """Policies that break ties at random draw from a generator of their own: seed it (and a fallback's)."""
    for part in (policy, getattr(policy, "fallback", None)):
        rng = getattr(part, "_rng", None)
        if isinstance(rng, random.Random):
            rng.seed(7)
    return policy


def _view(decision: Decision) -> tuple[list[str], str, list[tuple[str, list[tuple[str, float]]]]]:
    scores = sorted((k, sorted(v.items())) for k, v in decision.scores.items())
    return [w.id for w in decision.ranked], decision.reason, scores


def _step(rng: random.Random, workers: list[Worker]) -> tuple[RoutingRequest, list[Candidate]]:
    """A request (sometimes untokenized, sometimes of a known session) and candidates with frequent exact ties."""
    prefix = rng.randrange(3)
    tokens = [prefix] * 32 + [rng.randrange(50) for _ in range(rng.randint(1, 40))]
    tokenized = rng.random() < 0.8
    request = RoutingRequest(
        model="m",
        path="/generate",
        prompt_text=f"system prompt {prefix} " * 10 + " ".join(map(str, tokens)),
        token_ids=tokens if tokenized else None,
        block_keys=block_keys(tokens, 16) if tokenized else [],
        headers={"x-session-id": f"s{rng.randrange(4)}"} if rng.random() < 0.7 else {},
        max_new_tokens=16,
    )
    tie = rng.random() < 0.5
    candidates = [
        Candidate(
            worker=w,
            in_flight=0 if tie else rng.randrange(3),
            load=None if tie else WorkerLoad(num_waiting_reqs=rng.randrange(2), max_total_num_tokens=50_000),
            matched_blocks=0 if tie else rng.randrange(3),
            block_size=16,
        )
        for w in workers
    ]
    return request, candidates


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_explain_ranks_as_the_next_select_and_changes_nothing(name: str) -> None:
    clock = Clock()
    workers = _workers(4)
    plain, explained = (_seeded(create_policy(name, clock=clock)) for _ in range(2))
    rng = random.Random(name)
    pending: list[tuple[RoutingRequest, Worker]] = []
    for _ in range(60):
        request, candidates = _step(rng, workers)
        preview = explained.explain(request, candidates)
        again = explained.explain(request, candidates)  # twice: still nothing moved
        chosen, shadow = plain.select(request, candidates), explained.select(request, candidates)
        assert _view(shadow) == _view(chosen)  # what explain did changed no later decision
        assert _view(preview) == _view(again) == _view(chosen)  # and it said what the decision would be
        for policy, decision in ((plain, chosen), (explained, shadow)):
            policy.on_routed(request, decision)
        pending.append((request, chosen.ranked[0]))
        if rng.random() < 0.4:
            done, worker = pending.pop(0)
            plain.on_complete(done, worker)
            explained.on_complete(done, worker)
        clock.now += 0.013


def _parsed(rng: random.Random) -> ParsedRequest:
    prefix = rng.randrange(4)
    words = " ".join(f"w{rng.randrange(500)}" for _ in range(rng.randint(20, 120)))
    return ParsedRequest(
        path="/generate", kind="generate", model="m", prompt_text=f"shared prefix {prefix} " * 40 + words
    )


def _line(out: RouteOutcome) -> str:
    scores = sorted((k, sorted(v.items())) for k, v in out.decision.scores.items())
    candidates = [(c.worker.id, c.matched_blocks, c.in_flight) for c in out.candidates]
    return f"{out.worker.id} {[w.id for w in out.decision.ranked]} {candidates} {out.decision.reason} {scores}"


async def test_the_routers_explain_leaves_every_later_decision_as_it_would_have_been() -> None:
    """Two routers on one clock see the same requests; one explains each prompt first. Same decisions."""
    clock = Clock()
    config = RouterConfig(events=EventsConfig(enabled=False))
    plain = RouterApp(config, WorkerRegistry(_workers(4)), clock=clock)
    explaining = RouterApp(config, WorkerRegistry(_workers(4)), clock=clock)
    rng = random.Random(11)
    open_: list[tuple[RouteOutcome, RouteOutcome]] = []
    try:
        for step in range(80):
            parsed = _parsed(rng)
            before = (
                [w.in_flight for w in explaining.registry.workers],
                explaining.index.recent_total,
                sorted(explaining.index.memory().items()),
            )
            explained = await explaining.router.explain(parsed)
            after = (
                [w.in_flight for w in explaining.registry.workers],
                explaining.index.recent_total,
                sorted(explaining.index.memory().items()),
            )
            assert after == before  # no slot taken, nothing recorded
            a, b = plain.router.route(parsed), explaining.router.route(parsed)
            assert _line(b) == _line(a)
            assert explained.decision.ranked[0].id == b.worker.id  # explain named the worker the router chose
            open_.append((a, b))
            if step % 3 == 0:
                first, second = open_.pop(0)
                plain.router.finish(first)
                explaining.router.finish(second)
            clock.now += 0.02
    finally:
        await plain.stop()
        await explaining.stop()

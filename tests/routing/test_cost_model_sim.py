"""The learned cost model on real simulated workers of different GPUs, through the router.

Two sim-worker processes with different timing profiles (a 70B-TP4 on H200 beside an 8B on H100;
an 8B on H100 beside an 8B on A100) serve real requests; the router polls their ``/v1/loads`` and
learns each one's prefill constants from what they report. Nothing tells it the profiles: the test
compares what it learned with the profiles' own constants (divided by the workers' ``--speedup``,
since a sped-up worker is a faster GPU) and prints the figures.
"""

from __future__ import annotations

import asyncio
import random
import string
from collections.abc import Iterator

import aiohttp
import pytest

from extproc.config import RouterConfig, WorkerConfig
from extproc.decision.policies.prefix_aware import PrefixAwarePolicy
from extproc.decision.request import ParsedRequest
from extproc.fleet.workers import Worker, WorkerRegistry
from extproc.serving.app import RouterApp
from prefix_router.fleet import start_fleet
from sglang_workers.process import WorkerProcess
from sglang_workers.sim.timing import get_profile

SPEEDUP = 4.0
pytestmark = pytest.mark.timeout(120)


def _words(rng: random.Random, n: int) -> str:
    return " ".join("".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 8))) for _ in range(n))


@pytest.fixture(
    params=[("llama-3.1-70b-tp4-h200", "llama-3.1-8b-h100"), ("llama-3.1-8b-h100", "llama-3.1-8b-a100")],
    ids=["70b-h200+8b-h100", "8b-h100+8b-a100"],
)
def fleet(request: pytest.FixtureRequest) -> Iterator[list[tuple[WorkerProcess, str]]]:
    profiles = list(request.param)
    workers = start_fleet("sim", 2, page_size=16, profile=",".join(profiles), speedup=SPEEDUP, capacity_tokens=200_000)
    try:
        yield list(zip(workers, profiles))
    finally:
        for worker in workers:
            worker.stop()


async def _send(worker: Worker, parsed: ParsedRequest) -> None:
    body = {"model": "m", "messages": parsed.messages, "max_tokens": 1}
    async with aiohttp.ClientSession() as http, http.post(worker.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()


async def test_each_worker_learns_its_own_gpus_constants(fleet: list[tuple[WorkerProcess, str]]) -> None:
    config = RouterConfig(workers=[WorkerConfig(url=w.url) for w, _ in fleet], load={"poll_interval_s": 0.2})
    app = RouterApp(config, WorkerRegistry([Worker.from_config(c) for c in config.workers]))
    policy = app.pipeline.policy
    assert isinstance(policy, PrefixAwarePolicy)
    await app.start()
    rng = random.Random(7)
    documents = [_words(rng, rng.choice((200, 800, 1600))) for _ in range(6)]
    try:
        workers = app.registry.workers
        for i in range(160):  # one request at a time, each worker in turn (the other is out of the candidate set)
            for j, other in enumerate(workers):
                app.registry.set_healthy(other, j == i % len(workers))
            system = rng.choice(documents) if i % 3 else _words(rng, rng.choice((100, 400, 1200, 2400)))
            parsed = ParsedRequest(
                path="/v1/chat/completions",
                kind="chat",
                model="m",
                messages=[
                    {"role": "system", "content": system},
                    {"role": "user", "content": _words(rng, rng.randint(5, 300))},
                ],
            )
            outcome = app.router.route(parsed)
            try:
                await _send(outcome.worker, parsed)
            finally:
                app.router.finish(outcome)
            await asyncio.sleep(0.01)
        for other in workers:
            app.registry.set_healthy(other, True)
        await asyncio.sleep(0.5)  # the last poll
        for worker, (_, name) in zip(app.registry.workers, fleet):
            model = policy.cost_model(worker)
            model.observe(app.loads.get(worker))
            profile = get_profile(name)
            learned = model.prefill
            print(
                f"\n{name} (speedup {SPEEDUP}): learned c0 {learned.c0 * 1e3:.2f} ms, a {learned.a * 1e6:.2f} us, "
                f"b {learned.b * 1e9:.3f} ns from {model.windows} windows; profile / speedup: "
                f"c0 {profile.c0 / SPEEDUP * 1e3:.2f} ms, a {profile.a / SPEEDUP * 1e6:.2f} us, "
                f"b {profile.b / SPEEDUP * 1e9:.3f} ns"
            )
            assert model.windows >= 10, name
            for new, cached in ((256, 1024), (1024, 0), (2048, 1600)):
                truth = (profile.c0 + profile.a * new + profile.b * (new * new + 2 * cached * new)) / SPEEDUP
                assert learned.seconds(new, cached) == pytest.approx(truth, rel=0.15), (name, new, cached)
    finally:
        await app.stop()

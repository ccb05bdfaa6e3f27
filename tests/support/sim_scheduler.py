"""The simulator's scheduler in process, for the tests: a round-number timing profile, schedulers that are
stopped when the test ends, and requests read to their end."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from sglang_workers.sim.config import SimWorkerConfig
from sglang_workers.sim.radix_cache import RadixCache
from sglang_workers.sim.request import Request
from sglang_workers.sim.scheduler import Scheduler
from sglang_workers.sim.timing import TimingProfile

# Round numbers, so that a test can write the expected times down.
PROFILE = TimingProfile(
    "test", "round numbers", c0=0.01, a=1e-5, b=1e-9, d0=0.005, d1=1e-4, d2=1e-8, kv_pool_tokens=100_000
)
VOCAB = list(range(1000, 1100))

Factory = Callable[..., Scheduler]


def plain_scheduler(timing: TimingProfile = PROFILE, **settings: object) -> Scheduler:
    """A scheduler over a GPU-only radix cache, configured by ``settings`` (``SimWorkerConfig`` fields): 16-token
    pages and no KV events unless they say otherwise."""
    config = SimWorkerConfig.model_validate({"page_size": 16, "kv_events": False, **settings})
    return Scheduler(config, timing, RadixCache(config.page_size, enable_events=False), None, VOCAB)


@asynccontextmanager
async def started(build: Factory) -> AsyncIterator[Factory]:
    """A factory of started schedulers (``build(**overrides)`` makes one); all of them stop on exit."""
    made: list[Scheduler] = []

    def factory(**overrides: object) -> Scheduler:
        scheduler = build(**overrides)
        scheduler.start()
        made.append(scheduler)
        return scheduler

    try:
        yield factory
    finally:
        for scheduler in made:
            await scheduler.stop()


async def finish(*reqs: Request) -> None:
    """Read every request's updates to the end (``None``), 10 s at the most."""

    async def drain(req: Request) -> None:
        while await req.updates.get() is not None:
            pass

    await asyncio.wait_for(asyncio.gather(*(drain(r) for r in reqs)), timeout=10)

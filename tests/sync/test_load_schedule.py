"""The load poll's schedule: every worker every ``poll_interval_s`` (one round), and between the rounds every
``startup_poll_interval_s`` a worker the router has sent requests to whose prefill work no report has yet
measured (docs/routing.md, "Load").

Until a window between two reports shows a worker's prefill work, the router prices it on its priors; a fleet's
first burst was routed on them. Real HTTP servers answer ``/v1/loads`` as SGLang 0.5.23 does, one with the
prefill counters and one without (older SGLang), and the tracker runs on a clock the test moves.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from aiohttp import web

from extproc.config import LoadConfig
from extproc.fleet.workers import Worker, WorkerRegistry
from extproc.sync.http import WorkerHttp
from extproc.sync.load import LoadTracker
from tests.support.http_server import serving_app

pytestmark = pytest.mark.timeout(60)


@dataclass
class _Loads:
    """What a worker's ``/v1/loads`` says, and how often it was asked."""

    busy_us: int | None = 0  # None: no prefill counters in the report
    polls: list[str] = field(default_factory=list)


async def _served(state: _Loads) -> AsyncIterator[Worker]:
    async def loads(request: web.Request) -> web.Response:
        state.polls.append(request.path)
        rank: dict[str, int] = {"num_running_reqs": 0, "num_waiting_reqs": 0}
        if state.busy_us is not None:
            rank |= {"total_prefill_uncached_tokens": state.busy_us // 20, "total_prefill_busy_us": state.busy_us}
        return web.Response(text=json.dumps({"loads": [rank]}))

    app = web.Application()
    app.router.add_get("/v1/loads", loads)
    async with serving_app(app) as url:
        yield Worker(id=url, url=url, ip="127.0.0.1", port=int(url.rsplit(":", 1)[1]))


@pytest.fixture
async def counted() -> AsyncIterator[tuple[Worker, _Loads]]:
    state = _Loads()
    async for worker in _served(state):
        yield worker, state


@pytest.fixture
async def uncounted() -> AsyncIterator[tuple[Worker, _Loads]]:
    state = _Loads(busy_us=None)
    async for worker in _served(state):
        yield worker, state


async def test_a_worker_is_polled_sooner_until_its_prefill_work_is_measured(
    counted: tuple[Worker, _Loads], uncounted: tuple[Worker, _Loads]
) -> None:
    (worker, state), (old, old_state) = counted, uncounted
    now = [0.0]
    http = WorkerHttp()
    config = LoadConfig(read_prefill_batches=False)  # /v1/loads only: each poll is one request
    tracker = LoadTracker(config, WorkerRegistry([worker, old]), http, clock=lambda: now[0])
    assert tracker._poller.interval_s == config.startup_poll_interval_s == 0.1

    async def at(t: float) -> tuple[int, int]:
        now[0] = t
        await tracker.poll_due()
        return len(state.polls), len(old_state.polls)

    try:
        assert await at(0.0) == (1, 1)
        assert await at(0.1) == (1, 1)  # nothing sent there: every poll_interval_s
        worker.in_flight = old.in_flight = 1  # the router sent each a request
        assert await at(0.2) == (2, 1)  # polled sooner; the worker without counters is not
        assert tracker.measuring(worker) and not tracker.measuring(old)
        assert await at(0.3) == (3, 1)
        state.busy_us = 5_000  # it prefilled: the next report closes a window with prefill work in it
        assert await at(0.4) == (4, 1)
        assert not tracker.measuring(worker)
        assert await at(0.42) == (4, 1)  # measured: no poll between the rounds
        assert await at(0.5) == (5, 2)  # the round: every worker, every poll_interval_s as before
        assert await at(0.8) == (5, 2)
        assert await at(1.0) == (6, 3)
        decode = Worker(id="d", url=old.url, ip="127.0.0.1", port=old.port, role="decode", in_flight=1)
        assert not tracker.measuring(decode)  # a PD pair's decode side prefills nothing to measure
        off = LoadTracker(LoadConfig(startup_poll_interval_s=0), WorkerRegistry([worker]), http)
        assert off._poller.interval_s == 0.5 and off.poll_every(worker, 0.5, 0.0) == 0.5
    finally:
        await http.close()

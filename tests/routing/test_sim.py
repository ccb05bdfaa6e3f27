"""The router against real sim-worker processes over real HTTP and real ZMQ KV events.

The router is driven directly (``Router.route`` with a ``ParsedRequest``) and each request is then
sent to the chosen worker's HTTP API by the test, so what the worker reports (cached tokens, load)
is the ground truth the router's index is checked against. No Envoy is involved.
"""

from __future__ import annotations

import asyncio
import random
import string
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import aiohttp
import pytest
import zmq
import zmq.asyncio

from extproc.config import RouterConfig, WorkerConfig
from extproc.decision.request import ParsedRequest
from extproc.fleet.workers import Worker, WorkerRegistry
from extproc.serving.app import RouterApp
from prefix_common.addresses import free_ports
from prefix_router.fleet import start_fleet
from sglang_workers.process import WorkerProcess
from tests.support.waiting import until

PAGE = 16
pytestmark = pytest.mark.timeout(60)


def _words(rng: random.Random, n: int) -> str:
    return " ".join("".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 8))) for _ in range(n))


def _chat(system: str, question: str) -> ParsedRequest:
    return ParsedRequest(
        path="/v1/chat/completions",
        kind="chat",
        model="m",
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
    )


@pytest.fixture(scope="module")
def fleet() -> Iterator[list[WorkerProcess]]:
    workers = start_fleet("sim", 3, page_size=PAGE, profile="llama-3.1-8b-h100")
    try:
        yield workers
    finally:
        for worker in workers:
            worker.stop()


def _router(configs: list[WorkerConfig], **load: Any) -> RouterApp:
    config = RouterConfig(workers=configs, load={"poll_interval_s": 0.1, **load})
    return RouterApp(config, WorkerRegistry([Worker.from_config(c) for c in config.workers]))


@pytest.fixture
async def app(fleet: list[WorkerProcess]) -> AsyncIterator[RouterApp]:
    r = _router([WorkerConfig(url=w.url) for w in fleet])
    await r.start()
    try:
        await until(lambda: all(r.events.state(w) == "synced" for w in r.registry.workers))
        yield r
    finally:
        await r.stop()


async def _send(worker: Worker, parsed: ParsedRequest, max_tokens: int = 2) -> dict[str, int]:
    body = {"model": "m", "messages": parsed.messages, "max_tokens": max_tokens}
    async with aiohttp.ClientSession() as http, http.post(worker.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        usage = (await resp.json())["usage"]
    return {"prompt": usage["prompt_tokens"], "cached": usage["prompt_tokens_details"]["cached_tokens"]}


async def _route_and_send(app: RouterApp, parsed: ParsedRequest) -> tuple[Any, dict[str, int]]:
    outcome = app.router.route(parsed)
    try:
        usage = await _send(outcome.worker, parsed)
    finally:
        app.router.finish(outcome)
    return outcome, usage


def _confirmed(app: RouterApp, worker: Worker, keys: list[int]) -> bool:
    held = app.index.blocks(worker.id)
    return all(k in held for k in keys)


async def test_same_prefix_lands_on_the_worker_that_caches_it(app: RouterApp) -> None:
    rng = random.Random(1)
    system = _words(rng, 300)
    first, usage = await _route_and_send(app, _chat(system, "first question?"))
    assert usage["prompt"] == len(first.request.token_ids)  # router's tokens == the worker's
    assert usage["cached"] == 0
    keys = first.request.block_keys
    await until(lambda: _confirmed(app, first.worker, keys), what="KV events of the first request")
    others = [w for w in app.registry.workers if w is not first.worker]
    assert not any(app.index.blocks(w.id) & set(keys) for w in others)

    second, usage = await _route_and_send(app, _chat(system, "a different question"))
    assert second.worker is first.worker
    assert second.decision.reason == "prefix-hit"
    # The index claims exactly what the worker then reports as cached.
    assert second.matched_blocks > 0
    assert usage["cached"] == second.matched_blocks * PAGE


async def test_back_to_back_requests_share_a_worker_before_any_event(app: RouterApp) -> None:
    """A prompt long enough that recomputing it costs more than waiting behind its first copy.

    (A short one may spill to an idle worker: one worker of three busy prices an idle one's second at
    0.5 before any has measured itself, and a short prefill is cheap.)
    """
    rng = random.Random(2)
    system = _words(rng, 2000)
    a = app.router.route(_chat(system, "one"))
    b = app.router.route(_chat(system, "two"))  # no event can have arrived: speculative entries decide
    try:
        assert b.worker is a.worker and b.matched_blocks > 0, b.decision.scores
    finally:
        app.router.finish(a)
        app.router.finish(b)


async def test_overloaded_holder_sheds_to_another_worker(app: RouterApp) -> None:
    rng = random.Random(3)
    system = _words(rng, 700)
    first, _ = await _route_and_send(app, _chat(system, "warm up"))
    holder = first.worker
    await until(lambda: _confirmed(app, holder, first.request.block_keys), what="holder's events")
    # Another router's traffic swamps the holder: long distinct prompts it has to prefill.
    flood = [asyncio.create_task(_send(holder, _chat(_words(rng, 1500), str(i)), max_tokens=16)) for i in range(6)]
    try:
        await until(lambda: (app.loads.get(holder) or _NoLoad).num_waiting_reqs >= 3, what="holder's queue")
        shed = app.router.route(_chat(system, "now"))
        try:
            candidate = next(c for c in shed.candidates if c.worker is holder)
            assert candidate.matched_blocks > 0
            assert shed.worker is not holder and shed.decision.reason == "prefix-spill"
            usage = await _send(shed.worker, _chat(system, "now"))
            assert usage["cached"] == 0
        finally:
            app.router.finish(shed)
    finally:
        await asyncio.gather(*flood)


class _NoLoad:
    num_waiting_reqs = 0


async def test_eviction_on_the_worker_removes_blocks_from_the_index() -> None:
    rng = random.Random(4)
    (small,) = start_fleet("sim", 1, page_size=PAGE, profile="instant", capacity_tokens=1024)
    r = _router([WorkerConfig(url=small.url)])
    try:
        await r.start()
        (worker,) = r.registry.workers
        await until(lambda: r.events.state(worker) == "synced")
        await until(lambda: r.loads.get(worker) is not None, what="a load report (the pool's size)")
        victim = _chat(_words(rng, 60), "q")
        first, _usage = await _route_and_send(r, victim)
        await until(lambda: _confirmed(r, worker, first.request.block_keys), what="stored events")
        for i in range(4):  # each ~300 tokens: the 1024-token pool must evict the victim
            await _route_and_send(r, _chat(_words(rng, 60), str(i)))
        await until(lambda: not r.index.blocks(worker.id) & set(first.request.block_keys), what="removal events")
        assert r.events.views[worker.id][0].stats.blocks_removed > 0
        # The policy learned from the evictions where the worker's pool lets go of a block: after some hundreds
        # of tokens of other prompts, in the router's own count of blocks used since (a 1,024-token pool).
        # An eviction's event may reach the router after it counted its next send there (~300 tokens): the count
        # is then that much above what the pool held (1 in ~10 runs, 68.2 blocks against a 64-block pool).
        horizon = r.pipeline.policy.learned(worker.id)["eviction_horizon_blocks"]
        assert 0 < horizon <= (1024 + 320) // PAGE, horizon
        again = await _send(worker, victim)
        assert again["cached"] == 0  # ground truth: the worker really lost it
    finally:
        await r.stop()
        small.stop()


async def _relay(source: str, ctx: zmq.asyncio.Context, drop: Callable[[int], bool]) -> tuple[str, asyncio.Task[None]]:
    """A lossy network between publisher and router: forwards batches, dropping those ``drop`` picks."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(source)
    pub = ctx.socket(zmq.PUB)
    (port,) = free_ports(1)
    pub.bind(f"tcp://127.0.0.1:{port}")

    async def pump() -> None:
        try:
            while True:
                frames = await sub.recv_multipart()
                if not drop(int.from_bytes(frames[1], "big")):
                    await pub.send_multipart(frames)
        finally:
            sub.close(0)
            pub.close(0)

    return f"tcp://127.0.0.1:{port}", asyncio.create_task(pump())


@pytest.fixture(params=["tagged-3frame", "positional-2frame"])
def replay_target(request: pytest.FixtureRequest, fleet: list[WorkerProcess]) -> Iterator[WorkerProcess]:
    """Both payload encodings and both replay reply shapes SGLang has shipped."""
    if request.param == "tagged-3frame":
        yield fleet[0]
        return
    (old,) = start_fleet("sim", 1, page_size=PAGE, profile="instant", event_format="positional", replay_format=2)
    try:
        yield old
    finally:
        old.stop()


async def test_dropped_batch_is_repaired_by_replay(replay_target: WorkerProcess) -> None:
    rng = random.Random(5)
    target = replay_target
    ctx = zmq.asyncio.Context()
    dropped: list[int] = []
    armed = [False]

    def drop(seq: int) -> bool:
        if armed[0] and not dropped:
            dropped.append(seq)
            return True
        return False

    endpoint, pump = await _relay(target.kv_events_endpoint, ctx, drop)
    r = _router([WorkerConfig(url=target.url, kv_events_endpoint=endpoint, replay_endpoint=target.replay_endpoint)])
    try:
        await r.start()
        (worker,) = r.registry.workers
        await until(lambda: r.events.state(worker) == "synced")
        await asyncio.sleep(0.3)  # relay's own subscription past the slow-joiner window
        armed[0] = True
        lost, _ = await _route_and_send(r, _chat(_words(rng, 200), "lost"))
        await until(lambda: bool(dropped), what="the relay to drop a batch")
        assert not _confirmed(r, worker, lost.request.block_keys)
        later, _ = await _route_and_send(r, _chat(_words(rng, 200), "later"))
        await until(lambda: _confirmed(r, worker, later.request.block_keys), what="later events")
        view = r.events.views[worker.id][0]
        assert view.stats.gaps >= 1 and view.stats.gaps_repaired >= 1
        assert _confirmed(r, worker, lost.request.block_keys)  # recovered from the replay buffer
        assert r.events.state(worker) == "synced"
    finally:
        await r.stop()
        pump.cancel()
        await asyncio.gather(pump, return_exceptions=True)
        ctx.destroy(0)


async def test_restarted_worker_is_reset() -> None:
    rng = random.Random(6)
    (proc,) = start_fleet("sim", 1, page_size=PAGE, profile="instant")
    r = _router([WorkerConfig(url=proc.url)])
    try:
        await r.start()
        (worker,) = r.registry.workers
        await until(lambda: r.events.state(worker) == "synced")
        before, _ = await _route_and_send(r, _chat(_words(rng, 200), "before"))
        await until(lambda: _confirmed(r, worker, before.request.block_keys), what="stored events")
        proc.stop()
        proc.restart(20)  # the same command on the same ports: an empty worker where the old one was
        view = r.events.views[worker.id][0]
        await until(lambda: view.stats.restarts >= 1 and r.events.state(worker) == "synced", what="resync")
        assert r.index.size(worker.id) == 0
        assert r.index.match(before.request.block_keys, [worker.id]) == {worker.id: 0}
    finally:
        await r.stop()
        proc.stop()

"""Prefill/decode pairs on the router side: roles, the pair's choice, bootstrap fields, the prefill leg.

The pair is chosen by the real router (index, policies, in-flight counts); the prefill leg and the
decode abort go over real HTTP to small aiohttp servers that record what SGLang's PD endpoints would
receive. The whole path through Envoy and simulated PD workers is in tests/gateway/test_pd_gateway.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest
from aiohttp import web

from extproc.config import ConfigError, EventsConfig, PdConfig, RouterConfig, load_config
from extproc.decision.pipeline import NoWorkerError
from extproc.decision.policies import Candidate, RoutingRequest
from extproc.decision.policies.decode_load import DecodeLoadPolicy, decode_queue
from extproc.decision.request import ParsedRequest
from extproc.fleet.info import bootstrap_port, disaggregation_role
from extproc.fleet.reports import WorkerLoad
from extproc.fleet.roles import split_roles
from extproc.fleet.workers import Worker, WorkerRegistry
from extproc.pd.bootstrap import ROOM_LIMIT, bootstrap_body
from extproc.serving.app import RouterApp
from prefix_common.addresses import free_port
from tests.support.http_server import start_app

TOKENS = list(range(100, 164))  # four full pages of 16


def _worker(name: str, port: int, mode: str | None, bootstrap: int | None = None) -> Worker:
    info: dict[str, Any] = {} if mode is None else {"disaggregation_mode": mode}
    if bootstrap is not None:
        info["disaggregation_bootstrap_port"] = bootstrap
    return Worker(id=name, url=f"http://127.0.0.1:{port}", ip="127.0.0.1", port=port, info=info)


def _router(workers: list[Worker], **pd: Any) -> RouterApp:
    config = RouterConfig(events=EventsConfig(enabled=False), pd=PdConfig(**pd))
    return RouterApp(config, WorkerRegistry(workers))


def _parsed() -> ParsedRequest:
    return ParsedRequest(path="/generate", kind="generate", input_ids=list(TOKENS))


def _hold(app: RouterApp, worker_id: str, blocks: int) -> None:
    """The index says ``worker_id`` caches the prompt's first ``blocks`` pages (as its KV events would)."""
    keys = app.pipeline.prompts.chain(_parsed(), TOKENS, (16, ""))
    app.index.store(worker_id, keys[:blocks])


def test_roles_come_from_configuration_first_then_server_info() -> None:
    configured = _worker("c", 1, "decode")
    configured.role = "prefill"
    assert disaggregation_role(configured) == "prefill"
    assert disaggregation_role(_worker("d", 2, "decode")) == "decode"
    assert disaggregation_role(_worker("n", 3, "null")) == "aggregated"  # SGLang's word for aggregated
    assert disaggregation_role(_worker("u", 4, None)) == "aggregated"  # not discovered yet
    roles = split_roles([_worker("p", 5, "prefill"), _worker("d", 6, "decode"), _worker("a", 7, None)])
    assert [[w.id for w in ws] for ws in (roles.prefill, roles.decode, roles.aggregated)] == [["p"], ["d"], ["a"]]
    assert roles.disaggregated
    assert bootstrap_port(_worker("p", 5, "prefill", 9123), 8998) == 9123
    assert bootstrap_port(_worker("p", 5, "prefill"), 8998) == 8998


def test_worker_role_is_validated_in_configuration() -> None:
    config = load_config(overrides={"workers": [{"url": "127.0.0.1:1", "role": "prefill", "bootstrap_port": 9000}]})
    assert (config.workers[0].role, config.workers[0].bootstrap_port) == ("prefill", 9000)
    with pytest.raises(ConfigError, match="role"):
        load_config(overrides={"workers": [{"url": "127.0.0.1:1", "role": "prefil"}]})
    with pytest.raises(ConfigError, match=r"pd\.pair_retries"):
        load_config(overrides={"pd": {"pair_retries": 2}})


def test_bootstrap_body_adds_the_fields_and_keeps_the_clients_rid() -> None:
    body, plan = bootstrap_body(b'{"text": "hi", "bootstrap_room": 5}', "generate", "10.0.0.1", 8998, 77, 1)
    data = orjson.loads(body)
    assert (data["bootstrap_host"], data["bootstrap_port"], data["bootstrap_room"]) == ("10.0.0.1", 8998, 77)
    assert data["disagg_prefill_dp_rank"] == 1
    assert isinstance(data["rid"], str) and plan.rids == [data["rid"]]
    body, plan = bootstrap_body(b'{"text": ["a", "b", "c"]}', "generate", "h", 1, 2)
    data = orjson.loads(body)
    assert len(data["rid"]) == 3 and plan.rids == data["rid"] and "disagg_prefill_dp_rank" not in data
    body, plan = bootstrap_body(b'{"prompt": ["a", "b"], "rid": ["x", "y"]}', "completion", "h", 1, 2)
    assert orjson.loads(body)["rid"] == ["x", "y"] and plan.rids == ["x", "y"]
    body, plan = bootstrap_body(b'{"messages": [], "rid": "mine"}', "chat", "h", 1, 2)
    assert orjson.loads(body)["rid"] == "mine" and plan.rids == ["mine"]


def test_the_prefill_side_is_chosen_by_cache_and_the_decode_side_by_load() -> None:
    workers = [
        _worker("p1", 1, "prefill"),
        _worker("p2", 2, "prefill"),
        _worker("d1", 3, "decode"),
        _worker("d2", 4, "decode"),
    ]
    app = _router(workers)
    _hold(app, "p2", 4)
    _hold(app, "d1", 4)  # a decode worker's cache does not make it a prefill candidate
    workers[2].in_flight = 3  # d1 is busier
    outcome = app.router.route(_parsed())
    assert outcome.prefill is not None
    assert outcome.prefill.worker.id == "p2" and outcome.prefill.matched_blocks == 4
    assert outcome.worker.id == "d2" and outcome.endpoints(2)[0] == "127.0.0.1:4"
    assert [w.in_flight for w in workers] == [0, 1, 3, 1]
    app.router.finish(outcome)
    assert [w.in_flight for w in workers] == [0, 0, 3, 0]


def test_an_aggregated_fleet_routes_as_before_and_half_a_pair_is_refused() -> None:
    app = _router([_worker("a", 1, "null"), _worker("b", 2, None)])
    outcome = app.router.route(_parsed())
    assert outcome.prefill is None and outcome.worker.id in {"a", "b"}
    with pytest.raises(NoWorkerError, match="no healthy decode worker"):
        _router([_worker("p", 1, "prefill")]).router.route(_parsed())
    with pytest.raises(NoWorkerError, match="no healthy prefill worker"):
        _router([_worker("d", 1, "decode")]).router.route(_parsed())


def test_decode_load_ranks_by_in_flight_then_queued_then_kv_usage() -> None:
    def cand(name: str, in_flight: int, waiting: int, prealloc: int, usage: float) -> Candidate:
        load = WorkerLoad(num_waiting_reqs=waiting, token_usage=usage)
        load.disaggregation = [{"decode_prealloc_queue_reqs": prealloc, "decode_transfer_queue_reqs": 1}]
        return Candidate(worker=_worker(name, 1, "decode"), in_flight=in_flight, load=load)

    candidates = [cand("busy", 2, 0, 0, 0.0), cand("queued", 0, 1, 3, 0.1), cand("full", 0, 1, 3, 0.9)]
    assert decode_queue(candidates[1].load) == 5
    decision = DecodeLoadPolicy().select(RoutingRequest(model="", path="/generate"), candidates)
    assert [w.id for w in decision.ranked] == ["queued", "full", "busy"]
    assert decision.scores["queued"]["decode_queue"] == 5


@dataclass
class _Recorder:
    """A worker's PD endpoints as seen from outside: what reached it, and its answer."""

    status: int = 200
    delay_s: float = 0.0
    bodies: list[dict[str, Any]] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)

    def app(self) -> web.Application:
        async def generate(request: web.Request) -> web.Response:
            self.bodies.append(await request.json())
            await asyncio.sleep(self.delay_s)
            return web.json_response({"text": "", "meta_info": {}}, status=self.status)

        async def abort(request: web.Request) -> web.Response:
            self.aborts.append((await request.json())["rid"])
            return web.Response()

        app = web.Application()
        app.router.add_post("/generate", generate)
        app.router.add_post("/abort_request", abort)
        return app


@dataclass
class _Pair:
    """A prefill and a decode stand-in, served: what reached each, and workers that name them."""

    prefill: _Recorder
    decode: _Recorder
    prefill_port: int
    decode_port: int

    def workers(self, bootstrap_port: int | None = None) -> list[Worker]:
        """A prefill worker ``p`` (with ``bootstrap_port``) and a decode worker ``d`` on the two servers."""
        return [_worker("p", self.prefill_port, "prefill", bootstrap_port), _worker("d", self.decode_port, "decode")]


@pytest.fixture
async def servers() -> AsyncIterator[_Pair]:
    prefill, decode = _Recorder(), _Recorder()
    prefill_runner, prefill_port = await start_app(prefill.app())
    decode_runner, decode_port = await start_app(decode.app())
    yield _Pair(prefill, decode, prefill_port, decode_port)
    for runner in (prefill_runner, decode_runner):
        await runner.cleanup()


async def _launch(app: RouterApp, retries: list[float] | None = None) -> Any:
    async def on_retry(seconds: float) -> None:
        if retries is not None:
            retries.append(seconds)

    body = orjson.dumps({"input_ids": TOKENS, "sampling_params": {"max_new_tokens": 4}})
    route = lambda: app.router.aroute(_parsed())  # noqa: E731
    return await app.pairs.launch(await route(), route, "generate", "/generate", body, {"authorization": "x"}, on_retry)


async def test_the_prefill_leg_carries_the_body_decode_gets_and_is_read_to_its_end(servers: _Pair) -> None:
    prefill = servers.prefill
    prefill.delay_s = 0.2
    workers = servers.workers(bootstrap_port=9300)
    app = _router(workers)
    try:
        outcome, body, pair = await _launch(app)
        assert pair is not None and outcome.worker.id == "d"
        data = orjson.loads(body)
        assert (data["bootstrap_host"], data["bootstrap_port"]) == ("127.0.0.1", 9300)
        assert 0 <= data["bootstrap_room"] < ROOM_LIMIT and pair.plan.rids == [data["rid"]]
        assert workers[0].in_flight == 1  # the prefill worker's part lasts until its response is read
        await asyncio.wait_for(pair.leg.task, 5)
        assert prefill.bodies == [data] and pair.leg.status == 200 and pair.failure is None
        assert workers[0].in_flight == 0 and workers[1].in_flight == 1
        app.router.finish(outcome)
        assert workers[1].in_flight == 0
    finally:
        await app.stop()


async def test_a_refused_prefill_leg_is_retried_with_a_new_pair_before_envoy_is_answered(servers: _Pair) -> None:
    prefill = servers.prefill
    dead = _worker("dead", free_port(), "prefill")
    workers = [dead, *servers.workers()]
    app = _router(workers)
    _hold(app, "dead", 4)  # the best cache is on the dead worker: it is tried first
    try:
        retries: list[float] = []
        outcome, body, pair = await _launch(app, retries)
        assert outcome.prefill is not None and outcome.prefill.worker.id == "p"
        assert not dead.healthy and dead.in_flight == 0
        assert retries == [app.config.pd.connect_timeout_s]  # Envoy was asked to wait for the second pair
        await asyncio.wait_for(pair.leg.task, 5)
        assert prefill.bodies[0]["bootstrap_room"] == orjson.loads(body)["bootstrap_room"]
        sample = app.telemetry.metrics.get_sample_value
        assert sample("prefix_router_pd_prefill_failures_total", {"reason": "refused", "retried": "true"}) == 1
        app.router.finish(outcome)
        app.registry.set_healthy(dead, True)
        _hold(app, "p", 0)
        for worker in workers[:2]:  # both refuse now: each leaves the candidates, then 503
            worker.port = free_port()
            worker.url = f"http://127.0.0.1:{worker.port}"
            app.registry.set_healthy(worker, True)
        with pytest.raises(NoWorkerError, match="no healthy prefill worker"):
            await _launch(app)
        assert workers[2].in_flight == 0
    finally:
        await app.stop()


async def test_a_leg_on_an_idle_pooled_connection_does_not_hold_up_envoys_answer(servers: _Pair) -> None:
    prefill, workers = servers.prefill, servers.workers()
    for warm_idle_s, waits_again in ((2.0, False), (0.0, True)):
        app = _router(workers, warm_idle_s=warm_idle_s)
        client = app.prefill_client
        try:
            outcome, _, pair = await _launch(app)
            assert pair.leg.sent.is_set() and not pair.warm  # a new connection: waited for until on the wire
            await asyncio.wait_for(pair.leg.task, 5)
            app.router.finish(outcome)
            assert client.warm(workers[0]) is not waits_again  # the connection went back to the pool
            outcome, _, pair = await _launch(app)
            assert pair.warm is not waits_again  # warm: not waited for, only given the loop's next turns
            assert pair.leg.sent.is_set()  # in which it went out
            assert not client.warm(workers[0])  # the pooled connection is that leg's now
            await asyncio.wait_for(pair.leg.task, 5)
            assert pair.leg.status == 200 and pair.failure is None
            app.router.finish(outcome)
        finally:
            await app.stop()
    assert len(prefill.bodies) == 4


async def test_a_prefill_worker_that_died_is_cold_again_and_its_refusal_retries_the_pair(servers: _Pair) -> None:
    survivor = servers.prefill
    doomed = _Recorder()
    runner, port = await start_app(doomed.app())
    dead = _worker("dead", port, "prefill")
    workers = [dead, *servers.workers()]
    app = _router(workers)
    _hold(app, "dead", 4)  # the best cache is on the worker about to die: it is tried first
    try:
        outcome, _, pair = await _launch(app)
        await asyncio.wait_for(pair.leg.task, 5)
        app.router.finish(outcome)
        assert outcome.prefill is not None and outcome.prefill.worker is dead and app.prefill_client.warm(dead)
        await runner.cleanup()  # the worker dies: its end closes the pooled connection
        await asyncio.sleep(0.05)
        assert not app.prefill_client.warm(dead)
        outcome, body, pair = await _launch(app)  # cold: waited for, refused, a new pair before Envoy hears
        assert outcome.prefill is not None and outcome.prefill.worker.id == "p" and not dead.healthy
        await asyncio.wait_for(pair.leg.task, 5)
        assert survivor.bodies[-1]["bootstrap_room"] == orjson.loads(body)["bootstrap_room"]
        app.router.finish(outcome)
    finally:
        await app.stop()
        await runner.cleanup()


async def test_a_failed_prefill_leg_aborts_the_decode_side_by_rid(servers: _Pair) -> None:
    prefill, decode = servers.prefill, servers.decode
    prefill.status = 500
    app = _router(servers.workers(), abort_repeat_s=0.05)
    try:
        outcome, _, pair = await _launch(app)
        await asyncio.wait_for(pair.leg.task, 5)
        await asyncio.sleep(0.2)
        assert pair.failure is not None and "answered 500" in pair.failure
        # Aborted at once, and again while decode's response has not begun (the request may still be on its way).
        assert len(decode.aborts) >= 2 and set(decode.aborts) == set(pair.plan.rids)
        pair.response_started = True
        await asyncio.sleep(0.1)
        count = len(decode.aborts)
        await asyncio.sleep(0.2)
        assert len(decode.aborts) == count
        sample = app.telemetry.metrics.get_sample_value
        assert sample("prefix_router_pd_prefill_failures_total", {"reason": "status", "retried": "false"}) == 1
        assert sample("prefix_router_pd_decode_aborts_total", {"accepted": "true"}) == 1
        app.router.finish(outcome)
    finally:
        await app.stop()


async def test_a_leg_cancelled_because_decode_ended_aborts_nothing(servers: _Pair) -> None:
    prefill, decode = servers.prefill, servers.decode
    prefill.delay_s = 5
    app = _router(servers.workers())
    try:
        outcome, _, pair = await _launch(app)
        pair.leg.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pair.leg.task
        await asyncio.sleep(0.1)
        assert decode.aborts == [] and pair.failure is None
        assert outcome.prefill is not None and outcome.prefill.finished
        app.router.finish(outcome)
    finally:
        await app.stop()


def test_a_mostly_cached_prompt_skips_disaggregation_when_aggregated_workers_are_there() -> None:
    workers = [_worker("p", 1, "prefill"), _worker("d", 2, "decode"), _worker("a", 3, "null")]
    app = _router(workers, aggregate_below_tokens=20)
    outcome = app.router.route(_parsed())  # nothing cached: 64 tokens to prefill, a pair
    assert outcome.prefill is not None and outcome.prefill.worker.id == "p" and outcome.worker.id == "d"
    app.router.finish(outcome)
    _hold(app, "p", 3)  # 48 of 64 tokens cached on the prefill worker: 16 left, under 20
    outcome = app.router.route(_parsed())
    assert outcome.prefill is None and outcome.worker.id == "a"
    assert app.telemetry.metrics.get_sample_value("prefix_router_pd_skipped_total") == 1
    app.router.finish(outcome)
    assert [w.in_flight for w in workers] == [0, 0, 0]
    always = _router([_worker("p", 1, "prefill"), _worker("d", 2, "decode"), _worker("a", 3, "null")])
    _hold(always, "p", 4)
    assert always.router.route(_parsed()).prefill is not None  # 0 (the default): always paired

"""The ext_proc service stays responsive while a huge prompt is tokenized, and cancels cleanly.

A real grpc.aio server (ext_proc + health) with the real router and tokenizer runs in this test's
event loop, as in ``prefix-router serve``; the workers are never contacted (routing does no I/O).
The huge prompt (a few hundred thousand tokens of unique text, no cacheable pieces) keeps the
tokenize thread busy for a good fraction of a second on this machine.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import AsyncIterator

import grpc
import orjson
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc.config import EventsConfig, RouterConfig, ServerConfig
from extproc.fleet.workers import WorkerRegistry
from extproc.serving.app import RouterApp
from tests.support.router_service import serving
from tests.support.routing import loopback_workers
from tests.support.waiting import until

CHAT_PATH = "/v1/chat/completions"


def _messages(body: bytes) -> list[pb.ProcessingRequest]:
    headers = pb.HttpHeaders(
        headers=base_pb2.HeaderMap(
            headers=[
                base_pb2.HeaderValue(key=":method", raw_value=b"POST"),
                base_pb2.HeaderValue(key=":path", raw_value=CHAT_PATH.encode()),
                base_pb2.HeaderValue(key="content-length", raw_value=str(len(body)).encode()),
            ]
        )
    )
    buffered = pb.ProtocolConfiguration(request_body_mode=ProcessingMode.BUFFERED)  # declared, as Envoy does
    return [
        pb.ProcessingRequest(request_headers=headers, protocol_config=buffered),
        pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)),
    ]


async def _held_open(messages: list[pb.ProcessingRequest]) -> AsyncIterator[pb.ProcessingRequest]:
    """Like Envoy: send headers and body, then keep the stream open until the response is done."""
    for message in messages:
        yield message
    await asyncio.Event().wait()


def _chat(content: str) -> bytes:
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": content}]})


def _huge_prompt() -> str:
    rng = random.Random()
    return " ".join(f"w{rng.randrange(10**9)}" for _ in range(120_000))  # unique: never in the piece cache


class Gate:
    """Marks when the pool starts and ends tokenizing the first request (wraps the real ``prompts.prepare``)."""

    def __init__(self, app: RouterApp) -> None:
        self.started = threading.Event()
        self.done = threading.Event()
        inner = app.pipeline.prompts.prepare

        def prepare(*args: object) -> object:
            # Only the first call without a budget (the pool's, for the huge request) is watched.
            first = len(args) < 3 and not self.started.is_set()
            if first:
                self.started.set()
            try:
                return inner(*args)  # type: ignore[arg-type]
            finally:
                if first:
                    self.done.set()

        app.pipeline.prompts.prepare = prepare  # type: ignore[method-assign,assignment]

    async def wait_started(self) -> None:
        for _ in range(2000):
            if self.started.is_set():
                return
            await asyncio.sleep(0.005)
        raise AssertionError("tokenization never started")


@pytest.fixture
async def service() -> AsyncIterator[tuple[RouterApp, grpc.aio.Channel]]:
    workers = loopback_workers(2, 41000)
    config = RouterConfig(server=ServerConfig(tokenize_threads=2), events=EventsConfig(enabled=False))
    app = RouterApp(config, WorkerRegistry(workers))
    async with serving(app) as channel:
        yield app, channel


def _in_flight(app: RouterApp) -> int:
    return sum(w.in_flight for w in app.registry.workers)


def _decisions(app: RouterApp) -> float:
    return sum(
        s.value
        for m in app.telemetry.metrics.collect()
        if m.name == "prefix_router_decisions"
        for s in m.samples
        if s.name.endswith("_total")
    )


async def test_loop_answers_while_a_huge_prompt_is_tokenized(service: tuple[RouterApp, grpc.aio.Channel]) -> None:
    app, channel = service
    stub = pb_grpc.ExternalProcessorStub(channel)
    gate = Gate(app)
    big = stub.Process(_held_open(_messages(_chat(_huge_prompt()))))
    big_replies = asyncio.ensure_future(_collect(big, 2))
    await gate.wait_started()
    # Both answered on the loop while the tokenize thread is still busy with the huge prompt.
    health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    small = stub.Process(_held_open(_messages(_chat("a short question"))))
    small_replies = await asyncio.wait_for(_collect(small, 2), 5)
    assert not gate.done.is_set(), (
        "the huge prompt was done before the loop answered (tokenized on the loop, or too small)"
    )
    assert small_replies[1].request_body.response.header_mutation.set_headers[0].header.raw_value
    small.cancel()
    replies = await asyncio.wait_for(big_replies, 30)
    destination = replies[1].request_body.response.header_mutation.set_headers[0].header.raw_value.decode()
    assert set(destination.split(",")) == {w.endpoint for w in app.registry.workers}  # primary + fallback
    assert _in_flight(app) == 1  # the huge request's stream is still open: its slot is held
    big.cancel()
    await until(lambda: _in_flight(app) == 0)


async def test_cancel_while_tokenizing_takes_no_slot(service: tuple[RouterApp, grpc.aio.Channel]) -> None:
    app, channel = service
    stub = pb_grpc.ExternalProcessorStub(channel)
    gate = Gate(app)
    before = _decisions(app)
    call = stub.Process(_held_open(_messages(_chat(_huge_prompt()))))
    await _collect(call, 1)  # the headers were answered; the body is being tokenized
    await gate.wait_started()
    call.cancel()  # the client went away mid-tokenization
    await until(gate.done.is_set)
    await asyncio.sleep(0.05)  # the loop would route now if the cancel had not reached the server
    assert _in_flight(app) == 0 and _decisions(app) == before
    # The pool is free again and later requests route normally.
    follow = stub.Process(_held_open(_messages(_chat("after the cancel"))))
    assert len(await asyncio.wait_for(_collect(follow, 2), 10)) == 2
    assert _in_flight(app) == 1
    follow.cancel()
    await until(lambda: _in_flight(app) == 0)


async def _collect(call: grpc.aio.StreamStreamCall, count: int) -> list[pb.ProcessingResponse]:
    replies: list[pb.ProcessingResponse] = []
    while len(replies) < count:
        replies.append(await call.read())
    return replies

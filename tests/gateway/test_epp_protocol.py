"""The Endpoint Picker protocol at the gRPC level: every message shape, in both body modes.

A real grpc.aio server (ext_proc + health) with the real router runs in the test's loop, as in
``prefix-router serve``; the test is the gateway, sending what Envoy sends (``protocol_config`` names
the body mode; FULL_DUPLEX_STREAMED bodies in 64 KiB chunks), or what a gateway that declares no mode
sends (agentgateway). Routing does no I/O, so the workers are addresses only.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import orjson
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc.config import EventsConfig, FlowControlConfig, ObjectiveConfig, RouterConfig, ServerConfig
from extproc.fleet.workers import Worker, WorkerRegistry
from extproc.serving.app import RouterApp
from tests.support.router_service import serving
from tests.support.waiting import until

CHAT_PATH = "/v1/chat/completions"
CHUNK = 64 * 1024
FDS = ProcessingMode.FULL_DUPLEX_STREAMED
ENDPOINTS = [f"127.0.0.1:{41100 + i}" for i in range(3)]


def _chat(content: str = "hello", **extra: object) -> bytes:
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": content}], **extra})


def _headers_message(
    body: bytes | None,
    streamed: bool,
    subset: list[str] | None = None,
    extra: dict[str, str] | None = None,
    declared: bool = True,
) -> pb.ProcessingRequest:
    pairs = {":method": "POST", ":path": CHAT_PATH, **(extra or {})}
    if body is not None:
        pairs["content-length"] = str(len(body))
    message = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]
            ),
            end_of_stream=body is None,
        )
    )
    if declared:  # what Envoy does on every stream's first message
        message.protocol_config.request_body_mode = FDS if streamed else ProcessingMode.BUFFERED
        message.protocol_config.response_body_mode = FDS if streamed else ProcessingMode.NONE
    if subset is not None:
        hint = message.metadata_context.filter_metadata["envoy.lb.subset_hint"]
        hint.fields["x-gateway-destination-endpoint-subset"].list_value.values.extend(
            struct_pb2.Value(string_value=e) for e in subset
        )
    return message


def _body_messages(body: bytes, streamed: bool) -> list[pb.ProcessingRequest]:
    if not streamed:
        return [pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))]
    pieces = [body[i : i + CHUNK] for i in range(0, len(body), CHUNK)] or [b""]
    return [
        pb.ProcessingRequest(request_body=pb.HttpBody(body=p, end_of_stream=i == len(pieces) - 1))
        for i, p in enumerate(pieces)
    ]


class Gateway:
    """One ext_proc stream driven step by step, like Envoy: send, then read what came back."""

    def __init__(self, stub: pb_grpc.ExternalProcessorStub) -> None:
        self.outbox: asyncio.Queue[pb.ProcessingRequest | None] = asyncio.Queue()
        self.call = stub.Process(self._messages())
        self._pending: asyncio.Future[pb.ProcessingResponse] | None = None
        self.extensions: list[int] = []

    async def _messages(self) -> AsyncIterator[pb.ProcessingRequest]:
        while (message := await self.outbox.get()) is not None:
            yield message

    async def send(self, *messages: pb.ProcessingRequest) -> None:
        for message in messages:
            await self.outbox.put(message)

    def _next(self) -> asyncio.Future[pb.ProcessingResponse]:
        if self._pending is None:
            self._pending = asyncio.ensure_future(self.call.read())
        return self._pending

    async def read(self, count: int, timeout: float = 5.0) -> list[pb.ProcessingResponse]:
        out = []
        for _ in range(count):
            out.append(await asyncio.wait_for(asyncio.shield(self._next()), timeout))
            self._pending = None
        return out

    async def decision(self, timeout: float = 10.0) -> pb.ProcessingResponse:
        """The next reply that answers a phase (timeout extensions, counted in ``extensions``, skipped)."""
        while True:
            (reply,) = await self.read(1, timeout)
            if reply.WhichOneof("response") is not None:
                return reply
            assert reply.HasField("override_message_timeout")
            self.extensions.append(reply.override_message_timeout.ToMilliseconds())

    async def nothing_pending(self, wait: float = 0.2) -> bool:
        """True when no reply arrives within ``wait`` (a read still pending is kept for ``read``)."""
        done, _ = await asyncio.wait({self._next()}, timeout=wait)
        return not done

    async def close(self) -> None:
        await self.outbox.put(None)
        self.call.cancel()
        if self._pending is not None:
            self._pending.cancel()


@pytest.fixture
async def service(
    request: pytest.FixtureRequest,
) -> AsyncIterator[tuple[RouterApp, pb_grpc.ExternalProcessorStub, grpc.aio.Channel]]:
    workers = [Worker(id=e, url=f"http://{e}", ip="127.0.0.1", port=int(e.rsplit(":", 1)[1])) for e in ENDPOINTS]
    flow = getattr(request, "param", None) or FlowControlConfig()
    config = RouterConfig(
        server=ServerConfig(tokenize_threads=1, max_body_bytes=9 * 1024 * 1024),
        events=EventsConfig(enabled=False),
        policy={"name": "round-robin"},
        flow_control=flow,
    )
    app = RouterApp(config, WorkerRegistry(workers))
    limits = [("grpc.max_receive_message_length", 32 * 1024 * 1024), ("grpc.max_send_message_length", 32 * 1024 * 1024)]
    async with serving(app, limits) as channel:
        yield app, pb_grpc.ExternalProcessorStub(channel), channel


def _in_flight(app: RouterApp) -> dict[str, int]:
    return {w.endpoint: w.in_flight for w in app.registry.workers}


def _destination(reply: pb.ProcessingResponse, phase: str) -> tuple[str, str]:
    """The destination header and the envoy.lb metadata value of a route reply."""
    common = getattr(reply, phase).response
    assert common.clear_route_cache
    headers = {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}
    metadata = reply.dynamic_metadata.fields["envoy.lb"].struct_value.fields["x-gateway-destination-endpoint"]
    return headers["x-gateway-destination-endpoint"], metadata.string_value


# -- destination: header and metadata, primary plus fallbacks -------------------------------------


async def test_buffered_headers_continue_then_body_reply_names_the_destination(service) -> None:  # type: ignore[no-untyped-def]
    app, stub, _ = service
    gw = Gateway(stub)
    body = _chat()
    await gw.send(_headers_message(body, streamed=False))
    (headers_reply,) = await gw.read(1)
    assert headers_reply.WhichOneof("response") == "request_headers"
    assert not headers_reply.request_headers.response.header_mutation.set_headers
    await gw.send(*_body_messages(body, streamed=False))
    (reply,) = await gw.read(1)
    header, metadata = _destination(reply, "request_body")
    endpoints = metadata.split(",")
    assert header == metadata and len(endpoints) == 3 and set(endpoints) == set(ENDPOINTS)
    assert _in_flight(app)[endpoints[0]] == 1
    await gw.close()
    await until(lambda: sum(_in_flight(app).values()) == 0)


async def test_streamed_headers_reply_waits_for_the_whole_body_then_precedes_the_body(service) -> None:  # type: ignore[no-untyped-def]
    app, stub, _ = service
    gw = Gateway(stub)
    # 8 MiB in 64 KiB chunks: the prompt up front, the rest padding a parser must still read to the end.
    head = _chat("route on the whole body", user="x" * (8 * 1024 * 1024))
    body = head
    chunks = _body_messages(body, streamed=True)
    assert len(chunks) > 128
    await gw.send(_headers_message(body, streamed=True), *chunks[:-1])
    assert await gw.nothing_pending()  # no reply while the body is incomplete
    await gw.send(chunks[-1])
    replies = await gw.read(1 + len(chunks), timeout=20)
    assert replies[0].WhichOneof("response") == "request_headers"
    header, metadata = _destination(replies[0], "request_headers")
    assert header == metadata and len(metadata.split(",")) == 3
    streamed = [r.request_body.response.body_mutation.streamed_response for r in replies[1:]]
    assert b"".join(s.body for s in streamed) == body
    assert [s.end_of_stream for s in streamed] == [False] * (len(streamed) - 1) + [True]
    assert max(len(s.body) for s in streamed) <= CHUNK
    await gw.close()
    await until(lambda: sum(_in_flight(app).values()) == 0)


async def test_streamed_body_ended_by_trailers(service) -> None:  # type: ignore[no-untyped-def]
    _, stub, _ = service
    gw = Gateway(stub)
    body = _chat()
    await gw.send(
        _headers_message(body, streamed=True),
        pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=False)),
    )
    assert await gw.nothing_pending()
    await gw.send(pb.ProcessingRequest(request_trailers=pb.HttpTrailers()))
    replies = await gw.read(3)
    assert [r.WhichOneof("response") for r in replies] == ["request_headers", "request_body", "request_trailers"]
    piece = replies[1].request_body.response.body_mutation.streamed_response
    assert piece.body == body and not piece.end_of_stream
    await gw.close()


async def test_streamed_response_chunks_are_echoed_one_by_one(service) -> None:  # type: ignore[no-untyped-def]
    _, stub, _ = service
    gw = Gateway(stub)
    body = _chat(stream=True)
    await gw.send(_headers_message(body, streamed=True), *_body_messages(body, streamed=True))
    await gw.read(2)
    await gw.send(pb.ProcessingRequest(response_headers=pb.HttpHeaders()))
    (reply,) = await gw.read(1)
    assert reply.WhichOneof("response") == "response_headers"
    for i in range(5):  # each token's event comes back before the next is sent: nothing is buffered
        event = f'data: {{"token": {i}}}\n\n'.encode()
        await gw.send(pb.ProcessingRequest(response_body=pb.HttpBody(body=event, end_of_stream=i == 4)))
        (echo,) = await gw.read(1)
        piece = echo.response_body.response.body_mutation.streamed_response
        assert piece.body == event and piece.end_of_stream == (i == 4)
    await gw.send(pb.ProcessingRequest(response_trailers=pb.HttpTrailers()))
    (trailers,) = await gw.read(1)
    assert trailers.WhichOneof("response") == "response_trailers"
    await gw.close()


# -- a gateway that declares no body mode (no protocol_config, e.g. agentgateway) ----------------------------


async def test_undeclared_mode_holds_the_headers_reply_until_the_streamed_body_is_complete(service) -> None:  # type: ignore[no-untyped-def]
    router, stub, _ = service
    gw = Gateway(stub)
    body = _chat("route me without knowing the mode", user="y" * (3 * CHUNK))
    chunks = _body_messages(body, streamed=True)
    await gw.send(_headers_message(body, streamed=False, declared=False))
    # A CONTINUE now would lose the destination for good if the body streams: nothing may come back yet.
    assert await gw.nothing_pending()
    await gw.send(*chunks[:-1])  # body although the headers are unanswered: this gateway streams
    assert await gw.nothing_pending()
    await gw.send(chunks[-1])
    replies = await gw.read(1 + len(chunks))
    assert replies[0].WhichOneof("response") == "request_headers"
    header, metadata = _destination(replies[0], "request_headers")
    assert header == metadata and len(metadata.split(",")) == 3
    streamed = [r.request_body.response.body_mutation.streamed_response for r in replies[1:]]
    assert b"".join(s.body for s in streamed) == body and streamed[-1].end_of_stream
    assert _in_flight(router)[metadata.split(",")[0]] == 1
    # The response side streams too: each chunk is echoed at once.
    await gw.send(pb.ProcessingRequest(response_headers=pb.HttpHeaders()))
    (reply,) = await gw.read(1)
    assert reply.WhichOneof("response") == "response_headers"
    event = b'data: {"token": 1}\n\n'
    await gw.send(pb.ProcessingRequest(response_body=pb.HttpBody(body=event, end_of_stream=True)))
    (echo,) = await gw.read(1)
    assert echo.response_body.response.body_mutation.streamed_response.body == event
    await gw.close()
    await until(lambda: sum(_in_flight(router).values()) == 0)


async def test_undeclared_mode_whole_body_in_one_message_is_answered_as_streamed(service) -> None:  # type: ignore[no-untyped-def]
    _, stub, _ = service
    gw = Gateway(stub)
    body = _chat()
    await gw.send(_headers_message(body, streamed=False, declared=False))
    assert await gw.nothing_pending()
    await gw.send(pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)))
    headers_reply, body_reply = await gw.read(2)
    header, metadata = _destination(headers_reply, "request_headers")
    assert header == metadata
    piece = body_reply.request_body.response.body_mutation.streamed_response
    assert piece.body == body and piece.end_of_stream
    await gw.close()


async def test_undeclared_mode_bodiless_request_and_pass_through(service) -> None:  # type: ignore[no-untyped-def]
    _, stub, _ = service
    gw = Gateway(stub)  # no body follows: the headers are all there is, so they are answered at once
    await gw.send(_headers_message(None, streamed=False, declared=False))
    (reply,) = await gw.read(1)
    assert reply.immediate_response.status.code == 400
    await gw.close()
    gw = Gateway(stub)  # a path the router does not parse, with a body: its reply waits for the body's mode
    message = _headers_message(b"{}", streamed=False, declared=False)
    message.request_headers.headers.headers[1].raw_value = b"/v1/embeddings"
    await gw.send(message)
    assert await gw.nothing_pending()
    await gw.send(pb.ProcessingRequest(request_body=pb.HttpBody(body=b"{}", end_of_stream=True)))
    headers_reply, body_reply = await gw.read(2)
    assert headers_reply.WhichOneof("response") == "request_headers"
    assert body_reply.request_body.response.body_mutation.streamed_response.body == b"{}"
    await gw.close()


async def test_bodiless_request_is_decided_on_its_headers(service) -> None:  # type: ignore[no-untyped-def]
    _, stub, _ = service
    gw = Gateway(stub)
    await gw.send(_headers_message(None, streamed=True))
    (reply,) = await gw.read(1)
    assert reply.immediate_response.status.code == 400  # an empty body is a client error, answered at once
    await gw.close()


@pytest.mark.parametrize("streamed", [False, True])
async def test_body_over_the_limit_is_413_in_both_modes(service, streamed: bool) -> None:  # type: ignore[no-untyped-def]
    app, stub, _ = service
    gw = Gateway(stub)
    body = _chat("x" * (10 * 1024 * 1024))
    headers = _headers_message(None, streamed)
    headers.request_headers.end_of_stream = False  # chunked upload: no content-length to refuse early
    await gw.send(headers)
    if not streamed:
        await gw.read(1)
    await gw.send(*_body_messages(body, streamed))
    (reply,) = await gw.read(1, timeout=20)
    assert reply.immediate_response.status.code == 413
    assert orjson.loads(reply.immediate_response.body)["error"]["code"] == 413
    await gw.close()
    assert sum(_in_flight(app).values()) == 0


# -- subset hint ---------------------------------------------------------------------------------


@pytest.mark.parametrize("streamed", [False, True])
async def test_subset_hint_is_honoured(service, streamed: bool) -> None:  # type: ignore[no-untyped-def]
    _, stub, _ = service
    allowed = ENDPOINTS[1:2]
    for _ in range(4):  # round-robin would visit every worker: only the subset's may be named
        gw = Gateway(stub)
        body = _chat()
        await gw.send(_headers_message(body, streamed, subset=allowed), *_body_messages(body, streamed))
        replies = await gw.read(2)
        phase = "request_headers" if streamed else "request_body"
        route = replies[0] if streamed else replies[1]
        header, metadata = _destination(route, phase)
        assert header == allowed[0] and metadata == allowed[0]
        await gw.close()


@pytest.mark.parametrize("subset", [[], ["10.9.9.9:1"]])
async def test_empty_or_ineligible_subset_is_503(service, subset: list[str]) -> None:  # type: ignore[no-untyped-def]
    app, stub, _ = service
    gw = Gateway(stub)
    body = _chat()
    await gw.send(_headers_message(body, True, subset=subset), *_body_messages(body, True))
    (reply,) = await gw.read(1)
    assert reply.immediate_response.status.code == 503
    assert "subset" in orjson.loads(reply.immediate_response.body)["error"]["message"]
    await gw.close()
    assert sum(_in_flight(app).values()) == 0


async def test_no_ready_endpoint_is_503(service) -> None:  # type: ignore[no-untyped-def]
    app, stub, _ = service
    for worker in app.registry.workers:
        app.registry.mark_unreachable(worker, "test")
    gw = Gateway(stub)
    body = _chat()
    await gw.send(_headers_message(body, True), *_body_messages(body, True))
    (reply,) = await gw.read(1)
    assert reply.immediate_response.status.code == 503
    await gw.close()


async def test_workers_that_only_missed_probes_stay_candidates_for_a_while(service) -> None:  # type: ignore[no-untyped-def]
    app, stub, _ = service
    registry = app.registry
    for worker in registry.workers:
        registry.set_healthy(worker, False, "probe timed out", may_still_serve=True)
    gw = Gateway(stub)
    body = _chat()
    await gw.send(_headers_message(body, True), *_body_messages(body, True))
    (reply,) = await gw.read(1)
    header, _ = _destination(reply, "request_headers")  # the last healthy set, not a 503
    assert set(header.split(",")) == set(ENDPOINTS)
    await gw.close()
    registry.mark_unreachable(registry.workers[0], "refused")
    assert registry.workers[0] not in registry.recently_healthy(None, 5.0)
    assert registry.recently_healthy(None, 0.0) == []


# -- served endpoint -----------------------------------------------------------------------------


async def test_served_endpoint_moves_the_accounting(service) -> None:  # type: ignore[no-untyped-def]
    app, stub, _ = service
    gw = Gateway(stub)
    body = _chat("a prompt long enough to have blocks " * 20)
    await gw.send(_headers_message(body, True), *_body_messages(body, True))
    replies = await gw.read(2)
    _, metadata = _destination(replies[0], "request_headers")
    primary, fallback = metadata.split(",")[:2]
    assert _in_flight(app)[primary] == 1
    served = pb.ProcessingRequest(response_headers=pb.HttpHeaders())
    served.metadata_context.filter_metadata["envoy.lb"].fields[
        "x-gateway-destination-endpoint-served"
    ].string_value = fallback
    await gw.send(served)
    await gw.read(1)
    assert _in_flight(app)[primary] == 0 and _in_flight(app)[fallback] == 1
    await gw.close()
    await until(lambda: sum(_in_flight(app).values()) == 0)


# -- GIE request headers -------------------------------------------------------------------------


async def test_model_name_rewrite_buffered_keeps_content_length_consistent(service) -> None:  # type: ignore[no-untyped-def]
    _, stub, _ = service
    gw = Gateway(stub)
    body = _chat()
    await gw.send(_headers_message(body, False, extra={"x-gateway-model-name-rewrite": "served-name"}))
    await gw.read(1)
    await gw.send(*_body_messages(body, False))
    (reply,) = await gw.read(1)
    common = reply.request_body.response
    new_body = common.body_mutation.body
    assert orjson.loads(new_body)["model"] == "served-name"
    headers = {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}
    assert headers["content-length"] == str(len(new_body))
    await gw.close()


async def test_model_name_rewrite_streamed(service) -> None:  # type: ignore[no-untyped-def]
    _, stub, _ = service
    gw = Gateway(stub)
    body = _chat()
    await gw.send(
        _headers_message(body, True, extra={"x-gateway-model-name-rewrite": "a-much-longer-served-model-name"}),
        *_body_messages(body, True),
    )
    replies = await gw.read(2)
    headers = {
        h.header.key: h.header.raw_value.decode()
        for h in replies[0].request_headers.response.header_mutation.set_headers
    }
    new_body = replies[1].request_body.response.body_mutation.streamed_response.body
    assert orjson.loads(new_body)["model"] == "a-much-longer-served-model-name"
    assert headers["content-length"] == str(len(new_body)) != str(len(body))
    await gw.close()


# -- health --------------------------------------------------------------------------------------


async def test_health_services(service) -> None:  # type: ignore[no-untyped-def]
    _, _, channel = service
    health = health_pb2_grpc.HealthStub(channel)
    for name in ("", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
        reply = await health.Check(health_pb2.HealthCheckRequest(service=name))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING, name


# -- flow control ------------------------------------------------------------------------------


FLOW = FlowControlConfig(
    enabled=True,
    max_in_flight_per_worker=1,
    queue_ttl_s=0.5,
    retry_after_s=3,
    objectives={"critical": ObjectiveConfig(priority=10), "batch": ObjectiveConfig(priority=-1)},
)


async def _route(
    stub: pb_grpc.ExternalProcessorStub, objective: str
) -> tuple[Gateway, asyncio.Task[pb.ProcessingResponse]]:
    gw = Gateway(stub)
    body = _chat()
    await gw.send(
        _headers_message(body, True, extra={"x-gateway-inference-objective": objective}), *_body_messages(body, True)
    )
    return gw, asyncio.ensure_future(gw.decision())


@pytest.mark.parametrize("service", [FLOW], indirect=True)
async def test_flow_control_queues_sheds_and_expires(service) -> None:  # type: ignore[no-untyped-def]
    app, stub, _ = service
    held = [await _route(stub, "critical") for _ in ENDPOINTS]  # every worker at its bound now
    for gw, task in held:
        reply = await task
        assert reply.WhichOneof("response") == "request_headers"
        assert gw.extensions == []  # placed at once: Envoy's timeout was never extended
    # A sheddable request past saturation: 429 at once, with Retry-After.
    gw, task = await _route(stub, "batch")
    shed = await task
    assert shed.immediate_response.status.code == 429
    headers = {h.header.key: h.header.raw_value.decode() for h in shed.immediate_response.headers.set_headers}
    assert headers["retry-after"] == "3" and headers["x-llm-d-request-dropped-reason"] == "sheddable"
    await gw.close()
    # A critical one waits, and is routed as soon as a request ends.
    waiting, task = await _route(stub, "critical")
    await asyncio.sleep(0.1)
    assert not task.done() and app.flow is not None and app.flow.waiting == 1
    await held[0][0].close()
    routed = await task
    assert routed.WhichOneof("response") == "request_headers"
    assert waiting.extensions == [1500]  # queued: Envoy was asked to wait the queue TTL (+1 s)
    # One that waits past the queue TTL gets 429 too.
    late, task = await _route(stub, "critical")
    expired = await task
    assert expired.immediate_response.status.code == 429
    assert "waited" in orjson.loads(expired.immediate_response.body)["error"]["message"]
    for gw in [waiting, late, *(g for g, _ in held[1:])]:
        await gw.close()
    await until(lambda: sum(_in_flight(app).values()) == 0)
    shed_samples = {
        (s.labels["priority"], s.labels["reason"]): s.value
        for m in app.telemetry.metrics.collect()
        if m.name == "prefix_router_flow_shed"
        for s in m.samples
        if s.name.endswith("_total")
    }
    assert shed_samples == {("-1", "sheddable"): 1.0, ("10", "queue-ttl"): 1.0}


@pytest.mark.parametrize("service", [FLOW], indirect=True)
async def test_client_gone_while_queued_or_mid_body_leaks_nothing(service) -> None:  # type: ignore[no-untyped-def]
    app, stub, _ = service
    held = [await _route(stub, "critical") for _ in ENDPOINTS]
    for _, task in held:
        await task
    gw, task = await _route(stub, "critical")
    await asyncio.sleep(0.05)
    assert app.flow is not None and app.flow.waiting == 1
    task.cancel()
    await gw.close()
    await until(lambda: app.flow is not None and app.flow.waiting == 0)
    # mid-body: headers and half the chunks, then the stream is gone
    partial = Gateway(stub)
    body = _chat("y" * 300_000)
    await partial.send(_headers_message(body, True), *_body_messages(body, True)[:2])
    await asyncio.sleep(0.05)
    await partial.close()
    for g, _ in held:
        await g.close()
    await until(lambda: sum(_in_flight(app).values()) == 0)


HEADROOM = FlowControlConfig(
    enabled=True,
    max_in_flight_per_worker=2,
    sheddable_share=0.5,
    objectives={"critical": ObjectiveConfig(priority=10), "batch": ObjectiveConfig(priority=-1)},
)


@pytest.mark.parametrize("service", [HEADROOM], indirect=True)
async def test_sheddable_requests_leave_headroom_for_the_others(service) -> None:  # type: ignore[no-untyped-def]
    app, stub, _ = service
    held = [await _route(stub, "critical") for _ in ENDPOINTS]  # one in flight per worker: half the bound
    for _, task in held:
        await task
    gw, task = await _route(stub, "batch")
    assert (await task).immediate_response.status.code == 429  # sheddable: saturated at half the bound
    await gw.close()
    critical, task = await _route(stub, "critical")
    assert (await task).WhichOneof("response") == "request_headers"  # critical: still room
    for g in [critical, *(g for g, _ in held)]:
        await g.close()
    await until(lambda: sum(_in_flight(app).values()) == 0)

"""The ext_proc gRPC servicer: Envoy messages in, routing decisions out. Thin on purpose.

One bidirectional stream per HTTP request, in either body mode the Endpoint Picker protocol knows
(Envoy names it in the first message's ``protocol_config``):

- ``BUFFERED``: Envoy sends the headers (answered at once: CONTINUE, or an early 413 /
  pass-through), then the whole body, answered with the destination.
- ``FULL_DUPLEX_STREAMED`` (what GIE gateways configure): Envoy sends the headers and then body
  chunks without waiting. The headers reply is held until the body is complete (the decision needs
  all of it; ``max_body_bytes`` bounds what is gathered), then goes out with the destination, then
  the body is streamed back in ``STREAMED_CHUNK_BYTES`` pieces. Response chunks are echoed one by
  one as they come, so streamed tokens are never held up.
- No ``protocol_config`` (a gateway that does not declare its modes, e.g. agentgateway): the headers
  reply is held (a CONTINUE would lose the destination for good if the body streams), and the body's
  first message tells the mode: it came although the headers were not answered, so the gateway does
  not wait for that reply, i.e. streams. It is then handled as FULL_DUPLEX_STREAMED both ways, the
  mode the Endpoint Picker protocol requires every picker to support. A gateway that declares nothing
  yet waits for the headers reply (BUFFERED) gets no answer before its message timeout: declare it.

Either way the stream stays open until Envoy has sent the complete response, so its end is the
request's end: ``router.finish()`` runs there, whatever ended it (normal close, client cancel,
Envoy reset). A sampled response (index drift, ``extproc.routing.drift``) is read on its way: in
buffered mode the reply to its headers asks Envoy for its body (``read_response_body``); each chunk
is answered at once, its bytes kept and read when the response is over (``extproc.exchange.usage``).
Other responses never reach the router. The response headers carry the endpoint that really served
(``extproc.exchange.epp``); the router moves its accounting there when Envoy fell back to another
one. Messages are upb protobufs (``xds-protos``). The router's heavy CPU work (tokenizing) runs in
its thread pool, so one huge prompt never holds up the other streams or the health service on this
event loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import grpc
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import duration_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from extproc.config import RouterConfig
from extproc.decision.pipeline import NoWorkerError, RouteOutcome
from extproc.decision.request import RequestError, RequestKind, generation_kind, parse_request
from extproc.exchange.epp import gie_headers, rewrite_model, served_endpoint, subset_hint
from extproc.exchange.response import (
    STREAMED_CHUNK_BYTES,
    continue_headers,
    continue_phase,
    error_response,
    read_response_body,
    route_response,
    streamed_body,
)
from extproc.exchange.usage import UsageReader
from extproc.routing.drift import reports_usage
from extproc.routing.flow_control import Admission, ShedError
from extproc.routing.router import Router

__all__ = [
    "EXT_PROC_SERVICE",
    "LIVENESS_SERVICE",
    "READINESS_SERVICE",
    "ExtProcServicer",
    "PairStarter",
    "StartedPair",
    "add_services",
    "mark_ready",
    "mark_serving",
]

log = logging.getLogger(__name__)

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
LIVENESS_SERVICE = "liveness"
READINESS_SERVICE = "readiness"
_FULL_DUPLEX = ProcessingMode.FULL_DUPLEX_STREAMED
_CONTINUE_RESPONSE = pb.ProcessingResponse(response_headers=pb.HeadersResponse())


def _headers(message: pb.HttpHeaders) -> dict[str, str]:
    """Envoy's header map as a lower-cased dict (Envoy fills ``raw_value``; older versions ``value``)."""
    out: dict[str, str] = {}
    for h in message.headers.headers:
        out[h.key] = h.raw_value.decode("latin-1") if h.raw_value else h.value
    return out


class StartedPair(Protocol):
    """A disaggregated request's prefill side, as the servicer follows it (``extproc.pd.launch.LaunchedPair``)."""

    response_started: bool  # decode's response headers reached the router
    failure: str | None  # why the prefill leg failed after Envoy was answered (None: it has not)

    def cancel(self) -> None:
        """Stop the prefill leg (the decode side is over or failed)."""


# Starts the prefill leg of a paired decision (``extproc.pd.launch.PairLauncher.launch``, plugged in by the app):
# given the decision, how to choose a pair again, the request's kind, path, body and headers, and what to await
# before another pair is tried, it returns the pair Envoy sends on, the body it sends (with the bootstrap
# fields) and the leg to follow. The servicer calls it only for a decision that is disaggregated, so a request
# of an aggregated fleet never enters ``extproc.pd``.
PairStarter = Callable[
    [
        RouteOutcome,
        Callable[[], Awaitable[RouteOutcome]],
        RequestKind,
        str,
        bytes,
        Mapping[str, str],
        Callable[[float], Awaitable[None]] | None,
    ],
    Awaitable[tuple[RouteOutcome, bytes, StartedPair | None]],
]


@dataclass
class _Exchange:
    """One HTTP request's state across the messages of its stream."""

    streamed_request: bool = False
    streamed_response: bool = False
    undeclared: bool = False  # no protocol_config: the mode is unknown until the body's first message
    held: list[pb.ProcessingResponse] = field(default_factory=list)  # a headers reply waiting for that
    kind: RequestKind | None = None
    path: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    subset: frozenset[str] | None = None
    body: bytearray = field(default_factory=bytearray)
    decided: bool = False  # a decision (or an error) has answered the request part
    ended: bool = False  # an ImmediateResponse went out: Envoy sends nothing we must answer
    outcome: RouteOutcome | None = None
    pair: StartedPair | None = None  # a disaggregated request's prefill leg, sent by the router
    context: grpc.aio.ServicerContext | None = None
    started: float = field(default_factory=time.monotonic)  # the request headers arrived (a stream is one request)
    stream: bool = False  # the client asked for a streamed response
    reports_usage: bool = False  # the response will carry the engine's cached tokens (it may be sampled)
    usage: UsageReader | None = None  # set when the response is sampled: it reads the usage as it passes
    response_ended: bool = False

    async def extend_timeout(self, seconds: float) -> None:
        """Ask Envoy to wait ``seconds`` more for our reply (the request waits in flow control).

        Envoy honours it up to the filter's ``max_message_timeout`` (``envoy-config --max-message-timeout-ms``).
        """
        if self.context is not None:
            timeout = duration_pb2.Duration()
            timeout.FromMilliseconds(int(seconds * 1000) + 1000)
            await self.context.write(pb.ProcessingResponse(override_message_timeout=timeout))


class ExtProcServicer(pb_grpc.ExternalProcessorServicer):
    """Parses generation requests, asks the router, answers Envoy; knows nothing about policies."""

    def __init__(self, config: RouterConfig, router: Router, pairs: PairStarter | None = None) -> None:
        """``pairs``: how prefill/decode pairs start (None: a disaggregated decision is answered 503)."""
        self.router = router
        self.max_body_bytes = config.server.max_body_bytes
        self.fallbacks = config.server.fallback_endpoints
        self.flow = config.flow_control
        self.pairs = pairs

    async def Process(  # noqa: N802 (the gRPC method name)
        self,
        request_iterator: AsyncIterator[pb.ProcessingRequest],
        context: grpc.aio.ServicerContext,
    ) -> None:
        exchange = _Exchange(context=context)
        first = True
        try:
            async for message in request_iterator:
                if first:
                    first = False
                    modes = message.protocol_config
                    exchange.undeclared = not message.HasField("protocol_config")
                    exchange.streamed_request = modes.request_body_mode == _FULL_DUPLEX
                    exchange.streamed_response = modes.response_body_mode == _FULL_DUPLEX
                if exchange.usage is not None and message.HasField("response_body"):  # bytes kept, read at the end
                    exchange.usage.feed(message.response_body.body)
                    exchange.response_ended = message.response_body.end_of_stream
                for reply in await self._on_message(exchange, message):
                    await context.write(reply)
        finally:
            if exchange.pair is not None:  # the decode side is over: a prefill leg still running is useless
                exchange.pair.cancel()
            if exchange.outcome is not None:
                if exchange.usage is not None:
                    self._drift(exchange, exchange.outcome, exchange.usage)
                self.router.finish(exchange.outcome)

    async def _on_message(self, ex: _Exchange, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        phase = message.WhichOneof("request")
        if ex.ended:
            return []
        if phase == "request_headers":
            return await self._on_headers(ex, message)
        if phase in ("request_body", "request_trailers") and ex.undeclared:
            return [*self._streams(ex), *await self._on_message(ex, message)]
        if phase == "request_body":
            return await self._on_body(ex, message.request_body)
        if phase == "request_trailers":
            replies = [] if ex.decided or ex.kind is None else await self._decide(ex, bytes(ex.body), "trailers")
            return [*replies, *([] if ex.ended else [continue_phase(phase)])]
        if phase == "response_headers":
            served = served_endpoint(message)
            if served is not None and ex.outcome is not None:
                self.router.served(ex.outcome, served)
            if ex.outcome is not None:  # after served(): the worker that answered, fallbacks included
                self.router.telemetry.first_byte(ex.outcome.worker.id, ex.stream, time.monotonic() - ex.started)
            if ex.pair is not None:
                return self._on_pair_response(ex, _headers(message.response_headers).get(":status", ""))
            if ex.reports_usage and ex.outcome is not None:
                return self._sample(ex, ex.outcome, message.response_headers)
            return [continue_phase(phase)]
        if phase == "response_body":
            if ex.streamed_response:  # every chunk goes back at once: tokens reach the client as they come
                return [streamed_body(message.response_body.body, message.response_body.end_of_stream, phase)]
            return [continue_phase(phase)]
        reply = continue_phase(phase or "")
        return [reply] if reply is not None else []

    async def _on_headers(self, ex: _Exchange, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        ex.headers = _headers(message.request_headers)
        ex.path = ex.headers.get(":path", "")
        ex.kind = generation_kind(ex.headers.get(":method", ""), ex.path)
        ex.subset = subset_hint(message)
        if ex.kind is None:  # not a generation request: any worker (our Envoy routes these itself)
            ex.decided = True
            endpoints = self.router.pass_through_endpoints(ex.subset, self.fallbacks)
            reply = route_response(endpoints, phase="request_headers") if endpoints else continue_headers()
            if ex.undeclared and not message.request_headers.end_of_stream:
                ex.held = [reply]  # how the body must be answered is not known yet
                return []
            return [reply]
        if message.request_headers.end_of_stream:  # no body will follow: this reply is the only chance
            return await self._decide(ex, b"", "headers")
        length = ex.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            # Refuse as soon as the size is known: no worker and no parser need to see this body.
            return self._error(ex, 413, f"request body is {length} bytes; the limit is {self.max_body_bytes} bytes")
        if ex.streamed_request or ex.undeclared:
            return []  # the headers reply carries the destination: it waits for the whole body
        return [continue_headers()]

    @staticmethod
    def _streams(ex: _Exchange) -> list[pb.ProcessingResponse]:
        """An undeclared gateway sent body or trailers before its headers were answered: it streams.

        Returns the headers reply held for this moment (a pass-through's), which must precede the rest.
        """
        ex.undeclared = False
        ex.streamed_request = ex.streamed_response = True
        held, ex.held = ex.held, []
        return held

    async def _on_body(self, ex: _Exchange, body: pb.HttpBody) -> list[pb.ProcessingResponse]:
        if ex.decided:  # pass-through path or bodiless decision: the body goes on untouched
            if ex.streamed_request:
                return [streamed_body(body.body, body.end_of_stream)]
            return [continue_phase("request_body")]
        if not ex.streamed_request:
            return await self._decide(ex, body.body, "body")
        ex.body += body.body
        if len(ex.body) > self.max_body_bytes:
            return self._error(
                ex, 413, f"request body is over {len(ex.body)} bytes; the limit is {self.max_body_bytes} bytes"
            )
        if not body.end_of_stream:
            return []
        return await self._decide(ex, bytes(ex.body), "streamed-body")

    def _on_pair_response(self, ex: _Exchange, status: str) -> list[pb.ProcessingResponse]:
        """Decode's response begins: a failed prefill leg turns it into a 502; a decode error stops the leg."""
        assert ex.pair is not None
        ex.pair.response_started = True
        if ex.pair.failure is not None:
            ex.ended = True
            return [error_response(502, f"the prefill side of this request failed: {ex.pair.failure}", "api_error")]
        if status != "200":
            ex.pair.cancel()
        return [continue_phase("response_headers")]

    def _sample(self, ex: _Exchange, outcome: RouteOutcome, message: pb.HttpHeaders) -> list[pb.ProcessingResponse]:
        """Whether to read this response's usage (drift): a sampled 200 has Envoy send its body too."""
        drift = self.router.drift
        if drift is None or not drift.sample(outcome, ex.reports_usage):
            return [_CONTINUE_RESPONSE]
        headers = _headers(message)
        if headers.get(":status") != "200":
            return [_CONTINUE_RESPONSE]
        ex.usage = UsageReader(event_stream=headers.get("content-type", "").startswith("text/event-stream"))
        if ex.streamed_response:  # FULL_DUPLEX_STREAMED: the chunks come here anyway
            return [_CONTINUE_RESPONSE]
        return [read_response_body()]

    def _drift(self, ex: _Exchange, outcome: RouteOutcome, usage: UsageReader) -> None:
        """The sampled response is over: hand the engine's figures to the drift meter (never raises)."""
        drift = self.router.drift
        try:
            found = usage.result()
            if drift is None:
                return
            if found is not None:
                drift.observe(outcome, found.cached_tokens, found.prompt_tokens)
            elif ex.response_ended:  # a stream cut short says nothing of what the engine would have reported
                drift.observe(outcome, None, None)
        except Exception:
            log.exception("reading the usage of a sampled response failed")

    def _error(self, ex: _Exchange, status: int, message: str) -> list[pb.ProcessingResponse]:
        ex.decided = ex.ended = True
        types = {413: "request_too_large"}
        return [error_response(status, message, type_=types.get(status))]

    async def _decide(self, ex: _Exchange, body: bytes, at: str) -> list[pb.ProcessingResponse]:
        """Route the request; ``at`` is where its body ended: headers (none), body, streamed-body, trailers."""
        assert ex.kind is not None
        ex.decided = True
        gie = gie_headers(ex.headers)
        try:
            parsed = parse_request(ex.kind, ex.path, body, ex.headers, self.max_body_bytes)
            ex.stream = parsed.stream
            ex.reports_usage = reports_usage(parsed)
            if gie.model_rewrite is not None and body:
                body = rewrite_model(body, gie.model_rewrite)
                parsed.model = gie.model_rewrite
            admission = Admission(
                priority=self.flow.priority_of(gie.objective),
                fairness_id=gie.fairness_id or "",
                objective=gie.objective or "",
            )
            # Tokenizing runs in the router's pool; a cancel here (client gone) leaves no slot taken.
            route = lambda: self.router.aroute(  # noqa: E731 (a pair that must be chosen again calls it too)
                parsed, subset=ex.subset, admission=admission, on_queued=ex.extend_timeout
            )
            outcome = await route()
            if outcome.prefill is not None:  # disaggregated: the launcher adds the bootstrap fields, starts the leg
                if self.pairs is None:
                    self.router.finish(outcome)
                    raise NoWorkerError("this router does not launch prefill/decode pairs")
                outcome, body, ex.pair = await self.pairs(
                    outcome, route, ex.kind, ex.path, body, ex.headers, ex.extend_timeout
                )
        except RequestError as exc:
            ex.ended = True
            return [error_response(exc.status, exc.message, exc.type, exc.param)]
        except NoWorkerError as exc:
            ex.ended = True
            return [error_response(503, str(exc), type_="service_unavailable")]
        except ShedError as exc:
            ex.ended = True
            return [
                error_response(
                    429,
                    str(exc),
                    type_="rate_limit_exceeded",
                    extra_headers={"retry-after": str(exc.retry_after_s), "x-llm-d-request-dropped-reason": exc.reason},
                )
            ]
        except Exception:  # a routing bug must cost one request a 500, never the stream or the process
            log.exception("routing failed for %s", ex.path)
            ex.ended = True
            return [error_response(500, "the router failed to route this request", type_="api_error")]
        ex.outcome = outcome
        endpoints = outcome.endpoints(self.fallbacks)
        mutated = (gie.model_rewrite is not None and bool(body)) or ex.pair is not None
        if at == "headers":
            return [route_response(endpoints, outcome.upstream_headers, phase="request_headers")]
        if at == "body":
            return [route_response(endpoints, outcome.upstream_headers, body=body if mutated else None)]
        replies = [
            route_response(
                endpoints,
                outcome.upstream_headers,
                phase="request_headers",
                content_length=len(body) if mutated else None,
            )
        ]
        last = at == "streamed-body"  # before trailers, the body's end is the trailers' message
        for start in range(0, len(body), STREAMED_CHUNK_BYTES):
            end = start + STREAMED_CHUNK_BYTES
            replies.append(streamed_body(body[start:end], last and end >= len(body)))
        if not body:
            replies.append(streamed_body(b"", last))
        return replies


def add_services(server: grpc.aio.Server, servicer: ExtProcServicer) -> health.aio.HealthServicer:
    """Register ext_proc plus the gRPC health service (overall, ``liveness``, ``readiness``, ext_proc)."""
    pb_grpc.add_ExternalProcessorServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    return health_servicer


def _status(serving: bool) -> health_pb2.HealthCheckResponse.ServingStatus.ValueType:
    return health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING


async def mark_serving(health_servicer: health.aio.HealthServicer, serving: bool) -> None:
    """Liveness: the process runs and its event loop answers (NOT_SERVING only while shutting down)."""
    await health_servicer.set(LIVENESS_SERVICE, _status(serving))


async def mark_ready(health_servicer: health.aio.HealthServicer, ready: bool) -> None:
    """Readiness (the overall service, ``readiness`` and ext_proc): the router can take requests now.

    Ready means the worker set has been resolved once and the health checks, KV-event subscriptions
    and load polling have started. Replicas are active-active (no leader to elect), so every
    started replica is ready; it turns NOT_SERVING when it shuts down.
    """
    for name in ("", READINESS_SERVICE, EXT_PROC_SERVICE):
        await health_servicer.set(name, _status(ready))

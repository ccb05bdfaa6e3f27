"""The ext_proc gRPC servicer: Envoy messages in, routing decisions out. Thin on purpose.

One bidirectional stream per HTTP request. With ``request_header_mode: SEND`` and
``request_body_mode: BUFFERED`` Envoy sends the headers, then the whole body; we answer the headers
with CONTINUE (or an early 413 / pass-through), parse the body, ask the router, and answer with the
destination. The stream then stays open until Envoy has sent the complete response, so its end is
the request's end: ``router.finish()`` runs there, whatever ended it (normal close, client cancel,
Envoy reset). Messages are upb protobufs (``xds-protos``); the body is never re-serialized.
The router's heavy CPU work (tokenizing) runs in its thread pool, so one huge prompt never holds up
the other streams or the health service on this event loop.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from extproc.config import RouterConfig
from extproc.request import RequestError, RequestKind, generation_kind, parse_request
from extproc.response import continue_body, continue_headers, error_response, route_response
from extproc.router import NoWorkerError, RouteOutcome, Router

__all__ = ["EXT_PROC_SERVICE", "ExtProcServicer", "add_services", "mark_serving"]

log = logging.getLogger(__name__)

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"


def _headers(message: pb.HttpHeaders) -> dict[str, str]:
    """Envoy's header map as a lower-cased dict (Envoy fills ``raw_value``; older versions ``value``)."""
    out: dict[str, str] = {}
    for h in message.headers.headers:
        out[h.key] = h.raw_value.decode("latin-1") if h.raw_value else h.value
    return out


class ExtProcServicer(pb_grpc.ExternalProcessorServicer):
    """Parses generation requests, asks the router, answers Envoy; knows nothing about policies."""

    def __init__(self, config: RouterConfig, router: Router) -> None:
        self.router = router
        self.max_body_bytes = config.server.max_body_bytes
        self.fallbacks = config.server.fallback_endpoints

    async def Process(  # noqa: N802 (the gRPC method name)
        self,
        request_iterator: AsyncIterator[pb.ProcessingRequest],
        context: grpc.aio.ServicerContext,
    ) -> None:
        outcome: RouteOutcome | None = None
        kind: RequestKind | None = None
        path = ""
        headers: dict[str, str] = {}
        try:
            async for message in request_iterator:
                phase = message.WhichOneof("request")
                if phase == "request_headers":
                    headers = _headers(message.request_headers)
                    path = headers.get(":path", "")
                    kind = generation_kind(headers.get(":method", ""), path)
                    reply, outcome = await self._on_headers(kind, path, headers, message.request_headers.end_of_stream)
                elif phase == "request_body":
                    if kind is None or outcome is not None:
                        reply = continue_body()
                    else:
                        reply, outcome = await self._decide(kind, path, headers, message.request_body.body)
                else:
                    # Only reachable if Envoy is configured to send more than we asked for: never block it.
                    reply = _continue_for(phase)
                    if reply is None:
                        continue
                await context.write(reply)
        finally:
            if outcome is not None:
                self.router.finish(outcome)

    async def _on_headers(
        self, kind: RequestKind | None, path: str, headers: dict[str, str], end_of_stream: bool
    ) -> tuple[pb.ProcessingResponse, RouteOutcome | None]:
        if kind is None:
            return continue_headers(), None  # not a generation request: ordinary routing
        if end_of_stream:  # no body will follow, so this reply is the only chance to answer
            return await self._decide(kind, path, headers, b"", phase="request_headers")
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            # Refuse as soon as the size is known: no worker and no parser need to see this body.
            return error_response(
                413,
                f"request body is {length} bytes; the limit is {self.max_body_bytes} bytes",
                type_="request_too_large",
            ), None
        return continue_headers(), None

    async def _decide(
        self, kind: RequestKind, path: str, headers: dict[str, str], body: bytes, phase: str = "request_body"
    ) -> tuple[pb.ProcessingResponse, RouteOutcome | None]:
        try:
            parsed = parse_request(kind, path, body, headers, self.max_body_bytes)
            # Tokenizing runs in the router's pool; a cancel here (client gone) leaves no slot taken.
            outcome = await self.router.aroute(parsed)
        except RequestError as exc:
            return error_response(exc.status, exc.message, exc.type, exc.param), None
        except NoWorkerError as exc:
            return error_response(503, str(exc), type_="service_unavailable"), None
        except Exception:  # a routing bug must cost one request a 500, never the stream or the process
            log.exception("routing failed for %s", path)
            return error_response(500, "the router failed to route this request", type_="api_error"), None
        reply = route_response(outcome.endpoints(self.fallbacks), outcome.upstream_headers, phase=phase)
        return reply, outcome


def _continue_for(phase: str | None) -> pb.ProcessingResponse | None:
    if phase == "response_headers":
        return pb.ProcessingResponse(response_headers=pb.HeadersResponse())
    if phase == "response_body":
        return pb.ProcessingResponse(response_body=pb.BodyResponse())
    if phase == "request_trailers":
        return pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
    if phase == "response_trailers":
        return pb.ProcessingResponse(response_trailers=pb.TrailersResponse())
    return None


def add_services(server: grpc.aio.Server, servicer: ExtProcServicer) -> health.aio.HealthServicer:
    """Register ext_proc plus the standard gRPC health service (overall and per service: SERVING)."""
    pb_grpc.add_ExternalProcessorServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    return health_servicer


async def mark_serving(health_servicer: health.aio.HealthServicer, serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", EXT_PROC_SERVICE):
        await health_servicer.set(name, status)

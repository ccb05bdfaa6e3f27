"""ext_proc replies: routing header mutations and OpenAI-style immediate error responses.

Builders only (no gRPC): the servicer picks one per Envoy message. The destination travels twice,
as the ``x-gateway-destination-endpoint`` header (set with OVERWRITE so a client copy can never win; the
``router-picked`` route matches on it) and as dynamic metadata ``envoy.lb``, both the same
``ip:port,ip:port,...`` (the Endpoint Picker protocol: primary, then fallbacks, read by Envoy's
``override_host`` load balancer, which retries a refused connection on the next one).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import orjson
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

__all__ = [
    "DESTINATION_HEADER",
    "LB_METADATA_NAMESPACE",
    "SAMPLED_MODE",
    "STREAMED_CHUNK_BYTES",
    "continue_body",
    "continue_headers",
    "continue_phase",
    "error_body",
    "error_response",
    "read_response_body",
    "route_response",
    "streamed_body",
]

DESTINATION_HEADER = "x-gateway-destination-endpoint"
LB_METADATA_NAMESPACE = "envoy.lb"

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
_ERROR_TYPES = {
    400: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_exceeded",
    503: "service_unavailable",
}

# Replies that never change are built once: they go out on every pass-through request.
_CONTINUE_HEADERS = pb.ProcessingResponse(request_headers=pb.HeadersResponse())
_CONTINUE_BODY = pb.ProcessingResponse(request_body=pb.BodyResponse())
_CONTINUE = {
    "request_headers": _CONTINUE_HEADERS,
    "request_body": _CONTINUE_BODY,
    "request_trailers": pb.ProcessingResponse(request_trailers=pb.TrailersResponse()),
    "response_headers": pb.ProcessingResponse(response_headers=pb.HeadersResponse()),
    "response_body": pb.ProcessingResponse(response_body=pb.BodyResponse()),
    "response_trailers": pb.ProcessingResponse(response_trailers=pb.TrailersResponse()),
}
# The processing mode a sampled response switches to (``read_response_body``): the filter's buffered-mode
# settings with the response body sent too, chunk by chunk as it comes (STREAMED: each chunk goes on as soon
# as the router has answered it, nothing waits for the whole body). The Envoy config allows exactly this
# override (``allowed_override_modes``), so a router can never switch a request to anything else.
SAMPLED_MODE = {
    "request_header_mode": "SEND",
    "request_body_mode": "BUFFERED",
    "request_trailer_mode": "SKIP",
    "response_header_mode": "SEND",
    "response_body_mode": "STREAMED",
    "response_trailer_mode": "SKIP",
}
_READ_BODY = pb.ProcessingResponse(
    response_headers=pb.HeadersResponse(),
    mode_override=ProcessingMode(
        request_header_mode=ProcessingMode.HeaderSendMode.Value(SAMPLED_MODE["request_header_mode"]),
        request_body_mode=ProcessingMode.BodySendMode.Value(SAMPLED_MODE["request_body_mode"]),
        request_trailer_mode=ProcessingMode.HeaderSendMode.Value(SAMPLED_MODE["request_trailer_mode"]),
        response_header_mode=ProcessingMode.HeaderSendMode.Value(SAMPLED_MODE["response_header_mode"]),
        response_body_mode=ProcessingMode.BodySendMode.Value(SAMPLED_MODE["response_body_mode"]),
        response_trailer_mode=ProcessingMode.HeaderSendMode.Value(SAMPLED_MODE["response_trailer_mode"]),
    ),
)
# A request body streamed back to Envoy (FULL_DUPLEX_STREAMED) goes in pieces of this size: one
# gRPC message per piece keeps every message far below gRPC's 4 MiB default limits.
STREAMED_CHUNK_BYTES = 64 * 1024


def continue_headers() -> pb.ProcessingResponse:
    """Let the request headers through unchanged."""
    return _CONTINUE_HEADERS


def continue_body() -> pb.ProcessingResponse:
    """Let the request body through unchanged (pass-through paths)."""
    return _CONTINUE_BODY


def continue_phase(phase: str) -> pb.ProcessingResponse | None:
    """Let the message of ``phase`` through unchanged (None for a phase without a reply)."""
    return _CONTINUE.get(phase)


def read_response_body() -> pb.ProcessingResponse:
    """Let the response headers through and ask Envoy for the response body as well (``SAMPLED_MODE``).

    Honoured only in reply to a headers message and where the filter has ``allow_mode_override``.
    """
    return _READ_BODY


def streamed_body(chunk: bytes, end_of_stream: bool, phase: str = "request_body") -> pb.ProcessingResponse:
    """One piece of a body streamed back to Envoy in FULL_DUPLEX_STREAMED mode (request or response)."""
    mutation = pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(body=chunk, end_of_stream=end_of_stream))
    body = pb.BodyResponse(response=pb.CommonResponse(body_mutation=mutation))
    if phase == "response_body":
        return pb.ProcessingResponse(response_body=body)
    return pb.ProcessingResponse(request_body=body)


# Plain destination replies (no extra header, no body) by (phase, endpoints): a fleet has few distinct
# rankings of its primary and fallbacks, and each reply is otherwise rebuilt per request. Bounded.
_ROUTE_CACHE: dict[tuple[str, tuple[str, ...]], pb.ProcessingResponse] = {}
_ROUTE_CACHE_SIZE = 4096


def route_response(
    endpoints: Sequence[str],
    extra_headers: Mapping[str, str] | None = None,
    phase: str = "request_body",
    body: bytes | None = None,
    content_length: int | None = None,
) -> pb.ProcessingResponse:
    """Send the request to ``endpoints`` (primary first): header + ``envoy.lb`` metadata + route-cache clear.

    Header and ``envoy.lb`` metadata carry the same list, primary first (the protocol requires them
    equal): Envoy's ``override_host`` load balancer takes one entry per attempt, so a retry after a
    refused connection goes to the next worker of the ranking. A gateway whose cluster is
    ``ORIGINAL_DST`` on the header (Envoy Gateway's InferencePool translation) parses one ``ip:port``
    only: run the router with ``server.fallback_endpoints: 0`` there.

    ``phase`` is the message being answered (``request_body``, or ``request_headers`` for a bodiless
    request and in FULL_DUPLEX_STREAMED mode); Envoy applies header mutations only in the reply to
    the phase it is waiting on. ``body`` replaces a buffered body (with ``content-length`` set to its
    length, which Envoy requires); ``content_length`` sets that header in a headers reply whose
    streamed body will be of another length than the client's. Plain replies are built once and
    reused (the caller never changes a reply).
    """
    if extra_headers or body is not None or content_length is not None:
        return _route_response(endpoints, extra_headers, phase, body, content_length)
    key = (phase, tuple(endpoints))
    reply = _ROUTE_CACHE.get(key)
    if reply is None:
        reply = _route_response(endpoints, None, phase, None, None)
        if len(_ROUTE_CACHE) < _ROUTE_CACHE_SIZE:
            _ROUTE_CACHE[key] = reply
    return reply


def _route_response(
    endpoints: Sequence[str],
    extra_headers: Mapping[str, str] | None,
    phase: str,
    body: bytes | None,
    content_length: int | None,
) -> pb.ProcessingResponse:
    set_headers = [
        base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key=DESTINATION_HEADER, raw_value=",".join(endpoints).encode()),
            append_action=_OVERWRITE,
        )
    ]
    headers = dict(extra_headers or {})
    if body is not None:
        content_length = len(body)
    if content_length is not None:
        headers["content-length"] = str(content_length)
    for key, header_value in headers.items():
        set_headers.append(
            base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key=key, raw_value=header_value.encode()), append_action=_OVERWRITE
            )
        )
    common = pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=set_headers), clear_route_cache=True)
    if body is not None and phase == "request_body":
        common.body_mutation.body = body
    metadata = struct_pb2.Struct()
    metadata.fields[LB_METADATA_NAMESPACE].struct_value.fields[DESTINATION_HEADER].string_value = ",".join(endpoints)
    if phase == "request_headers":
        return pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common), dynamic_metadata=metadata)
    return pb.ProcessingResponse(request_body=pb.BodyResponse(response=common), dynamic_metadata=metadata)


def error_body(status: int, message: str, type_: str | None = None, param: str | None = None) -> bytes:
    """The OpenAI error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return orjson.dumps(
        {
            "error": {
                "message": message,
                "type": type_ or _ERROR_TYPES.get(status, "api_error"),
                "param": param,
                "code": status,
            }
        }
    )


def error_response(
    status: int,
    message: str,
    type_: str | None = None,
    param: str | None = None,
    details: str = "prefix_router",
    extra_headers: Mapping[str, str] | None = None,
) -> pb.ProcessingResponse:
    """End the request from the router with an OpenAI-style JSON error (no worker sees it).

    ``extra_headers`` go on the reply as well (``retry-after`` on a 429, the reason a request was dropped).
    """
    headers = pb.HeaderMutation(
        set_headers=[
            base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key=key, raw_value=value.encode()), append_action=_OVERWRITE
            )
            for key, value in {"content-type": "application/json", **(extra_headers or {})}.items()
        ]
    )
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=headers,
            body=error_body(status, message, type_, param),
            details=details,
        )
    )

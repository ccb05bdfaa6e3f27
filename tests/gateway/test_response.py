"""The ext_proc reply builders: plain destination replies are built once, the others every time."""

from __future__ import annotations

from extproc.exchange import response
from extproc.exchange.response import DESTINATION_HEADER, LB_METADATA_NAMESPACE, route_response

ENDPOINTS = ["127.0.0.1:41000", "127.0.0.1:41001"]


def _destination(reply: object, phase: str) -> tuple[str, str]:
    common = getattr(reply, phase).response
    header = next(h.header for h in common.header_mutation.set_headers if h.header.key == DESTINATION_HEADER)
    metadata = reply.dynamic_metadata.fields[LB_METADATA_NAMESPACE].struct_value.fields  # type: ignore[attr-defined]
    return header.raw_value.decode(), metadata[DESTINATION_HEADER].string_value


def test_a_plain_destination_reply_is_reused_and_equals_a_fresh_one() -> None:
    first = route_response(ENDPOINTS)
    assert route_response(list(ENDPOINTS)) is first  # same ranking: the reply built once
    fresh = response._route_response(ENDPOINTS, None, "request_body", None, None)
    assert first.SerializeToString(deterministic=True) == fresh.SerializeToString(deterministic=True)
    assert _destination(first, "request_body") == (",".join(ENDPOINTS), ",".join(ENDPOINTS))
    assert first.request_body.response.clear_route_cache
    # Another phase or another ranking is another reply.
    headers = route_response(ENDPOINTS, phase="request_headers")
    assert headers is not first and headers.HasField("request_headers")
    assert _destination(route_response(ENDPOINTS[::-1]), "request_body")[0] == ",".join(ENDPOINTS[::-1])


def test_replies_with_headers_or_a_body_are_built_per_request() -> None:
    traced = route_response(ENDPOINTS, {"traceparent": "00-ab-cd-01"})
    assert traced is not route_response(ENDPOINTS, {"traceparent": "00-ab-cd-01"})
    keys = {h.header.key: h.header.raw_value for h in traced.request_body.response.header_mutation.set_headers}
    assert keys == {DESTINATION_HEADER: ",".join(ENDPOINTS).encode(), "traceparent": b"00-ab-cd-01"}
    rewritten = route_response(ENDPOINTS, body=b'{"model": "m2"}')
    assert rewritten.request_body.response.body_mutation.body == b'{"model": "m2"}'
    lengths = {h.header.key: h.header.raw_value for h in rewritten.request_body.response.header_mutation.set_headers}
    assert lengths["content-length"] == b"15"
    # The cached plain reply was not touched by either.
    plain = route_response(ENDPOINTS)
    assert len(plain.request_body.response.header_mutation.set_headers) == 1
    assert not plain.request_body.response.HasField("body_mutation")

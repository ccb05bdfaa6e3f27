"""What the Endpoint Picker protocol (Gateway API Inference Extension, v1.0.0) adds to plain ext_proc.

Readers of the proxy's side of the protocol, as plain values, so that the servicer stays thin and
the router never sees protobuf:

- the **subset hint**: filter metadata ``envoy.lb.subset_hint`` / ``x-gateway-destination-endpoint-subset``
  on the request, a list of ``ip:port`` the picker must choose from (an empty list: 503);
- the **served endpoint**: ``envoy.lb`` / ``x-gateway-destination-endpoint-served`` in the response's
  ``metadata_context``, the endpoint that really served after Envoy's fallbacks;
- the **request headers GIE defines**: the inference objective (a priority), the fairness id and the
  model-name rewrite, which :func:`rewrite_model` applies to the body before any worker sees it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import orjson
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.decision.request import RequestError

__all__ = [
    "FAIRNESS_ID_HEADER",
    "MODEL_REWRITE_HEADER",
    "OBJECTIVE_HEADER",
    "SERVED_KEY",
    "SUBSET_KEY",
    "SUBSET_NAMESPACE",
    "GieHeaders",
    "gie_headers",
    "rewrite_model",
    "served_endpoint",
    "subset_hint",
]

SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
SERVED_NAMESPACE = "envoy.lb"
SERVED_KEY = "x-gateway-destination-endpoint-served"
OBJECTIVE_HEADER = "x-gateway-inference-objective"
FAIRNESS_ID_HEADER = "x-gateway-inference-fairness-id"
MODEL_REWRITE_HEADER = "x-gateway-model-name-rewrite"


def subset_hint(message: pb.ProcessingRequest) -> frozenset[str] | None:
    """The endpoints the gateway allows for this request, or None when it sets no hint.

    A hint given as one comma-separated string is read too (some gateways flatten lists that way).
    """
    namespace = message.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if namespace is None or SUBSET_KEY not in namespace.fields:
        return None
    value = namespace.fields[SUBSET_KEY]
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        items = [v.string_value for v in value.list_value.values if v.WhichOneof("kind") == "string_value"]
    elif kind == "string_value":
        items = value.string_value.split(",")
    else:
        items = []
    return frozenset(item.strip() for item in items if item.strip())


def served_endpoint(message: pb.ProcessingRequest) -> str | None:
    """The ``ip:port`` that served the request (first of a list), or None when the proxy did not say."""
    namespace = message.metadata_context.filter_metadata.get(SERVED_NAMESPACE)
    if namespace is None or SERVED_KEY not in namespace.fields:
        return None
    value = namespace.fields[SERVED_KEY]
    if value.WhichOneof("kind") != "string_value":
        return None
    first = value.string_value.split(",", 1)[0].strip()
    return first or None


@dataclass(frozen=True)
class GieHeaders:
    """The GIE request headers of one request (None: not sent)."""

    objective: str | None = None
    fairness_id: str | None = None
    model_rewrite: str | None = None


def gie_headers(headers: Mapping[str, str]) -> GieHeaders:
    """Read the objective, fairness id and model rewrite from lower-cased request headers."""

    def value(name: str) -> str | None:
        raw = headers.get(name, "").strip()
        return raw or None

    return GieHeaders(value(OBJECTIVE_HEADER), value(FAIRNESS_ID_HEADER), value(MODEL_REWRITE_HEADER))


def rewrite_model(body: bytes, model: str) -> bytes:
    """The body with its ``model`` field set to ``model`` (the only change; other fields keep their values).

    The body was already parsed as a JSON object by ``parse_request``; it is parsed again here only
    for requests that carry the rewrite header.
    """
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise RequestError(400, "request body is not valid JSON") from None
    if not isinstance(data, dict):
        raise RequestError(400, "request body must be a JSON object")
    data["model"] = model
    return orjson.dumps(data)

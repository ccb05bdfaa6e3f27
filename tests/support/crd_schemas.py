"""JSON schemas of the custom resources the Kubernetes manifests use, for validation without a cluster.

``kubernetes-validate`` ships the schemas of the built-in kinds only. These are the v1 CRDs' own
constraints, written out here for the fields the manifests use (any other field is an error, as
``kubectl apply``'s strict field validation makes it):

- ``InferencePool`` (``inference.networking.k8s.io/v1``): the openAPIV3Schema of
  ``config/crd/bases/inference.networking.k8s.io_inferencepools.yaml`` in
  kubernetes-sigs/gateway-api-inference-extension at tags v1.0.0 and v1.6.0 (the first and the
  latest v1 release when this was written). Where the two differ, the stricter one is kept, so a pool
  valid here is valid on either: v1.0.0 requires ``endpointPickerRef`` and allows one target port
  (v1.6.0: optional, up to 8) and has no ``appProtocol``; v1.6.0 bounds ``matchLabels`` to 1-64
  entries. The CRD's CEL rule "port is required when kind is 'Service' or unspecified" is the
  ``anyOf`` below.
- ``Gateway`` and ``HTTPRoute`` (``gateway.networking.k8s.io/v1``): the fields we use, with their
  types and enums.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CRD_SCHEMAS"]


def _fields(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    """An object with these fields and no other (strict field validation), ``required`` among them."""
    schema: dict[str, Any] = {"type": "object", "additionalProperties": False, "properties": properties}
    if required:
        schema["required"] = required
    return schema


def _resource(spec: dict[str, Any]) -> dict[str, Any]:
    """A custom resource: apiVersion, kind, metadata with a name, and ``spec``."""
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {"metadata": {"type": "object", "required": ["name"]}, "spec": spec},
    }


_NAME = {"type": "string", "minLength": 1, "maxLength": 253}
# GIE's LabelValue: at most 63 characters, alphanumeric at both ends, [-_.] and alphanumerics between.
_LABEL_VALUE = {"type": "string", "maxLength": 63, "pattern": r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"}
_PORT = _fields({"number": {"type": "integer", "minimum": 1, "maximum": 65535}}, ["number"])

_ENDPOINT_PICKER_REF = _fields(
    {
        "group": {
            "type": "string",
            "maxLength": 253,
            "pattern": r"^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$",
        },
        "kind": {
            "type": "string",
            "minLength": 1,
            "maxLength": 63,
            "pattern": r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$",
        },
        "name": _NAME,
        "port": _PORT,
        "failureMode": {"enum": ["FailOpen", "FailClose"]},
    },
    ["name"],
) | {
    # CEL: self.kind != 'Service' || has(self.port); kind defaults to Service.
    "anyOf": [
        {"required": ["port"]},
        {"required": ["kind"], "properties": {"kind": {"not": {"const": "Service"}}}},
    ],
}

_INFERENCE_POOL = _resource(
    _fields(
        {
            "selector": _fields(
                {
                    "matchLabels": {
                        "type": "object",
                        "minProperties": 1,
                        "maxProperties": 64,
                        "additionalProperties": _LABEL_VALUE,
                    }
                },
                ["matchLabels"],
            ),
            "targetPorts": {"type": "array", "minItems": 1, "maxItems": 1, "uniqueItems": True, "items": _PORT},
            "endpointPickerRef": _ENDPOINT_PICKER_REF,
        },
        ["selector", "targetPorts", "endpointPickerRef"],
    )
)

_LISTENER = _fields(
    {
        "name": _NAME,
        "port": {"type": "integer", "minimum": 1, "maximum": 65535},
        "protocol": {"enum": ["HTTP", "HTTPS", "TLS", "TCP", "UDP"]},
    },
    ["name", "port", "protocol"],
)
_GATEWAY = _resource(
    _fields(
        {"gatewayClassName": _NAME, "listeners": {"type": "array", "minItems": 1, "items": _LISTENER}},
        ["gatewayClassName", "listeners"],
    )
)

_PATH_MATCH = _fields({"type": {"enum": ["Exact", "PathPrefix", "RegularExpression"]}, "value": {"type": "string"}})
_BACKEND_REF = _fields(
    {
        "group": {"type": "string"},
        "kind": {"type": "string"},
        "name": _NAME,
        "port": {"type": "integer"},
        "weight": {"type": "integer"},
    },
    ["name"],
)
_HTTP_ROUTE_RULE = _fields(
    {
        "matches": {"type": "array", "items": {"type": "object", "properties": {"path": _PATH_MATCH}}},
        "backendRefs": {"type": "array", "minItems": 1, "items": _BACKEND_REF},
        "timeouts": _fields({"request": {"type": "string"}, "backendRequest": {"type": "string"}}),
    }
)
_PARENT_REF = _fields({"group": {"type": "string"}, "kind": {"type": "string"}, "name": _NAME}, ["name"])
_HTTP_ROUTE = _resource(
    _fields(
        {
            "parentRefs": {"type": "array", "minItems": 1, "items": _PARENT_REF},
            "rules": {"type": "array", "minItems": 1, "items": _HTTP_ROUTE_RULE},
        },
        ["parentRefs", "rules"],
    )
)

CRD_SCHEMAS: dict[tuple[str, str], dict[str, Any]] = {
    ("inference.networking.k8s.io/v1", "InferencePool"): _INFERENCE_POOL,
    ("gateway.networking.k8s.io/v1", "Gateway"): _GATEWAY,
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): _HTTP_ROUTE,
}

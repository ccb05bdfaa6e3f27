"""The Envoy configuration a GIE gateway generates for an ``InferencePool``, with the router as its endpoint picker.

Envoy Gateway reaches an ``InferencePool`` through Envoy AI Gateway's extension server
(envoyproxy/ai-gateway, ``internal/extensionserver``, read at commit c217da8, Aug 2026), which
translates it into:

- an ``ext_proc`` HTTP filter per pool calling the picker over gRPC (HTTP/2, a STRICT_DNS cluster of
  the picker's Service), processing mode: every header and trailer phase ``SEND``, request and
  response bodies ``FULL_DUPLEX_STREAMED`` (the default; ``BUFFERED`` by a pool annotation),
  ``allow_mode_override: false``, ``message_timeout: 300s``, ``failure_mode_allow: false`` (no
  picker, no request), no metadata options;
- the pool's cluster turned into ``ORIGINAL_DST`` with ``lb_policy: CLUSTER_PROVIDED`` and
  ``original_dst_lb_config {use_http_header: true, http_header_name: x-gateway-destination-endpoint}``
  (the primary endpoint of the picker's header is the upstream; no fallbacks), connect timeout 10 s;
- the route to that cluster.

:func:`bootstrap` is that shape as a complete Envoy bootstrap over a local router (``envoy/``
keeps one, ``python -m prefix_router.gie_envoy_config`` regenerates it): what the tests run to prove the
router works behind such a gateway as it is deployed, not only behind our own generated config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from extproc.exchange.response import DESTINATION_HEADER

__all__ = ["EPP_CLUSTER", "POOL_CLUSTER", "bootstrap", "example_file"]

EPP_CLUSTER = "envoyextensionpolicy_epp"  # the picker's Service
POOL_CLUSTER = "endpointpicker_pool_original_dst"  # the InferencePool's endpoints


_HCM_TYPE = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"


def _address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def bootstrap(
    epp: tuple[str, int],
    listen: tuple[str, int] = ("127.0.0.1", 8080),
    admin: tuple[str, int] = ("127.0.0.1", 9901),
    body_mode: str = "FULL_DUPLEX_STREAMED",
    message_timeout_s: float = 300.0,
) -> dict[str, Any]:
    """A bootstrap in the shape Envoy Gateway + Envoy AI Gateway give an ``InferencePool``."""
    ext_proc = {
        "name": "envoy.filters.http.ext_proc/inferencepool",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": EPP_CLUSTER}},
            "processing_mode": {
                "request_header_mode": "SEND",
                "request_body_mode": body_mode,
                "request_trailer_mode": "SEND",
                "response_header_mode": "SEND",
                "response_body_mode": body_mode,
                "response_trailer_mode": "SEND",
            },
            "allow_mode_override": False,
            "message_timeout": f"{message_timeout_s:g}s",
            "failure_mode_allow": False,
        },
    }
    hcm = {
        "@type": _HCM_TYPE,
        "stat_prefix": "gateway",
        "route_config": {
            "name": "gateway",
            "virtual_hosts": [
                {
                    "name": "gateway",
                    "domains": ["*"],
                    "routes": [{"match": {"prefix": "/"}, "route": {"cluster": POOL_CLUSTER, "timeout": "120s"}}],
                }
            ],
        },
        "http_filters": [
            ext_proc,
            {
                "name": "envoy.filters.http.router",
                "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
            },
        ],
    }
    epp_cluster = {
        "name": EPP_CLUSTER,
        "type": "STRICT_DNS",
        "connect_timeout": "10s",
        "lb_policy": "LEAST_REQUEST",
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
        "load_assignment": {
            "cluster_name": EPP_CLUSTER,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _address(*epp)}}]}],
        },
    }
    pool_cluster = {
        "name": POOL_CLUSTER,
        "type": "ORIGINAL_DST",
        "lb_policy": "CLUSTER_PROVIDED",
        "connect_timeout": "10s",
        "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION_HEADER},
    }
    return {
        "admin": {"address": _address(*admin)},
        "static_resources": {
            "listeners": [
                {
                    "name": "gateway",
                    "address": _address(*listen),
                    "filter_chains": [
                        {"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}
                    ],
                }
            ],
            "clusters": [epp_cluster, pool_cluster],
        },
    }


EXAMPLE_PATH = "envoy/envoy-gateway-inferencepool.yaml"


class _PlainDumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:
        return True


def example_file() -> tuple[str, str]:
    """The file kept under ``envoy/``: the shape over a router on 127.0.0.1:9002."""
    header = (
        "# The Envoy configuration Envoy Gateway (with Envoy AI Gateway's InferencePool support) generates for an\n"
        "# InferencePool whose endpoint picker is prefix-router, as a bootstrap over a router on 127.0.0.1:9002.\n"
        "# Generated by `python -m prefix_router.gie_envoy_config`; see docs/gateway.md.\n"
    )
    body = yaml.dump(bootstrap(("127.0.0.1", 9002)), Dumper=_PlainDumper, sort_keys=False, default_flow_style=False)
    return EXAMPLE_PATH, header + body


if __name__ == "__main__":  # regenerate envoy/envoy-gateway-inferencepool.yaml (from the repository root)
    path, content = example_file()
    Path(path).write_text(content)
    print(f"wrote {path}")

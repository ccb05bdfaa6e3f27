"""The Envoy pieces that put the router in front of a worker fleet (printed by ``prefix-router envoy-config``).

Built as plain dicts and printed as YAML: Envoy's own schema is the contract, and ``envoy --mode
validate`` (run by the tests) is the checker, so no typed config library is needed here.

The pieces, in request order:

1. ``header_mutation`` filter removes any client-sent ``x-gateway-destination-endpoint`` (and the
   data-parallel rank headers the router sets). It runs before ext_proc, so a client can never pick
   the upstream, not even while the router is down and ext_proc fails open (measured: without it,
   Envoy's ORIGINAL_DST cluster proxied to any ``ip:port`` the client named).
2. ``ext_proc`` filter: request headers SEND, body BUFFERED, response headers SEND, response bodies
   NONE (streams flow through unbuffered) except for the responses the router samples for index drift,
   whose body it asks for, streamed (``allow_mode_override`` for that one mode); ``failure_mode_allow``
   (fail open), ``envoy.lb`` metadata accepted.
3. Routes: with the router's header and ``envoy.lb`` metadata -> the ``picked`` cluster, whose
   ``override_host`` load balancer sends each attempt to the next endpoint of the router's ranking
   (primary, then fallbacks: a refused connection is retried on the next worker, never lost); a
   generation request without them (router down or slow) -> an ordinary least-request cluster of the
   same workers; any other path -> the same cluster, with ext_proc disabled on that route (no round
   trip, body not buffered); ``/metrics`` -> the router's fleet metrics (or a clear 404).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from extproc.decision.request import GENERATION_PATHS
from extproc.exchange.epp import SERVED_KEY, SUBSET_NAMESPACE
from extproc.exchange.response import DESTINATION_HEADER, LB_METADATA_NAMESPACE, SAMPLED_MODE
from extproc.fleet.info import DP_RANK_HEADERS
from prefix_common.addresses import is_ip_literal

__all__ = [
    "EXTPROC_CLUSTER",
    "FAILOPEN_CLUSTER",
    "METRICS_CLUSTER",
    "PICKED_CLUSTER",
    "GatewaySpec",
    "bootstrap",
    "clusters",
    "example_files",
    "http_filters",
    "local_reply_config",
    "pieces",
    "routes",
]

EXTPROC_CLUSTER = "prefix_router_extproc"
PICKED_CLUSTER = "prefix_router_picked"
FAILOPEN_CLUSTER = "prefix_router_workers"
METRICS_CLUSTER = "prefix_router_metrics"
# Failures before any response byte are retried on the next worker: a refused connection, and (with
# ``retry_on_reset``) a connection the worker reset, as a dying process does while the kernel tears it down.
RETRY_ON = "connect-failure,refused-stream,reset-before-request"
RETRY_ON_RESET = RETRY_ON + ",reset"
UPSTREAM_HOST_HEADER = "x-upstream-host"
HCM_TYPE = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
ACCESS_LOG_FORMAT = (
    "%REQ(:METHOD)% %REQ(:PATH)% -> %UPSTREAM_HOST% %RESPONSE_CODE% %DURATION%ms"
    " (%ROUTE_NAME%, %RESPONSE_CODE_DETAILS%)\n"
)
# The same line as one JSON object (``up --log-format json``), with the fields log pipelines read under the
# names the router's own JSON records use (prefix_common/logs.py); Envoy writes a number as a number.
ACCESS_LOG_JSON = {
    "time": "%START_TIME(%Y-%m-%dT%H:%M:%S.%3fZ)%",  # START_TIME is UTC
    "level": "info",
    "logger": "envoy.access",
    "message": ACCESS_LOG_FORMAT.rstrip("\n"),
    "method": "%REQ(:METHOD)%",
    "path": "%REQ(:PATH)%",
    "upstream": "%UPSTREAM_HOST%",
    "status": "%RESPONSE_CODE%",
    "duration_ms": "%DURATION%",
    "route": "%ROUTE_NAME%",
    "details": "%RESPONSE_CODE_DETAILS%",
}
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024  # same default as ServerConfig.max_body_bytes
DEFAULT_MAX_MESSAGE_TIMEOUT_MS = 35_000  # above FlowControlConfig.queue_ttl_s (30 s) + the 1 s the router adds


def _address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


@dataclass
class GatewaySpec:
    """Everything the generated config depends on."""

    workers: list[tuple[str, int]]
    extproc: tuple[str, int] | None = ("127.0.0.1", 9002)  # None: no router (plain least-request Envoy)
    # ``prefix-router serve --processes N``: the router's processes listen on port, port + 1, ... port + N - 1.
    extproc_processes: int = 1
    listen: tuple[str, int] = ("127.0.0.1", 8080)
    admin: tuple[str, int] = ("127.0.0.1", 9901)
    timeout_ms: int = 500
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    upstream_host_header: bool = False
    access_log: bool = False
    access_log_json: bool = False  # the access log as one JSON object per line (ACCESS_LOG_JSON) instead of text
    retries: int = 2  # attempts after the first on a refused connection (the router's fallbacks, then any)
    # Also retry a request whose worker reset the connection before answering (it died accepting or running
    # it): saves requests a dying worker took in; a request that itself crashes workers may crash retries more.
    retry_on_reset: bool = True
    router_metrics: tuple[str, int] | None = None  # the router's metrics port: served as the gateway's /metrics
    tls_ca: Path | None = None  # verify the router's certificate with this CA
    tls_cert: Path | None = None  # client certificate (mTLS) ...
    tls_key: Path | None = None  # ... and its key
    tls_sni: str | None = None
    extra_clusters: list[dict[str, Any]] = field(default_factory=list)
    # Envoy's own check of the fail-open cluster. SGLang's /ready is a flag (200 once warm-up is over, 503
    # after a failed /health): free for the worker, and Envoy starts without waiting a second for /health's
    # generation. Releases without /ready want "/health" (its 5 s timeout is kept for that).
    health_path: str = "/ready"
    # How Envoy hands bodies to the router: "buffered" (whole body, one message) or "streamed"
    # (FULL_DUPLEX_STREAMED both ways, as GIE gateways configure it; see extproc/exchange/servicer.py).
    body_mode: str = "buffered"
    # Longest wait flow control may ask for (override_message_timeout while a request is queued). It
    # costs nothing until the router asks: the default covers flow_control.queue_ttl_s' default (30 s) + 1 s.
    max_message_timeout_ms: int | None = DEFAULT_MAX_MESSAGE_TIMEOUT_MS
    # A prefill/decode fleet: a generation request the router did not pair (it is down, or slower than
    # ``timeout_ms``) has no bootstrap fields, and every PD worker refuses it with a 400 that blames the
    # client. Such requests are answered 503 at once instead (fail-open cannot serve them; a client retries a 503).
    disaggregated: bool = False

    @property
    def buffer_limit_bytes(self) -> int:
        """Envoy's buffer must exceed the router's limit, so that the router (with a JSON error) answers 413."""
        return 2 * self.max_body_bytes


def http_filters(spec: GatewaySpec) -> list[dict[str, Any]]:
    """The HTTP filter chain up to and including the router filter."""
    strip = {
        "name": "envoy.filters.http.header_mutation",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
            "mutations": {"request_mutations": [{"remove": h} for h in (DESTINATION_HEADER, *DP_RANK_HEADERS)]},
        },
    }
    chain = [strip]
    if spec.extproc is not None:
        streamed = spec.body_mode == "streamed"
        ext_proc: dict[str, Any] = {
            "grpc_service": {"envoy_grpc": {"cluster_name": EXTPROC_CLUSTER}},
            "failure_mode_allow": True,
            "message_timeout": f"{spec.timeout_ms / 1000:.3f}s",
            "processing_mode": {
                "request_header_mode": "SEND",
                "request_body_mode": "FULL_DUPLEX_STREAMED" if streamed else "BUFFERED",
                # FULL_DUPLEX_STREAMED needs trailers sent: a body ended by trailers ends there.
                "request_trailer_mode": "SEND" if streamed else "SKIP",
                # The response headers carry the endpoint that served (after fallbacks) to the router.
                "response_header_mode": "SEND",
                "response_body_mode": "FULL_DUPLEX_STREAMED" if streamed else "NONE",
                "response_trailer_mode": "SEND" if streamed else "SKIP",
            },
            "metadata_options": {
                "receiving_namespaces": {"untyped": [LB_METADATA_NAMESPACE]},
                "forwarding_namespaces": {"untyped": [LB_METADATA_NAMESPACE, SUBSET_NAMESPACE]},
            },
        }
        if not streamed:
            # A response sampled for index drift (observability.drift_sample_rate) is read by the router: the
            # reply to its headers asks for its body, chunk by chunk as it streams. Only that one mode may be
            # asked for; every other response's body never leaves Envoy.
            ext_proc["allow_mode_override"] = True
            ext_proc["allowed_override_modes"] = [dict(SAMPLED_MODE)]
        if spec.max_message_timeout_ms is not None:
            ext_proc["max_message_timeout"] = f"{spec.max_message_timeout_ms / 1000:.3f}s"
        chain.append(
            {
                "name": "envoy.filters.http.ext_proc",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
                    **ext_proc,
                },
            }
        )
        chain.append(_served_to_metadata())
    chain.append(
        {
            "name": "envoy.filters.http.router",
            "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
        }
    )
    return chain


def _served_to_metadata() -> dict[str, Any]:
    """Turn the served-endpoint response header (added by the picked route) into ``envoy.lb`` metadata.

    It runs after ext_proc in the chain, so before it on the response: the router then reads the
    endpoint that really served from the response headers' ``metadata_context``, as the Endpoint
    Picker protocol has it. The header itself is removed, so clients never see it.
    """
    return {
        "name": "envoy.filters.http.header_to_metadata",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config",
            "response_rules": [
                {
                    "header": SERVED_KEY,
                    "on_header_present": {"metadata_namespace": LB_METADATA_NAMESPACE, "key": SERVED_KEY},
                    "remove": True,
                }
            ],
        },
    }


def _no_circuit_breaking() -> dict[str, Any]:
    # Envoy's defaults (1024 requests / pending per cluster) would turn a burst into 503s, and on the
    # ext_proc cluster into silent fail-open; admission control belongs to the workers' queues.
    return {
        "thresholds": [
            {
                "max_connections": 1_000_000,
                "max_pending_requests": 1_000_000,
                "max_requests": 1_000_000,
                # Retries are of refused connections only (nothing reached a worker), so they cannot
                # multiply work; a low cap would turn a dead worker's share of a burst into errors.
                "max_retries": 1_000_000,
            }
        ]
    }


def _http2() -> dict[str, Any]:
    return {
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}},
        }
    }


def _tls_socket(spec: GatewaySpec) -> dict[str, Any]:
    common: dict[str, Any] = {"alpn_protocols": ["h2"]}
    if spec.tls_ca is not None:
        validation: dict[str, Any] = {"trusted_ca": {"filename": str(spec.tls_ca)}}
        if spec.tls_sni:  # a certificate from the same CA for another name must not pass
            validation["match_typed_subject_alt_names"] = [{"san_type": "DNS", "matcher": {"exact": spec.tls_sni}}]
        common["validation_context"] = validation
    if spec.tls_cert is not None and spec.tls_key is not None:
        common["tls_certificates"] = [
            {"certificate_chain": {"filename": str(spec.tls_cert)}, "private_key": {"filename": str(spec.tls_key)}}
        ]
    context: dict[str, Any] = {
        "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
        "common_tls_context": common,
    }
    if spec.tls_sni:
        context["sni"] = spec.tls_sni
    return {"name": "envoy.transport_sockets.tls", "typed_config": context}


def _workers_assignment(spec: GatewaySpec, name: str) -> dict[str, Any]:
    """A cluster's type and endpoints: the workers (every address of a DNS name is one)."""
    all_ips = all(is_ip_literal(h) for h, _ in spec.workers)
    return {
        "type": "STATIC" if all_ips else "STRICT_DNS",
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _address(h, p)}} for h, p in spec.workers]}],
        },
    }


_LB_TYPES = "type.googleapis.com/envoy.extensions.load_balancing_policies"


def _override_host() -> dict[str, Any]:
    """Envoy's Endpoint Picker load balancer: each attempt takes the next ``ip:port`` of the router's list.

    Only workers of the cluster can be chosen (an endpoint it does not hold is skipped), and once the
    list is used up the least-request fallback picks among the rest.
    """
    return {
        "policies": [
            {
                "typed_extension_config": {
                    "name": "envoy.load_balancing_policies.override_host",
                    "typed_config": {
                        "@type": f"{_LB_TYPES}.override_host.v3.OverrideHost",
                        "override_host_sources": [
                            {"metadata": {"key": LB_METADATA_NAMESPACE, "path": [{"key": DESTINATION_HEADER}]}}
                        ],
                        "fallback_policy": {
                            "policies": [
                                {
                                    "typed_extension_config": {
                                        "name": "envoy.load_balancing_policies.least_request",
                                        "typed_config": {"@type": f"{_LB_TYPES}.least_request.v3.LeastRequest"},
                                    }
                                }
                            ]
                        },
                    },
                }
            }
        ]
    }


def _outlier_detection() -> dict[str, Any]:
    # A worker that refuses connections is ejected after the first two refusals, without waiting
    # for the next active health check; only connection-level (local origin) failures count.
    return {
        "split_external_local_origin_errors": True,
        "consecutive_local_origin_failure": 2,
        "enforcing_consecutive_local_origin_failure": 100,
        "consecutive_5xx": 1_000_000,  # a worker's own 5xx answers are not a reason to eject it
        "interval": "1s",
        "base_ejection_time": "5s",
        "max_ejection_percent": 100,
    }


def clusters(spec: GatewaySpec) -> list[dict[str, Any]]:
    """ext_proc (HTTP/2, optional TLS), the router's pick (override_host), fail-open, the router's metrics."""
    out: list[dict[str, Any]] = []
    if spec.extproc is not None:
        host, port = spec.extproc
        extproc: dict[str, Any] = {
            "name": EXTPROC_CLUSTER,
            "type": "STATIC" if is_ip_literal(host) else "STRICT_DNS",
            "connect_timeout": "0.25s",
            "circuit_breakers": _no_circuit_breaking(),
            "typed_extension_protocol_options": _http2(),
            "load_assignment": {
                "cluster_name": EXTPROC_CLUSTER,
                # Each ext_proc stream goes to the next process, round robin (one HTTP/2 connection each).
                "endpoints": [
                    {
                        "lb_endpoints": [
                            {"endpoint": {"address": _address(host, port + i)}} for i in range(spec.extproc_processes)
                        ]
                    }
                ],
            },
        }
        if spec.tls_ca is not None or spec.tls_cert is not None:
            extproc["transport_socket"] = _tls_socket(spec)
        out.append(extproc)
        out.append(
            {
                "name": PICKED_CLUSTER,
                **_workers_assignment(spec, PICKED_CLUSTER),
                "connect_timeout": "1s",
                "circuit_breakers": _no_circuit_breaking(),
                "load_balancing_policy": _override_host(),
                "outlier_detection": _outlier_detection(),
            }
        )
    out.append(
        {
            "name": FAILOPEN_CLUSTER,
            **_workers_assignment(spec, FAILOPEN_CLUSTER),
            "lb_policy": "LEAST_REQUEST",
            "connect_timeout": "1s",
            "circuit_breakers": _no_circuit_breaking(),
            "outlier_detection": _outlier_detection(),
            # Fail-open must not send traffic to a dead worker: Envoy checks each worker itself (health_path).
            # SGLang answers /health after 1 s at the earliest (it runs a generation): the timeout stays 5 s.
            "health_checks": [
                {
                    "timeout": "5s",
                    "interval": "2s",
                    "unhealthy_threshold": 2,
                    "healthy_threshold": 1,
                    "http_health_check": {"path": spec.health_path},
                }
            ],
        }
    )
    if spec.router_metrics is not None:
        host, port = spec.router_metrics
        out.append(
            {
                "name": METRICS_CLUSTER,
                "type": "STATIC" if is_ip_literal(host) else "STRICT_DNS",
                "connect_timeout": "0.25s",
                "load_assignment": {
                    "cluster_name": METRICS_CLUSTER,
                    # Each ext_proc stream goes to the next process, round robin (one HTTP/2 connection each).
                    "endpoints": [
                        {
                            "lb_endpoints": [
                                {"endpoint": {"address": _address(host, port + i)}}
                                for i in range(spec.extproc_processes)
                            ]
                        }
                    ],
                },
            }
        )
    return out + spec.extra_clusters


def routes(spec: GatewaySpec) -> list[dict[str, Any]]:
    """``/metrics``; router's pick -> override_host; other generation requests (fail-open) and paths -> least-request.

    Paths the router does not parse never reach ext_proc at all (disabled per route): no gRPC round
    trip for them, and their bodies stream through instead of being buffered (a buffered body over
    Envoy's buffer limit would be refused). Routes to workers retry a refused connection (nothing
    reached the worker): the router's pick on its next fallback, fail-open on another worker.
    """
    action: dict[str, Any] = {"timeout": "0s"}  # generations may stream for minutes; idle timeout still applies
    extra: dict[str, Any] = {}
    if spec.upstream_host_header:
        extra["response_headers_to_add"] = [
            {
                "header": {"key": UPSTREAM_HOST_HEADER, "value": "%UPSTREAM_HOST%"},
                "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
            }
        ]
    failopen = {"cluster": FAILOPEN_CLUSTER, **action, "retry_policy": _retry_policy(spec, other_host=True)}
    if spec.extproc is None:
        return [{"name": "workers", "match": {"prefix": "/"}, "route": failopen, **extra}]
    # Match on the router's metadata as well as its header: a client cannot set dynamic metadata, and a
    # route cached before ext_proc ran (filters look up per-route config) must be the fail-open one.
    picked = {
        "name": "router-picked",
        "match": {
            "prefix": "/",
            "headers": [{"name": DESTINATION_HEADER, "present_match": True}],
            "dynamic_metadata": [
                {
                    "filter": LB_METADATA_NAMESPACE,
                    "path": [{"key": DESTINATION_HEADER}],
                    "value": {"present_match": True},
                }
            ],
        },
        "route": {"cluster": PICKED_CLUSTER, **action, "retry_policy": _retry_policy(spec, other_host=False)},
        **extra,
    }
    # The worker that really served (after fallbacks), for the router: see _served_to_metadata.
    served = {"header": {"key": SERVED_KEY, "value": "%UPSTREAM_HOST%"}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}
    picked["response_headers_to_add"] = [*picked.get("response_headers_to_add", []), served]
    paths = "|".join(re.escape(p.lstrip("/")) for p in GENERATION_PATHS)
    unrouted: dict[str, Any] = (
        {"direct_response": {"status": 503, "body": {"inline_string": PD_UNROUTED_MESSAGE}}}
        if spec.disaggregated
        else {"route": failopen}
    )
    generation = {"name": "fail-open", "match": {"safe_regex": {"regex": f"^/({paths})$"}}, **unrouted, **extra}
    other = {
        "name": "pass-through",
        "match": {"prefix": "/"},
        "route": failopen,
        "typed_per_filter_config": {
            "envoy.filters.http.ext_proc": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
                "disabled": True,
            }
        },
        **extra,
    }
    return [metrics_route(spec), picked, generation, other]


def _retry_policy(spec: GatewaySpec, other_host: bool) -> dict[str, Any]:
    policy: dict[str, Any] = {
        "retry_on": RETRY_ON_RESET if spec.retry_on_reset else RETRY_ON,
        "num_retries": spec.retries,
        "retry_back_off": {"base_interval": "0.005s", "max_interval": "0.05s"},
    }
    if other_host:  # least-request might pick the refusing worker again; override_host moves on by itself
        policy["retry_host_predicate"] = [
            {
                "name": "envoy.retry_host_predicates.previous_hosts",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"
                },
            }
        ]
        policy["host_selection_retry_max_attempts"] = 3
    return policy


ROUTER_FAILED_MESSAGE = (
    "the router (ext_proc) failed for this request and this gateway's body mode cannot go on without it: retry"
)
PD_UNROUTED_MESSAGE = (
    "the router did not answer for this request (down, restarting or overloaded), and a prefill/decode fleet "
    "cannot serve a generation request without it: retry"
)
METRICS_PATH = "/metrics"
FLEET_METRICS_PATH = "/metrics/fleet"  # the router's metrics port: its own figures plus every worker's


def metrics_route(spec: GatewaySpec) -> dict[str, Any]:
    """The gateway's ``/metrics``: the router's fleet view (its metrics and every worker's, labelled), or a 404.

    Passing it to "some worker" would show a different worker on each scrape, which a client reads
    as counter resets; a clear refusal is better than that when the router's metrics port is unknown.
    """
    disabled = {
        "envoy.filters.http.ext_proc": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
            "disabled": True,
        }
    }
    route: dict[str, Any] = {"name": "metrics", "match": {"path": METRICS_PATH}, "typed_per_filter_config": disabled}
    if spec.router_metrics is None:
        route["direct_response"] = {
            "status": 404,
            "body": {
                "inline_string": (
                    "this gateway serves no /metrics: scrape the router's metrics port and each worker's "
                    "/metrics directly (or give envoy-config --router-metrics HOST:PORT)"
                )
            },
        }
    else:
        route["route"] = {"cluster": METRICS_CLUSTER, "prefix_rewrite": FLEET_METRICS_PATH, "timeout": "10s"}
    return route


def local_reply_config() -> dict[str, Any]:
    """Envoy's own error replies (its 413 past the buffer limit, 503 no healthy upstream...) as OpenAI JSON.

    The router's ImmediateResponses are local replies too; they already are OpenAI JSON and carry
    the details ``prefix_router``, so the mappers leave them alone. A failed ext_proc stream (the
    router down, in a body mode where Envoy does not fail open: ``FULL_DUPLEX_STREAMED``) is
    Envoy's bare 500 with no message; it becomes a 503 that says what failed, which a client retries.
    """

    def mapper(
        condition: str, type_: str, message: str = "%LOCAL_REPLY_BODY%", status: int | None = None
    ) -> dict[str, Any]:
        expression = f"!response.code_details.startsWith('prefix_router') && {condition}"
        rule: dict[str, Any] = {
            "filter": {
                "extension_filter": {
                    "name": "envoy.access_loggers.extension_filters.cel",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.access_loggers.filters.cel.v3.ExpressionFilter",
                        "expression": expression,
                    },
                }
            },
            "body_format_override": {
                "json_format": {"error": {"message": message, "type": type_, "param": None, "code": "%RESPONSE_CODE%"}}
            },
        }
        if status is not None:
            rule["status_code"] = status
        return rule

    return {
        "mappers": [
            mapper(
                "response.code_details.startsWith('ext_proc_error')", "service_unavailable", ROUTER_FAILED_MESSAGE, 503
            ),
            mapper("response.code < 500", "invalid_request_error"),
            mapper("response.code >= 500", "service_unavailable"),
        ]
    }


def pieces(spec: GatewaySpec) -> dict[str, Any]:
    """The drop-in parts for a user's own Envoy."""
    return {
        "http_filters": http_filters(spec),
        "clusters": clusters(spec),
        "routes": routes(spec),
        "local_reply_config": local_reply_config(),
    }


def bootstrap(spec: GatewaySpec) -> dict[str, Any]:
    """A complete single-listener Envoy bootstrap around the pieces."""
    hcm: dict[str, Any] = {
        "@type": HCM_TYPE,
        "stat_prefix": "gateway",
        "codec_type": "AUTO",
        "route_config": {
            "name": "gateway",
            "virtual_hosts": [{"name": "gateway", "domains": ["*"], "routes": routes(spec)}],
        },
        "http_filters": http_filters(spec),
        "local_reply_config": local_reply_config(),
    }
    if spec.access_log:
        hcm["access_log"] = [
            {
                "name": "envoy.access_loggers.stdout",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.access_loggers.stream.v3.StdoutAccessLog",
                    "log_format": (
                        {"json_format": ACCESS_LOG_JSON}
                        if spec.access_log_json
                        else {"text_format_source": {"inline_string": ACCESS_LOG_FORMAT}}
                    ),
                },
            }
        ]
    return {
        "admin": {"address": _address(*spec.admin)},
        "static_resources": {
            "listeners": [
                {
                    "name": "gateway",
                    "address": _address(*spec.listen),
                    "per_connection_buffer_limit_bytes": spec.buffer_limit_bytes,
                    "filter_chains": [
                        {"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}
                    ],
                }
            ],
            "clusters": clusters(spec),
        },
    }


# The files under envoy/ in the repository: this generator's output for a local fleet of four workers
# on 127.0.0.1:30001-30004 and the router on 127.0.0.1:9002 (tests check they never drift).
EXAMPLE_SPEC = GatewaySpec(
    workers=[("127.0.0.1", 30001 + i) for i in range(4)], upstream_host_header=True, access_log=True
)
_EXAMPLE_HEADER = (
    "# Generated by `prefix-router envoy-config{flags}`; regenerate with\n"
    "# `python -m prefix_router.envoy_config` rather than editing. See docs/gateway.md.\n"
)


def example_files(spec: GatewaySpec = EXAMPLE_SPEC) -> dict[str, str]:
    """Relative path -> content of the example configs kept under ``envoy/``."""
    workers = " ".join(f"--worker {h}:{p}" for h, p in spec.workers)
    flags = f" {workers} --upstream-host-header"
    return {
        "envoy/envoy.yaml": _EXAMPLE_HEADER.format(flags=flags + " --access-log --bootstrap") + dump(bootstrap(spec)),
        "envoy/extproc-filter.yaml": _EXAMPLE_HEADER.format(flags=flags)
        + "# Your HCM's http_filters, in order.\n"
        + dump(http_filters(spec)),
        "envoy/clusters.yaml": _EXAMPLE_HEADER.format(flags=flags)
        + "# Add to static_resources.clusters.\n"
        + dump(clusters(spec)),
        "envoy/routes.yaml": _EXAMPLE_HEADER.format(flags=flags)
        + "# Your virtual host's routes, in this order.\n"
        + dump(routes(spec)),
        "envoy/local-reply.yaml": _EXAMPLE_HEADER.format(flags=flags)
        + "# Optional: your HCM's local_reply_config (Envoy's own errors as OpenAI-style JSON).\n"
        + dump(local_reply_config()),
    }


class _PlainDumper(yaml.SafeDumper):
    """Spell repeated pieces out instead of YAML anchors/aliases: the output is for people to paste."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def dump(data: Any) -> str:
    return yaml.dump(data, Dumper=_PlainDumper, sort_keys=False, default_flow_style=False)


if __name__ == "__main__":  # regenerate envoy/ (run from the repository root)
    for name, content in example_files().items():
        Path(name).write_text(content)
        print(f"wrote {name}")

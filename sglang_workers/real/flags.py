"""The SGLang flags this router depends on, as data: ``--page-size``, KV events, metrics, cache report.

One place for them, so the launch command (``launch_command``), the CPU workers
(``cpu_launch``), the compose files and the Kubernetes manifests cannot drift apart.
"""

from __future__ import annotations

import json

__all__ = ["kv_events_config", "sglang_flags"]


def kv_events_config(port: int, replay_port: int | None, topic: str = "", host: str = "*") -> str:
    """The ``--kv-events-config`` JSON value.

    SGLang binds its PUB socket only for a wildcard host (``*``, ``0.0.0.0``, ``::``); for a concrete
    one it *connects* to it, and a router subscribing there hears nothing, so ``"bind": true`` is added.
    """
    config: dict[str, object] = {"publisher": "zmq", "endpoint": f"tcp://{host}:{port}", "topic": topic}
    if replay_port is not None:
        config["replay_endpoint"] = f"tcp://{host}:{replay_port}"
    if host not in ("*", "0.0.0.0", "::"):
        config["bind"] = True
    return json.dumps(config, separators=(",", ":"))


def sglang_flags(
    host: str = "0.0.0.0",
    port: int = 30000,
    page_size: int = 16,
    kv_events_port: int = 5557,
    kv_replay_port: int | None = None,
    topic: str = "",
    replay: bool = True,
    events_host: str = "*",
    dp_size: int = 1,
) -> dict[str, str | bool]:
    """The SGLang flags this router depends on: flag -> value (``True`` for a bare switch).

    Other tools (compose files, Kubernetes manifests, tests) take them from here so they cannot drift.
    ``events_host`` is where the ZMQ sockets bind (``*``: every interface). Rank ``r`` of a ``--dp-size N``
    server publishes on ``kv_events_port + r`` and replays on ``replay_port + r``, so the replay ports start
    after the N event ports.
    """
    replay_port = (kv_replay_port or kv_events_port + dp_size) if replay else None
    return {
        "--host": host,
        "--port": str(port),
        "--page-size": str(page_size),
        "--kv-events-config": kv_events_config(kv_events_port, replay_port, topic, events_host),
        "--enable-metrics": True,
        "--enable-cache-report": True,
    }

"""Replicas share unconfirmed decisions through a real Redis server (Debian redis-server).

One replica's decision must appear in another replica's index as a routed (speculative) entry,
never be applied twice to the sender, expire like the replica's own decisions, and a store that is
down must cost nothing but the sharing.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Iterator

import pytest

from benchmarks.fleet.replica_gateway import redis_server
from extproc.config import IndexConfig, SharedStateConfig, load_config
from extproc.fleet.index import BlockIndex
from extproc.sync.shared_state import SharedDecisions

KEYS = [101, 202, 303, 404]


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    if shutil.which("redis-server") is None and shutil.which("valkey-server") is None:
        pytest.skip("redis-server not installed (Debian package redis-server; .ci/run installs it)")
    with redis_server() as url:
        yield url


async def _wait_for(condition, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def test_a_decision_reaches_the_other_replica(redis_url: str) -> None:
    config = SharedStateConfig(backend="redis", url=redis_url, channel="test:decisions:1")
    now = [0.0]
    index_a, index_b = (
        BlockIndex(IndexConfig(speculative_ttl_s=2.0)),
        BlockIndex(IndexConfig(speculative_ttl_s=2.0), clock=lambda: now[0]),
    )
    for index in (index_a, index_b):
        index.set_unknown("w0", False)  # w0's events are in sync: decisions live speculative_ttl_s
    a, b = SharedDecisions(config, index_a), SharedDecisions(config, index_b)
    await a.start()
    await b.start()
    try:
        await asyncio.wait_for(asyncio.gather(a.subscribed.wait(), b.subscribed.wait()), 5)
        index_a.record_routed("w0", KEYS)  # what Router.route does before publishing
        a.publish("w0", KEYS)
        await _wait_for(lambda: index_b.match(KEYS, ["w0", "w1"]).get("w0", 0) == len(KEYS))
        assert index_b.match(KEYS, ["w0", "w1"]).get("w1", 0) == 0
        # The sender ignores its own message: its record is the one it wrote, not a second copy.
        await asyncio.sleep(0.1)
        assert index_a.match(KEYS, ["w0"])["w0"] == len(KEYS)
        # A shared decision is as speculative as an own one: it expires with the same TTL.
        now[0] = 1.9
        assert index_b.match(KEYS, ["w0"])["w0"] == len(KEYS)
        now[0] = 2.1
        assert index_b.match(KEYS, ["w0"])["w0"] == 0
    finally:
        await a.stop()
        await b.stop()


async def test_store_down_never_blocks_or_raises() -> None:
    import socket

    with socket.socket() as sock:  # a port with nobody listening
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = SharedStateConfig(backend="redis", url=f"redis://127.0.0.1:{port}/0", timeout_s=0.2, retry_s=0.1)
    index = BlockIndex()
    shared = SharedDecisions(config, index, max_keys=4 * len(KEYS))
    await shared.start()
    try:
        started = time.perf_counter()
        for _ in range(100):
            shared.publish("w0", KEYS)  # queue full after 4: dropped, not awaited
        assert time.perf_counter() - started < 0.05
        await asyncio.sleep(0.3)
        assert index.match(KEYS, ["w0"]).get("w0", 0) == 0
    finally:
        await shared.stop()


def test_config_section_defaults_off_and_validates() -> None:
    assert load_config(environ={}).shared_state.backend == "none"
    config = load_config(
        environ={
            "PREFIX_ROUTER_SHARED_STATE__BACKEND": "redis",
            "PREFIX_ROUTER_SHARED_STATE__URL": "redis://cache:6379/0",
        }
    )
    assert (config.shared_state.backend, config.shared_state.url) == ("redis", "redis://cache:6379/0")
    from extproc.config import ConfigError

    with pytest.raises(ConfigError, match=r"shared_state\.backend"):
        load_config(environ={"PREFIX_ROUTER_SHARED_STATE__BACKEND": "memcached"})

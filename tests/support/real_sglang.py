"""Real SGLang CPU workers for the tests marked ``real_sglang``: their settings and an in-place restart."""

from __future__ import annotations

from typing import Any

__all__ = ["CPU_EXTRA_FLAGS", "CPU_POOL_TOKENS", "restart_cpu_worker"]

CPU_POOL_TOKENS = 2048  # the workers' KV pool (--max-total-tokens): small, so a test provokes evictions
CPU_EXTRA_FLAGS = ("--context-length", "4096", "--max-running-requests", "1024")  # as the simulator states them


def restart_cpu_worker(workers: list[Any], index: int, crash: bool = True) -> Any:
    """Kill (SIGKILL, a crash) or stop worker ``index`` and start it again on the same ports."""
    worker = workers[index]
    worker.kill() if crash else worker.stop()
    worker.restart(400)
    return worker

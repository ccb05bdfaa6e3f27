"""Waiting in a test for what another thread, process or task does: a condition polled until it holds."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


def wait_until(
    check: Callable[[], object], what: str = "condition", timeout: float = 30.0, every: float = 0.05
) -> None:
    """Poll ``check`` every ``every`` seconds until it holds; AssertionError naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what} ({timeout:g} s)")
        time.sleep(every)


async def until(
    check: Callable[[], object], what: str = "condition", timeout: float = 30.0, every: float = 0.01
) -> None:
    """``wait_until`` on the running event loop: its other tasks run between the polls."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not check():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what} ({timeout:g} s)")
        await asyncio.sleep(every)

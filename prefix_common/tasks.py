"""Background tasks ended cleanly: the one way the router and the simulated worker stop a loop they started."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

__all__ = ["cancel_and_wait"]


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Cancel ``task`` (None: nothing to stop) and wait until it has ended: its cancellation is swallowed, any
    other error it ended with is raised here."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task

"""The one clock the router's decisions read: a callable returning seconds, ``time.monotonic`` by default.

Everything that stamps or ages state on the read path (the index's speculative entries, load reports,
the policies' learned queues and traffic) takes it from the router, so a harness can run the whole
router on a virtual clock (``prefix-router bench --suite virtual-fleet``) without patching ``time`` for everyone.
"""

from __future__ import annotations

import time
from typing import Protocol

__all__ = ["MONOTONIC", "Clock"]


class Clock(Protocol):
    """Seconds on a clock that never goes back (only differences matter)."""

    def __call__(self) -> float: ...


MONOTONIC: Clock = time.monotonic

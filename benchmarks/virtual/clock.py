"""A virtual clock for asyncio: the event loop's time moves only when every task waits for a timer.

When nothing is ready, the loop's selector would sleep until the next timer; here it jumps the clock
to that timer instead, so a 10-minute trace runs in seconds and two runs with one seed give the same
numbers. The router takes the loop's clock as its ``clock``; the simulator has no clock seam, so
``simulator_clock`` points its scheduling modules' view of ``time.monotonic`` at the loop: the
scheduler, admission, the ``/v1/loads`` counters (whose 15-second hit-rate window prices the queue a
worker reports) and the requests' arrival stamps.
"""

from __future__ import annotations

import asyncio
import contextlib
import selectors
import time
import types
from collections.abc import Iterator
from typing import Any

import sglang_workers.sim.admission as sim_admission
import sglang_workers.sim.load_report as sim_load_report
import sglang_workers.sim.request as sim_request
import sglang_workers.sim.scheduler as sim_scheduler

# Every simulator module that reads ``time.monotonic`` on the scheduling path. One left out reads wall time
# inside a virtual run: the load report's hit-rate window did, so a run's figures depended on how fast the
# machine ran it (a run with ``--records``, ten times slower, took other decisions from request 736 on).
_TIMED = (sim_scheduler, sim_admission, sim_load_report, sim_request)

__all__ = ["VirtualClockLoop", "simulator_clock"]


class _VirtualSelector:
    """The loop's selector, except that waiting for a timer advances the virtual clock instead."""

    def __init__(self, real: selectors.BaseSelector, loop: VirtualClockLoop) -> None:
        self._real = real
        self._loop = loop

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        events = self._real.select(0)
        if events:
            return events
        if timeout is None:
            raise RuntimeError("virtual clock: nothing scheduled and nothing ready (the run cannot progress)")
        self._loop.now += max(timeout, 0.0)
        return []


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose ``time()`` only moves when every task waits for a timer."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        real: Any = self._selector  # type: ignore[has-type]
        self._selector = _VirtualSelector(real, self)

    def time(self) -> float:
        return self.now


@contextlib.contextmanager
def simulator_clock(loop: VirtualClockLoop) -> Iterator[None]:
    """The simulated scheduler reads ``time.monotonic``; for this run its modules read the loop's clock.

    Only the name ``time`` of those modules (``_TIMED``) is replaced (by a namespace whose ``monotonic`` is
    the loop's); the router gets the clock as a parameter, and nothing else in the process sees a changed
    ``time``.
    """
    shim = types.SimpleNamespace(**{name: getattr(time, name) for name in dir(time) if not name.startswith("_")})
    shim.monotonic = loop.time
    for module in _TIMED:
        module.time = shim  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for module in _TIMED:
            module.time = time  # type: ignore[attr-defined]

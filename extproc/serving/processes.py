"""``prefix-router serve --processes N``: N complete routers on one host, so decisions use N cores.

One Python process decides on one core (the GIL). Here each of N child processes is a full
``prefix-router serve``: its own index fed by every worker's KV events, its own pollers, its own
gRPC port, ``server.port + i`` (and metrics port ``server.metrics_port + i``). The parent only
supervises: it restarts a child that dies, forwards SIGHUP (config reload) and stops them all on
SIGTERM / Ctrl-C.

Why N ports rather than SO_REUSEPORT on one: Envoy speaks to ext_proc over HTTP/2, one long-lived
connection per Envoy worker thread, and the kernel balances connections, not streams, so on one
shared port a one-thread Envoy would send every stream to one process. With the N ports listed in
the ext_proc cluster (``prefix-router envoy-config --router-processes N``) Envoy balances each
stream round robin, and a killed process costs only the streams it held (ext_proc fails open:
those requests are still served, by least request) until it is back.

The processes see the same KV events, so their confirmed views agree; what one cannot see is
another's decisions not yet confirmed by an event, exactly as between replicas
(``prefix-router bench --suite replicas``, docs/deploy.md). ``shared_state`` (Redis) shares those as it does for
replicas.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from types import FrameType

__all__ = ["supervise"]

log = logging.getLogger("prefix_router")

RESTART_PAUSE_S = 0.5
CRASH_LOOP_WINDOW_S = 5.0  # a child that dies this soon after starting, ...
CRASH_LOOP_LIMIT = 5  # ... this many times in a row, stops the whole service


ServeOne = Callable[[argparse.Namespace, int], int]  # ``serve_command.serve_one``: one process, ports moved up


def _child(serve: ServeOne, args: argparse.Namespace, index: int) -> None:
    """One router process: the ordinary ``serve`` on its own ports."""
    raise SystemExit(serve(args, index))


class _Supervisor:
    def __init__(self, serve: ServeOne, args: argparse.Namespace, count: int, port: int) -> None:
        self.serve = serve
        self.args = args
        self.count = count
        self.port = port
        self.context = mp.get_context("spawn")  # a fresh interpreter each: no inherited event loop or sockets
        self.children: list[BaseProcess | None] = [None] * count
        self.started: list[float] = [0.0] * count
        self.quick_deaths: list[int] = [0] * count
        self.stopping = False

    def start(self, index: int) -> None:
        child = self.context.Process(target=_child, args=(self.serve, self.args, index), name=f"router-{index}")
        child.start()
        self.children[index] = child
        self.started[index] = time.monotonic()
        log.info("router process %d (pid %s) on port %d", index, child.pid, self.port + index)

    def signal_all(self, signum: int) -> None:
        for child in self.children:
            if child is not None and child.is_alive() and child.pid is not None:
                os.kill(child.pid, signum)

    def run(self) -> int:
        for i in range(self.count):
            self.start(i)
        while not self.stopping:
            time.sleep(0.1)
            for i, child in enumerate(self.children):
                if self.stopping or child is None or child.is_alive():
                    continue
                code = child.exitcode
                quick = time.monotonic() - self.started[i] < CRASH_LOOP_WINDOW_S
                self.quick_deaths[i] = self.quick_deaths[i] + 1 if quick else 0
                if self.quick_deaths[i] >= CRASH_LOOP_LIMIT or code == 2:  # 2: bad config, a restart repeats it
                    log.error("router process %d exited with %s; stopping the service", i, code)
                    self.stop()
                    return 1
                log.warning("router process %d exited with %s; restarting it", i, code)
                time.sleep(RESTART_PAUSE_S)
                self.start(i)
        return 0

    def stop(self) -> None:
        self.stopping = True
        self.signal_all(signal.SIGTERM)
        deadline = time.monotonic() + 30
        for child in self.children:
            if child is not None:
                child.join(max(0.1, deadline - time.monotonic()))
                if child.is_alive():
                    child.kill()
                    child.join(5)


def supervise(serve: ServeOne, args: argparse.Namespace, count: int, port: int) -> int:
    """Run ``serve(args, i)`` for i < ``count`` (ports ``port`` .. ``port + count - 1``) until SIGTERM / SIGINT.

    ``serve`` must be a module-level function: each child process imports it afresh (spawn).
    """
    supervisor = _Supervisor(serve, args, count, port)

    def on_stop(_signum: int, _frame: FrameType | None) -> None:
        supervisor.stopping = True

    def on_reload(_signum: int, _frame: FrameType | None) -> None:
        supervisor.signal_all(signal.SIGHUP)

    signal.signal(signal.SIGTERM, on_stop)
    signal.signal(signal.SIGINT, on_stop)
    signal.signal(signal.SIGHUP, on_reload)
    try:
        code = supervisor.run()
    finally:
        if not all(c is None or not c.is_alive() for c in supervisor.children):
            supervisor.stop()
    return code

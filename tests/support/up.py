"""``prefix-router up`` as a child process for the tests: start it, read its banner, stop it and its children."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


def stop_up(up: subprocess.Popen[str]) -> None:
    """SIGTERM (``up`` stops its children, which run in their own sessions), then SIGKILL its group after 30 s."""
    if up.poll() is None:
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()


def start_up(*args: str) -> subprocess.Popen[str]:
    """``prefix-router up ARGS``, its output piped as text, in a session of its own: a signal to the test's process
    group does not reach it, and ``stop_up`` can kill its whole group."""
    return subprocess.Popen(
        [sys.executable, "-m", "prefix_router", "up", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def gather_stderr(up: subprocess.Popen[str]) -> list[str]:
    """``up``'s stderr lines, appended as they come by a daemon thread (so that its pipe never fills)."""
    assert up.stderr is not None
    stderr = up.stderr
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(stderr.readline, "")), daemon=True).start()
    return lines


@contextmanager
def running_up(*args: str, timeout_s: float = 60.0) -> Iterator[tuple[subprocess.Popen[str], list[str]]]:
    """``prefix-router up ARGS`` until its banner has been printed: (the process, the banner's lines)."""
    up = start_up(*args)
    assert up.stdout is not None and up.stderr is not None
    try:
        banner: list[str] = []
        deadline = time.monotonic() + timeout_s
        while "Ctrl-C" not in (banner[-1] if banner else ""):
            assert time.monotonic() < deadline and up.poll() is None, "".join(banner) + up.stderr.read()
            banner.append(up.stdout.readline())
        yield up, banner
    finally:
        stop_up(up)

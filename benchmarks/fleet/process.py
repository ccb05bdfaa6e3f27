"""What every contender is: a gateway started in front of a worker set, and a child process with a log.

``ProcessContender`` is the common part of the contenders that are one process (Envoy, sgl-router, smg,
Dynamo's service): it starts the process in its own session, keeps its log in a temporary directory,
waits for readiness and, when that fails, reports the log's tail; ``stop`` ends the whole process group.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Sequence
from pathlib import Path

import aiohttp

__all__ = ["Contender", "ContenderError", "ProcessContender", "binary_beside_python", "wait_http"]


class ContenderError(RuntimeError):
    """A contender could not start; the message says why (reported in its result row)."""


def binary_beside_python(name: str) -> str | None:
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else shutil.which(name)


async def wait_http(url: str, timeout_s: float, proc: subprocess.Popen[bytes] | None = None, expect: int = 200) -> None:
    """Poll ``url`` until it answers ``expect``; fail early if ``proc`` exits."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    last = "no answer"
    async with aiohttp.ClientSession() as session:
        while asyncio.get_running_loop().time() < deadline:
            if proc is not None and proc.poll() is not None:
                raise ContenderError(f"process exited with code {proc.returncode} before {url} was ready")
            try:
                async with session.get(url, timeout=aiohttp.ClientTimeout(total=1.0)) as resp:
                    if resp.status == expect:
                        return
                    last = f"HTTP {resp.status}"
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                last = type(exc).__name__
            await asyncio.sleep(0.1)
    raise ContenderError(f"{url} not ready after {timeout_s:.0f} s ({last})")


def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def _tail(path: Path, limit: int = 600) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return text[-limit:].strip()


class Contender(ABC):
    """A gateway in front of ``worker_urls``: ``start`` returns the base URL clients send to.

    ``worker_transport`` says which of the workers' front doors it talks to: their HTTP API
    (``http://`` URLs) or SGLang's gRPC scheduler API (``grpc://`` URLs).
    """

    name: str
    worker_transport: str = "http"

    @abstractmethod
    async def start(self, worker_urls: Sequence[str]) -> str: ...

    @abstractmethod
    async def stop(self) -> None: ...


class ProcessContender(Contender):
    """Helpers for contenders that are one child process with a log file."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._workdir: Path | None = None

    @property
    def _dir(self) -> Path:
        if self._workdir is None:
            self._workdir = Path(tempfile.mkdtemp(prefix="bench-"))
        return self._workdir

    @property
    def _log(self) -> Path:
        return self._dir / "log.txt"

    def _spawn(self, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        with self._log.open("wb") as log:
            self._proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, env=env
            )
        return self._proc

    def _failure(self, exc: Exception) -> ContenderError:
        tail = _tail(self._log)
        return ContenderError(f"{exc}" + (f"; log tail: {tail}" if tail else ""))

    async def _until_ready(self, ready: Awaitable[None]) -> None:
        """Wait for ``ready``; if it fails, stop the process and raise with its log tail (read before the stop)."""
        try:
            await ready
        except ContenderError as exc:
            failure = self._failure(exc)
            await self.stop()
            raise failure from None

    async def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            # The child leads its own process group: signal the group, so nothing it started outlives it.
            _signal_group(proc, signal.SIGTERM)
            try:
                await asyncio.to_thread(proc.wait, 5)
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                await asyncio.to_thread(proc.wait)
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None

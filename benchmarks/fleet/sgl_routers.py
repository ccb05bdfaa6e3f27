"""SGLang's own routers as contenders: ``sgl-router`` and smg (``smg``, ``smg-grpc``).

- ``sgl-router``: the real sgl-router (PyPI ``sglang-router``, Rust) with ``--policy cache_aware``
  and its default thresholds.
- ``smg``: smg 1.13 (PyPI ``smg``, sgl-router's successor) in front of the workers' HTTP API with
  ``--policy cache_aware`` and its defaults: the approximate character tree of its HTTP mode.
- ``smg-grpc``: smg 1.13 in front of the workers' gRPC scheduler API (``grpc://`` URLs): event-driven
  ``cache_aware`` on a block index fed by each worker's ``SubscribeKvEvents`` stream, ``--block-size``
  equal to the workers' page size, every other setting at its default, as smg's KV-events guide sets it up.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Sequence

import aiohttp

from benchmarks.fleet.process import ContenderError, ProcessContender, binary_beside_python, wait_http
from prefix_common.addresses import free_port

__all__ = ["SglRouter", "Smg"]


def _common_args(metrics_port: int) -> list[str]:
    """What both routers are started with here: their own metrics port, quiet logs, a quick startup check."""
    return [
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(metrics_port),  # every instance needs its own: a taken one makes the router exit
        "--log-level",
        "warn",
        "--worker-startup-check-interval",
        "1",
        "--worker-startup-timeout-secs",
        "60",
    ]


class SglRouter(ProcessContender):
    """The real sgl-router (Rust) with ``cache_aware`` routing and its default constants."""

    name = "sgl-router"

    def __init__(self, policy: str = "cache_aware") -> None:
        super().__init__()
        self.policy = policy

    def argv(self, port: int, metrics_port: int, worker_urls: Sequence[str]) -> list[str]:
        binary = binary_beside_python("sglang-router")
        head = [binary, "launch"] if binary else [sys.executable, "-m", "sglang_router.launch_router"]
        return [
            *head,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--worker-urls",
            *worker_urls,
            "--policy",
            self.policy,
            *_common_args(metrics_port),
        ]

    async def start(self, worker_urls: Sequence[str]) -> str:
        port = free_port()
        # sgl-router logs every request at info level; keep its log small.
        proc = self._spawn(self.argv(port, free_port(), worker_urls), env={**os.environ, "RUST_LOG": "warn"})
        base = f"http://127.0.0.1:{port}"
        await self._until_ready(wait_http(base + "/readiness", 60, proc))
        return base


class Smg(ProcessContender):
    """The real smg 1.13 (Rust, PyPI ``smg``) with ``cache_aware``, over HTTP or gRPC workers.

    Started as ``python -m smg launch``: ``sglang-router`` installs a console script named ``smg`` as
    well, so the ``smg`` on PATH may be the older router. ``HF_HUB_OFFLINE`` keeps it from reaching for
    the Hub: over gRPC it loads the tokenizer from the path the workers report (``GetModelInfo``).
    """

    def __init__(self, transport: str = "http", page_size: int = 16, policy: str = "cache_aware") -> None:
        super().__init__()
        if transport not in ("http", "grpc"):
            raise ValueError(f"smg transport must be http or grpc, not {transport!r}")
        self.name = "smg" if transport == "http" else "smg-grpc"
        self.worker_transport = transport
        self.page_size = page_size
        self.policy = policy
        self.metrics_url: str | None = None  # its Prometheus endpoint, once started

    def argv(self, port: int, metrics_port: int, worker_urls: Sequence[str]) -> list[str]:
        return self.launch_argv(port, metrics_port, ["--worker-urls", *worker_urls, "--policy", self.policy])

    def launch_argv(self, port: int, metrics_port: int, routing: Sequence[str]) -> list[str]:
        """``smg launch`` with ``routing`` (the workers and the policy) and this benchmark's common settings."""
        argv = [
            sys.executable,
            "-m",
            "smg",
            "launch",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *routing,
            *_common_args(metrics_port),
            "--shutdown-grace-period-secs",
            "1",  # stopped only after the run: nothing in flight to wait for
        ]
        if self.worker_transport == "grpc":
            # smg learns the block size from the first BlockStored; until then (and for its token tree)
            # it uses this one, which its guide says to keep equal to the engine's page size.
            argv += ["--block-size", str(self.page_size)]
        return argv

    async def _ready(self, base: str, workers: int, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
        """All workers registered and healthy (``/readiness``), and over gRPC the tokenizer loaded."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        last = "no answer"
        async with aiohttp.ClientSession() as session:
            while asyncio.get_running_loop().time() < deadline:
                if proc.poll() is not None:
                    raise ContenderError(f"smg exited with code {proc.returncode} before it was ready")
                try:
                    async with session.get(base + "/readiness", timeout=aiohttp.ClientTimeout(total=1.0)) as resp:
                        body = json.loads(await resp.read() or b"{}")
                    healthy = int(body.get("healthy_workers") or 0)
                    last = f"{healthy} of {workers} workers healthy"
                    if healthy >= workers and self.worker_transport == "grpc":
                        async with session.get(base + "/v1/tokenizers", timeout=aiohttp.ClientTimeout(total=1.0)) as t:
                            tokenizers = json.loads(await t.read() or b"{}").get("tokenizers") or []
                        last = "no tokenizer loaded yet"
                        if tokenizers:
                            return
                    elif healthy >= workers:
                        return
                except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError) as exc:
                    last = type(exc).__name__
                await asyncio.sleep(0.1)
        raise ContenderError(f"smg not ready after {timeout_s:.0f} s ({last})")

    async def start(self, worker_urls: Sequence[str]) -> str:
        if importlib.util.find_spec("smg") is None:
            raise ContenderError("smg is not installed (pip install 'smg==1.13.*')")
        port, metrics_port = free_port(), free_port()
        env = {**os.environ, "RUST_LOG": "warn", "HF_HUB_OFFLINE": "1"}
        proc = self._spawn(self.argv(port, metrics_port, worker_urls), env=env)
        base = f"http://127.0.0.1:{port}"
        await self._until_ready(self._ready(base, len(worker_urls), proc, 60))
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        return base

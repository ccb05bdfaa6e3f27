"""A fresh cluster of SGLang workers for one contender: simulated, or real SGLang on this CPU.

Every contender gets its own cluster built from the same ``ClusterSpec``: same number of workers,
timing profile, speed-up, KV capacity, page size and seed. Caches therefore start cold and
identical, and nothing one contender did (cached prefixes, queued work) leaks into the next one's
numbers. All workers share one seed: a worker's output depends only on the prompt and the seed, so
a request produces the same tokens whichever worker a contender sends it to. Every worker serves
both front doors, the HTTP API (``urls``) and SGLang's gRPC scheduler API (``grpc_urls``), so the
clusters stay identical whichever one a contender talks to.

``hicache`` gives the workers SGLang's tiered KV cache: ``host`` a host-memory tier each
(``--enable-hierarchical-cache``, SGLang's defaults: twice the GPU pool, write-through), ``host+shared``
also the ``file`` storage tier in one fresh directory all of the cluster's workers share (removed
with the cluster).

Real SGLang CPU workers (``engine="sglang-cpu"``) take a minute to start, so one set serves every
contender (``CpuWorkerPool``): before each contender their caches are flushed (cold and identical
again) and their request counters read, so each contender's counts are its own.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import aiohttp

from benchmarks.metrics import FleetFigures

__all__ = ["HICACHE_SETTINGS", "Cluster", "ClusterError", "ClusterSpec", "CpuWorkerPool", "PdTargets"]

_REQUESTS_TOTAL = re.compile(r"^sglang:num_requests_total(?:\{[^}]*\})?\s+([0-9.eE+-]+)\s*$", re.MULTILINE)
_PROMPT_TOTAL = re.compile(r"^sglang:prompt_tokens_total(?:\{[^}]*\})?\s+([0-9.eE+-]+)\s*$", re.MULTILINE)
_CACHED_BY_SOURCE = re.compile(
    r'^sglang:cached_tokens_total\{[^}]*cache_source="(\w+)"[^}]*\}\s+([0-9.eE+-]+)\s*$', re.MULTILINE
)

HicacheSetting = Literal["none", "host", "host+shared"]
HICACHE_SETTINGS: tuple[HicacheSetting, ...] = ("none", "host", "host+shared")


@dataclass(frozen=True)
class PdTargets:
    """A PD fleet as a gateway is told about it: prefill URLs with their bootstrap ports, decode URLs."""

    prefill: tuple[tuple[str, int], ...]
    decode: tuple[str, ...]

    @property
    def urls(self) -> list[str]:
        return [url for url, _ in self.prefill] + list(self.decode)

    def prefill_args(self) -> list[str]:
        """``--prefill URL PORT`` per prefill worker, then ``--decode URL`` per decode worker (smg and sgl-router)."""
        args: list[str] = []
        for url, port in self.prefill:
            args += ["--prefill", url, str(port)]
        for url in self.decode:
            args += ["--decode", url]
        return args


class ClusterError(RuntimeError):
    """The workers could not be started (the message carries the worker's own error)."""


@dataclass(frozen=True)
class ClusterSpec:
    """Everything that makes two clusters identical."""

    workers: int
    profile: str
    speedup: float
    capacity_tokens: int
    page_size: int
    seed: int
    hicache: HicacheSetting = "none"
    engine: str = "sim"  # or "sglang-cpu": real SGLang 0.5.23 on this CPU (after `make sglang-cpu`)
    prefill: int = 0  # > 0: a PD fleet of this many prefill workers and ``workers - prefill`` decode workers


class CpuWorkerPool:
    """Real SGLang CPU workers started once for a whole benchmark (``async with``: stopped at the end)."""

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.workers: list[Any] = []

    async def __aenter__(self) -> CpuWorkerPool:
        from prefix_router.fleet import WorkerStartError, start_fleet

        try:
            self.workers = await asyncio.to_thread(
                start_fleet,
                "sglang-cpu",
                self.spec.workers,
                page_size=self.spec.page_size,
                capacity_tokens=self.spec.capacity_tokens,
                seed=self.spec.seed,
            )
        except WorkerStartError as exc:
            raise ClusterError(str(exc)[-1000:]) from None
        return self

    async def __aexit__(self, *exc: object) -> None:
        workers, self.workers = self.workers, []
        for worker in workers:
            await asyncio.to_thread(worker.stop)


class Cluster:
    """N sim-worker processes on free loopback ports (``stop()`` always kills them), or a flushed pool."""

    def __init__(self, spec: ClusterSpec, pool: CpuWorkerPool | None = None) -> None:
        self.spec = spec
        self.pool = pool
        self._workers: list[Any] = []
        self._baseline: dict[str, int] = {}
        self._storage: Path | None = None

    def _sim_options(self) -> dict[str, Any]:
        """What every simulated worker of this cluster is started with (aggregated or PD)."""
        spec = self.spec
        return {
            "profile": spec.profile,
            "speedup": spec.speedup,
            "capacity_tokens": spec.capacity_tokens,
            "page_size": spec.page_size,
            "seed": spec.seed,
            "log_level": "warning",
        }

    def _tier_options(self) -> dict[str, Any]:
        if self.spec.hicache == "none":
            return {}
        options: dict[str, Any] = {"enable_hierarchical_cache": True}
        if self.spec.hicache == "host+shared":
            self._storage = Path(tempfile.mkdtemp(prefix="bench-hicache-"))
            options |= {"hicache_storage_backend": "file", "file_storage_path": str(self._storage)}
        return options

    @property
    def urls(self) -> list[str]:
        return [str(w.url) for w in self._workers]

    @property
    def pd_targets(self) -> PdTargets:
        """A PD fleet's prefill workers (with their bootstrap ports) and decode workers."""
        prefill = tuple(
            (str(w.url), int(w.bootstrap_port)) for w in self._workers if w.disaggregation_mode == "prefill"
        )
        decode = tuple(str(w.url) for w in self._workers if w.disaggregation_mode == "decode")
        return PdTargets(prefill, decode)

    @property
    def grpc_urls(self) -> list[str]:
        """``grpc://`` addresses of the workers' gRPC scheduler API."""
        return [str(w.grpc_url) for w in self._workers]

    async def start(self) -> None:
        if self.pool is not None:
            self._workers = list(self.pool.workers)
            await self._flush_all()
            self._baseline = await self._counts()
            return
        from prefix_router.fleet import WorkerStartError, start_fleet, start_pd_fleet

        if self.spec.prefill:
            if not 0 < self.spec.prefill < self.spec.workers:
                raise ClusterError(f"a PD fleet of {self.spec.workers} workers cannot have {self.spec.prefill} prefill")
            try:
                pd = await asyncio.to_thread(
                    start_pd_fleet,
                    "sim",
                    self.spec.prefill,
                    self.spec.workers - self.spec.prefill,
                    **self._sim_options(),
                )
            except (WorkerStartError, OSError) as exc:
                raise ClusterError(str(exc)[-1000:]) from None
            self._workers = pd.workers
            return
        try:
            self._workers = await asyncio.to_thread(
                start_fleet,
                "sim",
                self.spec.workers,
                **self._sim_options(),
                grpc=True,
                **self._tier_options(),
            )
        except (WorkerStartError, OSError) as exc:  # reported in the contender's row
            raise ClusterError(str(exc)[-1000:]) from None

    @property
    def kv_events_endpoints(self) -> list[str]:
        return [str(w.kv_events_endpoint) for w in self._workers]

    async def served_model(self) -> str | None:
        """The model name the workers serve (``/v1/models``), which clients put in ``model``."""
        if not self._workers:
            return None
        try:
            async with (
                aiohttp.ClientSession() as session,
                session.get(f"{self._workers[0].url}/v1/models", timeout=aiohttp.ClientTimeout(total=5)) as resp,
            ):
                data = await resp.json()
            return str(data["data"][0]["id"])
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, IndexError, TypeError):
            return None

    async def _flush_all(self, timeout_s: float = 60.0) -> None:
        """Empty every worker's cache (SGLang refuses while requests run: retry until they are done)."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        async with aiohttp.ClientSession() as session:
            for worker in self._workers:
                while True:
                    try:
                        async with session.post(
                            f"{worker.url}/flush_cache", timeout=aiohttp.ClientTimeout(total=10)
                        ) as r:
                            if r.status == 200:
                                break
                    except (aiohttp.ClientError, asyncio.TimeoutError):
                        pass
                    if asyncio.get_running_loop().time() > deadline:
                        raise ClusterError(f"{worker.url} did not flush its cache in {timeout_s:.0f}s")
                    await asyncio.sleep(0.5)

    async def request_counts(self) -> dict[str, int]:
        """Requests each worker processed for this contender (``sglang:num_requests_total``); {} if unknown."""
        counts = await self._counts()
        return {url: n - self._baseline.get(url, 0) for url, n in counts.items()}

    async def _counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        async with aiohttp.ClientSession() as session:
            for worker in self._workers:
                try:
                    async with session.get(f"{worker.url}/metrics", timeout=aiohttp.ClientTimeout(total=5)) as resp:
                        text = await resp.text()
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    return {}
                matches = _REQUESTS_TOTAL.findall(text)  # one line per is_streaming value in SGLang 0.5.23
                if not matches:
                    return {}
                counts[str(worker.url)] = int(sum(float(m) for m in matches))
        return counts

    async def fleet_figures(self) -> FleetFigures | None:
        """Prompt and cached tokens by tier (``/metrics``) and simulated GPU seconds (``/server_info``)."""
        figures = FleetFigures()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            for worker in self._workers:
                try:
                    async with session.get(f"{worker.url}/metrics") as resp:
                        text = await resp.text()
                    async with session.get(f"{worker.url}/server_info") as resp:
                        info = await resp.json()
                except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                    return None
                prompt = _PROMPT_TOTAL.findall(text)  # one line per is_streaming value
                busy = (info.get("simulator") or {}).get("busy_seconds") if isinstance(info, dict) else None
                if not prompt or not isinstance(busy, dict):
                    return None
                figures.prompt_tokens += int(sum(float(p) for p in prompt))
                for source, value in _CACHED_BY_SOURCE.findall(text):
                    figures.cached_tokens[source] = figures.cached_tokens.get(source, 0) + int(float(value))
                figures.busy_prefill_s += float(busy.get("prefill", 0.0))
                figures.busy_decode_s += float(busy.get("decode", 0.0))
        return figures

    async def stop(self) -> None:
        workers, self._workers = self._workers, []
        if self.pool is not None:
            return  # the pool's workers serve the next contender; CpuWorkerPool stops them
        for worker in workers:
            await asyncio.to_thread(worker.stop)
        if self._storage is not None:
            shutil.rmtree(self._storage, ignore_errors=True)
            self._storage = None

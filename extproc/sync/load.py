"""Worker load as the workers report it: queue, running requests, KV usage, measured speed.

Polled on an interval (never on the request path): ``GET /v1/loads?include=all&format=json``
first, ``/get_load`` for older SGLang releases, then ``/metrics`` (Prometheus text, needs
``--enable-metrics``). Whichever answers first is remembered per worker. The router's own in-flight
count lives on ``Worker.in_flight``; this module only adds what the worker itself knows (requests
from other routers, the real queue, KV pressure) and, from SGLang 0.5.23's ``/v1/loads``, the
cumulative counters from which a worker's own prefill and decode speed can be learned
(``total_prefill_uncached_tokens``, ``total_prefill_busy_us``, ``decode_moments``; see
``extproc.decision.policies.prefix_aware.cost_model``). A poll whose connection is refused is also the router's fastest
sign that a worker died: it leaves the candidate set at once.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Iterator
from typing import Any

import aiohttp

from extproc.clock import MONOTONIC, Clock
from extproc.config import LoadConfig
from extproc.fleet.reports import LoadBook, WorkerLoad, poll_tick
from extproc.fleet.workers import Worker, WorkerRegistry
from extproc.sync.http import Poller, WorkerHttp

__all__ = ["LoadTracker", "parse_loads", "parse_metrics", "parse_new_token_ratio", "parse_prefill_passes"]

log = logging.getLogger(__name__)

# include=all: the sections too (memory, queues, disaggregation). SGLang 0.5.23 answers from a shared-memory
# snapshot (a few ms, no scheduler round trip), so every field costs the worker nothing more.
_LOAD_PATHS = ("/v1/loads?include=all&format=json", "/get_load", "/metrics")


def _num(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def parse_loads(body: Any) -> WorkerLoad | None:
    """``/v1/loads`` or ``/get_load`` JSON (one dict, a list per DP rank, or ``{"loads": [...]}``)."""
    if isinstance(body, dict) and isinstance(body.get("loads"), list):
        ranks = body["loads"]
    elif isinstance(body, list):
        ranks = body
    elif isinstance(body, dict):
        ranks = [body]
    else:
        return None
    ranks = [r for r in ranks if isinstance(r, dict)]
    if not ranks or not any("num_running_reqs" in r or "num_waiting_reqs" in r for r in ranks):
        return None
    total_tokens = sum(_num(r.get("max_total_num_tokens") or r.get("num_total_tokens")) for r in ranks)
    used = sum(_num(r.get("num_used_tokens")) for r in ranks)
    usage = used / total_tokens if total_tokens else max((_num(r.get("token_usage")) for r in ranks), default=0.0)
    rank_requests = {
        r["dp_rank"] if isinstance(r.get("dp_rank"), int) else i: int(
            _num(r.get("num_running_reqs")) + _num(r.get("num_waiting_reqs"))
        )
        for i, r in enumerate(ranks)
    }
    return WorkerLoad(
        rank_requests=rank_requests,
        num_running_reqs=int(sum(_num(r.get("num_running_reqs")) for r in ranks)),
        num_waiting_reqs=int(sum(_num(r.get("num_waiting_reqs")) for r in ranks)),
        num_used_tokens=int(used),
        max_total_num_tokens=int(total_tokens) if total_tokens else None,
        token_usage=usage,
        num_waiting_uncached_tokens=_sum_int(ranks, "num_waiting_uncached_tokens"),
        total_prefill_uncached_tokens=_sum_int(ranks, "total_prefill_uncached_tokens"),
        total_prefill_busy_us=_sum_int(ranks, "total_prefill_busy_us"),
        decode_moments=_sum_moments(ranks),
        num_total_tokens=_sum_int(ranks, "num_total_tokens"),
        num_active_tokens=_sum_int(ranks, "num_active_tokens"),
        num_prealloc_ready_tokens=_sum_int(ranks, "num_prealloc_ready_tokens"),
        max_running_requests=_sum_int(ranks, "max_running_requests"),
        gen_throughput=_rate(ranks, "gen_throughput", mean=False),
        cache_hit_rate=_rate(ranks, "cache_hit_rate", mean=True),
        utilization=_rate(ranks, "utilization", mean=True),
        memory=_sections(ranks, "memory"),
        disaggregation=_sections(ranks, "disaggregation"),
        queues=_sections(ranks, "queues"),
        reported_at=max((float(r["timestamp"]) for r in ranks if _is_number(r.get("timestamp"))), default=None),
        ranks=len(ranks),
    )


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _rate(ranks: list[dict[str, Any]], key: str, mean: bool) -> float | None:
    values = [float(r[key]) for r in ranks if _is_number(r.get(key))]
    if not values:
        return None
    return sum(values) / len(values) if mean else sum(values)


def _sections(ranks: list[dict[str, Any]], key: str) -> list[dict[str, Any]] | None:
    values = [r[key] for r in ranks if isinstance(r.get(key), dict)]
    return values or None


def _sum_int(ranks: list[dict[str, Any]], key: str) -> int | None:
    """The sum over ranks of a counter every rank reports; None when one of them does not."""
    values = [r.get(key) for r in ranks]
    if not values or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return None
    return int(sum(values))  # type: ignore[arg-type]


def _sum_moments(ranks: list[dict[str, Any]]) -> tuple[float, ...] | None:
    moments: list[list[Any]] = []
    for rank in ranks:
        value = rank.get("decode_moments")
        if not isinstance(value, list) or len(value) < 5:
            return None  # absent, or null before the rank's first decode step
        moments.append(value)
    return tuple(sum(_num(m[i]) for m in moments) for i in range(5)) if moments else None


def parse_metrics(text: str) -> WorkerLoad | None:
    """The ``sglang:*`` gauges of a Prometheus text page (summed over label sets)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("sglang:"):
            continue
        if "}" in line:  # name{labels} value [timestamp]
            head, _, tail = line.rpartition("}")
            name = head.split("{", 1)[0]
        else:  # name value [timestamp]
            name, _, tail = line.partition(" ")
        try:
            value = float(tail.split()[0])
        except (ValueError, IndexError):
            continue
        values[name] = values.get(name, 0.0) + value
    if "sglang:num_running_reqs" not in values and "sglang:num_queue_reqs" not in values:
        return None
    max_tokens = values.get("sglang:max_total_num_tokens")
    usage = values.get("sglang:token_usage", 0.0)
    return WorkerLoad(
        num_running_reqs=int(values.get("sglang:num_running_reqs", 0)),
        num_waiting_reqs=int(values.get("sglang:num_queue_reqs", 0)),
        num_used_tokens=int(usage * max_tokens) if max_tokens else 0,
        max_total_num_tokens=int(max_tokens) if max_tokens else None,
        token_usage=usage,
        new_token_ratio=parse_new_token_ratio(text),
    )


_PASSES_FAMILY = "sglang:cuda_graph_passes_total"
_RATIO_FAMILY = "sglang:new_token_ratio"
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
_PASSES_GIVE_UP = 3  # polls in a row without a usable count: the worker does not export it ...
_PASSES_RETRY_S = 300.0  # ... so it is not asked again for this long


def _samples(text: str, family: str) -> Iterator[tuple[str, float]]:
    """The sample lines of one ``family`` on a Prometheus text page: each one's label text and value.

    Only that family's lines are read (found with ``str.find``, not by splitting the whole page); comment
    lines, other families whose names start alike and values that are not numbers are skipped.
    """
    start = 0
    while (at := text.find(family, start)) >= 0:
        end = text.find("\n", at)
        end = len(text) if end < 0 else end
        start = end
        rest = text[at + len(family) : end]
        if rest[:1] == "{":
            labels, _, tail = rest[1:].rpartition("}")
        elif rest[:1] == " ":
            labels, tail = "", rest
        else:
            continue
        try:
            value = float(tail.split()[0])
        except (ValueError, IndexError):
            continue
        yield labels, value


def parse_prefill_passes(text: str) -> dict[str, int]:
    """How many prefill batches a worker has run since it started, per DP rank, from its ``/metrics`` page.

    SGLang 0.5.23 counts every prefill batch's forward pass in ``sglang:cuda_graph_passes_total``
    with ``mode="prefill_cuda_graph"`` or ``"prefill_none"`` (``observability/metrics_collector.py``,
    ``metrics_reporter.report_prefill_stats``), one series per reporting scheduler, labelled
    ``dp_rank`` where there are DP ranks. Under ``--enable-metrics-for-all-schedulers`` every TP rank
    of a DP rank reports the same batches, so a rank's count is its largest series. Keyed by the
    ``dp_rank`` label ("" where there is none); empty: no such series (an older release, metrics off).
    """
    series: dict[tuple[tuple[str, str], ...], float] = {}
    for labels_text, value in _samples(text, _PASSES_FAMILY):
        labels = dict(_LABEL.findall(labels_text))
        if not labels.get("mode", "").startswith("prefill"):
            continue
        key = tuple(sorted((k, v) for k, v in labels.items() if k != "mode"))
        series[key] = series.get(key, 0.0) + value
    per_rank: dict[str, float] = {}
    for key, value in series.items():
        rank = dict(key).get("dp_rank", "")
        per_rank[rank] = max(per_rank.get(rank, 0.0), value)
    return {rank: int(value) for rank, value in per_rank.items()}


def parse_new_token_ratio(text: str) -> float | None:
    """SGLang's ``new_token_ratio`` from its ``/metrics`` page: the largest over its series (None: not there).

    SGLang 0.5.23 sets the gauge at each prefill batch to the ratio its admission used
    (``metrics_reporter.report_prefill_stats``): the share of each running request's remaining output it
    reserves. It is 0.7 after the worker was idle or retracted requests and falls to 0.098 over 600 decode
    steps. With several schedulers the most reserving one is taken (its requests wait first).
    """
    ratios = [value for _, value in _samples(text, _RATIO_FAMILY) if 0.0 <= value <= 1.0]
    return max(ratios) if ratios else None


def _refused(exc: BaseException) -> bool:
    """A refused connection: the worker's port is closed (it died), not merely slow or busy."""
    return isinstance(exc, aiohttp.ClientConnectorError) and isinstance(exc.os_error, ConnectionRefusedError)


class LoadTracker(LoadBook):
    """Latest reported load per worker (a ``LoadBook``), refreshed by one background task."""

    def __init__(
        self, config: LoadConfig, registry: WorkerRegistry, http: WorkerHttp, clock: Clock = MONOTONIC
    ) -> None:
        super().__init__(clock)
        self.config = config
        self.registry = registry
        self.http = http
        self._path: dict[str, str] = {}
        self._passes_misses: dict[str, int] = {}  # polls in a row without a usable prefill-batch count
        self._passes_retry_at: dict[str, float] = {}  # not asked for the count again before then
        tick = poll_tick(config.poll_interval_s, config.startup_poll_interval_s)
        self._poller = Poller("load-poller", tick, self.poll_due)

    async def start(self) -> None:
        self._poller.start()

    async def stop(self) -> None:
        await self._poller.stop()

    async def poll_once(self) -> None:
        """Poll every worker now."""
        await asyncio.gather(*(self._poll(w) for w in self.registry.workers), return_exceptions=True)

    async def poll_due(self) -> None:
        """Poll the workers due now (``LoadBook.due``)."""
        config = self.config
        due = self.due(self.registry.workers, self.clock(), config.poll_interval_s, config.startup_poll_interval_s)
        if due:
            await asyncio.gather(*(self._poll(w) for w in due), return_exceptions=True)

    async def _poll(self, worker: Worker) -> None:
        known = self._path.get(worker.id)
        # A worker that reports its prefill counters (/v1/loads) is also asked, at the same moment, how many
        # prefill batches it has run, so the two snapshots bound the same window, and its new_token_ratio.
        if known == _LOAD_PATHS[0] and self.config.read_prefill_batches and self._asks_passes(worker):
            load, page = await asyncio.gather(self._fetch_load(worker, known), self._fetch_metrics_page(worker))
            passes = parse_prefill_passes(page)
            if load is not None:
                load.new_token_ratio = parse_new_token_ratio(page)
            # Every DP rank the load sums must have its count (else batches and busy time would not match).
            if load is not None and passes and len(passes) == max(load.ranks, 1):
                load.total_prefill_batches = sum(passes.values())
                self._passes_misses[worker.id] = 0
            elif load is not None:
                misses = self._passes_misses.get(worker.id, 0) + 1
                self._passes_misses[worker.id] = misses
                if misses >= _PASSES_GIVE_UP:
                    self._passes_retry_at[worker.id] = self.clock() + _PASSES_RETRY_S
        else:
            load = await self._fetch_load(worker, known)
        if load is not None:
            self.set(worker, load)

    def _asks_passes(self, worker: Worker) -> bool:
        retry_at = self._passes_retry_at.get(worker.id)
        if retry_at is None:
            return True
        if self.clock() < retry_at:
            return False
        del self._passes_retry_at[worker.id]  # try again (metrics switched on, a new release)
        self._passes_misses[worker.id] = 0
        return True

    async def _fetch_metrics_page(self, worker: Worker) -> str:
        """The worker's ``/metrics`` page ("" where it does not answer one)."""
        try:
            async with self.http.get(worker.url + "/metrics", self.config.timeout_s) as resp:
                if resp.status == 200:
                    return await resp.text()
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            pass  # down or slow: the load poll says which; this window goes without the count
        return ""

    async def _fetch_load(self, worker: Worker, known: str | None) -> WorkerLoad | None:
        for path in (known,) if known else _LOAD_PATHS:
            try:
                async with self.http.get(worker.url + path, self.config.timeout_s) as resp:
                    if resp.status != 200:
                        continue
                    if path == "/metrics":
                        load = parse_metrics(await resp.text())
                    else:
                        load = parse_loads(await resp.json(content_type=None))
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
                if _refused(exc):
                    # Nothing listens there any more: stop choosing it now rather than at the next
                    # failed /health (the health checker brings it back once it answers again).
                    self.registry.mark_unreachable(worker, "connection refused")
                    return None
                if known:
                    return None  # worker down: health checks handle that; keep the path
                continue
            if load is not None:
                self._path[worker.id] = path
                return load
        self._path.pop(worker.id, None)
        return None

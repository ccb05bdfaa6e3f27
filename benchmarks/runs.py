"""One contender at one offered load on a fresh cluster: the unit every comparing suite repeats."""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.client import ClientOptions, run_load
from benchmarks.fleet.cluster import Cluster, ClusterError, ClusterSpec, CpuWorkerPool
from benchmarks.fleet.contenders import create_contender
from benchmarks.fleet.pd_contenders import PdContender, create_pd_contender
from benchmarks.fleet.process import ContenderError
from benchmarks.metrics import RequestResult, Summary, failed, summarize
from benchmarks.workloads.base import Workload

__all__ = ["progress_bar", "run_one", "write_records"]


def progress_bar(total: int, desc: str, disabled: bool) -> Any:
    """A tqdm bar on stderr (stdout is for the tables)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", disable=disabled, leave=False, file=sys.stderr)


async def run_one(
    name: str,
    workload: Workload,
    spec: ClusterSpec,
    options: ClientOptions,
    rate: float | None,
    progress: bool,
    pool: CpuWorkerPool | None = None,
    records: Path | None = None,
) -> tuple[Summary, list[float]]:
    """One contender at one offered load on a fresh (or flushed) cluster; a start failure becomes its row.

    With ``spec.prefill`` the cluster is a PD fleet and ``name`` a PD contender (``pd_contenders``). ``records``:
    write what the client saw of each request there (``write_records``)."""
    contender = create_pd_contender(name) if spec.prefill else create_contender(name, page_size=spec.page_size)
    cluster = Cluster(spec, pool)
    try:
        try:
            await cluster.start()
        except ClusterError as exc:
            return failed(name, rate, f"cluster did not start: {exc}"), []
        try:
            if isinstance(contender, PdContender):
                url = await contender.start_pd(cluster.pd_targets)
            else:
                urls = cluster.grpc_urls if contender.worker_transport == "grpc" else cluster.urls
                url = await contender.start(urls)
        except ContenderError as exc:
            return failed(name, rate, str(exc)), []
        model = await cluster.served_model()
        if model is not None:
            options = dataclasses.replace(options, model=model)
        bar = progress_bar(len(workload.requests), f"{name} @ {rate:g} req/s" if rate else name, not progress)
        results: list[RequestResult]
        try:
            results = await run_load(url, workload.requests, options, on_done=lambda _r: bar.update(1))
        finally:
            bar.close()
        counts = await cluster.request_counts()
        if not counts:  # workers did not report: count what the gateway said in x-upstream-host
            for r in results:
                if r.error is None and r.upstream:
                    counts[r.upstream] = counts.get(r.upstream, 0) + 1
        if records is not None:
            write_records(records, results, cluster.urls, spec.profile)
        summary = summarize(name, rate, results, counts, spec.workers)
        summary.fleet = await cluster.fleet_figures()
        ttfts = sorted(r.ttft_s for r in results if r.error is None and r.ttft_s is not None)
        return summary, ttfts
    finally:
        await contender.stop()
        await cluster.stop()


def write_records(path: Path, results: Sequence[RequestResult], worker_urls: Sequence[str], profiles: str) -> None:
    """One JSON line per request, in request order: what the client saw (times in seconds since the run
    started, tokens, the upstream where the gateway names it) and, where it does, the worker's position in the
    cluster and its timing profile (profiles are cycled over the workers, as the cluster starts them). The
    figures a table summarises can then be taken apart request by request (which requests make a p99)."""
    position = {url.split("://", 1)[-1].rstrip("/"): i for i, url in enumerate(worker_urls)}
    cycle = [p.strip() for p in profiles.split(",") if p.strip()]
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as out:
        for result in results:
            worker = position.get(result.upstream or "")
            line = {
                **dataclasses.asdict(result),
                "worker": worker,
                "profile": cycle[worker % len(cycle)] if worker is not None and cycle else None,
            }
            out.write(json.dumps(line) + "\n")

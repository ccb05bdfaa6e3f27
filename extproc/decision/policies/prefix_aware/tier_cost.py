"""The extra seconds a prefix costs when it comes from host memory or shared storage instead of the GPU.

A worker with SGLang's HiCache serves a cached prefix from three tiers (SGLang 0.5.23 semantics):

- **GPU**: nothing to move;
- **host memory** (a host span of at least 10 tokens): loaded back at admission, the copy overlapping
  the prefill layer by layer, so it adds time only when it is longer than the computation:
  ``max(0, t_load - t_compute)`` with ``t_load = tokens x load-back seconds per token``;
- **shared storage** (a run of at least ``prefetch_threshold`` tokens after the local match): the
  request waits in the queue while the pages are read (existence checks and reads of up to 128 pages
  per operation), then they are loaded back like a host hit.

Shorter spans are recomputed, so they count as uncached. The per-token costs come from what the worker
reports (``extproc.sync.tier_stats``: its measured load-back seconds per token and storage bandwidth).
Until it has reported them they are priors: the KV bytes per token come from the worker's own
``/v1/loads`` memory section (``kv_cache_gb`` over ``token_capacity``) when it has one, and the
bandwidths are round figures of a modest setup, chosen to be pessimistic rather than to match any
profile: a host link of 20 GB/s (PCIe Gen4 x16 reaches about 25), shared storage at 1 GB/s with 1 ms
per operation (a network file system). Reported figures replace them after the first load-back or read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from extproc.fleet.reports import DEFAULT_PREFETCH_THRESHOLD, TierReport, WorkerLoad

__all__ = ["LOAD_BACK_THRESHOLD", "TierCosts", "TierExtra", "costs_from_report", "kv_bytes_per_token", "tier_extra"]

LOAD_BACK_THRESHOLD = 10  # SGLang's load_back_threshold: shorter host spans are recomputed
STORAGE_BATCH_PAGES = 128  # pages per storage operation
PRIOR_KV_BYTES_PER_TOKEN = 100_000  # when the worker reports no memory section: 7-14B GQA models in BF16 hold 64-200 KB
PRIOR_HOST_LINK_BYTES_PER_S = 20e9
PRIOR_STORAGE_BYTES_PER_S = 1e9
PRIOR_STORAGE_OP_S = 1e-3


@dataclass(frozen=True)
class TierCosts:
    """Per-token transfer costs of one worker (seconds)."""

    load_back_s_per_token: float = PRIOR_KV_BYTES_PER_TOKEN / PRIOR_HOST_LINK_BYTES_PER_S
    prefetch_s_per_token: float = PRIOR_KV_BYTES_PER_TOKEN / PRIOR_STORAGE_BYTES_PER_S
    storage_op_s: float = PRIOR_STORAGE_OP_S
    prefetch_threshold: int = DEFAULT_PREFETCH_THRESHOLD


@dataclass(frozen=True)
class TierExtra:
    """What serving a match from the lower tiers adds, and how many tokens each tier really serves."""

    host_tokens: int  # served from host memory (0 when below the load-back threshold)
    shared_tokens: int  # served from shared storage (0 when below the prefetch threshold)
    load_back_s: float  # added to the prefill step (the part of the copy that compute does not hide)
    prefetch_s: float  # waited in the queue before admission

    @property
    def seconds(self) -> float:
        return self.load_back_s + self.prefetch_s


def kv_bytes_per_token(load: WorkerLoad | None) -> float | None:
    """KV bytes per token per GPU from the worker's ``/v1/loads`` memory section (None: not reported)."""
    if load is None or not load.memory:
        return None
    rank = load.memory[0]
    gb, capacity = rank.get("kv_cache_gb"), rank.get("token_capacity")
    if not isinstance(gb, (int, float)) or not isinstance(capacity, (int, float)) or gb <= 0 or capacity <= 0:
        return None
    return float(gb) * 2**30 / float(capacity)


def costs_from_report(report: TierReport | None, bytes_per_token: float | None = None) -> TierCosts:
    """The worker's reported costs; priors (over its reported KV bytes per token, if any) until it has any."""
    size = bytes_per_token or PRIOR_KV_BYTES_PER_TOKEN
    load_back = size / PRIOR_HOST_LINK_BYTES_PER_S
    prefetch = size / PRIOR_STORAGE_BYTES_PER_S
    threshold = DEFAULT_PREFETCH_THRESHOLD
    if report is not None:
        threshold = report.prefetch_threshold
        if report.load_back_s_per_token is not None:
            load_back = report.load_back_s_per_token
        if report.prefetch_s_per_token is not None:
            prefetch = report.prefetch_s_per_token
    return TierCosts(load_back, prefetch, PRIOR_STORAGE_OP_S, threshold)


def tier_extra(
    host_tokens: int, shared_tokens: int, costs: TierCosts, compute_s: float = 0.0, page_size: int = 16
) -> TierExtra:
    """Extra seconds for ``host_tokens`` from host memory and ``shared_tokens`` from storage.

    ``compute_s`` is the predicted prefill computation the load-back overlaps with.
    """
    host = host_tokens if host_tokens >= LOAD_BACK_THRESHOLD else 0
    shared = shared_tokens if shared_tokens >= max(costs.prefetch_threshold, page_size, 1) else 0
    load = (host + shared) * costs.load_back_s_per_token
    prefetch = 0.0
    if shared:
        ops = 2 * math.ceil(shared / max(page_size, 1) / STORAGE_BATCH_PAGES)  # existence checks, then reads
        prefetch = shared * costs.prefetch_s_per_token + ops * costs.storage_op_s
    return TierExtra(host, shared, max(0.0, load - compute_s), prefetch)

"""The extra seconds a prefix costs when it comes from host memory or shared storage instead of the GPU.

A worker with SGLang's HiCache serves a cached prefix from three tiers (SGLang 0.5.23 semantics):

- **GPU**: nothing to move;
- **host memory** (a host span of at least 10 tokens): loaded back at admission, the copy overlapping
  the prefill layer by layer, so it adds time only when it is longer than the computation:
  ``max(0, t_load - t_compute)`` with ``t_load = tokens x load-back seconds per token``;
- **shared storage** (a run of at least ``prefetch_threshold`` tokens after the local match): the
  request waits in the queue while the pages are read (existence checks and reads of up to 128 pages
  per operation), then they are loaded back like a host hit.

Shorter spans are recomputed, so they count as uncached. The costs come from what the worker reports
(``extproc.sync.tier_stats``); until it has reported a load-back or a storage read, documented priors
stand in: Llama-3.1-8B in BF16 moves 131,072 KV bytes per token (32 layers x 8 KV heads x 256 x 2 B);
host-to-device copies reach ~45 GB/s on PCIe Gen5 x16 (NVIDIA nvbandwidth issue #24 measured ~35 GB/s
with SM copies on H100, copy engines reach 50-55 of the 64 GB/s raw), and storage reads are taken at
5 GB/s with 100 us per operation (SGLang's own ``sim`` storage backend defaults, NVMe-class).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from extproc.sync.tier_stats import DEFAULT_PREFETCH_THRESHOLD, TierReport

__all__ = ["LOAD_BACK_THRESHOLD", "TierCosts", "TierExtra", "costs_from_report", "tier_extra"]

LOAD_BACK_THRESHOLD = 10  # SGLang's load_back_threshold: shorter host spans are recomputed
STORAGE_BATCH_PAGES = 128  # pages per storage operation
PRIOR_KV_BYTES_PER_TOKEN = 131_072  # Llama-3.1-8B, BF16
PRIOR_LOAD_BACK_S_PER_TOKEN = PRIOR_KV_BYTES_PER_TOKEN / 45e9  # ~2.9 us
PRIOR_PREFETCH_S_PER_TOKEN = PRIOR_KV_BYTES_PER_TOKEN / 5e9  # ~26 us
PRIOR_STORAGE_OP_S = 100e-6


@dataclass(frozen=True)
class TierCosts:
    """Per-token transfer costs of one worker (seconds), and which of them it reported itself."""

    load_back_s_per_token: float = PRIOR_LOAD_BACK_S_PER_TOKEN
    prefetch_s_per_token: float = PRIOR_PREFETCH_S_PER_TOKEN
    storage_op_s: float = PRIOR_STORAGE_OP_S
    prefetch_threshold: int = DEFAULT_PREFETCH_THRESHOLD
    load_back_reported: bool = False
    prefetch_reported: bool = False


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


def costs_from_report(report: TierReport | None, prior_scale: float = 1.0) -> TierCosts:
    """The worker's reported costs, priors (times ``prior_scale``) where it has reported nothing yet.

    Reported figures are measured seconds already; ``prior_scale`` adapts the priors to a fleet faster
    or slower than the hardware they describe (the policy's own time scale).
    """
    prior = TierCosts(
        load_back_s_per_token=PRIOR_LOAD_BACK_S_PER_TOKEN * prior_scale,
        prefetch_s_per_token=PRIOR_PREFETCH_S_PER_TOKEN * prior_scale,
        storage_op_s=PRIOR_STORAGE_OP_S * prior_scale,
    )
    if report is None:
        return prior
    costs = replace(prior, prefetch_threshold=report.prefetch_threshold)
    load_back = report.load_back_s_per_token
    if load_back is not None:
        costs = replace(costs, load_back_s_per_token=load_back, load_back_reported=True)
    prefetch = report.prefetch_s_per_token
    if prefetch is not None:
        costs = replace(costs, prefetch_s_per_token=prefetch, prefetch_reported=True)
    return costs


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

"""How long a simulated step takes on real hardware: named profiles of a two-part timing model.

The model is the one simulators such as DistServe's and Dynamo's mocker use, which matches the
published H100/H200 figures collected in ``docs/sim-worker.md`` and what ``benchmarks/gpu_timing.py``
measured on an H200 (the ``llama-3.1-8b-h200`` profile is that measurement):

* a prefill batch whose requests compute ``L`` new tokens each on ``P`` cached ones takes
  ``c0 + sum(a*L + b*(L*L + 2*P*L))``: a linear part (weights: 2 x params FLOPs per token) and an
  attention part that grows with the context each new token attends to (quadratic in L, linear in P);
* a decode step over ``B`` sequences holding ``C`` KV tokens in total takes ``d0 + d1*B + d2*C``
  (weight streaming, per-sequence overhead, KV reads).

With HiCache (``--enable-hierarchical-cache``) pages also move between GPU and host memory, at the
profile's PCIe figures: ``kv_bytes_per_token`` (per GPU: SGLang's ``get_size_per_token`` of the MHA
host pool, ``(head_dim + v_head_dim) x kv_heads_per_rank x layers x 2`` bytes in BF16) over
``h2d_gbps`` / ``d2h_gbps``. A load-back overlaps the prefill layer by layer (SGLang waits per layer
on the host-to-device stream), so a prefill step that loads back ``t_h2d`` seconds of pages takes
``max(t_compute, t_h2d + t_compute / layers)``: the copy hides behind compute unless it is longer.

Sources of the transfer figures: NVIDIA nvbandwidth issue #24 (H100 SXM, SM copies, which SGLang's
HiCache I/O kernels are): host-to-device ~35 GB/s, device-to-host ~52.8 GB/s; PCIe Gen5 x16 is
~64 GB/s raw per direction with ~50-55 GB/s reached by pinned copy-engine copies. The profiles take
45 GB/s host-to-device (the middle of 35-55) and 50 GB/s device-to-host, per GPU (each GPU of a TP
group moves its own shard over its own link). SGLang's HiCache design doc and LMSYS's HiCache post
(2025-09-10) give no absolute bandwidth, only that the copy overlaps compute.

Times are in seconds of the simulated GPU; the scheduler divides them by ``--speedup``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["PROFILES", "TimingProfile", "get_profile", "profile_list"]


@dataclass(frozen=True)
class TimingProfile:
    """Constants of one model on one GPU setup (seconds, tokens)."""

    name: str
    description: str
    c0: float  # prefill batch floor (launch, scheduling, sampling)
    a: float  # per new prefill token
    b: float  # attention, per token^2
    d0: float  # decode step base
    d1: float  # per sequence in the decode batch
    d2: float  # per KV token read in a decode step
    kv_pool_tokens: int  # KV pool size SGLang allocates at its default --mem-fraction-static
    # What /v1/loads reports about the hardware (per DP rank: one TP group): the accelerator's name as
    # torch names it, how many there are, and the memory SGLang measured for weights, KV pool and graphs.
    gpu_name: str | None = None
    num_gpus: int = 1
    weight_gb: float = 0.0  # per GPU, GiB, as SGLang's weight_load_mem_usage
    kv_bytes_per_token: int = 0  # per GPU: layers x KV heads on this GPU x head dim x 2 (K, V) x 2 bytes (bf16)
    graph_gb: float = 0.0  # CUDA-graph memory per GPU
    # HiCache transfers (KV bytes per token above; 0 bytes or 0 GB/s: the copy is free).
    layers: int = 32  # transformer layers (a load-back overlaps the prefill one layer at a time)
    h2d_gbps: float = 0.0  # host-to-device copy bandwidth per GPU (GB/s, 1e9)
    d2h_gbps: float = 0.0  # device-to-host copy bandwidth per GPU (GB/s, 1e9)

    def prefill_time(self, chunks: Iterable[tuple[int, int]]) -> float:
        """One prefill batch; ``chunks`` holds (new tokens L, cached context P) per request."""
        work = 0.0
        any_chunk = False
        for new, cached in chunks:
            any_chunk = True
            work += self.a * new + self.b * (new * new + 2.0 * cached * new)
        return self.c0 + work if any_chunk else 0.0

    def decode_time(self, batch_size: int, context_tokens: int) -> float:
        """One decode step producing one token for each of ``batch_size`` sequences."""
        if batch_size <= 0:
            return 0.0
        return self.d0 + self.d1 * batch_size + self.d2 * context_tokens

    def kv_bytes(self, tokens: int) -> int:
        """Bytes of ``tokens`` tokens of KV on one GPU (what a HiCache copy moves per rank)."""
        return tokens * self.kv_bytes_per_token

    def h2d_time(self, tokens: int) -> float:
        """Seconds to copy ``tokens`` tokens of KV from host memory to the GPU (a load-back)."""
        return self.kv_bytes(tokens) / (self.h2d_gbps * 1e9) if self.h2d_gbps > 0 and tokens > 0 else 0.0

    def d2h_time(self, tokens: int) -> float:
        """Seconds to copy ``tokens`` tokens of KV from the GPU to host memory (a backup)."""
        return self.kv_bytes(tokens) / (self.d2h_gbps * 1e9) if self.d2h_gbps > 0 and tokens > 0 else 0.0

    def overlapped_prefill(self, compute: float, h2d: float) -> float:
        """A prefill step that also loads back ``h2d`` seconds of pages, layer by layer."""
        if h2d <= 0:
            return compute
        return max(compute, h2d + compute / max(self.layers, 1))


# KV bytes per token per GPU (BF16): 8B = 32 layers x 8 KV heads x (128 + 128) x 2 B = 131,072;
# 70B = 80 x 8 x 256 x 2 = 327,680 in all, 2 KV heads per GPU under TP4 = 81,920. Host links: see the
# module docstring (45 GB/s H2D, 50 GB/s D2H per GPU, PCIe Gen5).
_LLAMA_8B_PCIE5: dict[str, Any] = {"layers": 32, "h2d_gbps": 45.0, "d2h_gbps": 50.0}
_LLAMA_70B_TP4_PCIE5: dict[str, Any] = {
    "layers": 80,
    "h2d_gbps": 45.0,
    "d2h_gbps": 50.0,
}

# Constants derived in ../shared/reference/sglang-performance.md and docs/sim-worker.md (BF16,
# FlashAttention-3): a from 2 x params FLOPs at ~650 TFLOPS effective, b from 4 x layers x d_model
# attention FLOPs per token pair, decode from weight + KV bytes over HBM bandwidth (H100 3.35 TB/s,
# H200 4.8 TB/s), floors from published batch-1 TTFT / ITL.
PROFILES: dict[str, TimingProfile] = {
    p.name: p
    for p in (
        TimingProfile(
            "llama-3.1-8b-h100",
            "Llama-3.1-8B BF16 on 1x H100 80GB",
            c0=0.015,
            a=23e-6,
            b=0.52e-9,
            d0=0.007,
            d1=0.06e-3,
            d2=49e-9,
            kv_pool_tokens=417_000,
            gpu_name="NVIDIA H100 80GB HBM3",
            weight_gb=14.96,
            kv_bytes_per_token=131_072,
            graph_gb=0.5,
            **_LLAMA_8B_PCIE5,
        ),
        # Measured on an H200 (benchmarks/data/gpu-timing-h200-run*.json, benchmarks/gpu_timing.py,
        # 2026-12-04): a, d0, d1, d2 are the fitted GPU times; c0 is the eager (launch-bound) floor
        # measured there (15.3 ms; 5.8 ms of it GPU time), as SGLang launches prefill eagerly; b stays
        # FlashAttention-3's, which SGLang runs on Hopper: PyTorch's FlashAttention-2 measured 0.91 ns.
        TimingProfile(
            "llama-3.1-8b-h200",
            "Llama-3.1-8B BF16 on 1x H200 141GB",
            c0=0.015,
            a=23.4e-6,
            b=0.50e-9,
            d0=0.0063,
            d1=0.019e-3,
            d2=37.6e-9,
            kv_pool_tokens=915_000,
            gpu_name="NVIDIA H200",
            weight_gb=14.96,
            kv_bytes_per_token=131_072,
            graph_gb=0.5,
            **_LLAMA_8B_PCIE5,
        ),
        # A100 80GB SXM: BF16 dense peak 312 TFLOPS and 2.04 TB/s HBM (NVIDIA A100 datasheet); the
        # linear part at ~220 TFLOPS effective (70% of peak, as the H100 profile's 650 is 66%), attention
        # at FlashAttention-2's ~225 TFLOPS (arXiv 2307.08691: up to 230 on A100) instead of FA3's 640 on
        # H100, decode from 16 GB of weights and 131 kB of KV per token over 2.04 TB/s.
        TimingProfile(
            "llama-3.1-8b-a100",
            "Llama-3.1-8B BF16 on 1x A100 80GB",
            c0=0.020,
            a=73e-6,
            b=1.48e-9,
            d0=0.010,
            d1=0.08e-3,
            d2=80e-9,
            kv_pool_tokens=400_000,
        ),
        TimingProfile(
            "llama-3.1-70b-tp4-h100",
            "Llama-3.1-70B BF16 on 4x H100 80GB (TP4)",
            c0=0.030,
            a=67e-6,
            b=0.66e-9,
            d0=0.019,
            d1=0.11e-3,
            d2=31e-9,
            kv_pool_tokens=414_000,
            gpu_name="NVIDIA H100 80GB HBM3",
            num_gpus=4,
            weight_gb=32.87,
            kv_bytes_per_token=81_920,
            graph_gb=0.6,
            **_LLAMA_70B_TP4_PCIE5,
        ),
        TimingProfile(
            "llama-3.1-70b-tp4-h200",
            "Llama-3.1-70B BF16 on 4x H200 141GB (TP4)",
            c0=0.030,
            a=64e-6,
            b=0.64e-9,
            d0=0.0145,
            d1=0.09e-3,
            d2=22e-9,
            kv_pool_tokens=1_210_000,
            gpu_name="NVIDIA H200",
            num_gpus=4,
            weight_gb=32.87,
            kv_bytes_per_token=81_920,
            graph_gb=0.6,
            **_LLAMA_70B_TP4_PCIE5,
        ),
        TimingProfile(
            "instant",
            "No simulated time at all (overhead benchmarks, functional tests)",
            c0=0.0,
            a=0.0,
            b=0.0,
            d0=0.0,
            d1=0.0,
            d2=0.0,
            kv_pool_tokens=1_000_000,
        ),
    )
}


def get_profile(name: str) -> TimingProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown timing profile {name!r}; choose one of: {', '.join(PROFILES)}") from None


def profile_list(text: str) -> list[str]:
    """``name`` or ``name,name,...`` (cycled over workers): the names, each checked."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise ValueError("no timing profile given")
    for name in names:
        get_profile(name)
    return names

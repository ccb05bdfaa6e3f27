"""Prometheus text for ``/metrics`` under SGLang's metric names (``--enable-metrics``).

Rendered by hand from the scheduler's counters rather than through a client library registry: the
numbers already live in the scheduler, and one pass of string formatting is cheaper per scrape.
"""

from __future__ import annotations

from .scheduler import Histogram, Scheduler

__all__ = ["render_metrics"]


def _labels(model: str, extra: str = "") -> str:
    escaped = model.replace("\\", "\\\\").replace('"', '\\"')
    return f'{{model_name="{escaped}",engine_type="unified",tp_rank="0",pp_rank="0"{extra}}}'


def _histogram(
    lines: list[str], name: str, help_text: str, hist: Histogram, model: str, labels: str | None = None
) -> None:
    """A histogram; ``labels`` (the inside of ``{...}``) replaces the scheduler's label set when given."""

    def with_labels(extra: str = "") -> str:
        return _labels(model, extra) if labels is None else "{" + labels + extra + "}"

    lines.append(f"# HELP {name} {help_text}")
    lines.append(f"# TYPE {name} histogram")
    cumulative = 0
    for bound, count in zip(hist.buckets, hist.counts):
        cumulative += count
        le = f',le="{bound}"'
        lines.append(f"{name}_bucket{with_labels(le)} {cumulative}")
    inf = ',le="+Inf"'
    lines.append(f"{name}_bucket{with_labels(inf)} {hist.count}")
    lines.append(f"{name}_sum{with_labels()} {hist.sum}")
    lines.append(f"{name}_count{with_labels()} {hist.count}")


# SGLang's RadixCacheMetricsCollector and StorageMetricsCollector label their series by rank, not model.
RADIX_LABELS = 'cache_type="UnifiedRadixCache",tp_rank="0",pp_rank="0",dp_rank="0"'
STORAGE_LABELS = (
    'storage_backend="{backend}",tp_rank="0",dp_rank="0",pp_rank="0",pp_size="1",attn_cp_rank="0",attn_cp_size="1"'
)


def render_metrics(scheduler: Scheduler, model: str) -> str:
    load = scheduler.load()
    stats = scheduler.stats
    labels = _labels(model)
    lines: list[str] = []

    def gauge(name: str, help_text: str, value: float) -> None:
        lines.extend(
            [f"# HELP sglang:{name} {help_text}", f"# TYPE sglang:{name} gauge", f"sglang:{name}{labels} {value}"]
        )

    def counter(name: str, help_text: str, value: float) -> None:
        lines.extend(
            [
                f"# HELP sglang:{name} {help_text}",
                f"# TYPE sglang:{name} counter",
                f"sglang:{name}{labels} {float(value)}",
            ]
        )

    gauge("num_running_reqs", "The number of running requests.", load["num_running_reqs"])
    gauge("num_queue_reqs", "The number of requests in the waiting queue.", load["num_waiting_reqs"])
    gauge("num_used_tokens", "The number of used tokens.", load["num_used_tokens"])
    gauge("token_usage", "The token usage.", load["token_usage"])
    gauge("cache_hit_rate", "The prefix cache hit rate.", load["cache_hit_rate"])
    gauge("gen_throughput", "The generation throughput (token/s).", load["gen_throughput"])
    gauge("max_total_num_tokens", "Maximum total number of tokens in the KV cache pool.", scheduler.capacity)
    gauge("evictable_tokens", "Tokens held by the radix cache that can be evicted.", scheduler.cache.evictable_size)
    counter("prompt_tokens_total", "Number of prefill tokens processed.", stats.prompt_tokens)
    _cached_by_source(lines, scheduler, model)
    counter("generation_tokens_total", "Number of generation tokens processed.", stats.generation_tokens)
    counter("num_requests_total", "Number of requests processed.", stats.num_requests)
    counter("num_retracted_reqs_total", "Number of retracted requests.", stats.num_retractions)
    _histogram(
        lines, "sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.", stats.ttft, model
    )
    _histogram(
        lines, "sglang:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", stats.itl, model
    )
    _histogram(
        lines,
        "sglang:e2e_request_latency_seconds",
        "Histogram of End-to-end request latency in seconds",
        stats.e2e,
        model,
    )
    _histogram(lines, "sglang:queue_time_seconds", "Histogram of queueing time in seconds.", stats.queue_time, model)
    if scheduler.hicache is not None:
        _hicache(lines, scheduler, model)
    return "\n".join(lines) + "\n"


def _family(lines: list[str], name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
    lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    lines += [f"{name}{{{labels}}} {float(value)}" for labels, value in samples]


def _cached_by_source(lines: list[str], scheduler: Scheduler, model: str) -> None:
    """Cached prompt tokens by tier, as SGLang's tokenizer-side and scheduler-side collectors count them."""
    stats = scheduler.stats
    escaped = model.replace("\\", "\\\\").replace('"', '\\"')
    by_source = [("device", stats.cached_device_tokens)]
    by_source += [
        (src, n) for src, n in (("host", stats.cached_host_tokens), ("storage", stats.cached_storage_tokens)) if n
    ]
    _family(
        lines,
        "sglang:cached_tokens_total",
        "counter",
        "Number of cached prompt tokens by source (device/host/storage).",
        [(f'cache_source="{src}",engine_type="unified",model_name="{escaped}"', n) for src, n in by_source],
    )
    base = _labels(model)[1:-1]
    _family(
        lines,
        "sglang:prefill_effective_tokens_total",
        "counter",
        "Effective prefill tokens with retracted-request re-counts excluded. mode: device_hit, host_hit, "
        "storage_hit, input.",
        [
            (f'{base},mode="{mode}"', n)
            for mode, n in (
                ("input", stats.input_tokens),
                ("device_hit", stats.cached_device_tokens),
                ("host_hit", stats.cached_host_tokens),
                ("storage_hit", stats.cached_storage_tokens),
            )
        ],
    )


def _hicache(lines: list[str], scheduler: Scheduler, model: str) -> None:
    """The host tier's figures, under SGLang 0.5.23's names (present only with HiCache on)."""
    cache = scheduler.hicache
    assert cache is not None
    stats = scheduler.stats
    base = _labels(model)[1:-1]
    _family(lines, "sglang:hicache_host_used_tokens", "gauge", "Host KV tokens in use.", [(base, cache.host_used)])
    _family(
        lines,
        "sglang:hicache_host_total_tokens",
        "gauge",
        "Host KV pool size in tokens.",
        [(base, cache.host_capacity)],
    )
    r = RADIX_LABELS
    kv = r + ',pool="kv"'
    _family(
        lines,
        "sglang:evicted_tokens_total",
        "counter",
        "The number of device KV token slots freed by eviction.",
        [(r, cache.stats.evicted_tokens)],
    )
    _family(
        lines,
        "sglang:load_back_tokens_total",
        "counter",
        "The number of tokens loaded back from local host DRAM (L2) to GPU, by host pool.",
        [(kv, stats.load_back_tokens)],
    )
    _family(
        lines,
        "sglang:load_back_bytes_total",
        "counter",
        "Bytes loaded back from local host DRAM (L2) to GPU.",
        [(r, stats.load_back_bytes)],
    )
    _histogram(
        lines,
        "sglang:load_back_duration_seconds",
        "GPU-stream span of a merged host-to-device load-back copy.",
        stats.load_back_seconds,
        model,
        labels=r,
    )
    _family(
        lines,
        "sglang:hicache_backup_tokens_total",
        "counter",
        "The number of tokens backed up from GPU to local host DRAM (L2), by host pool.",
        [(kv, cache.stats.backup_tokens)],
    )
    _family(
        lines,
        "sglang:hicache_backup_bytes_total",
        "counter",
        "Bytes backed up from GPU to local host DRAM (L2).",
        [(r, stats.backup_bytes)],
    )
    _histogram(
        lines,
        "sglang:hicache_backup_duration_seconds",
        "Time taken to back up KV cache from GPU to local host DRAM (L2) in seconds, per merged write op.",
        stats.backup_seconds,
        model,
        labels=r,
    )
    _family(
        lines,
        "sglang:hicache_dropped_tokens_total",
        "counter",
        "The number of logical device KV tokens destroyed without a host backup.",
        [
            (r + ',reason="host_pressure",pool="kv"', cache.stats.dropped_host_pressure),
            (r + ',reason="write_through_unbacked_eviction",pool="kv"', cache.stats.dropped_write_through_unbacked),
        ],
    )
    prefetcher = scheduler.prefetcher
    if prefetcher is None:
        return
    backend = scheduler.config.hicache_storage_backend or ""
    st = STORAGE_LABELS.format(backend=backend)
    ps = prefetcher.stats
    _family(
        lines,
        "sglang:prefetched_tokens_total",
        "counter",
        "Prompt tokens successfully transferred from L3 storage into host memory.",
        [(st, ps.prefetched_tokens)],
    )
    _family(lines, "sglang:backuped_tokens_total", "counter", "Number of backuped tokens.", [(st, ps.backuped_tokens)])
    _family(
        lines,
        "sglang:storage_prefetch_hit_tokens_total",
        "counter",
        "Storage-hit tokens returned by an L3 query before host allocation, transfer, or cache insertion.",
        [(st, ps.prefetch_hit_tokens)],
    )
    _family(
        lines,
        "sglang:storage_prefetch_unfulfilled_tokens_total",
        "counter",
        "Attempt-level storage-hit tokens that did not become a usable prefetch result, by diagnostic reason.",
        [(st + f',reason="{reason}"', n) for reason, n in ps.unfulfilled.items()],
    )
    pages, bandwidth = scheduler.storage_histograms()
    _histogram(lines, "sglang:prefetch_pgs", "Histogram of prefetch pages of batches.", pages, model, labels=st)
    _histogram(
        lines,
        "sglang:prefetch_bandwidth",
        "Histogram of per-op L3 prefetch wire bandwidth in GB/s.",
        bandwidth,
        model,
        labels=st,
    )

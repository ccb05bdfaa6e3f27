"""Prometheus text for ``/metrics`` with SGLang 0.5.23's families, types and label names (``--enable-metrics``).

Rendered by hand from the scheduler's counters (``metrics``) rather than through a client library registry: the
numbers already live in the scheduler, and one pass of string formatting is cheaper per scrape.

The families and their labels are those a real 0.5.23 worker exposes (checked by the differential
conformance test against one): scheduler gauges and counters labelled ``engine_type, model_name,
moe_ep_rank, pp_rank, tp_rank``; request metrics of the tokenizer process labelled ``engine_type,
model_name`` (plus ``is_streaming`` where SGLang splits them); HTTP metrics by endpoint; radix-cache
eviction metrics by cache type. Families for features the simulator has not got (speculative decoding,
SWA and Mamba pools, disaggregation queues, DP attention, routing keys, CUDA graphs) are exported with
the value a worker without them shows, mostly 0, so dashboards built for SGLang find every series.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from typing import Any

from .metrics import GRAPH_PHASES, Histogram, HttpStats
from .scheduler import Scheduler

__all__ = ["render_metrics"]

STARTUP_PHASES = ("load_weight", "kv_cache_allocation", "scheduler_e2e", "tokenizer_e2e")
STAGE_CATEGORIES = (
    "other",
    "recv_requests",
    "process_input_requests",
    "get_next_batch_to_run",
    "process_queue",
    "run_batch",
    "process_batch_result",
    "sanity_check_cache",
    "idle",
)
ROUTING_KEY_BUCKETS = ((0, 1), (1, 2), (2, 3), (3, 5), (5, 7), (7, 10), (10, 20), (20, 50), (50, 100), (100, 200))
IMBALANCE_BUCKETS = (1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0)
SYNC_WAIT_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


def _labels(pairs: Iterable[tuple[str, str]]) -> str:
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in pairs)
    return f"{{{inner}}}" if inner else ""


class _Page:
    """Accumulates families; each family's HELP/TYPE once, then its samples."""

    def __init__(self, model: str) -> None:
        self.lines: list[str] = []
        self.scheduler = (
            ("engine_type", "unified"),
            ("model_name", model),
            ("moe_ep_rank", "0"),
            ("pp_rank", "0"),
            ("tp_rank", "0"),
        )
        self.tokenizer = (("engine_type", "unified"), ("model_name", model))

    def family(self, name: str, kind: str, help_text: str) -> None:
        self.lines.append(f"# HELP sglang:{name} {help_text}")
        self.lines.append(f"# TYPE sglang:{name} {kind}")

    def sample(self, name: str, labels: Iterable[tuple[str, str]], value: float) -> None:
        self.lines.append(f"sglang:{name}{_labels(labels)} {float(value)}")

    def gauge(self, name: str, help_text: str, value: float, labels: Iterable[tuple[str, str]] | None = None) -> None:
        self.family(name, "gauge", help_text)
        self.sample(name, self.scheduler if labels is None else labels, value)

    def histogram(
        self, name: str, help_text: str, series: Iterable[tuple[tuple[tuple[str, str], ...], Histogram]]
    ) -> None:
        self.family(name, "histogram", help_text)
        for labels, hist in series:
            cumulative = 0
            for bound, count in zip(hist.buckets, hist.counts):
                cumulative += count
                self.sample(f"{name}_bucket", (*labels, ("le", str(bound))), cumulative)
            self.sample(f"{name}_bucket", (*labels, ("le", "+Inf")), hist.count)
            self.sample(f"{name}_sum", labels, hist.sum)
            self.sample(f"{name}_count", labels, hist.count)


def render_metrics(scheduler: Scheduler, model: str, http: HttpStats | None = None) -> str:
    """The whole ``/metrics`` page of one simulated worker, section by section in SGLang's order."""
    page = _Page(model)
    load = scheduler.load()
    cpu = time.process_time()
    _request_metrics(page, scheduler)
    _scheduler_histograms(page, scheduler)
    _process_metrics(page, scheduler, http, cpu)
    _scheduler_gauges(page, scheduler, load, http)
    _scheduler_counters(page, scheduler, cpu)
    if scheduler.hicache is not None:
        _hicache(page.lines, scheduler, model)
    return "\n".join(page.lines) + "\n"


def _request_metrics(page: _Page, scheduler: Scheduler) -> None:
    """Request metrics (SGLang's tokenizer process): latencies, lengths, token counters."""
    stats, tok = scheduler.stats, page.tokenizer
    streams = sorted(stats.finished.items())

    def by_stream(flag: bool) -> tuple[tuple[str, str], ...]:
        return (*tok, ("is_streaming", "true" if flag else "false"))

    page.histogram(
        "time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        ((by_stream(f), s.ttft) for f, s in streams),
    )
    page.histogram(
        "e2e_request_latency_seconds",
        "Histogram of End-to-end request latency in seconds",
        ((by_stream(f), s.e2e) for f, s in streams),
    )
    page.histogram(
        "request_time_per_output_token_seconds",
        "Per-request TPOT in seconds: (finished_time - first_token_time) / (completion_tokens - 1).",
        ((by_stream(f), s.tpot) for f, s in streams),
    )
    page.histogram("prompt_tokens_histogram", "Histogram of prompt token length.", [(tok, stats.prompt_lengths)])
    page.histogram(
        "uncached_prompt_tokens_histogram",
        "Histogram of uncached (compute) prompt token length.",
        [(tok, stats.uncached_lengths)],
    )
    page.histogram(
        "generation_tokens_histogram", "Histogram of generation token length.", [(tok, stats.generation_lengths)]
    )
    page.histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", [(tok, stats.itl)])
    if stats.loads_served.count:
        page.histogram(
            "get_loads_duration_seconds",
            "Time spent serving /v1/loads requests (seconds).",
            [(tok, stats.loads_served)],
        )
    for name, kind_help in (("prompt_tokens_total", "Number of prefill tokens processed."),
                            ("generation_tokens_total", "Number of generation tokens processed."),
                            ("num_requests_total", "Number of requests processed.")):  # fmt: skip
        page.family(name, "counter", kind_help)
        field = {"prompt_tokens_total": "prompt_tokens", "generation_tokens_total": "generation_tokens"}.get(
            name, "num_requests"
        )
        for flag, finished in streams:
            page.sample(name, by_stream(flag), getattr(finished, field))
    if stats.cached_tokens:  # a labelled counter appears with its first hit, as in SGLang
        page.family("cached_tokens_total", "counter", "Number of cached prompt tokens by source (device/host/storage).")
        by_source = (
            ("device", stats.cached_device_tokens),
            ("host", stats.cached_host_tokens),
            ("storage", stats.cached_storage_tokens),
        )
        for source, value in by_source:
            if value or source == "device":
                page.sample("cached_tokens_total", (*tok, ("cache_source", source)), value)


def _scheduler_histograms(page: _Page, scheduler: Scheduler) -> None:
    """The scheduler's histograms: DP attention, stage latencies, queueing, evictions."""
    stats, config, sched = scheduler.stats, scheduler.config, page.scheduler
    page.histogram(
        "dp_attention_token_imbalance_ratio",
        "Per MLP-sync step, max tokens over mean tokens across the DP ranks (1.0 = balanced).",
        [(sched, Histogram(IMBALANCE_BUCKETS))],
    )
    page.histogram(
        "dp_attention_sync_wait_seconds",
        "Wall time of this DP rank's scheduler MLP-sync all-gather per step.",
        [(sched, Histogram(SYNC_WAIT_BUCKETS))],
    )
    page.histogram(
        "per_stage_req_latency_seconds",
        "The latency of each stage of requests.",
        [
            ((*sched, ("stage", "request_process")), stats.request_process),
            ((*sched, ("stage", "prefill_forward")), stats.prefill_forward),
        ],
    )
    page.histogram("queue_time_seconds", "Histogram of queueing time in seconds.", [(sched, stats.queue_time)])
    evicted = scheduler.hicache.stats.evicted_tokens if scheduler.hicache is not None else stats.evicted_tokens
    if evicted:
        cache_labels = (
            ("cache_type", "UnifiedRadixCache"),
            ("dp_rank", str(config.dp_rank)),
            ("pp_rank", "0"),
            ("tp_rank", "0"),
        )
        page.histogram(
            "eviction_duration_seconds",
            "End-to-end time of a device eviction pass in seconds.",
            [(cache_labels, stats.evictions)],
        )
        page.family("evicted_tokens_total", "counter", "The number of device KV token slots freed by eviction.")
        page.sample("evicted_tokens_total", cache_labels, evicted)


def _process_metrics(page: _Page, scheduler: Scheduler, http: HttpStats | None, cpu: float) -> None:
    """Start-up phases, process CPU and the HTTP server's request counters."""
    config, tok = scheduler.config, page.tokenizer
    page.family("startup_time_seconds", "gauge", "Engine startup duration by phase in seconds.")
    for phase in STARTUP_PHASES:
        page.sample(
            "startup_time_seconds",
            (*tok[:1], tok[1], ("phase", phase)),
            config.load_time if phase == "scheduler_e2e" else 0.0,
        )
    page.family("startup_cuda_graph_time_seconds", "gauge", "CUDA graph capture duration by phase in seconds.")
    for phase in GRAPH_PHASES:
        page.sample("startup_cuda_graph_time_seconds", (*tok, ("phase", phase)), 0.0)
    page.family("process_cpu_seconds_total", "counter", "Total CPU time consumed by this process (user + system)")
    for component in ("detokenizer", "tokenizer"):
        page.sample("process_cpu_seconds_total", (("component", component),), cpu if component == "tokenizer" else 0.0)
    if http is not None:
        page.family("http_requests_total", "counter", "Total number of HTTP requests by endpoint and method")
        for (endpoint, method), count in http.requests.items():
            page.sample("http_requests_total", (("endpoint", endpoint), ("method", method)), count)
        page.family("http_responses_total", "counter", "Total number of HTTP responses by endpoint and status code")
        for (endpoint, method, status), count in http.responses.items():
            page.sample(
                "http_responses_total",
                (("endpoint", endpoint), ("method", method), ("status_code", str(status))),
                count,
            )


def _scheduler_gauges(page: _Page, scheduler: Scheduler, load: dict[str, Any], http: HttpStats | None) -> None:
    """The scheduler's gauges: queues, KV pool, memory, routing keys, active HTTP requests."""
    profile, config, sched = scheduler.profile, scheduler.config, page.scheduler
    pid = (("pid", str(os.getpid())),)
    capacity = scheduler.capacity
    page.gauge("num_retracted_reqs", "The number of retracted requests.", load["queues"]["retracted"], (*sched, *pid))
    page.gauge("num_paused_reqs", "The number of paused requests by async weight sync.", 0, (*sched, *pid))
    page.gauge("max_total_num_tokens", "Maximum total number of tokens in the KV cache pool.", capacity)
    page.gauge("weight_memory_usage_gb", "Memory used by model weights in GB.", profile.weight_gb)
    page.gauge("kv_cache_memory_usage_gb", "Memory used by the KV cache pools in GB.", load["memory"]["kv_cache_gb"])
    page.family("graph_memory_usage_gb", "gauge", "Memory used by captured device graphs in GB.")
    for phase in GRAPH_PHASES:
        page.sample("graph_memory_usage_gb", (*sched, ("phase", phase)), profile.graph_gb if phase == "decode" else 0.0)
    page.gauge("page_size", "KV cache page size in tokens.", config.page_size)
    page.gauge("num_pages", "Number of KV cache pages.", capacity // config.page_size)
    page.gauge("context_len", "Maximum context length.", config.context_length)
    page.gauge("startup_available_gpu_memory_gb", "Available GPU memory in GB at startup.", 0.0)
    running = sum(r.kv_len for r in scheduler.running)
    values = {
        "num_running_reqs": ("The number of running requests.", load["num_running_reqs"]),
        "num_queue_reqs": ("The number of requests in the waiting queue.", load["num_waiting_reqs"]),
        "num_grammar_queue_reqs": ("The number of requests in the grammar waiting queue.", 0),
        "gen_throughput": ("The generation throughput (token/s).", load["gen_throughput"]),
        "cache_hit_rate": ("The prefix cache hit rate.", load["cache_hit_rate"]),
        "decode_sum_seq_lens": ("The sum of all sequence lengths in decode.", running),
        "token_usage": ("The token usage.", round(load["token_usage"], 2)),
        "full_token_usage": ("The token usage for full attention layers.", load["token_usage"]),
        "swa_token_usage": ("The token usage for SWA layers.", 0.0),
        "mamba_usage": ("The token usage for Mamba layers.", 0.0),
        "num_used_tokens": ("The number of used tokens.", load["num_used_tokens"]),
        "kv_available_tokens": ("Number of free token slots in the KV cache pool.", scheduler.free_tokens),
        "kv_evictable_tokens": (
            "Number of evictable (radix-cached) token slots in the KV cache pool.",
            scheduler.cache.evictable_size,
        ),
        "kv_used_tokens": ("Number of actively used token slots in the KV cache pool.", load["num_used_tokens"]),
    }
    for name, (help_text, value) in values.items():
        page.gauge(name, help_text, value)
    zeros = (
        ("swa_available_tokens", "Number of free token slots in the SWA pool (hybrid-SWA only)."),
        ("swa_evictable_tokens", "Number of evictable (radix-cached) token slots in the SWA pool."),
        ("swa_used_tokens", "Number of actively used token slots in the SWA pool."),
        ("mamba_available_tokens", "Number of free state slots in the mamba SSM pool (hybrid-SSM only)."),
        ("mamba_evictable_tokens", "Number of evictable (radix-cached) state slots in the mamba SSM pool."),
        ("mamba_used_tokens", "Number of actively used state slots in the mamba SSM pool."),
        ("spec_accept_length", "Mean acceptance length of speculative decoding."),
        ("spec_accept_rate", "Speculative acceptance rate."),
        ("spec_cap_length", "Mean confidence-scheduled verify window per verify step."),
        ("spec_block_accept_length", "Mean uncapped full-block accept length per verify step."),
        ("spec_num_steps", "Currently active speculative_num_steps."),
        ("spec_num_draft_tokens", "Currently active speculative_num_draft_tokens."),
        ("num_prefill_bootstrap_queue_reqs", "The number of requests in the prefill bootstrap queue."),
        ("num_prefill_inflight_queue_reqs", "The number of requests in the prefill inflight queue."),
        ("num_decode_prealloc_queue_reqs", "The number of requests in the decode prealloc queue."),
        ("num_decode_transfer_queue_reqs", "The number of requests in the decode transfer queue."),
        ("num_decode_host_receive_queue_reqs", "Requests in the decode transfer queue receiving into host memory."),
        ("num_decode_deferred_kv_release_reqs", "Failed decode requests whose KV allocations are held pending."),
        ("pending_prealloc_token_usage", "The token usage for pending preallocated tokens (not preallocated yet)."),
        ("prealloc_full_token_usage", "Share of the full-attention KV pool held by decode requests awaiting KV."),
        ("prealloc_swa_token_usage", "Share of the SWA KV pool held by decode requests awaiting KV."),
        ("utilization", "The utilization."),
    )
    for name, help_text in zeros:
        page.gauge(name, help_text, 0.0)
    page.gauge("fwd_occupancy", "Forward pass GPU occupancy percentage.", float("nan"))
    page.gauge("new_token_ratio", "The new token ratio.", scheduler.reported_new_token_ratio)
    page.gauge("is_cuda_graph", "Whether the batch is using CUDA graph.", 0.0)
    page.gauge("num_unique_running_routing_keys", "Number of unique routing keys in running batch.", 0.0)
    for name in ("routing_key_running_req_count", "routing_key_all_req_count"):
        page.family(name, "gauge", "Distribution of routing keys by request count (gt < count <= le).")
        for gt, le in ROUTING_KEY_BUCKETS:
            page.sample(name, (*sched, ("gt", str(gt)), ("le", str(le))), 0.0)
        page.sample(name, (*sched, ("gt", "200"), ("le", "+Inf")), 0.0)
    page.gauge("routing_keys_active", "Number of unique routing keys with active requests", 0.0, ())
    if http is not None:
        page.family("http_requests_active", "gauge", "Number of currently active HTTP requests")
        for (endpoint, method), count in http.active.items():
            page.sample("http_requests_active", (("endpoint", endpoint), ("method", method)), count)


def _scheduler_counters(page: _Page, scheduler: Scheduler, cpu: float) -> None:
    """The scheduler's counters: effective prefill tokens, idle and stage time, forward passes, tokens."""
    stats, sched = scheduler.stats, page.scheduler
    page.family(
        "prefill_effective_tokens_total",
        "counter",
        "Effective prefill tokens with retracted-request re-counts excluded.",
    )
    for mode, value in (
        ("input", stats.input_tokens),
        ("device_hit", stats.cached_device_tokens),
        ("host_hit", stats.cached_host_tokens),
        ("storage_hit", stats.cached_storage_tokens),
    ):
        page.sample("prefill_effective_tokens_total", (*sched, ("mode", mode)), value)
    page.family(
        "scheduler_idle_seconds_total", "counter", "Total wall time while the scheduler has no runnable or queued work."
    )
    page.sample("scheduler_idle_seconds_total", sched, stats.idle_s)
    page.family("scheduler_process_cpu_seconds_total", "counter", "Total CPU time consumed by the scheduler process.")
    page.sample("scheduler_process_cpu_seconds_total", sched, cpu)
    page.family("scheduler_stage_seconds_total", "counter", "Total scheduler-loop wall time attributed to each stage.")
    for category in STAGE_CATEGORIES:
        seconds = stats.busy_s if category == "run_batch" else stats.idle_s if category == "idle" else 0.0
        page.sample(
            "scheduler_stage_seconds_total", (("category", category), *sched, ("forward_overlap", "none")), seconds
        )
    for name, key, values_ in (("dp_attention_tokens_total", "kind", ("scheduled", "imbalance")),
                               ("dp_attention_steps_total", "rank_state", ("active", "idle")),
                               ("dp_attention_pairs_total", "kind", ("scheduled", "imbalance"))):  # fmt: skip
        page.family(name, "counter", "MLP-sync steps of DP attention on this rank (no DP attention here).")
        for label in values_:
            page.sample(name, (*sched, (key, label)), 0.0)
    page.family("cuda_graph_passes_total", "counter", "Total number of forward passes categorized by CUDA graph.")
    page.sample("cuda_graph_passes_total", (*sched, ("mode", "prefill_none")), stats.prefill_batches)
    page.sample("cuda_graph_passes_total", (*sched, ("mode", "decode_none")), stats.decode_steps)
    page.family(
        "realtime_tokens_total",
        "counter",
        "Total number of tokens processed. mode: prefill_compute, prefill_cache, decode.",
    )
    for mode, value in (
        ("prefill_compute", stats.prefill_compute_tokens),
        ("decode", stats.generation_tokens),
        ("prefill_cache", stats.prefill_cache_tokens),
    ):
        page.sample("realtime_tokens_total", (*sched, ("mode", mode)), value)


def _scheduler_label_text(model: str, extra: str = "") -> str:
    """The scheduler's label set as text (the HiCache families below are rendered from text)."""
    escaped = _escape(model)
    return f'{{engine_type="unified",model_name="{escaped}",moe_ep_rank="0",pp_rank="0",tp_rank="0"{extra}}}'


def _histogram(
    lines: list[str], name: str, help_text: str, hist: Histogram, model: str, labels: str | None = None
) -> None:
    """A histogram; ``labels`` (the inside of ``{...}``) replaces the scheduler's label set when given."""

    def with_labels(extra: str = "") -> str:
        return _scheduler_label_text(model, extra) if labels is None else "{" + labels + extra + "}"

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


def _family(lines: list[str], name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
    lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    lines += [f"{name}{{{labels}}} {float(value)}" for labels, value in samples]


def _hicache(lines: list[str], scheduler: Scheduler, model: str) -> None:
    """The host tier's figures, under SGLang 0.5.23's names (present only with HiCache on)."""
    cache = scheduler.hicache
    assert cache is not None
    stats = scheduler.stats
    base = _scheduler_label_text(model)[1:-1]
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

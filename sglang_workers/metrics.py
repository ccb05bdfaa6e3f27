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


def _histogram(lines: list[str], name: str, help_text: str, hist: Histogram, model: str) -> None:
    lines.append(f"# HELP {name} {help_text}")
    lines.append(f"# TYPE {name} histogram")
    cumulative = 0
    for bound, count in zip(hist.buckets, hist.counts):
        cumulative += count
        le = f',le="{bound}"'
        lines.append(f"{name}_bucket{_labels(model, le)} {cumulative}")
    inf = ',le="+Inf"'
    lines.append(f"{name}_bucket{_labels(model, inf)} {hist.count}")
    lines.append(f"{name}_sum{_labels(model)} {hist.sum}")
    lines.append(f"{name}_count{_labels(model)} {hist.count}")


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
    counter("cached_tokens_total", "Number of cached prompt tokens.", stats.cached_tokens)
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
    return "\n".join(lines) + "\n"

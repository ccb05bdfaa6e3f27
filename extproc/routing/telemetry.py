"""Observability of routing, kept out of the routing code: one span per decision, Prometheus metrics.

Spans carry what explains a decision (model, prompt tokens, blocks, per-candidate matched blocks,
load and predicted cost, the chosen worker, the reason, the decision time) and never prompt text.
Their W3C ``traceparent`` goes to the worker on the upstream request, so a worker's own spans join
the router's trace. Counters that the sync path keeps (``extproc.sync.cache_view.ViewStats``) and the
index sizes are read at scrape time by a collector instead of being pushed on the hot path.

Every metric lives in the ``CollectorRegistry`` a ``Telemetry`` is given (``prefix-router serve``
serves that one on its metrics port); nothing is registered globally at import time, so several
routers in one process (tests, benchmarks) never share or collide.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from extproc.config import ConfigError, ObservabilityConfig
from extproc.decision.policies import Candidate, Decision, RoutingRequest
from extproc.fleet.index import TIERS, BlockIndex, rank_key
from extproc.fleet.info import dp_size
from extproc.fleet.workers import WorkerRegistry
from extproc.sync.hub import EventHub

__all__ = ["FleetCollector", "MemoryCollector", "Telemetry"]

_propagator = TraceContextTextMapPropagator()

_EVENT_COUNTERS = (
    ("batches", "Event batches applied."),
    ("blocks_stored", "Blocks stored by events."),
    ("blocks_removed", "Blocks removed by events."),
    ("gaps", "Sequence gaps detected."),
    ("gaps_repaired", "Gaps repaired through replay."),
    ("restarts", "Worker restarts detected (seq went back)."),
    ("orphans", "Stored blocks whose parent was unknown."),
    ("decode_errors", "Undecodable batches."),
)


class FleetCollector(Collector):
    """Index, event-stream and worker figures of one router's fleet, read at scrape time."""

    def __init__(self, workers: WorkerRegistry, index: BlockIndex, events: EventHub) -> None:
        self.workers = workers
        self.index = index
        self.events = events

    def collect(self) -> Iterator[Any]:
        blocks = GaugeMetricFamily(
            "prefix_router_index_blocks",
            "Confirmed blocks in the index per worker, data-parallel rank and tier.",
            labels=["worker", "dp_rank", "tier"],
        )
        synced = GaugeMetricFamily(
            "prefix_router_index_synced",
            "1 when the rank's index state is known from events.",
            labels=["worker", "dp_rank"],
        )
        rank_in_flight = GaugeMetricFamily(
            "prefix_router_rank_in_flight",
            "Requests the router has in flight on each data-parallel rank it pinned (multi-rank workers).",
            labels=["worker", "dp_rank"],
        )
        lag = GaugeMetricFamily(
            "prefix_router_event_lag_seconds", "Publish-to-apply delay of the last event batch.", labels=["worker"]
        )
        healthy = GaugeMetricFamily(
            "prefix_router_worker_healthy", "1 when the worker is a routing candidate.", labels=["worker"]
        )
        in_flight = GaugeMetricFamily(
            "prefix_router_worker_in_flight", "Requests the router has in flight there.", labels=["worker"]
        )
        shared = GaugeMetricFamily(
            "prefix_router_index_shared_blocks",
            "Blocks credited to a storage tier shared by a group of HiCache workers.",
            labels=["group"],
        )
        for group in self.index.shared_groups():
            shared.add_metric([group], self.index.shared_size(group))
        counters = {
            name: CounterMetricFamily(f"prefix_router_event_{name}", help_, labels=["worker"])
            for name, help_ in _EVENT_COUNTERS
        }
        for worker in self.workers.workers:
            wid = worker.id
            ranks = dp_size(worker)
            for rank in range(ranks):
                label = str(rank)
                for tier in TIERS:
                    blocks.add_metric([wid, label, tier], self.index.size(rank_key(wid, rank), tier))
                synced.add_metric([wid, label], 1.0 if self.events.rank_state(worker, rank) == "synced" else 0.0)
                if ranks > 1:
                    rank_in_flight.add_metric([wid, label], worker.rank_in_flight.get(rank, 0))
            healthy.add_metric([wid], 1.0 if worker.healthy else 0.0)
            in_flight.add_metric([wid], worker.in_flight)
            stats = self.events.stats(worker)
            if stats:
                lag.add_metric([wid], max(s.lag_s for s in stats))
            for name, family in counters.items():
                family.add_metric([wid], sum(getattr(s, name) for s in stats))
        yield from (blocks, shared, synced, rank_in_flight, lag, healthy, in_flight, *counters.values())


class MemoryCollector(Collector):
    """``memory.budget_bytes`` by part: estimated bytes held and the part's limit."""

    def __init__(self, usage: Callable[[], dict[str, int]], limits: dict[str, int]) -> None:
        self.usage = usage
        self.limits = limits

    def collect(self) -> Iterator[Any]:
        held = GaugeMetricFamily(
            "prefix_router_memory_bytes", "Estimated bytes each cache of the router holds.", labels=["part"]
        )
        limit = GaugeMetricFamily(
            "prefix_router_memory_limit_bytes",
            "Bytes each cache may hold: its share of memory.budget_bytes.",
            labels=["part"],
        )
        for part, value in self.usage().items():
            held.add_metric([part], value)
        for part, value in self.limits.items():
            limit.add_metric([part], value)
        yield from (held, limit)


def _exporter(config: ObservabilityConfig) -> SpanExporter | None:
    if config.exporter == "none":
        return None
    if config.exporter == "console":
        return ConsoleSpanExporter()
    try:
        if config.exporter == "otlp-grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

            return GrpcExporter(endpoint=config.otlp_endpoint) if config.otlp_endpoint else GrpcExporter()
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        return HttpExporter(endpoint=config.otlp_endpoint) if config.otlp_endpoint else HttpExporter()
    except ImportError as exc:  # a broken install must say so at start-up, not per request
        raise ConfigError(f"observability.exporter={config.exporter} needs the OTLP exporter package: {exc}") from exc


class Telemetry:
    """Per-router tracer (own provider, so tests and several routers never share global state)."""

    def __init__(self, config: ObservabilityConfig, policy_name: str, metrics: CollectorRegistry | None = None) -> None:
        self.config = config
        self.policy_name = policy_name
        if metrics is None:  # a registry of its own, with the process figures a scrape expects
            metrics = CollectorRegistry()
            for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
                metrics.register(collector)
        self.metrics = metrics
        self._decisions = Counter(
            "prefix_router_decisions_total",
            "Routing decisions by policy and reason.",
            ["policy", "reason"],
            registry=metrics,
        )
        self._fell_back = Counter(
            "prefix_router_served_elsewhere_total",
            "Requests Envoy served on another endpoint than the router's primary (its fallbacks); accounting moved.",
            registry=metrics,
        )
        self._decision_seconds = Histogram(
            "prefix_router_decision_seconds",
            "Time to make one routing decision (tokenize, hash, look up, choose).",
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25),
            registry=metrics,
        )
        self._matched_blocks = Histogram(
            "prefix_router_matched_blocks",
            "Leading prompt blocks the chosen worker holds.",
            buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096),
            registry=metrics,
        )
        self._tier_blocks = Counter(
            "prefix_router_matched_tier_blocks_total",
            "Leading prompt blocks the chosen worker holds, by tier: gpu, host (its host memory, HiCache), "
            "shared (a storage tier it shares with other workers).",
            ["policy", "tier"],
            registry=metrics,
        )
        self._prompt_tokens = Histogram(
            "prefix_router_prompt_tokens",
            "Prompt length of routed requests, in tokens.",
            buckets=(64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072),
            registry=metrics,
        )
        self._pd_routed = Counter(
            "prefix_router_pd_routed_total",
            "Disaggregated requests by the part each worker played in the pair (role: prefill | decode).",
            ["role", "worker"],
            registry=metrics,
        )
        self._pd_prefill_failures = Counter(
            "prefix_router_pd_prefill_failures_total",
            "Prefill legs that failed, by reason: refused | reset | status | timeout (retried: before the "
            "client's request went anywhere, so the pair was tried again).",
            ["reason", "retried"],
            registry=metrics,
        )
        self._pd_decode_aborts = Counter(
            "prefix_router_pd_decode_aborts_total",
            "Decode sides aborted (/abort_request) after their prefill leg failed, by whether the worker accepted.",
            ["accepted"],
            registry=metrics,
        )
        self._pd_decode_lost = Counter(
            "prefix_router_pd_decode_lost_total",
            "Pairs failed because every decode endpoint given to Envoy went down before decode answered.",
            registry=metrics,
        )
        self._pd_skipped = Counter(
            "prefix_router_pd_skipped_total",
            "Requests on a PD fleet served by an aggregated worker because little of the prompt was uncached "
            "(pd.aggregate_below_tokens).",
            registry=metrics,
        )
        self._ready = Gauge(
            "prefix_router_ready",
            "1 while the router takes requests (workers resolved, health checks and KV-event sync started), "
            "0 while it starts or shuts down: what its gRPC readiness service says.",
            registry=metrics,
        )
        # Per chosen worker (before any fallback): its traffic, and the share of it the router expected cached.
        self._routed = Counter(
            "prefix_router_routed_total",
            "Requests routed, by the worker the router chose.",
            ["worker"],
            registry=metrics,
        )
        self._routed_tokens = Counter(
            "prefix_router_routed_tokens_total",
            "Prompt tokens of the tokenized requests routed, by the worker the router chose.",
            ["worker"],
            registry=metrics,
        )
        self._matched_tokens = Counter(
            "prefix_router_matched_tokens_total",
            "Leading prompt tokens the chosen worker held in any tier as the router's index saw it (the hit it "
            "predicted), by worker; over prefix_router_routed_tokens_total it is the predicted hit rate.",
            ["worker"],
            registry=metrics,
        )
        self._first_byte = Histogram(
            "prefix_router_time_to_first_byte_seconds",
            "From the request reaching the router to the worker's response headers, by the worker that served and "
            "whether the request streamed. SGLang's OpenAI endpoints send a stream's headers with its first token, "
            "so stream=true is the TTFT the router sees (its queue and decision included); unstreamed, the whole "
            "request.",
            ["worker", "stream"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
            registry=metrics,
        )
        self._tokenize_failures = Counter(
            "prefix_router_tokenize_failures_total",
            "Requests routed without tokens because tokenization failed.",
            ["model"],
            registry=metrics,
        )
        self.provider = TracerProvider(resource=Resource.create({"service.name": config.service_name}))
        self.tracer = self.provider.get_tracer("extproc.routing.router")
        # With no exporter a span would be built, filled and dropped on every request (~0.1 ms):
        # skip it, and leave the client's own trace context to reach the worker untouched.
        self.tracing = False
        exporter = _exporter(config)
        if exporter is not None:
            self.add_span_processor(BatchSpanProcessor(exporter))

    def add_span_processor(self, processor: SpanProcessor) -> None:
        """Send decision spans to ``processor`` too (the configured exporter, or a test's)."""
        self.provider.add_span_processor(processor)
        self.tracing = True

    def watch_memory(self, usage: Callable[[], dict[str, int]], limits: dict[str, int]) -> None:
        """Report what each part of the memory budget holds, and its limit."""
        self.metrics.register(MemoryCollector(usage, limits))

    def watch_fleet(self, workers: WorkerRegistry, index: BlockIndex, events: EventHub) -> None:
        """Report the fleet's index, event and worker figures with this router's metrics."""
        self.metrics.register(FleetCollector(workers, index, events))

    def decision(
        self,
        *,
        model: str,
        path: str,
        headers: Mapping[str, str],
        request: RoutingRequest,
        candidates: Sequence[Candidate],
        decision: Decision,
        start_ns: int,
        end_ns: int,
        blocks: int,
        tokenized: bool,
        queue_wait_s: float = 0.0,
        decode: Decision | None = None,
    ) -> dict[str, str]:
        """Record one decision; returns the headers that carry its trace context upstream (none untraced).

        ``decode``: on a disaggregated fleet, the decode side's ranking (``decision`` ranked the prefill workers).
        """
        elapsed = (end_ns - start_ns) / 1e9
        reason = decision.reason
        self._decisions.labels(self.policy_name, reason).inc()
        self._decision_seconds.observe(elapsed)
        chosen = decision.ranked[0]
        winner = next((c for c in candidates if c.worker is chosen), None)
        self._matched_blocks.observe(winner.matched_blocks if winner else 0)
        tier_blocks = winner.tier_blocks if winner else {"gpu": 0, "host": 0, "shared": 0}
        for tier, count in tier_blocks.items():
            if count:
                self._tier_blocks.labels(self.policy_name, tier).inc(count)
        self._routed.labels(chosen.id).inc()
        if request.token_ids is not None:
            tokens = len(request.token_ids)
            self._prompt_tokens.observe(tokens)
            self._routed_tokens.labels(chosen.id).inc(tokens)
            held = sum(tier_blocks.values()) * (winner.block_size if winner else 0)
            if held:
                self._matched_tokens.labels(chosen.id).inc(min(held, tokens))
        if decode is not None:
            self._pd_routed.labels("prefill", chosen.id).inc()
            self._pd_routed.labels("decode", decode.ranked[0].id).inc()
        if not self.tracing:
            return {}
        parent = _propagator.extract(headers) if "traceparent" in headers else None
        span = self.tracer.start_span("route", context=parent, start_time=start_ns, kind=trace.SpanKind.INTERNAL)
        ids = [c.worker.id for c in candidates]
        scores = decision.scores
        span.set_attributes(
            {
                "router.policy": self.policy_name,
                "router.model": model,
                "router.path": path,
                "router.tokenized": tokenized,
                "router.prompt_tokens": request.prompt_tokens,
                "router.blocks": blocks,
                "router.block_size": request.block_size,
                "router.reason": reason,
                "router.chosen": chosen.id,
                "router.chosen_endpoint": chosen.endpoint,
                "router.decision_ms": elapsed * 1000,
                "router.queue_wait_ms": queue_wait_s * 1000,
                "router.candidates": ids,
                "router.candidates.matched_blocks": [c.matched_blocks for c in candidates],
                "router.candidates.host_blocks": [c.tier_blocks["host"] for c in candidates],
                "router.candidates.shared_blocks": [c.tier_blocks["shared"] for c in candidates],
                "router.chosen.gpu_blocks": tier_blocks["gpu"],
                "router.chosen.host_blocks": tier_blocks["host"],
                "router.chosen.shared_blocks": tier_blocks["shared"],
                "router.candidates.in_flight": [c.in_flight for c in candidates],
                "router.candidates.waiting": [c.load.num_waiting_reqs if c.load else -1 for c in candidates],
                "router.candidates.kv_usage": [c.load.token_usage if c.load else -1.0 for c in candidates],
                "router.candidates.index_state": [c.index_state for c in candidates],
                "router.candidates.predicted_ttft_s": [float(scores.get(i, {}).get("ttft_s", -1.0)) for i in ids],
            }
        )
        if decode is not None:
            decode_ids = [w.id for w in decode.ranked]
            span.set_attributes(
                {
                    "router.pd.prefill": chosen.id,
                    "router.pd.prefill_reason": reason,
                    "router.pd.decode": decode.ranked[0].id,
                    "router.pd.decode_endpoint": decode.ranked[0].endpoint,
                    "router.pd.decode_reason": decode.reason,
                    "router.pd.decode_candidates": decode_ids,
                    "router.pd.decode_candidates.in_flight": [
                        float(decode.scores.get(i, {}).get("in_flight", -1.0)) for i in decode_ids
                    ],
                    "router.pd.decode_candidates.queue": [
                        float(decode.scores.get(i, {}).get("decode_queue", -1.0)) for i in decode_ids
                    ],
                }
            )
        span.end(end_time=end_ns)
        carrier: dict[str, str] = {}
        _propagator.inject(carrier, context=trace.set_span_in_context(span))
        return carrier

    def set_ready(self, ready: bool) -> None:
        """The router's readiness changed (``prefix-router serve`` sets it with its gRPC readiness service)."""
        self._ready.set(1.0 if ready else 0.0)

    def first_byte(self, worker: str, stream: bool, seconds: float) -> None:
        """The response headers of a routed request arrived from ``worker``, ``seconds`` after its request."""
        self._first_byte.labels(worker, "true" if stream else "false").observe(seconds)

    def fell_back(self) -> None:
        """Envoy served a request on a fallback endpoint (read from the response's served-endpoint metadata)."""
        self._fell_back.inc()

    def prefill_failed(self, reason: str, retried: bool) -> None:
        """A prefill leg failed (``retried``: refused before anything was sent, so a new pair was tried)."""
        self._pd_prefill_failures.labels(reason, "true" if retried else "false").inc()

    def decode_aborted(self, accepted: bool) -> None:
        """The router aborted a decode side whose prefill leg failed."""
        self._pd_decode_aborts.labels("true" if accepted else "false").inc()

    def decode_lost(self) -> None:
        """A pair failed: its decode endpoints went down before the decode side answered."""
        self._pd_decode_lost.inc()

    def pd_skipped(self) -> None:
        """A request of a PD fleet went to an aggregated worker: its uncached part was short."""
        self._pd_skipped.inc()

    def tokenize_failed(self, model: str) -> None:
        self._tokenize_failures.labels(model or "default").inc()

    def shutdown(self) -> None:
        self.provider.shutdown()

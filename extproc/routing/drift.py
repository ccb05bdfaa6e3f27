"""Index drift, measured: the cached prompt tokens the router predicted against what the engine reports.

The router routes on its index of every worker's KV cache; when that index drifts from the caches
(events lost or cut, a worker that flushed, a wrong page size) decisions go wrong silently. For a
sampled share of requests (``observability.drift_sample_rate``) the exchange reads the engine's own
``cached_tokens`` out of the response (``extproc.exchange.usage``) and hands it here, where it is set
against the prediction for the worker that served: its longest indexed match, in whole pages of the
prompt (``Candidate.predicted_cached_tokens``). Unsampled requests are never read: Envoy sends their
response bodies nowhere.

Per worker, as counters read at scrape time (docs/routing.md, "Index drift"): samples, predicted and
served cached tokens (their sums), samples that differ by more than one page, and samples without
figures; every worker of the fleet has its series from 0, so a rate or a ratio exists before the first
mismatch. A short span ``drift``, a child of the decision's span, carries the same figures, and the
decision's record in the debug view gains them. Sampling only reads: it never changes what the router
chooses, and it never fails a request.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass

from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from extproc.decision.pipeline import RouteOutcome
from extproc.decision.request import ParsedRequest
from extproc.fleet.workers import WorkerRegistry
from extproc.routing.decision_log import DecisionLog
from extproc.routing.telemetry import Telemetry

__all__ = ["DriftMeter", "DriftSample", "reports_usage"]

log = logging.getLogger(__name__)

_propagator = TraceContextTextMapPropagator()


def reports_usage(parsed: ParsedRequest) -> bool:
    """Whether the response will carry the engine's cached tokens for this one prompt.

    ``/generate`` always does (``meta_info``); an OpenAI answer does unless it streams without
    ``stream_options.include_usage``. Batches and ``n`` > 1 report several prompts' figures together
    and are not sampled.
    """
    return parsed.single and (parsed.kind == "generate" or not parsed.stream or parsed.stream_usage)


@dataclass(frozen=True)
class DriftSample:
    """One sampled response: the prediction, the engine's report, and whether they differ by over a page."""

    worker: str
    predicted: int
    served: int
    page: int
    prompt_tokens: int
    served_prompt_tokens: int | None

    @property
    def mismatched(self) -> bool:
        return abs(self.predicted - self.served) > self.page


# name (prometheus_client adds ``_total``), help: one counter per worker each.
_FAMILIES = (
    (
        "prefix_router_drift_samples",
        "Sampled responses whose engine-reported cached_tokens was compared with the router's prediction.",
    ),
    (
        "prefix_router_predicted_cached_tokens",
        "Cached prompt tokens the router predicted on the worker that served, summed over sampled requests.",
    ),
    (
        "prefix_router_served_cached_tokens",
        "Cached prompt tokens the engine reported (usage / meta_info cached_tokens), same sampled requests.",
    ),
    (
        "prefix_router_drift_mismatched",
        "Sampled requests whose predicted and reported cached tokens differ by more than one page.",
    ),
    (
        "prefix_router_drift_unread",
        "Sampled responses that carried no cached_tokens (an engine without --enable-cache-report, an error).",
    ),
)
_SAMPLES, _PREDICTED, _SERVED, _MISMATCHED, _UNREAD = range(len(_FAMILIES))
_KEYS = ("samples", "predicted_cached_tokens", "served_cached_tokens", "mismatched", "unread")


class _Counts(Collector):
    """The meter's counters at scrape time: every worker of the fleet has its series, from zero."""

    def __init__(self, counts: dict[str, list[float]], workers: WorkerRegistry | None) -> None:
        self.counts = counts
        self.workers = workers

    def collect(self) -> Iterator[CounterMetricFamily]:
        ids = dict.fromkeys(w.id for w in self.workers.workers) if self.workers is not None else {}
        ids.update(dict.fromkeys(self.counts))  # a worker that left keeps what it counted
        zero = [0.0] * len(_FAMILIES)
        for i, (name, help_) in enumerate(_FAMILIES):
            family = CounterMetricFamily(name, help_, labels=["worker"])
            for wid in ids:
                family.add_metric([wid], self.counts.get(wid, zero)[i])
            yield family


class DriftMeter:
    """Chooses the sampled requests and counts what their responses showed, per worker."""

    def __init__(
        self,
        rate: float,
        telemetry: Telemetry,
        decisions: DecisionLog,
        workers: WorkerRegistry | None = None,
        rng: random.Random | None = None,
    ) -> None:
        """``workers``: the fleet, whose every worker gets its series at 0 before its first sample."""
        self.rate = rate
        self.telemetry = telemetry
        self.decisions = decisions
        self._rng = rng or random.Random()  # its own: sampling never moves the process's random state
        self._counts: dict[str, list[float]] = {}  # worker id -> the _FAMILIES' values
        telemetry.metrics.register(_Counts(self._counts, workers))

    def counts(self, worker_id: str) -> dict[str, int]:
        """One worker's counters so far (zeros before its first sample), for the debug view."""
        values = self._counts.get(worker_id, [0.0] * len(_FAMILIES))
        return {key: int(value) for key, value in zip(_KEYS, values)}

    def sample(self, outcome: RouteOutcome, reports: bool) -> bool:
        """Whether to read this request's response (``reports``: it will carry usage, ``reports_usage``).

        A disaggregated decision is not sampled: its prefix was matched on the prefill worker, its
        response comes from the decode worker.
        """
        rate = self.rate
        if rate <= 0 or not reports or outcome.prefill is not None:
            return False
        return rate >= 1 or self._rng.random() < rate

    def observe(self, outcome: RouteOutcome, reported_cached: int | None, reported_prompt: int | None) -> None:
        """Count one sampled response (``reported_cached`` None: it carried no figures). Never raises."""
        try:
            self._observe(outcome, reported_cached, reported_prompt)
        except Exception:  # a bookkeeping bug must not cost the request anything
            log.exception("drift sample of %s failed", outcome.worker.id)

    def _observe(self, outcome: RouteOutcome, reported_cached: int | None, reported_prompt: int | None) -> None:
        worker = outcome.worker
        counts = self._counts.setdefault(worker.id, [0.0] * len(_FAMILIES))
        if reported_cached is None:
            counts[_UNREAD] += 1
            return
        candidate = next((c for c in outcome.candidates if c.worker is worker), None)
        if candidate is None:  # Envoy fell back to a worker the decision never scored
            return
        prompt_tokens = outcome.request.prompt_tokens
        sample = DriftSample(
            worker=worker.id,
            predicted=candidate.predicted_cached_tokens(prompt_tokens),
            served=reported_cached,
            page=max(candidate.block_size, 1),
            prompt_tokens=prompt_tokens,
            served_prompt_tokens=reported_prompt,
        )
        counts[_SAMPLES] += 1
        counts[_PREDICTED] += sample.predicted
        counts[_SERVED] += sample.served
        counts[_MISMATCHED] += sample.mismatched
        record = self.decisions.find(outcome.request_id)
        if record is not None:
            record.served = {
                "worker": worker.id,
                "predicted_cached_tokens": sample.predicted,
                "cached_tokens": sample.served,
                "prompt_tokens": reported_prompt,
                "mismatched": sample.mismatched,
            }
        self._span(outcome, sample)

    def _span(self, outcome: RouteOutcome, sample: DriftSample) -> None:
        """A short ``drift`` span under the decision's (the decision span ended when Envoy was answered)."""
        telemetry = self.telemetry
        if not telemetry.tracing:
            return
        parent = _propagator.extract(outcome.upstream_headers) if "traceparent" in outcome.upstream_headers else None
        now = time.time_ns()
        span = telemetry.tracer.start_span("drift", context=parent, start_time=now)
        attributes: dict[str, str | int | bool] = {
            "router.drift.worker": sample.worker,
            "router.drift.predicted_cached_tokens": sample.predicted,
            "router.drift.served_cached_tokens": sample.served,
            "router.drift.mismatch": sample.mismatched,
            "router.drift.page_size": sample.page,
            "router.drift.prompt_tokens": sample.prompt_tokens,
        }
        if sample.served_prompt_tokens is not None:
            attributes["router.drift.served_prompt_tokens"] = sample.served_prompt_tokens
        span.set_attributes(attributes)
        span.end(end_time=now)

"""The drift meter: which requests it samples, what it counts, the span it leaves, the record it completes."""

from __future__ import annotations

import random

from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import generate_latest

from extproc.config import EventsConfig, ObservabilityConfig, RouterConfig
from extproc.decision.pipeline import RouteOutcome
from extproc.decision.policies import Candidate
from extproc.decision.request import ParsedRequest
from extproc.fleet.workers import Worker, WorkerRegistry
from extproc.routing.decision_log import DecisionLog
from extproc.routing.drift import DriftMeter
from extproc.routing.telemetry import Telemetry
from extproc.serving.app import RouterApp

PROMPT = ParsedRequest(
    path="/v1/chat/completions",
    kind="chat",
    model="m",
    messages=[{"role": "system", "content": "You are terse. " * 60}, {"role": "user", "content": "hi"}],
    headers={"x-request-id": "req-1"},
)


def _workers(n: int) -> list[Worker]:
    return [Worker(id=f"w{i}", url=f"http://127.0.0.1:{42100 + i}", ip="127.0.0.1", port=42100 + i) for i in range(n)]


def _counter(app: RouterApp, name: str, worker: str) -> float:
    text = generate_latest(app.telemetry.metrics).decode()
    line = next((s for s in text.splitlines() if s.startswith(f'{name}{{worker="{worker}"}}')), None)
    return float(line.rsplit(" ", 1)[1]) if line else 0.0


def test_predicted_cached_tokens_are_whole_pages_short_of_the_last_token() -> None:
    worker = _workers(1)[0]
    c = Candidate(worker=worker, matched_blocks=4, host_matched_blocks=6, block_size=16)
    assert c.predicted_cached_tokens(200) == 96  # the host tier is loaded back: it counts
    assert c.predicted_cached_tokens(97) == 96  # 96 full pages' worth before the last token
    assert c.predicted_cached_tokens(96) == 80  # the last token is always computed: its page is not cached
    assert c.predicted_cached_tokens(0) == 0


def test_sampling_follows_the_rate_and_skips_what_cannot_be_compared() -> None:
    telemetry = Telemetry(ObservabilityConfig(), "prefix-aware")
    never = DriftMeter(0.0, telemetry, DecisionLog(0))
    some = DriftMeter(0.25, Telemetry(ObservabilityConfig(), "prefix-aware"), DecisionLog(0), rng=random.Random(1))
    app = RouterApp(RouterConfig(events=EventsConfig(enabled=False)), WorkerRegistry(_workers(2)))
    outcome = app.router.route(PROMPT)
    assert not never.sample(outcome, True)
    assert not some.sample(outcome, False)  # the response will not report usage
    share = sum(some.sample(outcome, True) for _ in range(4000)) / 4000
    assert 0.22 < share < 0.28
    paired = RouteOutcome(outcome.request, outcome.decision, outcome.worker, prefill=outcome)
    every = DriftMeter(1.0, Telemetry(ObservabilityConfig(), "prefix-aware"), DecisionLog(0))
    assert every.sample(outcome, True)
    assert not every.sample(paired, True)  # PD: matched on the prefill worker, answered by the decode one


def test_a_sample_is_counted_traced_and_added_to_its_decisions_record() -> None:
    app = RouterApp(RouterConfig(events=EventsConfig(enabled=False)), WorkerRegistry(_workers(2)))
    spans = InMemorySpanExporter()
    app.telemetry.add_span_processor(SimpleSpanProcessor(spans))
    first = app.router.route(PROMPT)
    app.router.finish(first)
    second = app.router.route(PROMPT)  # the same prompt: predicted on its holder from the router's record
    holder = second.worker.id
    predicted = next(c for c in second.candidates if c.worker is second.worker).predicted_cached_tokens(
        second.request.prompt_tokens
    )
    assert second.worker is first.worker and predicted > 16
    meter = app.router.drift
    assert meter is not None
    meter.observe(second, predicted - 16, second.request.prompt_tokens)  # one page off: not a mismatch
    meter.observe(second, 0, None)  # the engine had none of it
    meter.observe(second, None, None)  # no figures in the response
    assert _counter(app, "prefix_router_drift_samples_total", holder) == 2
    assert _counter(app, "prefix_router_predicted_cached_tokens_total", holder) == 2 * predicted
    assert _counter(app, "prefix_router_served_cached_tokens_total", holder) == predicted - 16
    assert _counter(app, "prefix_router_drift_mismatched_total", holder) == 1
    assert _counter(app, "prefix_router_drift_unread_total", holder) == 1
    assert meter.counts(holder) == {
        "samples": 2,
        "predicted_cached_tokens": 2 * predicted,
        "served_cached_tokens": predicted - 16,
        "mismatched": 1,
        "unread": 1,
    }
    other = next(w.id for w in app.registry.workers if w.id != holder)
    text = generate_latest(app.telemetry.metrics).decode()
    for name in ("samples", "mismatched", "unread"):  # every worker's series exists from 0: rates and ratios work
        assert f'prefix_router_drift_{name}_total{{worker="{other}"}} 0.0' in text
    drift = [s for s in spans.get_finished_spans() if s.name == "drift"]
    route = [s for s in spans.get_finished_spans() if s.name == "route"]
    assert len(drift) == 2 and drift[-1].parent is not None
    assert drift[-1].parent.span_id == route[-1].context.span_id  # a child of the decision's span
    assert drift[-1].attributes is not None
    assert drift[-1].attributes["router.drift.predicted_cached_tokens"] == predicted
    assert drift[-1].attributes["router.drift.served_cached_tokens"] == 0
    assert drift[-1].attributes["router.drift.mismatch"] is True
    record = app.router.decisions.find("req-1")
    assert record is not None and record.served is not None
    assert record.served["cached_tokens"] == 0 and record.served["mismatched"] is True
    assert record.to_json()["predicted_cached_tokens"] == predicted

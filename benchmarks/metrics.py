"""Per-request results -> one contender's figures (the JSON schema of ``prefix-router bench``)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from benchmarks.stats import bootstrap_intervals, distribution

__all__ = ["FleetFigures", "RequestResult", "Summary", "failed", "max_over_mean", "summarize"]


@dataclass
class RequestResult:
    """What the client saw for one request. Times are seconds since the run started."""

    index: int
    sent_s: float
    ttft_s: float | None = None  # first content chunk - send
    e2e_s: float | None = None  # last byte - send
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    upstream: str | None = None  # worker that served it, when the gateway says (x-upstream-host)
    error: str | None = None


@dataclass
class FleetFigures:
    """What the workers themselves counted over a run (summed over the cluster)."""

    prompt_tokens: int = 0
    cached_tokens: dict[str, int] = field(default_factory=dict)  # by tier: device, host, storage
    busy_prefill_s: float = 0.0  # simulated GPU seconds spent in prefill batches
    busy_decode_s: float = 0.0  # ... and in decode steps

    @property
    def gpu_seconds(self) -> float:
        return self.busy_prefill_s + self.busy_decode_s

    def hit_rate(self, source: str) -> float:
        return self.cached_tokens.get(source, 0) / self.prompt_tokens if self.prompt_tokens else float("nan")

    def to_json(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": dict(self.cached_tokens),
            "busy_prefill_s": self.busy_prefill_s,
            "busy_decode_s": self.busy_decode_s,
        }


@dataclass
class Summary:
    """One contender's figures at one offered load."""

    name: str
    rate: float | None
    requests: int
    errors: int
    ttft_s: dict[str, float]
    e2e_s: dict[str, float]
    output_tok_s: float
    hit_rate: float
    requests_per_worker: dict[str, int]
    max_mean_requests: float
    duration_s: float
    error_samples: list[str] = field(default_factory=list)
    start_error: str | None = None  # the contender could not start: every figure is NaN
    fleet: FleetFigures | None = None  # what the workers counted (tokens by tier, GPU seconds), if they said
    # Time per output token after the first, per request: (e2e - TTFT) / (output tokens - 1), its mean ITL.
    tpot_s: dict[str, float] = field(default_factory=lambda: distribution([]))
    # 95% percentile-bootstrap intervals [low, high] of the TTFT p50, p99 and mean (``bootstrap_intervals``).
    ttft_ci_s: dict[str, list[float]] = field(default_factory=lambda: bootstrap_intervals([]))

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "rate": self.rate,
            "requests": self.requests,
            "errors": self.errors,
            "ttft_s": self.ttft_s,
            "e2e_s": self.e2e_s,
            "output_tok_s": self.output_tok_s,
            "hit_rate": self.hit_rate,
            "max_mean_requests": self.max_mean_requests,
            "requests_per_worker": self.requests_per_worker,
            "duration_s": self.duration_s,
            "error_samples": self.error_samples,
            "start_error": self.start_error,
            "fleet": self.fleet.to_json() if self.fleet is not None else None,
            "tpot_s": self.tpot_s,
            "ttft_ci95_s": self.ttft_ci_s,
        }


def max_over_mean(counts: Mapping[str, int], workers: int) -> float:
    """Busiest worker's request count over the mean; workers that got nothing count as 0."""
    total = sum(counts.values())
    if total == 0 or workers <= 0:
        return math.nan
    values = list(counts.values()) + [0] * max(0, workers - len(counts))
    return max(values) / (total / workers)


def summarize(
    name: str,
    rate: float | None,
    results: Sequence[RequestResult],
    requests_per_worker: Mapping[str, int],
    workers: int,
) -> Summary:
    """Aggregate one run. Hit rate is cached prompt tokens / prompt tokens over successful requests."""
    ok = [r for r in results if r.error is None]
    errors = [r for r in results if r.error is not None]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    e2es = [r.e2e_s for r in ok if r.e2e_s is not None]
    tpots = [
        (r.e2e_s - r.ttft_s) / (r.output_tokens - 1)
        for r in ok
        if r.e2e_s is not None and r.ttft_s is not None and r.output_tokens > 1
    ]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    if ok:
        start = min(r.sent_s for r in ok)
        end = max(r.sent_s + (r.e2e_s or 0.0) for r in ok)
        duration = max(end - start, 1e-9)
    else:
        duration = 0.0
    out_tokens = sum(r.output_tokens for r in ok)
    samples = sorted({r.error for r in errors if r.error})[:5]
    return Summary(
        name=name,
        rate=rate,
        requests=len(results),
        errors=len(errors),
        ttft_s=distribution(ttfts),
        e2e_s=distribution(e2es),
        output_tok_s=out_tokens / duration if duration else math.nan,
        hit_rate=cached / prompt if prompt else math.nan,
        requests_per_worker=dict(sorted(requests_per_worker.items())),
        max_mean_requests=max_over_mean(requests_per_worker, workers),
        duration_s=duration,
        error_samples=samples,
        tpot_s=distribution(tpots),
        ttft_ci_s=bootstrap_intervals(ttfts),
    )


def failed(name: str, rate: float | None, reason: str) -> Summary:
    """The row of a contender that could not start: reported, never dropped."""
    nan = distribution([])
    return Summary(
        name=name,
        rate=rate,
        requests=0,
        errors=0,
        ttft_s=nan,
        e2e_s=dict(nan),
        output_tok_s=math.nan,
        hit_rate=math.nan,
        requests_per_worker={},
        max_mean_requests=math.nan,
        duration_s=0.0,
        start_error=reason,
    )

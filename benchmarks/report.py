"""The routing suite's results -> a Markdown table, a JSON file and PNG plots (and the figure formats others use).

Ratios are taken against the round-robin baseline (``envoy-rr``, else ``ours:round-robin``) and
against ``sgl-router`` at the same offered load, so a row reads "x times the baseline's TTFT".
The hit-rate column is also given as a fraction of the pooled-cache oracle.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.metrics import Summary

__all__ = [
    "BenchReport",
    "fmt",
    "json_safe",
    "markdown_table",
    "ms",
    "ms_with_interval",
    "plot_ttft_cdf",
    "plot_ttft_vs_load",
    "ratio",
    "write_json",
]

ROUND_ROBIN_NAMES = ("envoy-rr", "ours:round-robin")
SGL_NAME = "sgl-router"


class BenchReport:
    """Everything one ``prefix-router bench`` run measured."""

    def __init__(
        self,
        workload: str,
        params: dict[str, Any],
        oracles: dict[float | None, float],
        summaries: Sequence[Summary],
        ttfts: dict[tuple[str, float | None], list[float]],
        setup: dict[str, Any],
    ) -> None:
        self.workload = workload
        self.params = params
        self.oracles = oracles  # offered load -> pooled-cache oracle hit rate (request order can differ)
        self.summaries = list(summaries)
        self.ttfts = ttfts  # (contender, rate) -> sorted TTFTs, for the CDF plot
        self.setup = setup

    @property
    def oracle_hit_rate(self) -> float:
        """The oracle of the first offered load (the same at every load unless the order changes)."""
        return next(iter(self.oracles.values()), math.nan)

    def oracle(self, rate: float | None) -> float:
        return self.oracles.get(rate, math.nan)

    def rates(self) -> list[float | None]:
        seen: list[float | None] = []
        for s in self.summaries:
            if s.rate not in seen:
                seen.append(s.rate)
        return seen

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = json_safe(
            {
                "workload": self.workload,
                "params": self.params,
                "setup": self.setup,
                "oracle_hit_rate": self.oracle_hit_rate,
                "contenders": [
                    s.to_json()
                    | {"hit_rate_vs_oracle": ratio(s.hit_rate, self.oracle(s.rate)), **_ratios(s, self.summaries)}
                    for s in self.summaries
                ],
            }
        )
        return out


def json_safe(value: Any) -> Any:
    """``value`` with every NaN or infinite float replaced by None: JSON has no NaN, an unmeasured figure is null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def ratio(a: float, b: float) -> float:
    """``a / b``, NaN where either is not finite or ``b`` is 0 (a figure that could not be measured)."""
    if not (math.isfinite(a) and math.isfinite(b)) or b == 0:
        return math.nan
    return a / b


def _reference(summaries: Sequence[Summary], names: Sequence[str], rate: float | None) -> Summary | None:
    for name in names:
        for s in summaries:
            if s.name == name and s.rate == rate and s.start_error is None:
                return s
    return None


def _ratios(s: Summary, summaries: Sequence[Summary]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for label, names in (("vs_round_robin", ROUND_ROBIN_NAMES), ("vs_sgl_router", (SGL_NAME,))):
        ref = _reference(summaries, names, s.rate)
        out[label] = (
            None
            if ref is None
            else {
                "reference": ref.name,
                "ttft_p50": ratio(s.ttft_s["p50"], ref.ttft_s["p50"]),
                "ttft_p99": ratio(s.ttft_s["p99"], ref.ttft_s["p99"]),
            }
        )
    return out


def fmt(value: float | None, digits: int = 3) -> str:
    """A figure with ``digits`` decimals; "-" for one that could not be measured."""
    if value is None or not math.isfinite(value):
        return "-"
    return f"{value:.{digits}f}"


def ms(value: float) -> str:
    """Seconds as whole milliseconds; "-" for a figure that could not be measured."""
    return "-" if not math.isfinite(value) else f"{value * 1000:.0f}"


def ms_with_interval(value: float, interval: Sequence[float] | None) -> str:
    """``1764 [1500-2100]``: a figure in ms with its 95% bootstrap interval (just the figure without one)."""
    if not interval or len(interval) != 2 or not all(v is not None and math.isfinite(v) for v in interval):
        return ms(value)
    return f"{ms(value)} [{ms(interval[0])}-{ms(interval[1])}]"


def markdown_table(report: BenchReport) -> str:
    """One table per offered load; ratios < 1 mean faster than the reference; [low-high]: 95% bootstrap CIs."""
    lines: list[str] = []
    if report.setup.get("engine") == "sglang-cpu":
        lines += [
            "_Engine: real SGLang 0.5.23 on this CPU, serving a tiny random-weight Llama. These are CPU figures: "
            "compare the contenders with each other (the ratios), not the times with a GPU._",
            "",
        ]
    for rate in report.rates():
        rows = [s for s in report.summaries if s.rate == rate]
        title = f"offered load {rate:g} req/s" if rate is not None else "trace arrivals"
        oracle = report.oracle(rate)
        lines += [
            f"**{report.workload}, {title}** (pooled-cache oracle hit rate {fmt(oracle)})",
            "",
            "| contender | requests | errors | TTFT p50 ms [95% CI] | TTFT p90 ms | TTFT p99 ms [95% CI] "
            "| TTFT mean ms [95% CI] "
            "| e2e p50 ms | e2e p99 ms | out tok/s | hit rate | hit / oracle | max/mean req "
            "| p50 / RR | p99 / RR | p50 / sgl | p99 / sgl |",
            "|" + "---|" * 17,
        ]
        for s in rows:
            if s.start_error is not None:
                lines.append(f"| {s.name} | did not start: {s.start_error[:160].replace('|', '/')} |" + " |" * 15)
                continue
            r = _ratios(s, report.summaries)
            rr, sgl = r["vs_round_robin"] or {}, r["vs_sgl_router"] or {}
            lines.append(
                f"| {s.name} | {s.requests} | {s.errors} | {ms_with_interval(s.ttft_s['p50'], s.ttft_ci_s['p50'])} "
                f"| {ms(s.ttft_s['p90'])} | {ms_with_interval(s.ttft_s['p99'], s.ttft_ci_s['p99'])} "
                f"| {ms_with_interval(s.ttft_s['mean'], s.ttft_ci_s['mean'])} "
                f"| {ms(s.e2e_s['p50'])} | {ms(s.e2e_s['p99'])} "
                f"| {fmt(s.output_tok_s, 0)} | {fmt(s.hit_rate)} | {fmt(ratio(s.hit_rate, oracle), 2)} "
                f"| {fmt(s.max_mean_requests, 2)} | {fmt(rr.get('ttft_p50'), 2)} | {fmt(rr.get('ttft_p99'), 2)} "
                f"| {fmt(sgl.get('ttft_p50'), 2)} | {fmt(sgl.get('ttft_p99'), 2)} |"
            )
        errors = [s for s in rows if s.error_samples]
        for s in errors:
            lines.append(f"\n{s.name} errors (first kinds): " + "; ".join(s.error_samples))
        lines.append("")
    return "\n".join(lines)


def write_json(report: BenchReport, path: str | Path) -> None:
    Path(path).write_text(json.dumps(report.to_json(), indent=2) + "\n")


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    return plt


def plot_ttft_cdf(report: BenchReport, out_dir: Path) -> list[Path]:
    """One PNG per offered load: the TTFT CDF of every contender."""
    plt = _pyplot()
    paths = []
    for rate in report.rates():
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for s in report.summaries:
            values = report.ttfts.get((s.name, rate)) if s.rate == rate else None
            if not values:
                continue
            ys = [(i + 1) / len(values) for i in range(len(values))]
            ax.step(values, ys, where="post", label=s.name)
        ax.set_xscale("log")
        ax.set_xlabel("TTFT (s, log scale)")
        ax.set_ylabel("fraction of requests")
        label = f"{rate:g} req/s" if rate is not None else "trace arrivals"
        ax.set_title(f"TTFT CDF, {report.workload}, {label}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        suffix = f"-{rate:g}rps" if rate is not None else ""
        path = out_dir / f"ttft-cdf-{report.workload}{suffix}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def plot_ttft_vs_load(report: BenchReport, out_dir: Path) -> Path | None:
    """TTFT p50 (solid) and p99 (dashed) against offered load; only for sweeps over 2+ rates."""
    rates = [r for r in report.rates() if r is not None]
    if len(rates) < 2:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = list(dict.fromkeys(s.name for s in report.summaries))
    for i, name in enumerate(names):
        rows = sorted(
            (s for s in report.summaries if s.name == name and s.start_error is None and s.rate is not None),
            key=lambda s: s.rate or 0.0,
        )
        if not rows:
            continue
        color = f"C{i % 10}"
        xs = [s.rate for s in rows]
        ax.plot(xs, [s.ttft_s["p50"] for s in rows], "-o", color=color, label=f"{name} p50")
        ax.plot(xs, [s.ttft_s["p99"] for s in rows], "--x", color=color, label=f"{name} p99")
    ax.set_yscale("log")
    ax.set_xlabel("offered load (req/s)")
    ax.set_ylabel("TTFT (s, log scale)")
    ax.set_title(f"TTFT vs offered load, {report.workload}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    path = out_dir / f"ttft-vs-load-{report.workload}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

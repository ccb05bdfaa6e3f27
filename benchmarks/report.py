"""Results -> a Markdown table, a JSON file and PNG plots.

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
    "TieredReport",
    "markdown_table",
    "ms_with_interval",
    "plot_ttft_cdf",
    "plot_ttft_vs_load",
    "tiered_table",
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
        out: dict[str, Any] = _clean(
            {
                "workload": self.workload,
                "params": self.params,
                "setup": self.setup,
                "oracle_hit_rate": self.oracle_hit_rate,
                "contenders": [
                    s.to_json()
                    | {"hit_rate_vs_oracle": _ratio(s.hit_rate, self.oracle(s.rate)), **_ratios(s, self.summaries)}
                    for s in self.summaries
                ],
            }
        )
        return out


def _clean(value: Any) -> Any:
    # JSON has no NaN: a figure that could not be measured is null.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def _ratio(a: float, b: float) -> float:
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
                "ttft_p50": _ratio(s.ttft_s["p50"], ref.ttft_s["p50"]),
                "ttft_p99": _ratio(s.ttft_s["p99"], ref.ttft_s["p99"]),
            }
        )
    return out


def _fmt(value: float | None, digits: int = 3) -> str:
    if value is None or not math.isfinite(value):
        return "-"
    return f"{value:.{digits}f}"


def _ms(value: float) -> str:
    return "-" if not math.isfinite(value) else f"{value * 1000:.0f}"


def ms_with_interval(value: float, interval: Sequence[float] | None) -> str:
    """``1764 [1500-2100]``: a figure in ms with its 95% bootstrap interval (just the figure without one)."""
    if not interval or len(interval) != 2 or not all(v is not None and math.isfinite(v) for v in interval):
        return _ms(value)
    return f"{_ms(value)} [{_ms(interval[0])}-{_ms(interval[1])}]"


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
            f"**{report.workload}, {title}** (pooled-cache oracle hit rate {_fmt(oracle)})",
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
                f"| {_ms(s.ttft_s['p90'])} | {ms_with_interval(s.ttft_s['p99'], s.ttft_ci_s['p99'])} "
                f"| {ms_with_interval(s.ttft_s['mean'], s.ttft_ci_s['mean'])} "
                f"| {_ms(s.e2e_s['p50'])} | {_ms(s.e2e_s['p99'])} "
                f"| {_fmt(s.output_tok_s, 0)} | {_fmt(s.hit_rate)} | {_fmt(_ratio(s.hit_rate, oracle), 2)} "
                f"| {_fmt(s.max_mean_requests, 2)} | {_fmt(rr.get('ttft_p50'), 2)} | {_fmt(rr.get('ttft_p99'), 2)} "
                f"| {_fmt(sgl.get('ttft_p50'), 2)} | {_fmt(sgl.get('ttft_p99'), 2)} |"
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


# -- the tiered-cache suite -------------------------------------------------------------------------
OURS = "ours:prefix-aware"
TIER_LABELS = {"none": "no HiCache", "host": "host tier", "host+shared": "host + shared storage tier"}


class TieredReport:
    """``--suite tiered``: per tier setting, every contender's figures (and each request's TTFT)."""

    def __init__(
        self,
        workload: str,
        params: dict[str, Any],
        oracle: float,
        rows: Sequence[tuple[str, Summary, list[float]]],
        slo_s: float,
        setup: dict[str, Any],
    ) -> None:
        self.workload = workload
        self.params = params
        self.oracle = oracle
        self.rows = list(rows)
        self.slo_s = slo_s
        self.setup = setup

    def tiers(self) -> list[str]:
        return list(dict.fromkeys(tier for tier, _s, _t in self.rows))

    def find(self, tier: str, name: str) -> Summary | None:
        for t, s, _ttfts in self.rows:
            if t == tier and s.name == name and s.start_error is None:
                return s
        return None

    def goodput(self, summary: Summary, ttfts: Sequence[float]) -> tuple[float, float]:
        """(requests/s that met the TTFT SLO, their share of all requests)."""
        met = sum(1 for t in ttfts if t <= self.slo_s)
        rate = met / summary.duration_s if summary.duration_s else math.nan
        return rate, met / summary.requests if summary.requests else math.nan

    def targets(self) -> list[tuple[str, bool | None, str]]:
        """The scenario's targets (docs/benchmarks.md): (what, met or None when not measurable, figures)."""
        out: list[tuple[str, bool | None, str]] = []
        ours_host, rr_none = self.find("host", OURS), self.find("none", "envoy-rr")
        if ours_host is not None and rr_none is not None:
            cut = 1 - _ratio(ours_host.ttft_s["p50"], rr_none.ttft_s["p50"])
            out.append(
                ("ours (host tier) TTFT p50 >= 40% below round robin without HiCache", cut >= 0.40, f"{cut:.0%} lower")
            )
            ours_gpu, rr_gpu = gpu_seconds_per_request(ours_host), gpu_seconds_per_request(rr_none)
            saved = 1 - _ratio(ours_gpu, rr_gpu)
            out.append(
                (
                    "ours (host tier) >= 25% fewer GPU-seconds per request than round robin without HiCache",
                    saved >= 0.25 if math.isfinite(saved) else None,
                    f"{saved:.0%} fewer ({_fmt(ours_gpu)} vs {_fmt(rr_gpu)} s)",
                )
            )
        else:
            out.append(("ours (host tier) vs round robin without HiCache", None, "a run is missing"))
        for tier in self.tiers():
            ours = self.find(tier, OURS)
            peers = [s for t, s, _ in self.rows if t == tier and s.name != OURS and s.start_error is None]
            if ours is None or not peers:
                out.append((f"{TIER_LABELS.get(tier, tier)}: ours at or below every peer", None, "a run is missing"))
                continue
            worse = [
                f"{p.name} {q} {_ms(p.ttft_s[q])} < ours {_ms(ours.ttft_s[q])} ms"
                for p in peers
                for q in ("p50", "p99")
                if ours.ttft_s[q] > p.ttft_s[q]
            ]
            out.append(
                (
                    f"{TIER_LABELS.get(tier, tier)}: ours TTFT p50 and p99 at or below every peer's",
                    not worse,
                    "; ".join(worse) if worse else f"peers: {', '.join(p.name for p in peers)}",
                )
            )
        return out

    def to_json(self) -> dict[str, Any]:
        rows = []
        for tier, summary, ttfts in self.rows:
            rate, share = self.goodput(summary, ttfts)
            fleet = summary.fleet
            rows.append(
                summary.to_json()
                | {
                    "tier": tier,
                    "goodput_req_s": rate,
                    "goodput_share": share,
                    "gpu_seconds_per_request": gpu_seconds_per_request(summary),
                    "hit_rate_by_tier": {src: fleet.hit_rate(src) for src in ("device", "host", "storage")}
                    if fleet
                    else None,
                }
            )
        out: dict[str, Any] = _clean(
            {
                "suite": "tiered",
                "workload": self.workload,
                "params": self.params,
                "setup": self.setup,
                "slo_ttft_s": self.slo_s,
                "gpu_only_oracle_hit_rate": self.oracle,
                "rows": rows,
                "targets": [{"target": t, "met": m, "figures": f} for t, m, f in self.targets()],
            }
        )
        return out


def gpu_seconds_per_request(summary: Summary) -> float:
    """Simulated GPU seconds (prefill + decode, whole fleet) per successful request."""
    done = summary.requests - summary.errors
    if summary.fleet is None or done <= 0:
        return math.nan
    return summary.fleet.gpu_seconds / done


def tiered_table(report: TieredReport) -> str:
    """One table per tier setting, then the targets; ratios are against round robin without HiCache."""
    slo_ms = report.slo_s * 1000
    rr = report.find("none", "envoy-rr")
    lines: list[str] = []
    for tier in report.tiers():
        lines += [
            f"**{report.workload}, {TIER_LABELS.get(tier, tier)}** (TTFT SLO {slo_ms:.0f} ms; GPU-only pooled "
            f"oracle hit rate {_fmt(report.oracle)})",
            "",
            "| contender | requests | errors | TTFT p50 ms | TTFT p99 ms | hit GPU | hit host | hit storage "
            f"| goodput req/s (share) @{slo_ms:.0f} ms | GPU-s / req | p50 / RR-none | GPU-s / RR-none |",
            "|" + "---|" * 12,
        ]
        for t, s, ttfts in report.rows:
            if t != tier:
                continue
            if s.start_error is not None:
                lines.append(f"| {s.name} | did not start: {s.start_error[:160].replace('|', '/')} |" + " |" * 10)
                continue
            fleet = s.fleet
            hits = [fleet.hit_rate(src) if fleet else math.nan for src in ("device", "host", "storage")]
            rate, share = report.goodput(s, ttfts)
            gpu = gpu_seconds_per_request(s)
            lines.append(
                f"| {s.name} | {s.requests} | {s.errors} | {_ms(s.ttft_s['p50'])} | {_ms(s.ttft_s['p99'])} "
                f"| {_fmt(hits[0])} | {_fmt(hits[1])} | {_fmt(hits[2])} | {_fmt(rate, 2)} ({_fmt(share, 2)}) "
                f"| {_fmt(gpu)} | {_fmt(_ratio(s.ttft_s['p50'], rr.ttft_s['p50']) if rr else math.nan, 2)} "
                f"| {_fmt(_ratio(gpu, gpu_seconds_per_request(rr)) if rr else math.nan, 2)} |"
            )
        lines.append("")
    lines += ["**Targets**", ""]
    for target, met, figures in report.targets():
        mark = "n/a" if met is None else ("met" if met else "NOT met")
        lines.append(f"- {target}: **{mark}** ({figures})")
    missing = report.setup.get("missing_contenders") or []
    if missing:
        lines.append(f"- not in this build, not run: {', '.join(missing)}")
    return "\n".join(lines) + "\n"

"""Write the Grafana dashboard deploy/grafana/dashboards/prefix-router.json (`python scripts/grafana_dashboard.py`).

Why a script: the panels are listed here as (title, queries, unit) and laid out by code (ids, grid
positions), so adding a panel is a few lines rather than hand-placed JSON; the committed file is
this script's output (tests/deploy/test_dashboard.py checks that, Grafana's structural rules, that
every query parses, and that every metric a query names is exported by a running stack).

Every query reads the metrics of the router (``prefix_router_*``), Envoy (``envoy_*``, the
``gateway`` listener of the generated config) and the workers (SGLang's ``sglang:*``), whatever
the scrape jobs are called; the data source is the dashboard's ``datasource`` variable.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "dashboards" / "prefix-router.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
RATE = "[$__rate_interval]"
GATEWAY = 'envoy_http_conn_manager_prefix="gateway"'  # the HTTP listener of `prefix-router envoy-config`
GRID_WIDTH = 24

# Queries used by more than one panel.
PICKED = f"sum(rate(prefix_router_decisions_total{RATE}))"
FAIL_OPEN = f"sum(rate(envoy_http_ext_proc_failure_mode_allowed{RATE}))"
EXT_PROC_STREAMS = f"sum(rate(envoy_http_ext_proc_streams_started{RATE}))"
SHED = f"sum(rate(prefix_router_flow_shed_total{RATE}))"
PREDICTED_HIT = (
    f"sum(rate(prefix_router_matched_tokens_total{RATE})) / sum(rate(prefix_router_routed_tokens_total{RATE}))"
)
SERVED_HIT = (
    f"1 - sum(rate(sglang:uncached_prompt_tokens_histogram_sum{RATE}))"
    f" / sum(rate(sglang:prompt_tokens_histogram_sum{RATE}))"
)


def quantile(q: float, bucket: str, by: str = "", selector: str = "") -> str:
    """``histogram_quantile`` of a histogram's buckets, summed over everything but ``le`` and ``by``."""
    labels = ", ".join(["le", *([by] if by else [])])
    return f"histogram_quantile({q}, sum by ({labels}) (rate({bucket}_bucket{selector}{RATE})))"


@dataclass
class Panel:
    """One panel: ``queries`` are (PromQL, legend) pairs."""

    title: str
    description: str
    queries: list[tuple[str, str]]
    unit: str = "short"
    kind: str = "timeseries"
    width: int = 12
    height: int = 8
    stacked: bool = False
    thresholds: list[tuple[float, str]] = field(default_factory=list)  # (from value, colour) above green

    def to_json(self, panel_id: int, x: int, y: int) -> dict[str, Any]:
        steps: list[dict[str, Any]] = [{"color": "green", "value": None}]
        steps += [{"color": colour, "value": value} for value, colour in self.thresholds]
        defaults: dict[str, Any] = {"unit": self.unit, "thresholds": {"mode": "absolute", "steps": steps}}
        if self.unit == "percentunit":
            defaults.update(min=0, max=1)
        if self.kind == "timeseries":
            defaults["custom"] = {
                "drawStyle": "line",
                "lineWidth": 1,
                "fillOpacity": 20 if self.stacked else 0,
                "showPoints": "never",
                "spanNulls": False,
                "stacking": {"mode": "normal" if self.stacked else "none", "group": "A"},
            }
            options: dict[str, Any] = {
                "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True, "calcs": []},
                "tooltip": {"mode": "multi", "sort": "desc"},
            }
        else:
            options = {
                "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                "colorMode": "value",
                "graphMode": "area",
                "justifyMode": "auto",
                "orientation": "auto",
                "textMode": "auto",
                "wideLayout": True,
                "showPercentChange": False,
                "percentChangeColorMode": "standard",
            }
        return {
            "id": panel_id,
            "type": self.kind,
            "title": self.title,
            "description": self.description,
            "datasource": DATASOURCE,
            "gridPos": {"h": self.height, "w": self.width, "x": x, "y": y},
            "fieldConfig": {"defaults": defaults, "overrides": []},
            "options": options,
            "targets": [
                {"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": expr, "legendFormat": legend}
                for i, (expr, legend) in enumerate(self.queries)
            ],
        }


def stat(title: str, description: str, expr: str, unit: str, thresholds: list[tuple[float, str]]) -> Panel:
    return Panel(title, description, [(expr, "")], unit, kind="stat", width=4, height=4, thresholds=thresholds)


def overview() -> list[Panel]:
    return [
        stat(
            "Gateway requests/s",
            "Every request Envoy's gateway listener answered, all paths.",
            f"sum(rate(envoy_http_downstream_rq_total{{{GATEWAY}}}{RATE}))",
            "reqps",
            [],
        ),
        stat(
            "Fail-open share",
            "Generation requests Envoy served without the router's choice (router down, or slower than the "
            "ext_proc message timeout). Alert PrefixRouterFailOpenHigh fires above 5%.",
            f"{FAIL_OPEN} / {EXT_PROC_STREAMS}",
            "percentunit",
            [(0.01, "orange"), (0.05, "red")],
        ),
        stat(
            "Hit rate predicted",
            "Prompt tokens the router expected the chosen worker to hold, over the prompt tokens it routed.",
            PREDICTED_HIT,
            "percentunit",
            [],
        ),
        stat(
            "Hit rate served",
            "Prompt tokens the workers served from cache (SGLang's own counts).",
            SERVED_HIT,
            "percentunit",
            [],
        ),
        stat(
            "Routers ready",
            "Router replicas whose readiness service says SERVING.",
            "sum(prefix_router_ready)",
            "short",
            [],
        ),
        stat(
            "Workers healthy",
            "Healthy workers, as the router replica that sees the fewest counts them. 0 fires "
            "PrefixRouterNoHealthyWorkers.",
            "min(sum by (instance) (prefix_router_worker_healthy))",
            "short",
            [],
        ),
    ]


def outcomes() -> list[Panel]:
    return [
        Panel(
            "Generation requests by outcome",
            "router-picked: the router chose the worker. fail-open: Envoy's least-request route served it (router "
            "down or slow). shed: flow control answered 429. refused: the router answered an error itself (400, "
            "413, 503 when no worker is healthy).",
            [
                (PICKED, "router-picked"),
                (FAIL_OPEN, "fail-open"),
                (SHED, "shed"),
                (
                    f"sum(rate(envoy_http_ext_proc_immediate_responses_sent{RATE})) - ({SHED} or vector(0))",
                    "refused",
                ),
            ],
            "reqps",
            stacked=True,
        ),
        Panel(
            "Gateway responses by status class",
            "What clients got from the gateway listener, all paths.",
            [
                (
                    f"sum by (envoy_response_code_class) (rate(envoy_http_downstream_rq_xx{{{GATEWAY}}}{RATE}))",
                    "{{envoy_response_code_class}}xx",
                )
            ],
            "reqps",
            stacked=True,
        ),
        Panel(
            "Routing decisions by reason",
            "Why the router chose as it did (prefix hit, least load, session affinity...).",
            [(f"sum by (reason) (rate(prefix_router_decisions_total{RATE}))", "{{reason}}")],
            "reqps",
            stacked=True,
        ),
        Panel(
            "Fallbacks, retries and ext_proc timeouts",
            "served elsewhere: Envoy served a request on one of the router's fallbacks (the primary refused). "
            "retries: Envoy's retries of refused connections. timeouts: the router answered after the ext_proc "
            "message timeout (those requests failed open).",
            [
                (f"sum(rate(prefix_router_served_elsewhere_total{RATE}))", "served elsewhere"),
                (
                    "sum by (envoy_cluster_name) (rate(envoy_cluster_upstream_rq_retry"
                    f'{{envoy_cluster_name=~"prefix_router_picked|prefix_router_workers"}}{RATE}))',
                    "retries {{envoy_cluster_name}}",
                ),
                (f"sum(rate(envoy_http_ext_proc_message_timeouts{RATE}))", "ext_proc timeouts"),
            ],
            "reqps",
        ),
    ]


def cache() -> list[Panel]:
    return [
        Panel(
            "Hit rate, predicted and served",
            "predicted: the leading prompt tokens the router's index says the chosen worker holds (any tier). "
            "served: the tokens the workers did not compute. Served far below predicted means the index is wrong "
            "about the workers' caches. Alert PrefixRouterHitRateDropped watches the served rate.",
            [(PREDICTED_HIT, "predicted"), (SERVED_HIT, "served")],
            "percentunit",
        ),
        Panel(
            "Matched blocks by tier",
            "Leading prompt blocks the chosen worker holds: on its GPU, in its host memory (HiCache), in a storage "
            "tier it shares.",
            [(f"sum by (tier) (rate(prefix_router_matched_tier_blocks_total{RATE}))", "{{tier}}")],
            "short",
            stacked=True,
        ),
        Panel(
            "Predicted hit rate per worker",
            "The router's expected cached share of the prompts it sends each worker.",
            [
                (
                    f"sum by (worker) (rate(prefix_router_matched_tokens_total{RATE}))"
                    f" / sum by (worker) (rate(prefix_router_routed_tokens_total{RATE}))",
                    "{{worker}}",
                )
            ],
            "percentunit",
        ),
        Panel(
            "Served hit rate per worker",
            "Each worker's cached share of its prompt tokens (SGLang's counts, by scrape target).",
            [
                (
                    f"1 - sum by (instance) (rate(sglang:uncached_prompt_tokens_histogram_sum{RATE}))"
                    f" / sum by (instance) (rate(sglang:prompt_tokens_histogram_sum{RATE}))",
                    "{{instance}}",
                )
            ],
            "percentunit",
        ),
    ]


def latency() -> list[Panel]:
    ttft = "prefix_router_time_to_first_byte_seconds"
    return [
        Panel(
            "TTFT as the router sees it",
            "From the request reaching the router to the worker's response headers, for streamed requests: "
            "SGLang's OpenAI endpoints send those with the first token, so this is TTFT including the router's "
            "queue and decision. engine p95: SGLang's own TTFT, measured inside the worker.",
            [
                (quantile(0.5, ttft, selector='{stream="true"}'), "p50"),
                (quantile(0.95, ttft, selector='{stream="true"}'), "p95"),
                (quantile(0.99, ttft, selector='{stream="true"}'), "p99"),
                (quantile(0.95, "sglang:time_to_first_token_seconds"), "engine p95"),
            ],
            "s",
        ),
        Panel(
            "TTFT p95 per worker (router's view)",
            "As the panel beside it, by the worker that served.",
            [(quantile(0.95, ttft, by="worker", selector='{stream="true"}'), "{{worker}}")],
            "s",
        ),
        Panel(
            "Decision latency",
            "Time the router takes per decision: tokenize, hash, look up, choose.",
            [
                (quantile(0.5, "prefix_router_decision_seconds"), "p50"),
                (quantile(0.99, "prefix_router_decision_seconds"), "p99"),
            ],
            "s",
        ),
        Panel(
            "End-to-end latency (workers)",
            "SGLang's request latency, from the workers' own histograms.",
            [
                (quantile(0.5, "sglang:e2e_request_latency_seconds"), "p50"),
                (quantile(0.95, "sglang:e2e_request_latency_seconds"), "p95"),
            ],
            "s",
        ),
    ]


def workers() -> list[Panel]:
    return [
        Panel(
            "Requests routed per worker",
            "Requests per second the router sent to each worker (its first choice).",
            [(f"sum by (worker) (rate(prefix_router_routed_total{RATE}))", "{{worker}}")],
            "reqps",
            stacked=True,
        ),
        Panel(
            "Router's in-flight requests per worker",
            "Requests the routers have running or queued on each worker (all replicas together).",
            [("sum by (worker) (prefix_router_worker_in_flight)", "{{worker}}")],
            "short",
        ),
        Panel(
            "Running and queued requests per worker (engine)",
            "What each worker reports: requests in its running batch, and waiting in its queue.",
            [
                ("sum by (instance) (sglang:num_running_reqs)", "{{instance}} running"),
                ("sum by (instance) (sglang:num_queue_reqs)", "{{instance}} queued"),
            ],
            "short",
        ),
        Panel(
            "KV cache usage per worker",
            "Share of each worker's KV cache in use (SGLang's token_usage).",
            [("max by (instance) (sglang:token_usage)", "{{instance}}")],
            "percentunit",
        ),
        Panel(
            "Worker health",
            "1 while a worker is a routing candidate (worst of the router replicas). Envoy healthy: the fail-open "
            "cluster's members passing Envoy's own health check.",
            [
                ("min by (worker) (prefix_router_worker_healthy)", "{{worker}}"),
                (
                    'sum(envoy_cluster_membership_healthy{envoy_cluster_name="prefix_router_workers"})',
                    "Envoy healthy",
                ),
            ],
            "short",
        ),
        Panel(
            "Index blocks per worker",
            "Blocks the router's index holds for each worker and tier (the replica with the most).",
            [
                (
                    "max by (worker, tier) (sum by (instance, worker, tier) (prefix_router_index_blocks))",
                    "{{worker}} {{tier}}",
                )
            ],
            "short",
        ),
    ]


def events() -> list[Panel]:
    counters = ("gaps", "gaps_repaired", "restarts", "orphans", "decode_errors")
    return [
        Panel(
            "KV-event batches applied per worker",
            "Event batches each router applies from each worker (the busiest replica). A worker taking traffic "
            "with none fires PrefixRouterNoKvEvents.",
            [(f"max by (worker) (rate(prefix_router_event_batches_total{RATE}))", "{{worker}}")],
            "ops",
        ),
        Panel(
            "KV-event lag per worker",
            "Publish-to-apply delay of the last batch (the slowest replica).",
            [("max by (worker) (prefix_router_event_lag_seconds)", "{{worker}}")],
            "s",
        ),
        Panel(
            "Event gaps, repairs and restarts",
            "gaps: sequence holes detected; gaps_repaired: those filled by replay; restarts: a worker's sequence "
            "went back; orphans: stored blocks with an unknown parent; decode_errors: undecodable batches.",
            [(f"sum(increase(prefix_router_event_{name}_total{RATE}))", name) for name in counters],
            "short",
        ),
        Panel(
            "Index in sync per worker",
            "1 while the router knows the worker's cache from its events; 0 (events lost and not replayed) makes "
            "it match on its own record, and fires PrefixRouterIndexUnsynced after 10 minutes.",
            [("min by (worker) (prefix_router_index_synced)", "{{worker}}")],
            "short",
        ),
        Panel(
            "Router memory by part",
            "Estimated bytes each cache of the router holds, against its share of memory.budget_bytes.",
            [
                ("max by (part) (prefix_router_memory_bytes)", "{{part}}"),
                ("max by (part) (prefix_router_memory_limit_bytes)", "{{part}} limit"),
            ],
            "bytes",
            width=24,
        ),
    ]


def flow_control() -> list[Panel]:
    return [
        Panel(
            "Flow-control queue by band",
            "Requests waiting in the routers for a worker with room, by priority band (flow_control.enabled).",
            [("sum by (priority) (prefix_router_flow_queue_depth)", "band {{priority}}")],
            "short",
            width=8,
        ),
        Panel(
            "Flow-control wait p95 by band",
            "How long requests waited in the router before being routed.",
            [(quantile(0.95, "prefix_router_flow_wait_seconds", by="priority"), "band {{priority}}")],
            "s",
            width=8,
        ),
        Panel(
            "Sheds by band and reason",
            "Requests answered 429: sheddable (negative band while saturated), queue-ttl, queue-full. "
            "Alert PrefixRouterShedding fires above 5%.",
            [(f"sum by (priority, reason) (rate(prefix_router_flow_shed_total{RATE}))", "{{priority}} {{reason}}")],
            "reqps",
            width=8,
            stacked=True,
        ),
    ]


def pd_legs() -> list[Panel]:
    return [
        Panel(
            "PD pairs by worker and role",
            "Disaggregated requests by the part each worker played. aggregated: requests of a PD fleet sent to "
            "an aggregated worker because little of the prompt was uncached.",
            [
                (f"sum by (role, worker) (rate(prefix_router_pd_routed_total{RATE}))", "{{role}} {{worker}}"),
                (f"sum(rate(prefix_router_pd_skipped_total{RATE}))", "aggregated"),
            ],
            "reqps",
        ),
        Panel(
            "Prefill-leg failures, decode aborts and losses",
            "Prefill legs that failed (retried: before anything was sent, so the pair was tried again), decode "
            "sides aborted after their prefill failed, and pairs lost because every decode endpoint went down.",
            [
                (
                    f"sum by (reason, retried) (rate(prefix_router_pd_prefill_failures_total{RATE}))",
                    "prefill {{reason}} retried={{retried}}",
                ),
                (
                    f"sum by (accepted) (rate(prefix_router_pd_decode_aborts_total{RATE}))",
                    "decode aborted accepted={{accepted}}",
                ),
                (f"sum(rate(prefix_router_pd_decode_lost_total{RATE}))", "decode lost"),
            ],
            "reqps",
        ),
        Panel(
            "PD queues in the workers",
            "Requests waiting for a KV transfer: prefill workers' bootstrap queue, decode workers' transfer queue.",
            [
                ("sum by (instance) (sglang:num_prefill_bootstrap_queue_reqs)", "{{instance}} prefill bootstrap"),
                ("sum by (instance) (sglang:num_decode_transfer_queue_reqs)", "{{instance}} decode transfer"),
            ],
            "short",
            width=24,
        ),
    ]


def drift() -> list[Panel]:
    """Index drift: the router's predicted cached tokens against the engine-reported ones (sampled requests)."""
    by_worker = "sum by (worker) (rate(prefix_router_drift_{}_total" + RATE + "))"
    return [
        Panel(
            "Index drift share per worker",
            "Share of sampled requests whose predicted and engine-reported cached tokens differ by more than a "
            "page (observability.drift_sample_rate of the requests are sampled). Near 0 the router's index of the "
            "worker is right; PrefixRouterIndexDrift fires above 20% for 10 minutes.",
            [(f"{by_worker.format('mismatched')} / {by_worker.format('samples')}", "{{worker}}")],
            "percentunit",
            width=8,
            thresholds=[(0.2, "orange")],
        ),
        Panel(
            "Cached tokens: predicted against engine-reported",
            "On the sampled requests, per worker: the cached prompt tokens the router predicted and the ones "
            "SGLang reported. Predicted above reported: the index believes in blocks the worker lost (events cut "
            "or late, an unseen flush); reported above predicted: the worker holds prefixes the index missed.",
            [
                (
                    f"sum by (worker) (rate(prefix_router_predicted_cached_tokens_total{RATE}))",
                    "{{worker}} predicted",
                ),
                (f"sum by (worker) (rate(prefix_router_served_cached_tokens_total{RATE}))", "{{worker}} reported"),
            ],
            "short",
            width=8,
        ),
        Panel(
            "Drift samples per worker",
            "Responses read for drift per second, and those without cached_tokens (unread: SGLang without "
            "--enable-cache-report; PrefixRouterDriftUnread).",
            [
                (by_worker.format("samples"), "{{worker}} sampled"),
                (by_worker.format("unread"), "{{worker}} unread"),
            ],
            "reqps",
            width=8,
        ),
    ]


ROWS: list[tuple[str, Callable[[], list[Panel]]]] = [
    ("Requests and outcomes", outcomes),
    ("Prefix cache: predicted and served", cache),
    ("Latency", latency),
    ("Workers: load and health", workers),
    ("KV events and index", events),
    ("Index drift", drift),
    ("Flow control", flow_control),
    ("Prefill/decode legs", pd_legs),
]


def _layout(panels: list[Panel], start_id: int, y: int) -> tuple[list[dict[str, Any]], int, int]:
    """Left to right, wrapping at the grid's width; returns the panels' JSON, the next id and the next free row."""
    out, x, row_height = [], 0, 0
    for i, panel in enumerate(panels):
        if x + panel.width > GRID_WIDTH:
            x, y, row_height = 0, y + row_height, 0
        out.append(panel.to_json(start_id + i, x, y))
        x += panel.width
        row_height = max(row_height, panel.height)
    return out, start_id + len(panels), y + row_height


def dashboard() -> dict[str, Any]:
    panels, next_id, y = _layout(overview(), 1, 0)
    for title, build in ROWS:
        members = build()
        if not members:
            continue
        panels.append(
            {
                "id": next_id,
                "type": "row",
                "title": title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": GRID_WIDTH, "x": 0, "y": y},
                "panels": [],
            }
        )
        laid, next_id, y = _layout(members, next_id + 1, y + 1)
        panels += laid
    return {
        "uid": "prefix-router",
        "title": "prefix-router gateway",
        "description": "The router, Envoy and the SGLang workers of a prefix-router gateway.",
        "tags": ["prefix-router", "sglang", "envoy"],
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "links": [],
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                }
            ]
        },
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Prometheus",
                    "type": "datasource",
                    "query": "prometheus",
                    "hide": 0,
                    "refresh": 1,
                    "regex": "",
                    "includeAll": False,
                    "multi": False,
                    "options": [],
                    "skipUrlSync": False,
                }
            ]
        },
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(render())
    print(f"wrote {OUT}")

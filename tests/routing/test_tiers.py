"""Routing by tier without processes: the per-tier match, the tier-cost arithmetic, the policies' use of
it, and what the router reports (span attributes, metrics). Fast and deterministic."""

from __future__ import annotations

import functools
import json

import pytest
from prometheus_client import generate_latest

from extproc.config import RouterConfig
from extproc.decision.policies import Candidate, RoutingRequest, create_policy
from extproc.decision.policies.prefix_aware import PrefixAwarePolicy
from extproc.decision.policies.prefix_aware.tier_cost import (
    PRIOR_STORAGE_OP_S,
    TierCosts,
    costs_from_report,
    kv_bytes_per_token,
    tier_extra,
)
from extproc.decision.request import ParsedRequest
from extproc.fleet.blocks import block_keys, chain_seed
from extproc.fleet.index import BlockIndex
from extproc.fleet.info import prefetch_threshold, storage_group
from extproc.fleet.reports import TierReport, WorkerLoad
from extproc.fleet.workers import WorkerRegistry
from extproc.serving.app import RouterApp
from extproc.sync.cache_view import WorkerCacheView
from extproc.sync.event_wire import decode_payload
from extproc.sync.tier_stats import parse_tier_metrics
from tests.support.routing import as_policy, loopback_workers

PAGE = 16


def _request(tokens: int) -> RoutingRequest:
    ids = list(range(tokens))
    return RoutingRequest(model="m", path="/generate", token_ids=ids, block_keys=block_keys(ids, PAGE))


def _hicache_info(path: str = "/shared/hicache", backend: str | None = "file") -> dict[str, object]:
    return {
        "enable_hierarchical_cache": True,
        "hicache_storage_backend": backend,
        "hicache_storage_backend_extra_config": None,
        "file_storage_path": path,
        "served_model_name": "m",
        "tp_size": 1,
    }


# -- index ------------------------------------------------------------------------------------------
def test_match_tiers_follows_gpu_then_host_then_the_shared_group() -> None:
    index = BlockIndex()
    keys = block_keys(list(range(320)), PAGE)  # 20 blocks
    index.store("a", keys[:4])  # GPU
    index.store("a", keys[4:8], "host")  # then host memory (demoted pages)
    index.store("b", keys[:2])
    index.store_shared("g", keys[:15])  # the storage group holds 15 blocks
    depth = index.match_tiers(keys, ["a", "b", "c"], {"a": "g", "b": "g", "c": None})
    assert (depth["a"].gpu, depth["a"].local, depth["a"].shared) == (4, 8, 15)
    assert (depth["b"].gpu, depth["b"].local, depth["b"].shared) == (2, 2, 15)
    assert (depth["c"].gpu, depth["c"].local, depth["c"].shared) == (0, 0, 0)  # not in the group
    # A host run that starts after the GPU prefix counts only if it is contiguous with it.
    index.store("c", keys[5:9], "host")
    assert index.match_tiers(keys, ["c"])["c"].local == 0
    # Shared pages survive the workers' own removals and flushes (L3 keeps them).
    index.clear("a")
    assert index.match_tiers(keys, ["a"], {"a": "g"})["a"].shared == 15
    assert index.shared_groups() == ["g"] and index.shared_size("g") == 15


def test_host_stores_of_a_storage_group_member_feed_the_shared_tier() -> None:
    from sglang_workers.sim.kv_events import BlockStored, encode_payload, hash_to_int64, page_digest

    index = BlockIndex()
    groups = {"w0": "file:/shared:m:tp1", "w1": None}
    views = {w: WorkerCacheView(w, index, model="m", storage_group=functools.partial(groups.get, w)) for w in groups}
    tokens = list(range(64))
    digests: list[bytes] = []
    prior = None
    for i in range(0, 64, PAGE):
        prior = page_digest(prior, tokens[i : i + PAGE])
        digests.append(prior)
    hashes = [hash_to_int64(d) for d in digests]
    for view in views.values():
        for medium in ("GPU", "CPU_PINNED"):
            stored = BlockStored(hashes, None, tokens, PAGE, medium=medium)
            view.apply_batch(decode_payload(encode_payload([stored], 0.0)))
    keys = block_keys(tokens, PAGE, chain_seed("m"))
    assert index.shared_size("file:/shared:m:tp1") == 4  # only the group member's host stores count
    assert index.blocks("w1", "host") == set(keys)


def test_storage_groups_come_from_server_info() -> None:
    a, b, c, d = loopback_workers(4, 41000)
    a.info, b.info = _hicache_info(), _hicache_info()
    c.info = _hicache_info(path="/elsewhere")
    d.info = _hicache_info(backend=None)
    assert storage_group(a) == storage_group(b) is not None
    assert storage_group(c) != storage_group(a)
    assert storage_group(d) is None and storage_group(loopback_workers(1, 41000)[0]) is None
    a.info["hicache_storage_backend_extra_config"] = json.dumps({"file_storage_path": "/x", "prefetch_threshold": 64})
    assert storage_group(a) is not None and "/x" in storage_group(a)  # type: ignore[operator]
    assert prefetch_threshold(a) == 64 and prefetch_threshold(b) == 256


# -- tier costs ---------------------------------------------------------------------------------------
def test_tier_extra_counts_only_what_sglang_would_use() -> None:
    costs = TierCosts()
    assert tier_extra(8, 0, costs).host_tokens == 0  # under the 10-token load-back threshold: recomputed
    assert tier_extra(0, 128, costs).shared_tokens == 0  # under the 256-token prefetch threshold
    extra = tier_extra(4096, 1024, costs, compute_s=0.0)
    assert (extra.host_tokens, extra.shared_tokens) == (4096, 1024)
    assert extra.load_back_s == pytest.approx(5120 * costs.load_back_s_per_token)
    ops = 2  # one existence check, one read of 64 pages
    assert extra.prefetch_s == pytest.approx(1024 * costs.prefetch_s_per_token + ops * PRIOR_STORAGE_OP_S)
    # The load-back overlaps the prefill: only the part longer than the computation is added.
    assert tier_extra(4096, 0, costs, compute_s=1.0).load_back_s == 0.0


def test_costs_come_from_the_workers_report_with_documented_priors_until_then() -> None:
    assert costs_from_report(None) == TierCosts()
    # Before any transfer the KV size per token comes from the worker's /v1/loads memory section.
    load = WorkerLoad(memory=[{"kv_cache_gb": 2.0, "token_capacity": 8192}])
    size = kv_bytes_per_token(load)
    assert size is not None and size == pytest.approx(2 * 2**30 / 8192)
    assert kv_bytes_per_token(WorkerLoad()) is None and kv_bytes_per_token(None) is None
    sized = costs_from_report(None, size)
    assert sized.load_back_s_per_token == pytest.approx(TierCosts().load_back_s_per_token * size / 100_000)
    report = TierReport(
        load_back_tokens=10_000,
        load_back_bytes=10_000 * 65_536,
        load_back_seconds=0.05,
        load_back_ops=4,
        prefetch_gbps_sum=20.0,
        prefetch_ops=2,  # 10 GB/s on average
        prefetch_threshold=128,
    )
    costs = costs_from_report(report, size)
    assert costs.load_back_s_per_token == pytest.approx(5e-6)  # measured: the prior's size no longer matters
    assert costs.prefetch_s_per_token == pytest.approx(65_536 / 10e9)
    assert costs.prefetch_threshold == 128


def test_tier_metrics_parse_from_sglang_names() -> None:
    text = "\n".join(
        [
            "# TYPE sglang:load_back_tokens_total counter",
            'sglang:load_back_tokens_total{cache_type="UnifiedRadixCache",tp_rank="0",pool="kv"} 2048.0',
            'sglang:load_back_bytes_total{cache_type="UnifiedRadixCache",tp_rank="0"} 268435456.0',
            'sglang:load_back_duration_seconds_sum{cache_type="UnifiedRadixCache",tp_rank="0"} 0.006',
            'sglang:load_back_duration_seconds_count{cache_type="UnifiedRadixCache",tp_rank="0"} 3',
            'sglang:prefetch_bandwidth_sum{storage_backend="file",tp_rank="0"} 9.5',
            'sglang:prefetch_bandwidth_count{storage_backend="file",tp_rank="0"} 2',
            'sglang:num_running_reqs{model_name="m"} 3.0',
        ]
    )
    report = parse_tier_metrics(text)
    assert report is not None
    assert report.load_back_tokens == 2048 and report.bytes_per_token == 131_072
    assert report.load_back_s_per_token == pytest.approx(0.006 / 2048)
    assert report.prefetch_s_per_token == pytest.approx(131_072 / 4.75e9)
    assert parse_tier_metrics('sglang:num_running_reqs{model_name="m"} 3.0') is None


# -- policies -----------------------------------------------------------------------------------------
def test_prefix_aware_prices_host_and_shared_hits_between_gpu_and_recompute() -> None:
    policy = as_policy(PrefixAwarePolicy, create_policy("prefix-aware"))
    request = _request(8192)
    gpu, host, shared, cold = loopback_workers(4, 41000)
    cands = {
        "gpu": Candidate(worker=gpu, matched_blocks=500, host_matched_blocks=500, shared_matched_blocks=500),
        "host": Candidate(worker=host, matched_blocks=0, host_matched_blocks=500, shared_matched_blocks=500),
        "shared": Candidate(worker=shared, matched_blocks=0, host_matched_blocks=0, shared_matched_blocks=500),
        "cold": Candidate(worker=cold),
    }
    ttft = {name: policy.predict(request, c, 0.0)["ttft_s"] for name, c in cands.items()}
    assert ttft["gpu"] <= ttft["host"] < ttft["cold"]
    assert ttft["host"] < ttft["shared"]  # a storage read is slower than a host load-back
    figures = policy.predict(request, cands["shared"], 0.0)
    assert figures["shared_tokens"] == 8000 and figures["host_tokens"] == 0
    # A worker that reports a slow storage read is priced by its report, not the prior.
    cands["shared"].tier_report = TierReport(
        load_back_tokens=1000, load_back_bytes=1000 * 131_072, load_back_seconds=0.003, load_back_ops=1,
        prefetch_gbps_sum=0.5, prefetch_ops=1,
    )  # fmt: skip
    assert policy.predict(request, cands["shared"], 0.0)["ttft_s"] > ttft["shared"] + 1.0


def test_dynamo_cost_credits_tiers_like_dynamo() -> None:
    policy = create_policy("dynamo-cost")
    request = _request(1600)  # 100 blocks
    a, b, c = loopback_workers(3, 41000)
    cands = [
        Candidate(worker=a, matched_blocks=40, host_matched_blocks=40, shared_matched_blocks=40),
        Candidate(worker=b, matched_blocks=0, host_matched_blocks=40, shared_matched_blocks=40),
        Candidate(worker=c, matched_blocks=0, host_matched_blocks=0, shared_matched_blocks=40),
    ]
    decision = policy.select(request, cands)
    credits = {w: decision.scores[w]["overlap_credit"] for w in ("w0", "w1", "w2")}
    assert credits == {"w0": 40.0, "w1": 30.0, "w2": 10.0}  # 1.0 device, 0.75 host, 0.25 disk per block
    assert decision.ranked[0] is a


# -- the router ---------------------------------------------------------------------------------------
def test_the_router_reports_the_per_tier_match_in_spans_and_metrics() -> None:
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    workers = loopback_workers(2, 41000)
    for w in workers:
        w.info = _hicache_info()
        w.model = "m"
    # Priors of an H100-class GPU, the hardware the transfer priors describe: with slower compute priors
    # the shared-tier prefetch on w1 would tie with w0's mixed match (this test is about reporting).
    h100 = {"prefill_floor_s": 0.015, "prefill_per_token_s": 23e-6, "attention_per_token2_s": 0.52e-9}
    app = RouterApp(RouterConfig(policy={"name": "prefix-aware", "prefix_aware": h100}), WorkerRegistry(workers))
    exporter = InMemorySpanExporter()
    app.telemetry.add_span_processor(SimpleSpanProcessor(exporter))
    ids = list(range(640))  # 40 blocks
    keys = block_keys(ids, PAGE, chain_seed("m"))
    app.index.store("w0", keys[:10])
    app.index.store("w0", keys[10:20], "host")
    app.index.store_shared(storage_group(workers[0]) or "", keys[:30])
    app.index.set_unknown("w0", False)
    app.index.set_unknown("w1", False)
    outcome = app.router.route(ParsedRequest(path="/generate", kind="generate", model="m", input_ids=ids))
    app.router.finish(outcome)
    tiers = {c.worker.id: c.tier_blocks for c in outcome.candidates}
    assert tiers == {"w0": {"gpu": 10, "host": 10, "shared": 10}, "w1": {"gpu": 0, "host": 0, "shared": 30}}
    assert outcome.worker.id == "w0"
    (span,) = exporter.get_finished_spans()
    attrs = dict(span.attributes or {})
    assert list(attrs["router.candidates.host_blocks"]) == [10, 0]  # type: ignore[arg-type]
    assert list(attrs["router.candidates.shared_blocks"]) == [10, 30]  # type: ignore[arg-type]
    assert (attrs["router.chosen.gpu_blocks"], attrs["router.chosen.host_blocks"]) == (10, 10)
    text = generate_latest(app.telemetry.metrics).decode()
    assert 'prefix_router_matched_tier_blocks_total{policy="prefix-aware",tier="host"} 10.0' in text
    assert 'prefix_router_matched_tier_blocks_total{policy="prefix-aware",tier="shared"} 10.0' in text
    assert "prefix_router_index_shared_blocks{" in text

"""Unit tests of the benchmark's pure parts: workloads, oracle, metrics, report."""

from __future__ import annotations

import itertools
import json
import math
import os
import random
from pathlib import Path

import pytest

from benchmarks.metrics import RequestResult, Summary, failed, max_over_mean, summarize
from benchmarks.oracle import PooledCache, oracle_hit_rate
from benchmarks.report import (
    BenchReport,
    markdown_table,
    ms_with_interval,
    plot_ttft_cdf,
    plot_ttft_vs_load,
    write_json,
)
from benchmarks.stats import bootstrap_intervals, distribution, percentile
from benchmarks.workloads.base import block_text, iter_token_ids, prefix_hash, word_vocabulary
from benchmarks.workloads.generated import AGENT_BLOCK, agent_workload, gsp_workload, multiturn_workload
from benchmarks.workloads.trace import TraceError, TraceWindow, read_trace, trace_workload
from prefix_common.tokenization import load_tokenizer

SHARED_TRACE = Path(__file__).resolve().parents[2] / ".." / "shared" / "traces" / "mooncake-conversation.jsonl"


def test_block_text_is_exactly_n_tokens_and_concatenates() -> None:
    tok = load_tokenizer()
    a, b = block_text("t", 1, 512), block_text("t", 2, 100)
    assert len(tok.encode_text(a, add_special_tokens=False)) == 512
    assert len(tok.encode_text(b, add_special_tokens=False)) == 100
    # No BPE merge crosses a block boundary: tokens of a+b are tokens of a then tokens of b.
    assert tok.encode_text(a + b, add_special_tokens=False) == (
        tok.encode_text(a, add_special_tokens=False) + tok.encode_text(b, add_special_tokens=False)
    )
    assert block_text("t", 1, 512) == a and block_text("t", 3, 512) != a
    assert len(word_vocabulary()) > 1000


def test_gsp_groups_share_their_system_prompt_and_are_deterministic() -> None:
    w = gsp_workload(groups=3, prompts_per_group=4, system_prompt_len=64, question_len=8, output_len=5, rate=10, seed=1)
    again = gsp_workload(
        groups=3, prompts_per_group=4, system_prompt_len=64, question_len=8, output_len=5, rate=10, seed=1
    )
    assert [r.messages for r in w.requests] == [r.messages for r in again.requests]
    assert [r.arrival_s for r in w.requests] == [r.arrival_s for r in again.requests]
    assert len(w.requests) == 12
    systems = {r.messages[0]["content"] for r in w.requests}
    assert len(systems) == 3
    assert len({r.messages[1]["content"] for r in w.requests}) == 12
    assert all(r.max_tokens == 5 for r in w.requests)
    arrivals = [r.arrival_s for r in w.requests]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0
    other = gsp_workload(
        groups=3, prompts_per_group=4, system_prompt_len=64, question_len=8, output_len=5, rate=10, seed=2
    )
    assert other.requests[0].messages != w.requests[0].messages or other.requests[1].messages != w.requests[1].messages


def test_multiturn_history_grows_and_repeats_earlier_turns() -> None:
    w = multiturn_workload(
        sessions=2,
        turns=3,
        system_prompt_len=16,
        question_len=8,
        answer_len=8,
        output_len=4,
        turn_interval_s=1.0,
        rate=5.0,
        seed=0,
    )
    assert len(w.requests) == 6
    by_session: dict[str, list] = {}
    for r in w.requests:
        by_session.setdefault(r.session or "", []).append(r)
    for turns in by_session.values():
        assert [len(t.messages) for t in turns] == [2, 4, 6]
        # Turn k+1 starts with all of turn k's messages (plus the assistant answer).
        for prev, nxt in itertools.pairwise(turns):
            assert nxt.messages[: len(prev.messages)] == prev.messages
            assert nxt.arrival_s == pytest.approx(prev.arrival_s + 1.0)


def _agent(**changes: object) -> list:
    shape: dict = {
        "sessions": 40,
        "tenants": 4,
        "tenant_zipf": 1.0,
        "docs_per_tenant": 3,
        "doc_zipf": 1.0,
        "doc_share": 0.5,
        "steps": (2, 6),
        "step_s": 1.0,
        "fan_out": 3,
        "fan_out_share": 0.3,
        "output_len": 16,
        "rate": 20.0,
        "seed": 3,
    }
    shape.update(changes)
    return agent_workload(**shape).requests


def test_agent_sessions_grow_share_tenants_and_documents_and_fan_out() -> None:
    requests = _agent()
    assert requests == _agent()  # deterministic
    tok = load_tokenizer()
    by_session: dict[str, list] = {}
    for r in requests:
        by_session.setdefault(r.session or "", []).append(r)
    assert len(by_session) == 40
    fanned = 0
    for steps in by_session.values():
        assert 2 <= len({len(r.messages) for r in steps}) <= 6  # one history length per step
        for prev, nxt in itertools.pairwise(steps):
            assert nxt.arrival_s >= prev.arrival_s
            if len(nxt.messages) == len(prev.messages):  # parallel calls of one step: same history, own result
                fanned += 1
                assert nxt.messages[:-1] == prev.messages[:-1] and nxt.messages[-1] != prev.messages[-1]
                assert nxt.arrival_s - prev.arrival_s == pytest.approx(0.005)
            else:  # the next step: everything before plus an action and a result
                assert len(nxt.messages) == len(prev.messages) + 2
                # (the step before may be a parallel call whose result the session did not go on from)
                assert nxt.messages[: len(prev.messages) - 1] == prev.messages[:-1]
                assert nxt.messages[-2]["role"] == "assistant"
                assert 0.5 <= nxt.arrival_s - prev.arrival_s <= 1.5 + 0.01
    assert fanned > 0
    # Tenants: their tool prompts are shared by sessions and Zipf-popular; every length is whole blocks.
    systems = [r.messages[0]["content"] for s in by_session.values() for r in s[:1]]
    counts = sorted((systems.count(t) for t in set(systems)), reverse=True)
    assert len(counts) <= 4 and counts[0] > counts[-1]
    for text in set(systems):
        assert len(tok.encode_text(text, add_special_tokens=False)) % AGENT_BLOCK == 0
    openings = [s[0].messages[1]["content"] for s in by_session.values()]
    with_doc = [o.split("\n\nTask:")[0] for o in openings if "\n\nTask:" in o]
    assert 0 < len(with_doc) < 40 and len(set(with_doc)) < len(with_doc)  # some sessions share a document
    # No documents, no fan-out: each session a plain chain of steps.
    plain = _agent(doc_share=0.0, fan_out_share=0.0)
    assert not any("\n\nTask:" in r.messages[1]["content"] for r in plain)
    assert len(plain) == len({(r.session, len(r.messages)) for r in plain})
    with pytest.raises(ValueError, match="steps a range"):
        _agent(steps=(3, 2))


def test_trace_prompts_follow_hash_ids_and_lengths(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"timestamp": 0, "input_length": 40, "output_length": 3, "hash_ids": [0, 1, 2]},
                {"timestamp": 500, "input_length": 30, "output_length": 9, "hash_ids": [0, 1]},
                {"timestamp": 2000, "input_length": 20, "output_length": 1, "hash_ids": [0, 5]},
            ]
        )
        + "\n"
    )
    w = trace_workload(trace, block_size=16, window=TraceWindow(time_scale=2.0, max_output=5))
    assert [r.arrival_s for r in w.requests] == [0.0, 0.25, 1.0]
    assert [r.max_tokens for r in w.requests] == [3, 5, 1]
    tok = load_tokenizer()
    texts = [r.messages[0]["content"] for r in w.requests]
    assert [len(tok.encode_text(t, add_special_tokens=False)) for t in texts] == [40, 30, 20]
    assert texts[1] == texts[0][: len(texts[1])]  # shares ids 0,1 (second block cut to 14 tokens)
    assert texts[2][: len(texts[2]) // 2] != texts[0][len(texts[2]) // 2 :]
    cut = trace_workload(trace, block_size=16, window=TraceWindow(max_input=20))
    assert [len(tok.encode_text(r.messages[0]["content"], add_special_tokens=False)) for r in cut.requests] == [
        20,
        20,
        20,
    ]
    assert cut.requests[0].messages[0]["content"] == texts[0][: len(cut.requests[0].messages[0]["content"])]
    poisson = trace_workload(trace, block_size=16, window=TraceWindow(rate=1.0, start=1, max_requests=1))
    assert len(poisson.requests) == 1 and poisson.requests[0].messages == w.requests[1].messages


def test_trace_sampling_keeps_whole_families(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    # 200 families (second hash id), three turns each, interleaved in time.
    lines = [
        {
            "timestamp": t * 1000 + f,
            "input_length": 24,
            "output_length": 1,
            "hash_ids": [0, 1000 + f, 5000 + f * 10 + t],
        }
        for t in range(3)
        for f in range(200)
    ]
    trace.write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    kept = read_trace(trace, sample=0.25)
    families: dict[int, int] = {}
    for r in kept:
        families[r.hash_ids[1]] = families.get(r.hash_ids[1], 0) + 1
    assert set(families.values()) == {3}  # every kept conversation keeps all of its turns
    assert 25 <= len(families) <= 75
    assert read_trace(trace, sample=0.25, start=3, limit=2) == kept[3:5]


def test_trace_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read trace"):
        read_trace(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0}\n')
    with pytest.raises(TraceError, match=r"bad\.jsonl:1: not a Mooncake record"):
        read_trace(bad)


def test_real_conversation_trace_window_when_present() -> None:
    if not SHARED_TRACE.is_file():
        pytest.skip(f"shared trace not present at {SHARED_TRACE}")
    w = trace_workload(SHARED_TRACE, window=TraceWindow(start=10, max_requests=5, time_scale=10.0))
    assert len(w.requests) == 5
    first = [r.messages[0]["content"][:200] for r in w.requests]
    assert len(set(first)) == 1  # every conversation request starts with hash id 0


def test_prefix_hash_depends_only_on_leading_chars() -> None:
    assert prefix_hash("a" * 10 + "x", 10) == prefix_hash("a" * 10 + "y", 10)
    assert prefix_hash("b" * 10, 10) != prefix_hash("a" * 10, 10)


def test_oracle_counts_leading_pages_and_evicts_lru() -> None:
    cache = PooledCache(capacity_tokens=64, page_size=4)
    a = list(range(16))
    assert cache.access(a) == 0
    assert cache.access(a + [99, 98]) == 16  # all four pages of a
    assert cache.access(a) == 15  # fully cached: the last token is always computed
    b = list(range(100, 164))  # 16 pages: evicts everything of a
    cache.access(b)
    assert cache.access(a) == 0
    assert cache.hit_rate == pytest.approx((16 + 15) / (16 + 18 + 16 + 64 + 16))


def test_oracle_evicts_leaves_before_shared_roots() -> None:
    cache = PooledCache(capacity_tokens=16, page_size=4)  # four pages
    root = [1, 2, 3, 4]
    cache.access(root + [10, 11, 12, 13])
    cache.access(root + [20, 21, 22, 23])
    cache.access(root + [30, 31, 32, 33])  # over capacity: an old leaf goes, the shared root stays
    assert cache.access(root + [40, 41, 42, 43]) == 4


def test_oracle_on_gsp_matches_the_closed_form() -> None:
    w = gsp_workload(
        groups=2, prompts_per_group=4, system_prompt_len=256, question_len=16, output_len=4, rate=10, seed=3
    )
    tokens = list(iter_token_ids(w.requests))
    rate = oracle_hit_rate(tokens, capacity_tokens=1_000_000, page_size=16)
    # Each group's 2nd..4th request hits the system prompt's full pages (template header included).
    assert 0.6 < rate < 0.75
    assert oracle_hit_rate(tokens, capacity_tokens=0, page_size=16) == 0.0
    # Prompts no single worker could hold are rejected by every worker: the oracle skips them too.
    assert (
        oracle_hit_rate(tokens + [list(range(5000))], capacity_tokens=1_000_000, page_size=16, max_prompt_tokens=4096)
        == rate
    )


def test_percentiles_and_summary() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    assert math.isnan(percentile([], 50))
    d = distribution([0.1, 0.2, 0.3])
    assert d["p50"] == pytest.approx(0.2) and d["mean"] == pytest.approx(0.2)
    results = [
        RequestResult(
            index=0, sent_s=0.0, ttft_s=0.1, e2e_s=1.0, prompt_tokens=100, cached_tokens=50, output_tokens=10
        ),
        RequestResult(index=1, sent_s=0.5, ttft_s=0.3, e2e_s=1.5, prompt_tokens=100, cached_tokens=0, output_tokens=10),
        RequestResult(index=2, sent_s=1.0, error="HTTP 503: x"),
    ]
    s = summarize("x", 2.0, results, {"w1": 2, "w2": 0}, workers=2)
    assert (s.requests, s.errors) == (3, 1)
    assert s.hit_rate == pytest.approx(0.25)
    assert s.output_tok_s == pytest.approx(20 / 2.0)
    assert s.max_mean_requests == pytest.approx(2.0)
    assert s.ttft_s["p50"] == pytest.approx(0.2)
    assert s.error_samples == ["HTTP 503: x"]
    assert max_over_mean({"a": 3}, workers=3) == pytest.approx(3.0)  # idle workers count


def test_bootstrap_intervals_cover_the_estimate_narrow_with_samples_and_repeat() -> None:
    rng = random.Random(7)
    small = [rng.expovariate(1.0) for _ in range(200)]
    large = [rng.expovariate(1.0) for _ in range(2000)]
    ci_small, ci_large = bootstrap_intervals(small), bootstrap_intervals(large)
    for values, ci in ((small, ci_small), (large, ci_large)):
        point = distribution(values)
        for q in ("p50", "p99", "mean"):
            low, high = ci[q]
            assert low < point[q] < high, (q, low, point[q], high)
    for q in ("p50", "p99", "mean"):  # ten times the samples: a clearly narrower interval
        assert ci_large[q][1] - ci_large[q][0] < 0.6 * (ci_small[q][1] - ci_small[q][0]), q
    # The exponential's true p99 (ln 100 = 4.6) and mean (1) lie inside the large sample's intervals.
    assert ci_large["p99"][0] < math.log(100) < ci_large["p99"][1]
    assert ci_large["mean"][0] < 1.0 < ci_large["mean"][1]
    assert bootstrap_intervals(small) == ci_small  # fixed seed: the same run prints the same interval
    assert bootstrap_intervals(small, seed=1) != ci_small
    half = bootstrap_intervals(small, confidence=0.5)["p99"]
    assert ci_small["p99"][0] <= half[0] < half[1] <= ci_small["p99"][1]
    assert all(math.isnan(v) for v in bootstrap_intervals([1.0])["p99"])
    s = summarize("x", 1.0, [RequestResult(index=i, sent_s=0.0, ttft_s=v, e2e_s=v) for i, v in enumerate(small)], {}, 1)
    assert s.ttft_ci_s == ci_small and s.to_json()["ttft_ci95_s"] == ci_small
    assert ms_with_interval(1.7641, [1.5, 2.1]) == "1764 [1500-2100]"
    assert ms_with_interval(1.7641, [math.nan, math.nan]) == "1764"


def test_report_table_json_and_plots(tmp_path: Path) -> None:
    def row(name: str, ttft: float, rate: float) -> RequestResult:
        return RequestResult(
            index=0, sent_s=0.0, ttft_s=ttft, e2e_s=ttft + 1, prompt_tokens=10, cached_tokens=5, output_tokens=3
        )

    summaries: list[Summary] = []
    ttfts: dict[tuple[str, float | None], list[float]] = {}
    for rate in (1.0, 2.0):
        for name, ttft in (("envoy-rr", 0.4), ("sgl-router", 0.2), ("ours:prefix-aware", 0.1)):
            summaries.append(summarize(name, rate, [row(name, ttft * rate, rate)], {"w": 1}, workers=1))
            ttfts[(name, rate)] = [ttft * rate]
    summaries.append(failed("envoy-lr", 2.0, "boom"))
    report = BenchReport("gsp", {}, {1.0: 0.8, 2.0: 0.8}, summaries, ttfts, {})
    table = markdown_table(report)
    assert "| ours:prefix-aware | 1 | 0 | 100 |" in table
    assert "| 0.25 | 0.25 | 0.50 | 0.50 |" in table  # ratios to envoy-rr and sgl-router
    assert "envoy-lr | did not start: boom" in table
    out = tmp_path / "r.json"
    write_json(report, out)
    data = json.loads(out.read_text())
    assert data["oracle_hit_rate"] == 0.8
    names = [c["name"] for c in data["contenders"]]
    assert names.count("ours:prefix-aware") == 2 and "envoy-lr" in names
    ours = data["contenders"][2]
    assert set(ours["ttft_s"]) == {"p50", "p90", "p99", "mean"}
    assert ours["vs_round_robin"]["ttft_p50"] == pytest.approx(0.25)
    assert ours["hit_rate_vs_oracle"] == pytest.approx(0.5 / 0.8)
    assert data["contenders"][-1]["start_error"] == "boom" and data["contenders"][-1]["hit_rate"] is None
    paths = plot_ttft_cdf(report, tmp_path)
    sweep = plot_ttft_vs_load(report, tmp_path)
    assert len(paths) == 2 and sweep is not None
    for p in [*paths, sweep]:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("name", ["envoy-rr", "envoy-lr", "envoy-ringhash"])
def test_baseline_envoy_configs_validate(name: str, tmp_path: Path) -> None:
    import subprocess

    from benchmarks.fleet.envoy_baselines import EnvoyBaseline, envoy_binary
    from benchmarks.fleet.process import ContenderError

    try:
        binary = envoy_binary()
    except ContenderError as exc:
        pytest.skip(str(exc))
    contender = EnvoyBaseline(name)
    path, _, _ = contender.write_config(["http://127.0.0.1:30001", "http://127.0.0.1:30002"])
    try:
        text = path.read_text()
        done = subprocess.run(
            [binary, "--mode", "validate", "-c", str(path), "--disable-hot-restart", "--log-level", "error"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    finally:
        import asyncio

        asyncio.run(contender.stop())  # removes its temporary directory
    assert done.returncode == 0, done.stderr[-2000:]
    expected = {"envoy-rr": "ROUND_ROBIN", "envoy-lr": "LEAST_REQUEST", "envoy-ringhash": "RING_HASH"}[name]
    assert f"lb_policy: {expected}" in text
    assert ("header_name: x-prefix-hash" in text) == (name == "envoy-ringhash")


def test_sglang_cpu_engine_fills_only_the_defaults_not_given(tmp_path: Path) -> None:
    import argparse
    import subprocess
    import sys

    from benchmarks.suites.routing import CPU_DEFAULTS, apply_engine_defaults, configure

    parser = argparse.ArgumentParser()
    configure(parser)
    args = parser.parse_args(["--engine", "sglang-cpu", "--workers", "3"])
    apply_engine_defaults(args)
    assert args.workers == 3  # given: kept
    assert args.capacity_tokens == CPU_DEFAULTS["capacity_tokens"] and args.gsp_groups == CPU_DEFAULTS["gsp_groups"]
    sim = parser.parse_args([])
    apply_engine_defaults(sim)
    assert sim.workers == 4 and sim.capacity_tokens == 24576  # the simulator's defaults are untouched
    done = subprocess.run(
        [sys.executable, "-m", "prefix_router", "bench", "--engine", "sglang-cpu"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PREFIX_ROUTER_SGLANG_CPU": str(tmp_path / "none")},
    )
    assert done.returncode == 1 and "make sglang-cpu" in done.stderr and "Traceback" not in done.stderr


def test_cpu_reports_say_they_are_cpu_figures() -> None:
    report = BenchReport("gsp", {}, {2.0: 0.5}, [failed("envoy-rr", 2.0, "x")], {}, {"engine": "sglang-cpu"})
    assert "CPU figures" in markdown_table(report)


# -- the tiered suite ---------------------------------------------------------------------------------
def test_longctx_mixes_document_qa_and_growing_chat_sessions() -> None:
    from benchmarks.workloads.generated import longctx_workload

    kwargs = {
        "docs": 3,
        "doc_len": 64,
        "questions_per_doc": 2,
        "question_len": 8,
        "sessions": 2,
        "turns": 3,
        "system_prompt_len": 32,
        "turn_len": 8,
        "output_len": 4,
        "duration_s": 10.0,
        "seed": 1,
    }
    w = longctx_workload(**kwargs)  # type: ignore[arg-type]
    assert len(w.requests) == 3 * 2 + 2 * 3 and w.name == "longctx"
    assert [r.index for r in w.requests] == list(range(len(w.requests)))
    assert all(a.arrival_s <= b.arrival_s for a, b in itertools.pairwise(w.requests))
    qa = [r for r in w.requests if r.session is None]
    docs = {r.messages[0]["content"] for r in qa}
    assert len(docs) == 3 and all(sum(r.messages[0]["content"] == d for r in qa) == 2 for d in docs)
    turns = sorted((r for r in w.requests if r.session == "s0"), key=lambda r: r.arrival_s)
    assert [len(r.messages) for r in turns] == [2, 4, 6]  # system + the history, growing each turn
    assert max(r.arrival_s for r in w.requests) <= 10.0 * 1.5
    assert longctx_workload(**kwargs).requests == w.requests  # type: ignore[arg-type]  # deterministic


def test_tiered_report_goodput_gpu_seconds_and_targets() -> None:
    from benchmarks.metrics import FleetFigures
    from benchmarks.suites.tiered import TieredReport, gpu_seconds_per_request, tiered_table

    def run(name: str, ttft: float, busy: float, cached: dict[str, int]) -> tuple[Summary, list[float]]:
        results = [
            RequestResult(index=i, sent_s=float(i), ttft_s=ttft * (1 + i / 10), e2e_s=ttft * 2, prompt_tokens=100)
            for i in range(10)
        ]
        s = summarize(name, None, results, {}, 2)
        s.fleet = FleetFigures(prompt_tokens=1000, cached_tokens=cached, busy_prefill_s=busy, busy_decode_s=busy)
        return s, sorted(r.ttft_s or 0.0 for r in results)

    rows = []
    for tier, rr_ttft, ours_ttft in (("none", 1.0, 0.9), ("host", 0.9, 0.5)):
        rr, rr_t = run("envoy-rr", rr_ttft, 1.0, {"device": 100})
        ours, ours_t = run("ours:prefix-aware", ours_ttft, 0.7, {"device": 400, "host": 300})
        rows += [(tier, rr, rr_t), (tier, ours, ours_t)]
    report = TieredReport("longctx", {}, 0.3, rows, slo_s=1.0, setup={"missing_contenders": ["smg"]})
    ours_host = report.find("host", "ours:prefix-aware")
    assert ours_host is not None and gpu_seconds_per_request(ours_host) == pytest.approx(0.14)
    rate, share = report.goodput(*rows[3][1:])
    assert share == pytest.approx(1.0) and rate > 0  # 0.5 s .. 0.95 s: all within the 1 s SLO
    assert report.goodput(*rows[0][1:])[1] == pytest.approx(0.1)  # envoy-rr, none: only the first one
    targets = {t: m for t, m, _f in report.targets()}
    assert targets["ours (host tier) TTFT p50 >= 40% below round robin without HiCache"] is True
    assert targets["ours (host tier) >= 25% fewer GPU-seconds per request than round robin without HiCache"] is True
    assert all(m for t, m in targets.items() if "every peer" in t)
    table = tiered_table(report)
    assert "| ours:prefix-aware | 10 | 0 |" in table and "0.400 | 0.300 | 0.000" in table
    assert "not in this build, not run: smg" in table
    data = report.to_json()
    assert data["rows"][1]["hit_rate_by_tier"] == {"device": 0.4, "host": 0.3, "storage": 0.0}
    assert data["targets"][0]["met"] is True


def test_smg_contenders_talk_to_their_own_door_with_their_own_ports() -> None:
    from benchmarks.fleet.contenders import create_contender
    from benchmarks.fleet.sgl_routers import Smg

    http, grpc_ = create_contender("smg"), create_contender("smg-grpc", page_size=64)
    assert (http.name, http.worker_transport) == ("smg", "http")
    assert (grpc_.name, grpc_.worker_transport) == ("smg-grpc", "grpc")
    assert isinstance(http, Smg) and isinstance(grpc_, Smg)
    urls = ["grpc://127.0.0.1:1", "grpc://127.0.0.1:2"]
    argv = grpc_.argv(30000, 29001, urls)
    # `python -m smg`: sglang-router installs a console script named smg as well.
    assert argv[1:4] == ["-m", "smg", "launch"]
    assert argv[argv.index("--worker-urls") + 1 : argv.index("--worker-urls") + 3] == urls
    assert argv[argv.index("--policy") + 1] == "cache_aware"
    assert argv[argv.index("--block-size") + 1] == "64"  # = the workers' page size
    assert argv[argv.index("--prometheus-port") + 1] == "29001"
    assert "--block-size" not in http.argv(30000, 29002, ["http://127.0.0.1:1"])

"""Index drift on real SGLang 0.5.23: near zero while a worker's KV events flow, visible once they are cut.

Two real SGLang CPU workers (the session's, a 2048-token pool each) behind the real Envoy and the router
process, every response sampled (``observability.drift_sample_rate: 1``). The router follows worker A's
KV events; worker B's are cut (its configured publisher and replay endpoints lead nowhere), so for B the
router has only its own record of what it sent there. Chat turns over shared system prompts go through
the gateway; then each worker flushes its cache. A's events say so (AllBlocksCleared) and its predictions
stay right; B's flush goes unseen and every request the router still sends B on the strength of its record
is a mismatch. The figures are printed (run with ``-s``) and quoted in docs/routing.md, "Index drift".
"""

from __future__ import annotations

import functools
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from prefix_common.addresses import free_port
from prefix_router.stack import GatewayStack
from tests.support import waiting
from tests.support.gateway_http import flush_cache, post, request
from tests.support.real_sglang import tiny_model_config
from tests.support.sglang_session import fit_chat

pytestmark = [pytest.mark.real_sglang, pytest.mark.timeout(1200)]

MODEL = "tiny-llama"
SYSTEMS = {
    name: f"You are the assistant of the {name} team. Answer briefly and politely. " * 20
    for name in ("billing", "travel", "support", "legal")
}
NAMES = ("samples", "mismatched", "predicted", "served")
wait_until = functools.partial(waiting.wait_until, timeout=60.0, every=0.2)
COUNTERS = {
    "prefix_router_drift_samples_total": "samples",
    "prefix_router_drift_mismatched_total": "mismatched",
    "prefix_router_predicted_cached_tokens_total": "predicted",
    "prefix_router_served_cached_tokens_total": "served",
}


def _id(worker: Any) -> str:
    return f"127.0.0.1:{worker.port}"


@pytest.fixture(scope="module")
def stack(
    sglang_cpu_workers: list[Any], envoy_bin: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayStack]:
    synced, cut = sglang_cpu_workers
    # Cold caches whatever ran on the session's workers before (the figures assume it). This module runs after
    # test_gateway.py, whose first test counts on the workers' start-up warm-up being all they hold.
    for worker in sglang_cpu_workers:
        flush_cache(worker.url)
    dead = [free_port(), free_port()]  # nothing listens there: the router never hears B's events
    config = tmp_path_factory.mktemp("router") / "router.yaml"
    config.write_text(
        tiny_model_config() + "observability: {drift_sample_rate: 1.0}\n"
        "debug: {decisions: 256}\n"
        "workers:\n"
        f"  - url: {synced.url}\n"
        f"  - url: {cut.url}\n"
        f"    kv_events_endpoint: tcp://127.0.0.1:{dead[0]}\n"
        f"    replay_endpoint: tcp://127.0.0.1:{dead[1]}\n"
    )
    metrics_port = free_port()
    router = [sys.executable, "-m", "prefix_router", "serve", "--host", "127.0.0.1", "--port", "{port}"]
    router += ["--metrics-port", str(metrics_port), "--config", str(config)]
    with GatewayStack(
        worker_urls=[synced.url, cut.url], router_command=router, metrics_port=metrics_port, timeout_ms=5000
    ) as gateway:
        yield gateway


def drift(stack: GatewayStack) -> dict[str, dict[str, float]]:
    """Per worker: samples, mismatched, predicted and served cached tokens (sums)."""
    text = request(f"http://127.0.0.1:{stack.metrics_port}/metrics").body.decode()
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = COUNTERS.get(sample.name)
            if name is not None:
                out.setdefault(sample.labels["worker"], dict.fromkeys(NAMES, 0.0))[name] = sample.value
    return out


def delta(after: dict[str, dict[str, float]], before: dict[str, dict[str, float]], worker: str) -> dict[str, float]:
    zero = dict.fromkeys(NAMES, 0.0)
    return {k: after.get(worker, zero)[k] - before.get(worker, zero)[k] for k in NAMES}


def ask(stack: GatewayStack, system: str, user: str, how: int) -> str:
    """One chat turn (``how`` 0: a JSON answer, 1: streamed with usage); the worker that served it."""
    messages = fit_chat(system, user)
    body: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": 4, "ignore_eos": True}
    if how == 1:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    reply = post(stack.url + "/v1/chat/completions", body, timeout=180)
    assert reply.status == 200, reply.body
    return reply.headers["x-upstream-host"]


def samples(stack: GatewayStack) -> float:
    return sum(w["samples"] for w in drift(stack).values())


def run(stack: GatewayStack, turns: list[tuple[str, str]]) -> dict[str, str]:
    """Send the turns one by one; every one is sampled. Returns which worker served each (system, user)."""
    served: dict[str, str] = {}
    for i, (name, user) in enumerate(turns):
        counted = samples(stack) + 1
        served[f"{name}|{user}"] = ask(stack, SYSTEMS[name], user, i % 2)
        wait_until(lambda: samples(stack) >= counted, what="the sample counted")  # noqa: B023 (called at once)
    return served


def report(phase: str, stack: GatewayStack, before: dict[str, dict[str, float]], workers: dict[str, str]) -> None:
    after = drift(stack)
    for role, worker in workers.items():
        d = delta(after, before, worker)
        share = d["mismatched"] / d["samples"] if d["samples"] else 0.0
        print(
            f"{phase:<28} {role:<14} samples {d['samples']:>3.0f}  mismatched {d['mismatched']:>3.0f} ({share:5.1%})"
            f"  predicted {d['predicted']:>6.0f}  served {d['served']:>6.0f}"
        )


def test_drift_is_near_zero_with_events_and_visible_once_they_are_cut(
    stack: GatewayStack, sglang_cpu_workers: list[Any]
) -> None:
    synced, cut = sglang_cpu_workers
    a, b = _id(synced), _id(cut)
    roles = {"A (events)": a, "B (events cut)": b}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"\ncommit {commit}; workers A {a}, B {b}")
    # Steady state: four shared system prompts, six turns each, one at a time.
    start = drift(stack)
    turns = [(name, f"Question {turn} for the {name} desk") for turn in range(6) for name in SYSTEMS]
    served = run(stack, turns)  # which worker served each turn (named in a failure)
    report("steady state", stack, start, roles)
    steady = drift(stack)
    for worker in (a, b):
        d = delta(steady, start, worker)
        assert d["samples"] > 0, f"{worker} served nothing: {served}"
    on_a = delta(steady, start, a)
    assert on_a["mismatched"] <= 0.1 * on_a["samples"], on_a  # events flowing: the index is right
    assert on_a["served"] > 0  # later turns found their system prompt cached, as predicted

    # Twice: each worker flushes its cache; A's events say so, B's cannot. Then the last turn of every system
    # prompt again (the router's record of B's sends is freshest there): on B each one is a prefix it lost.
    before = drift(stack)
    for last in (5, 4):
        for worker in (synced, cut):
            flush_cache(worker.url)
        wait_until(lambda: _gpu_blocks(stack, a) == 0, what="A's index emptied by its AllBlocksCleared")
        time.sleep(2.5)  # past index.speculative_ttl_s: the router's record of A's last sends has expired
        run(stack, [(name, f"Question {last} for the {name} desk") for name in SYSTEMS])
    report("after each worker flushed", stack, before, roles)
    view = request(f"http://127.0.0.1:{stack.metrics_port}/debug/decisions?limit=8").json()
    for row in reversed(view["decisions"]):
        served = row["served"] or {}
        print(
            f"  {row['worker']:<16} {row['reason']:<24} predicted {row['predicted_cached_tokens']:>4}"
            f"  served {served.get('cached_tokens')!s:>4}  prompt {row['prompt_tokens']}"
        )
    flushed = drift(stack)
    after_a, after_b = delta(flushed, before, a), delta(flushed, before, b)
    assert after_a["mismatched"] <= 0.1 * after_a["samples"], after_a  # A's flushes were seen
    assert after_b["samples"] >= 2, after_b
    assert after_b["mismatched"] >= 0.5 * after_b["samples"], after_b  # B's were not: visible drift
    assert after_b["predicted"] > 2 * after_b["served"], after_b  # the router believed in prefixes B had lost


def _gpu_blocks(stack: GatewayStack, worker: str) -> int:
    view = request(f"http://127.0.0.1:{stack.metrics_port}/debug/workers").json()
    return int(next(w for w in view["workers"] if w["id"] == worker)["index"]["blocks"]["gpu"])


def test_the_view_shows_what_the_engine_reported(stack: GatewayStack) -> None:
    view = request(f"http://127.0.0.1:{stack.metrics_port}/debug/decisions?limit=20").json()
    served = [d for d in view["decisions"] if d["served"] is not None]
    assert len(served) == 20  # every one sampled
    assert any(d["served"]["mismatched"] for d in served)
    for d in served:
        assert d["served"]["prompt_tokens"] == d["prompt_tokens"]  # the router tokenized as SGLang did

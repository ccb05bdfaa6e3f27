"""Differential conformance: the simulator against real SGLang 0.5.23, one scripted session on each.

The same session (``sglang_session.Runner``: every generation API, streaming and not, bad inputs,
``/flush_cache``, evictions in a 2048-token pool) runs against a real SGLang CPU worker and a simulated
worker with the same page size, capacity, context length and running-request cap. Then everything a
router, sgl-router, smg or a dashboard reads must agree:

* status, content type and body shape (keys, key order, value types) of every answer, SSE chunk
  shapes of every stream, the error status, shape, ``type`` and ``code`` of every bad input;
* ``cached_tokens``, ``prompt_tokens``, ``completion_tokens`` and ``finish_reason`` of every request;
* ``/server_info`` for the keys routers read (and ``kv_events``), ``/model_info``, ``/v1/models``,
  ``/v1/loads`` (all keys) and how much prefill work it says was done;
* ``/metrics``: the same families, types and label names;
* the KV events since the session's first flush: the same events, block hashes, tokens and order.

The only differences allowed are listed in ``ALLOWED`` with the reason, and keys SGLang writes only when it
could time them (``sglang_session.TIMED_KEYS``) may be missing from its answers; docs/sim-worker.md says what
the simulator leaves out on purpose.
"""

from __future__ import annotations

from typing import Any

import pytest

from prefix_router.fleet import start_fleet
from sglang_workers.process import WorkerProcess
from tests.support.real_sglang import CPU_POOL_TOKENS
from tests.support.sglang_session import (
    Observation,
    Runner,
    Session,
    shape,
    shape_differences,
    timed_only_in_simulator,
)

pytestmark = [pytest.mark.real_sglang, pytest.mark.timeout(900)]

MODEL = "tiny-llama"

# The server arguments a router (ours: discovery), sgl-router, smg or a dashboard reads from /server_info.
SERVER_INFO_KEYS = (
    "model_path",
    "tokenizer_path",
    "served_model_name",
    "host",
    "port",
    "skip_tokenizer_init",
    "is_embedding",
    "dtype",
    "kv_cache_dtype",
    "device",
    "context_length",
    "page_size",
    "chunked_prefill_size",
    "max_prefill_tokens",
    "max_running_requests",
    "max_total_tokens",
    "schedule_policy",
    "random_seed",
    "tp_size",
    "pp_size",
    "dp_size",
    "load_balance_method",
    "enable_dp_attention",
    "disable_radix_cache",
    "enable_hierarchical_cache",
    "speculative_algorithm",
    "disaggregation_mode",
    "enable_metrics",
    "enable_cache_report",
    "kv_events_config",
    "max_total_num_tokens",
    "status",
    "version",
    "kv_events",
)
INTERNAL_STATE_KEYS = ("effective_max_running_requests_per_dp", "last_gen_throughput", "memory_usage")

# (step, what) -> why the simulator differs there on purpose.
ALLOWED = {
    ("* /v1/loads*", "accelerator"): "the simulator models a GPU (its name); the CPU worker has none (null)",
    ("flush", "content_type"): "aiohttp always names a content type (text/plain); SGLang's Response sends none",
}


@pytest.fixture(scope="module")
def sessions(sglang_cpu_workers: list[Any]) -> tuple[Session, Session]:
    real_worker = sglang_cpu_workers[0]
    real = Runner(real_worker.url, real_worker.kv_events_endpoint, real_worker.replay_endpoint, MODEL).run()
    with start_fleet(
        "sim",
        1,
        page_size=16,
        capacity_tokens=CPU_POOL_TOKENS,
        context_length=4096,
        max_running_requests=1024,
        chunked_prefill_size=4096,
        model=MODEL,
        speedup=20,
    )[0] as sim_worker:
        sim = _run(sim_worker)
    return real, sim


def _run(worker: WorkerProcess) -> Session:
    return Runner(worker.url, worker.kv_events_endpoint, worker.replay_endpoint, MODEL).run()


def _allowed(step: str, what: str) -> bool:
    for (pattern, field), _why in ALLOWED.items():
        matches = step == pattern or (pattern.startswith("*") and pattern.strip("*") in step)
        if matches and field == what:
            return True
    return False


def _compare(real: Observation, sim: Observation) -> list[str]:
    problems = []
    if real.status != sim.status:
        problems.append(f"status: SGLang {real.status}, simulator {sim.status}")
    if real.content_type != sim.content_type and not _allowed(real.step, "content_type"):
        problems.append(f"content type: SGLang {real.content_type!r}, simulator {sim.content_type!r}")
    if real.values != sim.values:
        problems.append(f"values: SGLang {real.values}, simulator {sim.values}")
    for diff in shape_differences(real.shape, sim.shape):
        field = diff.split(":", 1)[0].lstrip(".").split(".")[0]
        if not _allowed(real.step, field) and not timed_only_in_simulator(diff):
            problems.append(diff)
    return problems


def test_every_answer_has_the_same_status_shape_and_token_counts(sessions: tuple[Session, Session]) -> None:
    real, sim = sessions
    sim_steps = sim.by_step()
    assert [o.step for o in real.observations] == [o.step for o in sim.observations]
    problems = {}
    for observation in real.observations:
        if "/server_info" in observation.step:
            continue  # next test: 1,000+ keys, of which the ones routers read are compared
        found = _compare(observation, sim_steps[observation.step])
        if found:
            problems[observation.step] = found
    assert problems == {}
    # The script did what it means to: caches were hit, evictions happened, errors were errors.
    by_step = real.by_step()
    assert by_step["generate ids #1"].values["cached_tokens"] == 0
    assert by_step["generate ids #2"].values["cached_tokens"] == 160
    assert by_step["chat #2"].values["cached_tokens"] > 0
    assert by_step["evict probe 0"].values["cached_tokens"] == 0  # evicted
    assert by_step["evict probe 5"].values["cached_tokens"] == 480  # still there
    assert by_step["generate empty input_ids"].status == 400 and by_step["unknown path"].status == 404


def test_server_info_keys_routers_read_agree(sessions: tuple[Session, Session]) -> None:
    real, sim = sessions
    for when in ("start", "end"):
        real_info, sim_info = real.raw[f"{when} /server_info"], sim.raw[f"{when} /server_info"]
        missing = [k for k in SERVER_INFO_KEYS if k not in real_info]
        assert missing == [], f"SGLang 0.5.23 no longer reports {missing}"
        picked = {k: shape(real_info[k]) for k in SERVER_INFO_KEYS}
        assert shape_differences(picked, {k: shape(sim_info.get(k, "<missing>")) for k in SERVER_INFO_KEYS}) == []
        real_state = {k: shape(real_info["internal_states"][0][k]) for k in INTERNAL_STATE_KEYS}
        sim_state = {k: shape(sim_info["internal_states"][0][k]) for k in INTERNAL_STATE_KEYS}
        memory_keys = set(real_state.pop("memory_usage")) - set(sim_state.pop("memory_usage"))
        assert real_state == sim_state and memory_keys == set()
        # The publisher a router subscribes to, described the same way.
        assert set(real_info["kv_events"]) == set(sim_info["kv_events"])
        assert real_info["kv_events"]["block_size"] == sim_info["kv_events"]["block_size"] == 16


def test_loads_count_the_same_prefill_work(sessions: tuple[Session, Session]) -> None:
    real, sim = sessions

    def prefilled(session: Session) -> int:
        start, end = session.raw["start /v1/loads"]["loads"][0], session.raw["end /v1/loads"]["loads"][0]
        return int(end["total_prefill_uncached_tokens"] - start["total_prefill_uncached_tokens"])

    assert prefilled(real) == prefilled(sim) > 0
    for session in (real, sim):
        end = session.raw["end /v1/loads"]["loads"][0]
        assert end["max_total_num_tokens"] == CPU_POOL_TOKENS and end["num_running_reqs"] == 0


def test_metrics_have_the_same_families_types_and_labels(sessions: tuple[Session, Session]) -> None:
    real, sim = sessions
    assert len(real.metrics) > 80
    assert sorted(set(real.metrics) - set(sim.metrics)) == []
    assert sorted(set(sim.metrics) - set(real.metrics)) == []
    assert {k: v for k, v in real.metrics.items() if sim.metrics[k] != v} == {}


def test_kv_events_are_the_same_events_with_the_same_hashes(sessions: tuple[Session, Session]) -> None:
    real, sim = sessions
    kinds = [e["type"] for e in real.events]
    assert kinds.count("AllBlocksCleared") == 2 and "BlockRemoved" in kinds  # the flush and the evictions
    assert len(real.events) == len(sim.events)
    for i, (a, b) in enumerate(zip(real.events, sim.events)):
        assert a == b, f"event {i}: SGLang {a}, simulator {b}"


def test_a_timed_key_missing_from_sglangs_answer_is_the_only_missing_key_allowed() -> None:
    """``decode_throughput`` may be absent from SGLang's answer; any other key missing on either side still counts."""
    sim = Observation("generate text #1", 200, "application/json", {"meta_info": {"id": "", "decode_throughput": 0.0}})
    timed = Observation("generate text #1", 200, "application/json", {"meta_info": {"id": ""}})
    assert _compare(timed, sim) == []
    assert _compare(sim, timed) == [".meta_info.decode_throughput: only in SGLang"]
    other = Observation("generate text #1", 200, "application/json", {"meta_info": {"decode_throughput": 0.0}})
    assert _compare(other, sim) == [".meta_info.id: only in the simulator"]

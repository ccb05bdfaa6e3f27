"""Index, policies and router wiring without processes (fast, deterministic)."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from prometheus_client import generate_latest

from extproc.config import IndexConfig, ObservabilityConfig, RouterConfig
from extproc.decision.policies import Candidate, Decision, Policy, PolicyError, RoutingRequest, create_policy
from extproc.decision.policies.prefix_aware import PrefixAwareOptions, PrefixAwarePolicy
from extproc.decision.policies.prefix_aware.cost_model import PrefillModel, WorkerCostModel
from extproc.decision.policies.session import SessionPolicy
from extproc.decision.policies.sgl_cache_aware import SglCacheAwarePolicy
from extproc.decision.request import ParsedRequest
from extproc.fleet.blocks import block_keys
from extproc.fleet.index import BlockIndex
from extproc.fleet.reports import WorkerLoad
from extproc.fleet.workers import Worker, WorkerRegistry
from extproc.memory import BLOCK_BYTES, RECENT_BYTES
from extproc.serving.app import RouterApp
from tests.support.routing import as_policy, loopback_workers


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _request(tokens: int, keys: list[int] | None = None, **extra: Any) -> RoutingRequest:
    return RoutingRequest(
        model="m",
        path="/generate",
        token_ids=list(range(tokens)),
        block_keys=keys if keys is not None else block_keys(list(range(tokens)), 16),
        **extra,
    )


# -- index ------------------------------------------------------------------------------------------
def test_match_walks_the_prompt_until_no_worker_matches() -> None:
    index = BlockIndex()
    keys = block_keys(list(range(160)), 16)
    index.store("a", keys[:7])
    index.store("b", keys[:3])
    index.store("c", keys[1:])  # holds later blocks but not the first: no prefix
    assert index.match(keys, ["a", "b", "c", "d"]) == {"a": 7, "b": 3, "c": 0, "d": 0}
    index.remove("a", keys[5:6])
    assert index.match(keys, ["a"]) == {"a": 5}
    index.clear("b")
    assert index.match(keys, ["b"]) == {"b": 0}


def _walked_depth(index: BlockIndex, keys: Sequence[int], worker: str, tiers: Sequence[str], now: float) -> int:
    """One worker's depth by the definition: leading keys confirmed in a tier or in a fresh record for it."""
    slot = index.slot(worker)
    synced = index._synced >> slot & 1
    cut = now - (index.config.speculative_ttl_s if synced else index.config.fallback_ttl_s)
    for i, key in enumerate(keys):
        confirmed = any(index._tiers[t].holders.get(key, 0) >> slot & 1 for t in tiers)
        stamp = index._recent.get(key, {}).get(slot)
        if not confirmed and (stamp is None or stamp <= cut):
            return i
    return len(keys)


def test_match_equals_each_workers_own_walk_over_random_stores_removals_and_records() -> None:
    rng = random.Random(5)
    clock = [0.0]
    index = BlockIndex(IndexConfig(speculative_ttl_s=2.0, fallback_ttl_s=5.0), clock=lambda: clock[0])
    workers = [f"w{i}" for i in range(6)]
    prompts = [block_keys([rng.randrange(50) for _ in range(16 * 24)], 16) for _ in range(5)]
    for step in range(600):
        clock[0] += rng.random() * 0.3
        worker, prompt = rng.choice(workers), rng.choice(prompts)
        cut = rng.randrange(len(prompt) + 1)
        action = rng.randrange(6)
        if action == 0:
            index.store(worker, prompt[:cut], rng.choice(["gpu", "host"]))
        elif action == 1:
            index.remove(worker, prompt[rng.randrange(cut + 1) : cut], rng.choice(["gpu", "host"]))
        elif action == 2:
            index.record_routed(worker, prompt[:cut])
        elif action == 3:
            index.set_unknown(worker, rng.random() < 0.5)
        asked = rng.sample(workers, rng.randrange(1, len(workers) + 1))
        tiers = rng.choice([("gpu",), ("gpu", "host")])
        keys = rng.choice(prompts)
        got = index.match(keys, asked, tiers[0] if len(tiers) == 1 else tiers)
        assert list(got) == asked
        for w in asked:  # match expires stale records first; the walk reads what it left
            assert got[w] == _walked_depth(index, keys, w, tiers, clock[0]), (step, w)


def test_tiers_are_kept_apart() -> None:
    index = BlockIndex()
    keys = block_keys(list(range(64)), 16)
    index.store("a", keys, "host")
    assert index.match(keys, ["a"], "gpu") == {"a": 0}
    assert index.match(keys, ["a"], "host") == {"a": 4}


def test_key_cache_reuses_shared_prefixes_and_equals_block_keys() -> None:
    from extproc.decision.key_cache import KeyCache

    cache = KeyCache(max_bytes=64 * 1024)
    rng = random.Random(5)
    bases = [[rng.randrange(128_000) for _ in range(rng.randint(0, 2000))] for _ in range(4)]
    for _ in range(300):
        base = rng.choice(bases)
        tokens = base[: rng.randint(0, len(base))] + [rng.randrange(128_000) for _ in range(rng.randint(0, 300))]
        size, seed, limit = rng.choice((16, 32)), rng.choice((0, 7)), rng.choice((None, 40))
        assert cache.keys(tokens, size, seed, limit) == block_keys(tokens, size, seed, limit=limit)
    assert 0 < cache.bytes <= cache.max_bytes
    wide = [2**40, *range(40)]  # ids beyond u32 take block_keys' own path
    assert cache.keys(wide, 16, 3) == block_keys(wide, 16, 3)


def test_key_cache_finds_each_sessions_own_turn_among_sessions_sharing_a_system_prompt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Interleaved sessions over one system prompt: each turn hashes only the blocks its own last turn lacked."""
    import extproc.decision.key_cache as key_cache

    hashed: list[int] = []

    def counting(tokens: list[int], block_size: int, seed: int = 0, **kw: Any) -> list[int]:
        keys = block_keys(tokens, block_size, seed, **kw)
        hashed.append(len(keys))
        return keys

    monkeypatch.setattr(key_cache, "block_keys", counting)
    cache = key_cache.KeyCache(max_bytes=8 << 20)
    rng = random.Random(9)
    system = [rng.randrange(128_000) for _ in range(64 * 16)]
    sessions = [system + [rng.randrange(128_000) for _ in range(200 * 16)] for _ in range(8)]
    for _ in range(4):
        for prompt in sessions:
            shared = len(prompt) // 16
            prompt += [rng.randrange(128_000) for _ in range(rng.randint(20, 100))]
            hashed.clear()
            assert cache.keys(prompt, 16, 0) == block_keys(prompt, 16, 0)
            if shared > 64 + 200:  # a later turn: only the blocks past the previous turn are hashed
                assert sum(hashed) == len(prompt) // 16 - shared
    assert len(cache) == len(sessions)  # each turn replaced the one it extends


def test_a_removal_event_overrides_the_routers_record_of_a_send() -> None:
    """Stored, then evicted within the record's lifetime (a full pool on real SGLang): the eviction wins."""
    clock = Clock()
    index = BlockIndex(IndexConfig(speculative_ttl_s=2.0, fallback_ttl_s=60.0), clock=clock)
    keys = block_keys(list(range(64)), 16)
    index.set_unknown("a", False)
    index.record_routed("a", keys)
    index.record_routed("b", keys)
    index.store("a", keys)
    clock.now += 0.5
    index.remove("a", keys[2:])
    assert index.match(keys, ["a", "b"]) == {"a": 2, "b": 4}  # b's record is its own
    clock.now += 2.0  # later expiry of the records still works
    assert index.match(keys, ["a"]) == {"a": 2}


def test_speculative_entries_expire_unless_confirmed() -> None:
    clock = Clock()
    index = BlockIndex(IndexConfig(speculative_ttl_s=2.0, fallback_ttl_s=60.0), clock=clock)
    keys = block_keys(list(range(64)), 16)
    index.set_unknown("a", False)  # its events flow
    index.record_routed("a", keys)
    assert index.match(keys, ["a"]) == {"a": 4}
    clock.now += 2.5
    assert index.match(keys, ["a"]) == {"a": 0}  # never confirmed: gone
    index.record_routed("a", keys)
    index.store("a", keys[:2])  # events confirm part of it
    clock.now += 2.5
    assert index.match(keys, ["a"]) == {"a": 2}
    # "b" never reported events: the router's own record lives longer
    index.record_routed("b", keys)
    clock.now += 30
    assert index.match(keys, ["b"]) == {"b": 4}
    clock.now += 31
    assert index.match(keys, ["b"]) == {"b": 0}


def test_memory_is_bounded_across_the_fleet() -> None:
    index = BlockIndex(max_blocks=10, max_recent=10)
    keys = block_keys(list(range(16 * 25)), 16)
    index.store("a", keys)
    assert index.size("a") == 10 and index.blocks_total == 10
    assert index.blocks("a") == set(keys[-10:])  # the most recently stored survive
    index.store("b", keys[:4])  # the largest holder makes room for a newcomer
    assert (index.size("a"), index.size("b"), index.blocks_total) == (6, 4, 10)
    assert index.blocks("a") == set(keys[-6:])
    index.remove("a", keys[-2:])
    assert index.blocks_total == 8
    for i in range(0, 25, 5):
        index.record_routed("b", keys[i : i + 5])
    assert sum(len(v) for v in index._recent.values()) <= 10 and index.recent_total <= 10
    assert index.memory() == {"index": 8 * BLOCK_BYTES, "speculative": index.recent_total * RECENT_BYTES}


def test_the_records_bound_keeps_what_a_later_decision_sent_again() -> None:
    """Dropping an old decision to make room leaves the keys a later decision refreshed (a session's next turn)."""
    clock = Clock()
    index = BlockIndex(clock=clock, max_recent=40)
    turn = list(range(16 * 8))
    first = block_keys(turn, 16)  # 8 blocks
    index.record_routed("a", first)
    clock.now += 0.1
    second = block_keys(turn + list(range(1000, 1000 + 16 * 4)), 16)  # the next turn: the same 8 blocks and 4 more
    index.record_routed("a", second)
    for i in range(5):  # other sessions' decisions to other workers fill the record: the largest worker's oldest go
        clock.now += 0.1
        index.record_routed(f"b{i}", block_keys(list(range(5000 + 100 * i, 5000 + 100 * i + 16 * 5)), 16))
    assert index.recent_total <= 40
    assert len(index._recent_fifo[index._slot("a")]) == 1  # the first turn's decision was dropped
    assert index.match(second, ["a"]) == {"a": 12}  # the second turn's record is whole
    assert sum(len(v) for v in index._recent.values()) <= index.recent_total


# -- prefix-aware -----------------------------------------------------------------------------------
def test_prefill_cost_model_shape() -> None:
    opts = PrefixAwareOptions()
    prior = PrefillModel(opts.prefill_floor_s, opts.prefill_per_token_s, opts.attention_per_token2_s)
    assert prior.seconds(0, 4096) == 0.0
    assert prior.seconds(1024, 0) == pytest.approx(0.02 + 1024 * 4e-5 + 1024**2 * 1e-9)
    # cached context makes new tokens dearer (attention over it), but far cheaper than recomputing
    assert prior.seconds(100, 8000) > prior.seconds(100, 0)
    assert prior.seconds(100, 8000) < prior.seconds(8100, 0) / 10


def _candidates(
    workers: list[Worker], matched: list[int], loads: Sequence[WorkerLoad | None] | None = None
) -> list[Candidate]:
    loads = loads or [None] * len(workers)
    return [
        Candidate(worker=w, matched_blocks=m, host_matched_blocks=m, load=ld, block_size=16)
        for w, m, ld in zip(workers, matched, loads)
    ]


def _select(policy: Policy, request: RoutingRequest, candidates: list[Candidate]) -> Decision:
    """What the router does: each candidate's load report reaches the policy (``on_load``), then it ranks."""
    for c in candidates:
        if c.load is not None:
            policy.on_load(c.worker, c.load)
    return policy.select(request, candidates)


def test_longest_cached_prefix_wins_when_idle() -> None:
    policy = create_policy("prefix-aware")
    workers = loopback_workers(3)
    decision = _select(policy, _request(4096), _candidates(workers, [10, 200, 0]))
    assert decision.ranked[0] is workers[1] and decision.reason == "prefix-hit"


def test_busy_holder_spills_to_an_idle_worker() -> None:
    policy = create_policy("prefix-aware")
    workers = loopback_workers(2)
    busy = WorkerLoad(num_running_reqs=40, num_waiting_reqs=30, token_usage=0.5, polled_at=time.monotonic())
    decision = _select(policy, _request(4096), _candidates(workers, [200, 0], [busy, None]))
    assert decision.ranked[0] is workers[1] and decision.reason == "prefix-spill"
    # own decisions queue up too: a long cold prompt routed to w0 delays the next one there
    cold = create_policy("prefix-aware")
    first = cold.select(_request(30000, keys=[1]), _candidates(workers, [0, 0]))
    cold.on_routed(_request(30000, keys=[1]), first)
    second = cold.select(_request(30000, keys=[1]), _candidates(workers, [0, 0]))
    assert second.ranked[0] is not first.ranked[0]


def test_near_ties_spread_by_prefix_and_stay_consistent() -> None:
    policy = create_policy("prefix-aware")
    workers = loopback_workers(4)
    chosen = {}
    for prefix in range(200):
        keys = block_keys([prefix] * 64, 16)
        chosen[prefix] = _select(policy, _request(64, keys), _candidates(workers, [0] * 4)).ranked[0].id
    counts = {w.id: list(chosen.values()).count(w.id) for w in workers}
    assert min(counts.values()) > 25, counts  # different prefixes spread
    keys = block_keys([7] * 64, 16)
    assert all(
        _select(policy, _request(64, keys), _candidates(workers, [0] * 4)).ranked[0].id == chosen[7] for _ in range(5)
    )  # one prefix keeps its worker


def test_a_full_cache_costs_the_evictions_it_forces() -> None:
    """With evictions priced (the default), a cold prompt goes where it evicts nothing, even against the tie-break."""
    policy = create_policy("prefix-aware")
    full, empty = loopback_workers(2)
    now = time.monotonic()
    loads = [
        WorkerLoad(max_total_num_tokens=24576, polled_at=now),
        WorkerLoad(max_total_num_tokens=24576, polled_at=now),
    ]
    for _ in range(20):  # the empty worker received more traffic lately: the tie-break alone would pick the full one
        policy.on_routed(
            _request(64),
            Decision(ranked=[empty], reason="test", scores={empty.id: {"new_tokens": 0, "cached_tokens": 64}}),
        )
    candidates = _candidates([full, empty], [0, 0], loads)
    candidates[0].cached_blocks = 24576 * 8 // 10 // 16  # its cached prefixes fill the pool's cacheable share
    decision = _select(policy, _request(4096, keys=[3]), candidates)
    assert decision.ranked[0] is empty
    assert decision.scores[full.id]["eviction_s"] > 0 == decision.scores[empty.id]["eviction_s"]


def test_only_the_evictions_a_choice_could_avoid_are_priced() -> None:
    """Where every cache is full a prompt evicts as much anywhere: only the excess over the least is charged."""
    policy = as_policy(PrefixAwarePolicy, create_policy("prefix-aware"))
    workers = loopback_workers(3)
    now = time.monotonic()
    loads = [WorkerLoad(max_total_num_tokens=24576, polled_at=now) for _ in workers]
    candidates = _candidates(workers, [0, 0, 0], loads)
    full = 24576 * 8 // 10 // 16
    for c, cached in zip(candidates, [full, full, full - 128]):  # the third has room for 2048 of the 4096 tokens
        c.cached_blocks = cached
    decision = _select(policy, _request(4096, keys=[3]), candidates)
    ev = [decision.scores[w.id]["eviction_s"] for w in workers]
    assert ev[2] == 0 < ev[0] == ev[1]  # the third's 2048 evicted tokens are the least: nobody is charged for them
    assert decision.ranked[0] is workers[2]
    for c in candidates[2:]:
        c.cached_blocks = full
    decision = _select(policy, _request(4096, keys=[3]), candidates)
    assert all(decision.scores[w.id]["eviction_s"] == 0 for w in workers)  # all full: nothing to avoid


def test_evictions_are_priced_only_where_a_new_prefix_is_placed() -> None:
    """A prompt one worker holds goes to it or spills, priced by GPU time alone: no candidate pays evictions."""
    policy = create_policy("prefix-aware")
    holder, full, empty = loopback_workers(3)
    now = time.monotonic()
    loads = [WorkerLoad(max_total_num_tokens=24576, polled_at=now) for _ in range(3)]
    candidates = _candidates([holder, full, empty], [0, 0, 0], loads)
    candidates[1].cached_blocks = 24576 * 8 // 10 // 16
    cold = _select(policy, _request(4096, keys=[3]), candidates)
    assert cold.scores[full.id]["eviction_s"] > 0  # placing a new prefix: the full cache pays
    candidates[0].matched_blocks = 8  # now the holder has the prompt's first 128 tokens
    held = _select(policy, _request(4096, keys=[3]), candidates)
    assert all(held.scores[w.id]["eviction_s"] == 0 for w in (holder, full, empty))


def test_an_eviction_is_priced_at_the_fleets_reuse_not_the_workers() -> None:
    """A worker that drew cold prompts (low reuse of its own) is no cheaper to evict on than one that drew hits."""
    policy = as_policy(PrefixAwarePolicy, create_policy("prefix-aware"))
    cold, warm, empty = loopback_workers(3)
    for _ in range(30):
        for worker, new, cached in ((cold, 2048.0, 0.0), (warm, 64.0, 2048.0)):
            scores = {worker.id: {"new_tokens": new, "cached_tokens": cached}}
            policy.on_routed(_request(64), Decision(ranked=[worker], reason="test", scores=scores))
    assert policy.costs[cold.id].reuse < 0.2 < 0.8 < policy.costs[warm.id].reuse
    assert policy.fleet_reuse() == pytest.approx((policy.costs[cold.id].reuse + policy.costs[warm.id].reuse) / 2)
    now = time.monotonic()
    loads = [WorkerLoad(max_total_num_tokens=24576, polled_at=now) for _ in range(3)]
    candidates = _candidates([cold, warm, empty], [0, 0, 0], loads)
    candidates[0].cached_blocks = candidates[1].cached_blocks = 24576 * 8 // 10 // 16
    decision = _select(policy, _request(4096, keys=[3]), candidates)
    assert decision.scores[cold.id]["eviction_s"] == decision.scores[warm.id]["eviction_s"] > 0
    policy.remove_worker(cold.id)  # the one left keeps its own; the empty one, seen in its report, has the prior
    assert policy.fleet_reuse() == pytest.approx((policy.costs[warm.id].reuse + policy.costs[empty.id].reuse) / 2)


def test_an_eviction_is_priced_at_the_fleets_pace_and_the_wait_it_causes() -> None:
    """A fast GPU is no cheaper to evict on: the evicted prefix is recomputed wherever its next request goes.

    Priced at each worker's own pace, a new prefix evicted on a fast H100 rather than use an A100 with room, and
    the H100s' caches thrashed (virtual fleet, 4 x H100 + 4 x A100, gsp past the knee: 39 recomputed prefixes on
    seed 0; 22 priced as here). The recomputation also delays the request that finds its prefix gone, by its own length:
    the score carries the eviction once more, beside its price as GPU time.
    """
    policy = as_policy(PrefixAwarePolicy, create_policy("prefix-aware"))
    fast, slow, spare = loopback_workers(3)
    prior = PrefillModel(0.02, 4e-5, 1e-9)
    _learned(policy, {fast: prior, slow: PrefillModel(prior.c0 * 3, prior.a * 3, prior.b * 3), spare: prior})
    assert policy.costs[slow.id].prefill.a > 2 * policy.costs[fast.id].prefill.a
    now = time.monotonic()
    loads = [WorkerLoad(max_total_num_tokens=24576, polled_at=now) for _ in range(3)]
    candidates = _candidates([fast, slow, spare], [0, 0, 0], loads)
    candidates[0].cached_blocks = candidates[1].cached_blocks = 24576 * 8 // 10 // 16
    decision = _select(policy, _request(4096, keys=[3]), candidates)
    assert decision.scores[fast.id]["eviction_s"] == pytest.approx(decision.scores[slow.id]["eviction_s"])
    assert decision.scores[fast.id]["eviction_s"] > 0 == decision.scores[spare.id]["eviction_s"]
    for worker in (fast, slow, spare):
        f = decision.scores[worker.id]
        gpu_time = f["work_price"] * (f["prefill_s"] + f["eviction_s"]) + f["memory_price"] * f["memory_work_s"]
        assert f["score"] == pytest.approx(f["ttft_s"] + gpu_time + f["eviction_s"])


def test_bad_options_are_reported() -> None:
    with pytest.raises(PolicyError, match="prefix-aware"):
        create_policy("prefix-aware", {"prefill_per_token_s": -1})
    with pytest.raises(PolicyError, match="unknown policy"):
        create_policy("nope")


# -- peers and session ------------------------------------------------------------------------------
def test_sgl_cache_aware_follows_text_then_balances() -> None:
    policy = create_policy("sgl-cache-aware")
    workers = loopback_workers(2)
    text = "system prompt " * 20
    req = RoutingRequest(model="m", path="/generate", prompt_text=text + "one")
    first = _select(policy, req, _candidates(workers, [0, 0]))
    policy.on_routed(req, first)
    again = RoutingRequest(model="m", path="/generate", prompt_text=text + "two")
    assert _select(policy, again, _candidates(workers, [0, 0])).ranked[0] is first.ranked[0]
    cands = _candidates(workers, [0, 0])
    holder = next(c for c in cands if c.worker is first.ranked[0])
    holder.in_flight = 200  # imbalanced beyond 64 and 1.5x
    decision = _select(policy, again, cands)
    assert decision.ranked[0] is not first.ranked[0] and decision.reason == "imbalanced-least-load"


def test_sgl_tree_evicts_to_its_bound() -> None:
    policy = as_policy(SglCacheAwarePolicy, create_policy("sgl-cache-aware", {"max_tree_size": 100}))
    workers = loopback_workers(1)
    for i in range(20):
        req = RoutingRequest(model="m", path="/generate", prompt_text=f"{i:03d}" + "x" * 40)
        policy.on_routed(req, _select(policy, req, _candidates(workers, [0])))
    assert policy.tree.chars["w0"] <= 100


def test_gie_prefix_scores_cached_servers_higher() -> None:
    policy = create_policy("gie-prefix")
    workers = loopback_workers(3)
    req = RoutingRequest(model="m", path="/generate", prompt_text="abc" * 400)
    first = _select(policy, req, _candidates(workers, [0, 0, 0]))
    policy.on_routed(req, first)
    decision = _select(policy, req, _candidates(workers, [0, 0, 0]))
    assert decision.ranked[0] is first.ranked[0]
    assert decision.scores[first.ranked[0].id]["prefix"] == 1.0


def test_dynamo_cost_weighs_overlap_against_active_blocks() -> None:
    policy = create_policy("dynamo-cost")
    workers = loopback_workers(2)
    req = _request(1600)  # 100 blocks
    decision = _select(policy, req, _candidates(workers, [80, 0]))
    assert decision.ranked[0] is workers[0]
    assert decision.scores["w0"]["cost"] == 20 + 100 and decision.scores["w1"]["cost"] == 100 + 100
    policy.on_routed(req, decision)
    policy.on_routed(req, decision)  # w0 now carries 200 active blocks and 40 owed prefill blocks
    assert _select(policy, req, _candidates(workers, [80, 0])).ranked[0] is workers[1]


@pytest.mark.parametrize("name", ["gie-prefix", "dynamo-cost"])
def test_a_seeded_random_tie_break_repeats(name: str) -> None:
    """Peers break exact ties at random; with ``seed`` set, a benchmark run of their policy repeats."""
    workers = loopback_workers(4)

    def placements(seed: int | None) -> list[str]:
        policy = create_policy(name, {"seed": seed})
        out = []
        for i in range(40):  # every prompt new, every worker idle: each decision is an exact tie
            req = RoutingRequest(
                model="m", path="/generate", prompt_text=f"{i:04d}" * 100, token_ids=[i] * 64, block_keys=[i] * 4
            )
            out.append(policy.select(req, _candidates(workers, [0, 0, 0, 0])).ranked[0].id)
        return out

    assert placements(7) == placements(7)
    assert placements(7) != placements(8)
    assert len(set(placements(7))) > 1  # the tie-break is random, not the first worker


def test_session_sticks_and_moves_when_its_worker_leaves() -> None:
    policy = create_policy("session", {"fallback": "least-load"})
    workers = loopback_workers(3)
    req = RoutingRequest(model="m", path="/generate", headers={"x-session-id": "abc"})
    first = _select(policy, req, _candidates(workers, [0, 0, 0]))
    policy.on_routed(req, first)
    for _ in range(3):
        cands = _candidates(workers, [0, 0, 0])
        for c in cands:
            c.in_flight = 0 if c.worker is not first.ranked[0] else 5
        decision = _select(policy, req, cands)
        assert decision.ranked[0] is first.ranked[0] and decision.reason == "session-affinity"
    rest = [w for w in workers if w is not first.ranked[0]]
    moved = _select(policy, req, _candidates(rest, [0, 0]))
    assert moved.ranked[0] in rest and moved.reason == "session-moved"


# -- router wiring, telemetry -----------------------------------------------------------------------
def test_router_tokenizes_records_and_traces() -> None:
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    config = RouterConfig(observability=ObservabilityConfig(exporter="none"))
    app = RouterApp(config, WorkerRegistry(loopback_workers(3)))
    untraced = app.router.route(
        ParsedRequest(
            path="/generate",
            kind="generate",
            model="m",
            prompt_text="hi",
            headers={"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
        )
    )
    app.router.finish(untraced)
    assert untraced.upstream_headers == {}  # exporter none: no span, the client's context goes on untouched
    app.telemetry.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))
    messages = [{"role": "system", "content": "You are terse. " * 400}, {"role": "user", "content": "hi"}]
    parsed = ParsedRequest(
        path="/v1/chat/completions",
        kind="chat",
        model="m",
        messages=messages,
        headers={"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
    )
    first = app.router.route(parsed)
    assert list(first.request.token_ids or []) == app.pipeline.prompts.tokenizer_for("m").encode_chat(messages)
    assert first.worker.in_flight == 1
    header = first.upstream_headers["traceparent"]
    assert header.startswith("00-0af7651916cd43dd8448eb211c80319c-")  # joins the client's trace
    second = app.router.route(parsed)
    assert second.worker is first.worker and second.matched_blocks == len(first.request.block_keys)
    app.router.finish(first)
    app.router.finish(first)  # idempotent
    app.router.finish(second)
    assert first.worker.in_flight == 0
    text = generate_latest(app.telemetry.metrics).decode()
    assert 'prefix_router_decisions_total{policy="prefix-aware",reason="prefix-hit-own-record"}' in text
    assert "prefix_router_decision_seconds_count" in text and 'prefix_router_worker_healthy{worker="w0"}' in text


def test_router_counts_each_workers_traffic_and_predicted_hit() -> None:
    """Per chosen worker: requests, prompt tokens, and the leading tokens the index said it held."""
    app = RouterApp(RouterConfig(), WorkerRegistry(loopback_workers(2)))
    messages = [{"role": "system", "content": "You are terse. " * 400}, {"role": "user", "content": "hi"}]
    parsed = ParsedRequest(path="/v1/chat/completions", kind="chat", model="m", messages=messages)
    first = app.router.route(parsed)
    app.router.finish(first)
    second = app.router.route(parsed)  # the router's own record of the first: a predicted hit on the same worker
    app.router.finish(second)
    assert second.worker is first.worker and second.matched_blocks > 0
    metrics, worker = app.telemetry.metrics, {"worker": first.worker.id}
    tokens = len(first.request.token_ids or [])
    assert metrics.get_sample_value("prefix_router_routed_total", worker) == 2
    assert metrics.get_sample_value("prefix_router_routed_tokens_total", worker) == 2 * tokens
    held = second.matched_blocks * second.request.block_size
    assert 0 < held <= tokens
    assert metrics.get_sample_value("prefix_router_matched_tokens_total", worker) == held  # the first: no hit
    assert metrics.get_sample_value("prefix_router_ready") == 0  # until `serve` says it is ready
    app.telemetry.set_ready(True)
    assert metrics.get_sample_value("prefix_router_ready") == 1
    app.telemetry.first_byte(first.worker.id, True, 0.2)
    first_byte = {**worker, "stream": "true"}
    assert metrics.get_sample_value("prefix_router_time_to_first_byte_seconds_count", first_byte) == 1
    assert metrics.get_sample_value("prefix_router_time_to_first_byte_seconds_bucket", {**first_byte, "le": "0.1"}) == 0


def test_untokenizable_request_is_still_routed() -> None:
    app = RouterApp(RouterConfig(), WorkerRegistry(loopback_workers(2)))
    bad = ParsedRequest(
        path="/v1/chat/completions",
        kind="chat",
        model="m",
        messages=[{"role": "user", "content": "x"}],
        chat_template_kwargs={"messages": "clash"},
    )  # duplicate keyword: render fails
    outcome = app.router.route(bad)
    assert outcome.request.token_ids is None and outcome.worker in app.registry.workers


def test_load_reports_parse_from_loads_json_and_metrics_text() -> None:
    from extproc.sync.load import parse_loads, parse_metrics

    body = {
        "dp_rank_count": 2,
        "loads": [
            {
                "dp_rank": 0,
                "num_running_reqs": 3,
                "num_waiting_reqs": 1,
                "num_used_tokens": 500,
                "max_total_num_tokens": 1000,
            },
            {
                "dp_rank": 1,
                "num_running_reqs": 1,
                "num_waiting_reqs": 4,
                "num_used_tokens": 100,
                "max_total_num_tokens": 1000,
            },
        ],
    }
    load = parse_loads(body)
    assert load is not None and (load.num_running_reqs, load.num_waiting_reqs) == (4, 5)
    assert load.token_usage == pytest.approx(0.3)
    text = (
        '# HELP sglang:num_running_reqs x\nsglang:num_running_reqs{model_name="m"} 7.0\n'
        'sglang:num_queue_reqs{model_name="m"} 2\nsglang:token_usage{model_name="m"} 0.25\n'
        'sglang:max_total_num_tokens{model_name="m"} 4000\n'
    )
    load = parse_metrics(text)
    assert load is not None and (load.num_running_reqs, load.num_waiting_reqs, load.num_used_tokens) == (7, 2, 1000)
    assert parse_loads({"unrelated": 1}) is None and parse_metrics("up 1\n") is None


def test_every_field_of_sglang_0_5_23_loads_is_read() -> None:
    from extproc.fleet.reports import WorkerLoad
    from extproc.sync.load import parse_loads

    rank = {
        "timestamp": 100.0,
        "dp_rank": 0,
        "num_running_reqs": 1,
        "num_waiting_reqs": 2,
        "num_waiting_uncached_tokens": 900,
        "num_used_tokens": 300,
        "num_total_tokens": 1300,
        "num_active_tokens": 1300,
        "num_prealloc_ready_tokens": 0,
        "max_total_num_tokens": 8192,
        "max_running_requests": 2048,
        "token_usage": 0.0366,
        "gen_throughput": 120.5,
        "cache_hit_rate": 0.5,
        "utilization": 0.0,
        "total_prefill_uncached_tokens": 10_000,
        "total_prefill_busy_us": 2_000_000,
        "decode_moments": [30.0, 30.0, 212229.0, 30.0, 212229.0, 30.0],
        "memory": {"weight_gb": 0.003, "kv_cache_gb": 0.004, "graph_gb": 0.0, "token_capacity": 8192},
        "disaggregation": {"mode": "null"},
        "queues": {"waiting": 2, "grammar": 0, "paused": 0, "retracted": 0, "prealloc_ready": 0},
    }
    load = parse_loads({"version": "0.5.23", "loads": [rank, {**rank, "dp_rank": 1}]})
    assert load is not None
    assert (load.num_waiting_uncached_tokens, load.num_total_tokens, load.max_running_requests) == (1800, 2600, 4096)
    assert load.gen_throughput == 241.0 and load.cache_hit_rate == 0.5 and load.utilization == 0.0
    assert (load.total_prefill_uncached_tokens, load.total_prefill_busy_us) == (20_000, 4_000_000)
    assert load.decode_moments == (60.0, 60.0, 424458.0, 60.0, 424458.0)  # what the cost model regresses on
    assert load.memory is not None and len(load.memory) == 2 and load.queues is not None
    assert load.reported_at == 100.0
    # Every flat key real SGLang reports lands in a field of the same name (none is dropped on the floor).
    fields = set(WorkerLoad.__dataclass_fields__)
    assert {k for k, v in rank.items() if k not in ("timestamp", "dp_rank")} <= fields


def test_event_endpoints_come_from_server_info_with_wildcards_replaced() -> None:
    from extproc.fleet.info import event_endpoints, page_size

    worker = loopback_workers(1)[0]
    worker.info = {
        "page_size": 32,
        "kv_events": {
            "publisher": "zmq",
            "endpoint_host": "*",
            "endpoint_port_base": 5557,
            "replay_endpoint_port_base": 5600,
            "dp_size": 2,
            "block_size": 32,
        },
    }
    assert event_endpoints(worker) == [
        ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5600"),
        ("tcp://127.0.0.1:5558", "tcp://127.0.0.1:5601"),
    ]
    assert page_size(worker) == 32
    worker.info["kv_events"]["endpoint_host"] = "10.1.2.3"
    assert event_endpoints(worker)[0][0] == "tcp://10.1.2.3:5557"
    worker.kv_events_endpoint = "tcp://127.0.0.9:7000"  # configured endpoints win: rank 0's, the others offset
    assert event_endpoints(worker) == [("tcp://127.0.0.9:7000", None), ("tcp://127.0.0.9:7001", None)]
    worker.replay_endpoint = "tcp://127.0.0.9:7100"
    assert event_endpoints(worker)[1] == ("tcp://127.0.0.9:7001", "tcp://127.0.0.9:7101")


def test_decision_span_explains_the_choice_without_prompt_text() -> None:
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    app = RouterApp(RouterConfig(), WorkerRegistry(loopback_workers(3)))
    exporter = InMemorySpanExporter()
    app.telemetry.add_span_processor(SimpleSpanProcessor(exporter))
    secret = "the launch codes are " + "zebra " * 80
    outcome = app.router.route(
        ParsedRequest(
            path="/v1/chat/completions", kind="chat", model="m", messages=[{"role": "user", "content": secret}]
        )
    )
    app.router.finish(outcome)
    (span,) = exporter.get_finished_spans()
    attrs: dict[str, Any] = dict(span.attributes or {})
    assert attrs["router.chosen"] == outcome.worker.id and attrs["router.reason"] == outcome.decision.reason
    assert attrs["router.prompt_tokens"] == len(outcome.request.token_ids or [])
    assert attrs["router.blocks"] == len(outcome.request.block_keys) > 0
    assert len(attrs["router.candidates.predicted_ttft_s"]) == 3 and attrs["router.decision_ms"] > 0
    assert not any("zebra" in str(v) for v in attrs.values())
    trace_id = format(span.context.trace_id, "032x")
    assert outcome.upstream_headers["traceparent"].split("-")[1] == trace_id


def test_decisions_ignore_the_simulator_block_of_server_info() -> None:
    """Nothing a simulated worker says about its own timing (``simulator`` in /server_info) is read."""
    load = WorkerLoad(num_running_reqs=2, num_waiting_reqs=1, num_waiting_uncached_tokens=900, polled_at=1.0)
    ranked = []
    for info in ({"simulator": {"speedup": 0.25, "profile": "llama-3.1-8b-h100"}}, {}):
        policy = create_policy("prefix-aware")
        workers = loopback_workers(3)
        for w in workers:
            w.info = dict(info)
        decisions = [
            _select(policy, _request(2048, keys=[k]), _candidates(workers, m, [load, None, None]))
            for k, m in ((1, [0, 0, 0]), (2, [100, 10, 0]), (3, [0, 40, 120]))
        ]
        ranked.append([([w.id for w in d.ranked], d.reason, d.scores) for d in decisions])
    assert ranked[0] == ranked[1]


def test_each_worker_is_judged_by_its_own_learned_speed() -> None:
    """Two idle workers, neither holding the prompt: the one measured faster wins (no prior decides)."""
    policy = as_policy(PrefixAwarePolicy, create_policy("prefix-aware"))
    slow, fast = loopback_workers(2)
    truth = {"w0": PrefillModel(0.06, 92e-6, 2.1e-9), "w1": PrefillModel(0.015, 23e-6, 0.52e-9)}
    busy = dict.fromkeys(truth, 0.0)
    tokens = dict.fromkeys(truth, 0)
    now = 0.0
    for step in range(40):  # 20 s of traffic, 1k-token prompts, both workers idle between them
        now = step * 0.5
        for worker in (slow, fast):
            model = policy.cost_model(worker)
            model.sent(1024 + 64 * (step % 5), 512 * (step % 3), now)
            busy[worker.id] += truth[worker.id].seconds(1024 + 64 * (step % 5), 512 * (step % 3))
            tokens[worker.id] += 1024 + 64 * (step % 5)
            model.observe(
                WorkerLoad(
                    num_waiting_uncached_tokens=0,
                    total_prefill_busy_us=int(busy[worker.id] * 1e6),
                    total_prefill_uncached_tokens=tokens[worker.id],
                    polled_at=now + 0.4,
                )
            )
    for worker in (slow, fast):
        assert policy.cost_model(worker).prefill.seconds(2048, 0) == pytest.approx(
            truth[worker.id].seconds(2048, 0), rel=0.1
        )
    decision = _select(policy, _request(4096, keys=[9]), _candidates([slow, fast], [0, 0]))
    assert decision.ranked[0] is fast
    assert decision.scores["w0"]["prefill_s"] > 3 * decision.scores["w1"]["prefill_s"]


def _learned(policy: PrefixAwarePolicy, truth: dict[Worker, PrefillModel]) -> None:
    """20 s of 1k-token prefills on idle workers, reported as SGLang's counters: each worker learns its speed."""
    busy = dict.fromkeys(truth, 0.0)
    tokens = dict.fromkeys(truth, 0)
    for step in range(40):
        now = step * 0.5
        for worker, model in truth.items():
            cost = policy.cost_model(worker)
            new, cached = 1024 + 64 * (step % 5), 512 * (step % 3)
            cost.sent(new, cached, now)
            busy[worker] += model.seconds(new, cached)
            tokens[worker] += new
            cost.observe(
                WorkerLoad(
                    num_waiting_uncached_tokens=0,
                    total_prefill_busy_us=int(busy[worker] * 1e6),
                    total_prefill_uncached_tokens=tokens[worker],
                    polled_at=now + 0.4,
                )
            )


def _traffic(policy: Policy, worker: Worker, requests: int, tokens: int = 64) -> None:
    for _ in range(requests):
        policy.on_routed(
            _request(tokens),
            Decision(ranked=[worker], reason="t", scores={worker.id: {"new_tokens": 0, "cached_tokens": tokens}}),
        )


def test_near_ties_go_to_the_worker_sent_the_fewest_prompt_tokens_not_the_fewest_requests() -> None:
    """Three long prompts outweigh twenty short ones: a near-tie goes to the worker sent fewer tokens lately.

    Counted in requests, the tie-break sent the long prompts of the Mooncake trace past the knee to the worker
    that got the fewest requests because each of its requests was long: its backlog drained 23 s after another
    worker's (virtual fleet, 4 workers, 1.3 x knee, seed 0), and the slowest requests were its own.
    """
    many_short, few_long = loopback_workers(2)
    policy = as_policy(PrefixAwarePolicy, create_policy("prefix-aware"))
    _traffic(policy, many_short, 20, tokens=256)  # 5,120 tokens in 20 requests
    _traffic(policy, few_long, 3, tokens=8192)  # 24,576 in 3
    decision = policy.select(_request(4096, keys=[11]), _candidates([many_short, few_long], [0, 0]))
    assert decision.reason == "cold"
    both = [decision.scores[w.id]["score"] for w in (many_short, few_long)]
    assert max(both) <= min(both) * 1.05  # a near-tie: the tie-break decides
    assert decision.ranked[0] is many_short
    # prompts alike in length: the fewest requests, as before
    policy = as_policy(PrefixAwarePolicy, create_policy("prefix-aware"))
    _traffic(policy, many_short, 20, tokens=256)
    _traffic(policy, few_long, 3, tokens=256)
    assert policy.select(_request(4096, keys=[11]), _candidates([many_short, few_long], [0, 0])).ranked[0] is few_long


def test_a_cold_prompt_is_placed_by_balance_across_like_workers_measured_apart() -> None:
    """Nobody holds the prompt, two like workers learned 10% apart: the one with less recent traffic takes it.

    Measured under cache pressure on a simulated 2P2D fleet: noise of that size sent 40 of 66 cold prefixes
    to one prefill worker. A worker 3x faster, or one with a queue, still wins (``cold_tie_rel`` band).
    """
    quick, slow = loopback_workers(2)
    prior = PrefillModel(0.02, 4e-5, 1e-9)
    truth = {quick: prior, slow: PrefillModel(prior.c0 * 1.1, prior.a * 1.1, prior.b * 1.1)}
    chosen = {}
    for band in (0.0, 0.15):
        policy = as_policy(PrefixAwarePolicy, create_policy("prefix-aware", {"cold_tie_rel": band}))
        _learned(policy, truth)
        _traffic(policy, quick, 20)  # the quicker one took more of the fleet's traffic lately
        decision = policy.select(_request(4096, keys=[5]), _candidates([quick, slow], [0, 0]))
        assert decision.reason == "cold"
        assert decision.scores[slow.id]["score"] > decision.scores[quick.id]["score"] * 1.05  # outside tie_rel
        chosen[band] = decision.ranked[0]
    assert chosen == {0.0: quick, 0.15: slow}
    # a hit is not a cold placement: the holder keeps it whatever the traffic
    hit = policy.select(_request(4096, keys=[5] * 256), _candidates([quick, slow], [200, 0]))
    assert hit.ranked[0] is quick and hit.reason == "prefix-hit"
    # the less busy worker waits for a queue: the measured queue is not noise, it stays out of the band
    policy.cost_model(slow).sent(1024, 0, policy.clock())
    queued = policy.select(_request(4096, keys=[6]), _candidates([quick, slow], [0, 0]))
    assert queued.scores[slow.id]["queue_s"] > 0.003 and queued.ranked[0] is quick
    # a worker 3x slower stays out of it too
    policy = as_policy(PrefixAwarePolicy, create_policy("prefix-aware"))
    _learned(policy, {quick: prior, slow: PrefillModel(prior.c0 * 3, prior.a * 3, prior.b * 3)})
    _traffic(policy, quick, 20)
    assert policy.select(_request(4096, keys=[7]), _candidates([quick, slow], [0, 0])).ranked[0] is quick


def _replica(truth: dict[Worker, PrefillModel], busiest: Worker, shared: bool) -> PrefixAwarePolicy:
    """One router replica: its own learned constants and its own recent traffic (``shared``: decisions shared)."""
    policy = as_policy(PrefixAwarePolicy, create_policy("prefix-aware"))
    if shared:
        policy.share_decisions()
    _learned(policy, truth)
    _traffic(policy, busiest, 20)
    return policy


def test_replicas_sharing_decisions_place_a_new_prefix_alike() -> None:
    """Two replicas that learned two like workers 40% apart, each the other way, place a cold prompt alike.

    The compose stack's race: a burst's first two requests, taken by different replicas 5 ms apart, before
    either has heard of the other's decision. Alone, each replica places the prefix on the worker it
    measured faster (or sent less to lately); sharing decisions, both hash its first block, and new prefixes
    still spread over both workers. A worker with a queue, or one scoring more than twice the best, stays out.
    """
    a, b = loopback_workers(2)
    prior = PrefillModel(0.02, 4e-5, 1e-9)
    slower = PrefillModel(prior.c0 * 1.4, prior.a * 1.4, prior.b * 1.4)
    views = ({a: prior, b: slower}, {a: slower, b: prior})  # each replica measured the other worker slower
    prompts = [_request(1024, keys=[1000 + i, 7]) for i in range(60)]
    for shared in (False, True):
        first, second = _replica(views[0], b, shared), _replica(views[1], a, shared)
        placed = []
        for prompt in prompts:
            one = first.select(prompt, _candidates([a, b], [0, 0]))
            two = second.select(prompt, _candidates([a, b], [0, 0]))
            assert one.reason == two.reason == "cold"
            placed.append((one.ranked[0].id, two.ranked[0].id))
        agreed = sum(x == y for x, y in placed)
        if not shared:
            assert agreed == 0, placed  # each keeps to the worker it believes faster
            continue
        assert agreed == len(prompts), placed
        on_a = sum(x == a.id for x, _ in placed)
        assert 15 <= on_a <= 45, on_a  # hashing alone spreads new prefixes (binomial 60 x 0.5: 30 +- 4)
    # a prompt some worker holds is not a placement: the holder keeps it on both replicas
    hit = first.select(_request(1024, keys=[1000] + [7] * 63), _candidates([a, b], [0, 64]))
    assert hit.ranked[0] is b and hit.reason == "prefix-hit"
    # a queue stays out of the band: the replica that knows of one avoids it whatever the hash says
    for prompt in prompts[:10]:
        first.cost_model(a).sent(2048, 0, first.clock())
        queued = first.select(prompt, _candidates([a, b], [0, 0]))
        assert queued.scores[a.id]["queue_s"] > 0.003 and queued.ranked[0] is b
    # a worker 3x slower stays out too
    third = _replica({a: prior, b: PrefillModel(prior.c0 * 3, prior.a * 3, prior.b * 3)}, a, shared=True)
    assert all(third.select(p, _candidates([a, b], [0, 0])).ranked[0] is a for p in prompts[:20])
    # 0 turns it off: the lone router's placement
    lone = as_policy(PrefixAwarePolicy, create_policy("prefix-aware", {"replica_cold_tie_rel": 0}))
    lone.share_decisions()
    _learned(lone, views[0])
    assert all(lone.select(p, _candidates([a, b], [0, 0])).ranked[0] is a for p in prompts[:20])


@pytest.mark.parametrize("policy", ["prefix-aware", "session"])
def test_router_replicas_with_shared_state_place_new_prefixes_alike(policy: str) -> None:
    """Two routers over one fleet, one of which sent a worker more lately: shared state makes them agree.

    Through the router itself (config -> pipeline -> policy): with ``shared_state`` on, the replicas hash
    a new prefix alike whatever each one's own traffic; off, the busier view sends every new prefix to
    the other worker. ``session`` places new sessions with its fallback, so it places them alike too.
    """
    prompts = [
        ParsedRequest(
            path="/v1/chat/completions",
            kind="chat",
            model="m",
            messages=[{"role": "system", "content": f"You are agent {i}. " * 40}, {"role": "user", "content": "go"}],
            headers={"x-session-id": f"session-{i}"},
        )
        for i in range(30)
    ]
    for backend in ("none", "redis"):
        config = RouterConfig.model_validate(
            {"policy": {"name": policy}, "shared_state": {"backend": backend, "url": "redis://unused:6379/0"}}
        )
        workers = loopback_workers(2)  # each replica its own Worker objects: their in-flight counts are their own
        first, second = (
            RouterApp(config, WorkerRegistry(workers)),
            RouterApp(config, WorkerRegistry(loopback_workers(2))),
        )
        assert (first.shared is not None) == (backend == "redis")  # built, never started: nothing is published
        chosen = first.pipeline.policy
        _traffic(chosen.fallback if isinstance(chosen, SessionPolicy) else chosen, workers[0], 20)  # w0 busier lately
        placed = []
        for parsed in prompts:
            one, two = first.router.route(parsed), second.router.route(parsed)
            first.router.finish(one)  # answered before the next: no queue of the router's own
            second.router.finish(two)
            # each prompt is new to both (the session policy: a new session, placed by prefix-aware as cold)
            assert one.decision.reason == two.decision.reason == ("cold" if policy == "prefix-aware" else "session-new")
            placed.append((one.worker.id, two.worker.id))
        agreed = sum(x == y for x, y in placed)
        if backend == "none":
            assert agreed < len(prompts), placed
        else:
            assert agreed == len(prompts), placed
            assert 0 < sum(x == workers[0].id for x, _ in placed) < len(prompts), placed


def test_saturated_fleet_keeps_prefixes_on_their_holders() -> None:
    """The same queue imbalance spills a hot prefix on an idle fleet but not on a saturated one."""
    workers = loopback_workers(2)
    for utilization, expected in ((0.1, "prefix-spill"), (0.97, "prefix-hit")):
        policy = as_policy(PrefixAwarePolicy, create_policy("prefix-aware"))
        for w in workers:
            # 40 requests in the worker at the last report: the queue is real
            policy.cost_model(w).observe(WorkerLoad(num_running_reqs=40, polled_at=time.monotonic() - 0.1))
            policy.cost_model(w).utilization = utilization
        # w0 holds 3k of a 3.2k-token prompt but has ~0.65 s of work queued; w1 holds nothing and has ~0.1 s.
        loads = [
            WorkerLoad(num_waiting_reqs=8, num_waiting_uncached_tokens=12000, polled_at=time.monotonic()),
            WorkerLoad(num_waiting_reqs=2, num_waiting_uncached_tokens=2000, polled_at=time.monotonic()),
        ]
        decision = _select(policy, _request(3200, keys=[5]), _candidates(workers, [188, 0], loads))
        assert decision.reason == expected, (utilization, decision.scores)


def _light_fleet_with_a_busy_holder(
    options: dict[str, Any], cached_blocks: int = 0, busy: int = 1, measured: bool = True
) -> Decision:
    """Three measured (or, ``measured`` False, not yet measured), lightly used workers: w0 holds 3,000 of a
    3,200-token prompt behind ~0.19 s of the router's own cold sends; w1 and w2 hold nothing and have
    ``cached_blocks`` of a 24k-token pool filled; w2 also has a queue when ``busy`` is 2."""
    workers = loopback_workers(3)
    policy = as_policy(PrefixAwarePolicy, create_policy("prefix-aware", options))
    now = time.monotonic()
    loads = [WorkerLoad(max_total_num_tokens=24576, polled_at=now) for _ in workers]
    for w, ld in zip(workers, loads):
        model = policy.cost_model(w)
        if measured:
            model.windows, model.utilization = 1, 0.1  # measured itself: busy a tenth of the time
        policy.on_load(w, ld)
    holder = policy.cost_model(workers[0])
    holder.sent(1800, 0, now)
    holder.sent(1800, 0, now)
    if busy == 2:
        policy.cost_model(workers[2]).sent(1800, 0, now)
    candidates = _candidates(workers, [188, 0, 0], loads)
    for c in candidates[1:]:
        c.cached_blocks = cached_blocks
    return policy.select(_request(3200, keys=[5]), candidates)


def test_an_idle_worker_with_room_on_a_light_fleet_takes_a_hit_whose_holder_is_busy() -> None:
    """Its seconds delay no queue and evict nothing: priced at the fleet's mean, not the least price."""
    decision = _light_fleet_with_a_busy_holder({})
    assert decision.reason == "prefix-spill" and decision.ranked[0].id != "w0", decision.scores
    assert decision.scores["w1"]["work_price"] < 0.2
    assert decision.scores["w0"]["work_price"] == 1.0  # the holder has a queue: the least price stands
    # Priced at the least price everywhere (before this option), the request waits behind the holder's queue.
    fixed = _light_fleet_with_a_busy_holder({"idle_fleet_price": False})
    assert fixed.reason == "prefix-hit", fixed.scores
    assert fixed.scores["w1"]["ttft_s"] < fixed.scores["w0"]["ttft_s"]  # although the idle worker is sooner


def test_before_any_worker_has_measured_itself_an_idle_worker_is_priced_by_the_fleets_queues() -> None:
    """A fleet's first half second: one of three candidates has a queue, so a second costs 1/3 / (1 - 1/3).

    Priced at the least price instead (as before), a hot prefix's siblings queued behind the worker still
    computing it while idle workers would have answered sooner (virtual fleet, 64 workers, hot-burst).
    """
    decision = _light_fleet_with_a_busy_holder({}, measured=False)
    assert decision.reason == "prefix-spill" and decision.ranked[0].id != "w0", decision.scores
    assert decision.scores["w1"]["work_price"] == pytest.approx(0.5)
    # Two of three candidates with a queue are no light fleet: the least price stands, the hit waits for its holder.
    crowded = _light_fleet_with_a_busy_holder({}, busy=2, measured=False)
    assert crowded.reason == "prefix-hit", crowded.scores


def test_an_idle_worker_whose_cache_is_full_keeps_the_least_price() -> None:
    """Recomputing into a full cache pushes another prefix out: that second is not cheap."""
    decision = _light_fleet_with_a_busy_holder({}, cached_blocks=24576 // 16)
    assert decision.reason == "prefix-hit", decision.scores
    assert decision.scores["w1"]["work_price"] == 1.0


def test_an_idle_worker_of_a_mostly_busy_fleet_keeps_the_least_price() -> None:
    """Two of three workers have a queue: the idle one is only momentarily idle, its seconds are not free."""
    decision = _light_fleet_with_a_busy_holder({}, busy=2)
    assert decision.reason == "prefix-hit", decision.scores
    assert decision.scores["w1"]["work_price"] == 1.0


def test_the_fleet_price_is_the_measured_workers_mean_and_forgets_a_removed_worker() -> None:
    workers = loopback_workers(3)
    policy = as_policy(PrefixAwarePolicy, create_policy("prefix-aware", {"work_price": "utilization"}))
    # Nobody measured: what the share of candidates with a queue says; with none, no spill is sooner than a
    # holder, and idle workers keep the least price.
    assert policy.fleet_price() == math.inf and policy.fleet_price(0.25) == pytest.approx(0.25 / 0.75)
    for w, utilization in zip(workers, (0.5, 0.2, 0.0)):
        model = policy.cost_model(w)
        model.utilization = utilization
        model.windows = 1 if utilization else 0  # w2 has not measured a window: not in the mean
        policy.on_load(w, WorkerLoad(polled_at=time.monotonic()))
    assert policy.fleet_price() == pytest.approx((1.0 + 0.25) / 2)
    policy.remove_worker("w0")
    assert policy.fleet_price() == pytest.approx(0.25)


def test_a_worker_busy_with_one_client_at_a_time_keeps_its_prefix() -> None:
    """Busy all the time but never more than one request in it: its follow-ups stay (real SGLang, CPU)."""
    workers = loopback_workers(2)
    chosen = {}
    for work_price in ("utilization", "lesser"):
        policy = as_policy(PrefixAwarePolicy, create_policy("prefix-aware", {"work_price": work_price}))
        holder = policy.cost_model(workers[0])
        # The client's previous turn kept it busy (the only request in it), and has just finished.
        holder.observe(WorkerLoad(num_running_reqs=1, polled_at=time.monotonic() - 0.1))
        holder.utilization = 0.97
        loads = [WorkerLoad(polled_at=time.monotonic()), WorkerLoad(polled_at=time.monotonic())]
        decision = _select(policy, _request(3200, keys=[5]), _candidates(workers, [188, 0], loads))
        chosen[work_price] = decision.ranked[0].id
    # Priced by utilisation alone it would leave (that is what the second turn of a chat did on real SGLang).
    assert chosen == {"utilization": "w1", "lesser": "w0"}


def _feed(model: WorkerCostModel, new: int, steps: int, seconds: Callable[[int], float]) -> None:
    """``steps`` requests of ``new`` uncached tokens sent every 0.5 s, each taking ``seconds(new)`` of prefill on
    the worker: its cumulative counters, polled 0.4 s after each send, reported to ``model``."""
    busy = tokens = 0.0
    for step in range(steps):
        model.sent(new, 0, step * 0.5)
        busy += seconds(new)
        tokens += new
        model.observe(
            WorkerLoad(
                total_prefill_busy_us=int(busy * 1e6),
                total_prefill_uncached_tokens=int(tokens),
                polled_at=step * 0.5 + 0.4,
            )
        )


def test_a_fresh_worker_is_judged_by_the_measured_ones_not_the_priors() -> None:
    """The holder measured itself slower than the priors; an unmeasured idle worker must not look faster."""
    workers = loopback_workers(2)
    policy = as_policy(PrefixAwarePolicy, create_policy("prefix-aware"))
    holder = policy.cost_model(workers[0])
    truth = PrefillModel(0.05, 4e-5, 1e-9)  # a per-request floor 2.5x the prior's (a CPU, a small model)
    _feed(holder, 400, 20, lambda new: truth.seconds(new, 0))
    assert holder.windows and holder.prefill.seconds(400, 0) == pytest.approx(truth.seconds(400, 0), rel=0.1)
    assert policy.cost_model(workers[1]).windows == 0
    decision = _select(policy, _request(433, keys=[5]), _candidates(workers, [25, 0]))
    assert decision.ranked[0] is workers[0], decision.scores
    assert decision.scores["w1"]["prefill_s"] > decision.scores["w0"]["prefill_s"]


def test_dp_ranks_are_indexed_apart_and_the_holding_rank_is_pinned() -> None:
    from extproc.fleet.index import rank_key
    from extproc.fleet.info import DP_RANK_HEADERS

    workers = loopback_workers(2)
    for w in workers:
        w.info = {"dp_size": 2, "page_size": 16}
    app = RouterApp(RouterConfig(), WorkerRegistry(workers))
    parsed = ParsedRequest(path="/generate", kind="generate", model="m", input_ids=list(range(160)))
    keys = app.pipeline.prompts.chain(parsed, list(range(160)), (16, ""))
    app.index.store(rank_key("w1", 1), keys)  # rank 1 of w1 holds the prompt; rank 0 nothing
    app.index.store(rank_key("w1", 0), keys[:2])
    first = app.router.route(parsed)
    assert first.worker.id == "w1" and first.dp_rank == 1
    assert first.matched_blocks == 10  # the worker's best rank
    assert all(first.upstream_headers[h] == "1" for h in DP_RANK_HEADERS)
    assert workers[1].rank_in_flight == {1: 1}
    # Its decision is recorded on rank 1's slot only; rank 0's slot keeps its own two blocks.
    assert app.index.match(keys, [rank_key("w1", 0)]) == {rank_key("w1", 0): 2}
    app.router.finish(first)
    assert workers[1].rank_in_flight == {1: 0}
    # No rank holds anything: the rank with fewer of our requests in flight wins the tie.
    workers[0].rank_in_flight[0] = 3
    assert app.pipeline._pin_rank(workers[0], [0, 0]) == 1
    assert app.pipeline._pin_rank(workers[0], [0, 0]) == 1  # 3 vs 1 in flight: still rank 1
    assert app.pipeline._pin_rank(workers[0], [4, 0]) == 0  # a match beats load
    # A fallback must have the pinned rank: a single-rank worker is left out of the list.
    workers[0].info = {}
    pinned = app.router.route(parsed)
    assert pinned.dp_rank == 1 and pinned.endpoints(2) == [workers[1].endpoint]
    metrics = generate_latest(app.telemetry.metrics).decode()
    assert 'prefix_router_index_blocks{dp_rank="1",tier="gpu",worker="w1"} 10.0' in metrics
    assert 'prefix_router_index_blocks{dp_rank="0",tier="gpu",worker="w1"} 2.0' in metrics
    assert 'prefix_router_rank_in_flight{dp_rank="1",worker="w1"} 1.0' in metrics


def test_session_affinity_headers_are_a_configurable_list() -> None:
    policy = create_policy("session", {"fallback": "least-load"})
    workers = loopback_workers(3)
    # aiperf's header is among the defaults; the first header present names the session.
    aiperf = RoutingRequest(model="m", path="/generate", headers={"x-session-affinity": "conv-7"})
    first = _select(policy, aiperf, _candidates(workers, [0, 0, 0]))
    assert first.reason == "session-new"
    policy.on_routed(aiperf, first)
    cands = _candidates(workers, [0, 0, 0])
    for c in cands:
        c.in_flight = 9 if c.worker is first.ranked[0] else 0
    again = _select(policy, aiperf, cands)
    assert again.ranked[0] is first.ranked[0] and again.reason == "session-affinity"
    custom = create_policy("session", {"headers": ["X-Conversation"], "fallback": "least-load"})
    assert custom.select(aiperf, _candidates(workers, [0, 0, 0])).reason.startswith("no-session")
    tagged = RoutingRequest(model="m", path="/generate", headers={"x-conversation": "c1"})
    assert custom.select(tagged, _candidates(workers, [0, 0, 0])).reason == "session-new"
    with pytest.raises(PolicyError):
        create_policy("session", {"headers": []})


def test_ranking_reads_the_cost_models_and_reports_feed_them() -> None:
    """``select`` changes no learned state; a load report reaches the model through ``on_load`` only."""
    policy = create_policy("prefix-aware")
    workers = loopback_workers(2)
    load = WorkerLoad(num_waiting_reqs=4, num_waiting_uncached_tokens=8000, polled_at=1.0)
    policy.select(_request(2048), _candidates(workers, [0, 0], [load, None]))
    assert policy.costs == {}  # type: ignore[attr-defined]
    policy.on_load(workers[0], load)
    model = policy.cost_model(workers[0])  # type: ignore[attr-defined]
    assert model.queued_seconds(1.0) > 0  # the report's waiting work is now the worker's queue


def test_router_clock_reaches_index_loads_and_policy_and_departed_workers_are_forgotten() -> None:
    clock = Clock()
    workers = loopback_workers(3)
    registry = WorkerRegistry(workers)
    app = RouterApp(RouterConfig(), registry, clock=clock)
    assert app.pipeline.policy.clock is clock and app.loads.clock is clock
    app.loads.set(workers[0], WorkerLoad(num_running_reqs=1))
    assert app.loads.get(workers[0]).polled_at == clock.now  # type: ignore[union-attr]
    parsed = ParsedRequest(path="/generate", kind="generate", model="m", prompt_text="a shared prompt " * 200)
    first = app.router.route(parsed)
    app.router.finish(first)
    assert app.router.route(parsed).worker is first.worker  # the speculative entry holds ...
    clock.now += 2 * app.config.index.fallback_ttl_s  # no events here: the own record's life
    assert app.index.match(first.request.block_keys, [first.worker.id])[first.worker.id] == 0  # ... then ages
    policy = app.pipeline.policy
    assert set(policy.costs) >= {workers[0].id, first.worker.id}  # type: ignore[attr-defined]
    registry.reconcile([w for w in workers if w.id != workers[0].id])
    assert workers[0].id not in policy.costs  # type: ignore[attr-defined]


def test_the_router_prices_the_wait_for_kv_room_from_its_own_open_requests() -> None:
    """A worker whose pool its open requests fill makes a new one wait about the share that must finish first."""
    from extproc.decision.policies.prefix_aware.in_flight import InFlightBook

    book = InFlightBook()
    assert book.memory_wait_s("w0", 2000, 0, 10_000) == 0.0  # nothing open: nothing to wait for
    for i in range(4):
        book.booked("w0", i, 2000, 0, now=0.0)
    book.released("w0", 0, now=2.0)  # residence 2 s
    assert book.residence_s("w0") == pytest.approx(2.0)
    assert book.held_tokens("w0") == 6000
    assert book.memory_wait_s("w0", 2000, 0, 10_000) == 0.0  # 6k held + 2k new fits in 10k
    assert book.memory_wait_s("w0", 6000, 0, 10_000) == pytest.approx(2000 / 6000 * 2.0)  # a third must finish
    book.booked("w1", 9, 2000, 0, now=0.0)
    assert book.memory_wait_s("w1", 9000, 0, 10_000) == pytest.approx(0.5 * 2.0)  # no residence of its own: the fleet's
    book.forget("w0")
    assert book.held_tokens("w0") == 0.0


def test_a_full_pool_waits_for_its_oldest_requests_at_the_pace_the_worker_decodes_now() -> None:
    """Before any request has finished there, a worker's residence is its open requests' outputs at its present
    pace (``token_s``); and room frees as the oldest finish: a pool filled by a burst of young requests waits
    for what is left of their residence, not for the share of a residence that uniform arrivals would imply."""
    from extproc.decision.policies.prefix_aware.in_flight import InFlightBook

    book = InFlightBook()
    for i in range(100):  # a burst of 100 requests, 32 output tokens each, opened between t=1.0 and t=1.5
        book.booked("w0", i, 200, 0, now=1.0 + i * 0.005, output_tokens=32)
    held = book.held_tokens("w0", now=1.5, residence=32 * 0.06)  # their outputs a quarter written
    capacity = int(held) + 100  # a 200-token prompt with its 32-token output does not fit
    # Nothing has finished anywhere: with no pace either, nothing says how long the wait is.
    assert book.memory_wait_s("w0", 200, 0, capacity, 32, now=1.5) == 0.0
    # 60 ms per output token (its prefills leave its decodes a sixth of the time): a residence of 1.92 s, and the
    # oldest request, opened 0.5 s ago, finishes in 1.42 s.
    wait = book.memory_wait_s("w0", 200, 0, capacity, 32, now=1.5, token_s=0.06)
    assert wait == pytest.approx(32 * 0.06 - 0.5, abs=0.01)
    # A shorter measured residence does not hide the pace: the same burst on a worker that finished one short
    # request early (0.3 s) waits as long.
    book.booked("w1", 999, 200, 0, now=0.0, output_tokens=32)
    book.released("w1", 999, now=0.3)
    for i in range(100):
        book.booked("w1", i, 200, 0, now=1.0 + i * 0.005, output_tokens=32)
    assert book.memory_wait_s("w1", 200, 0, capacity, 32, now=1.5, token_s=0.06) == pytest.approx(wait, abs=0.01)
    assert book.memory_wait_s("w1", 200, 0, capacity, 32, now=1.5) < 0.1  # by the measured 0.3 s alone


def test_open_requests_hold_shared_pages_once_and_room_for_their_output() -> None:
    """Pages two open requests share count once; each request's output limit counts; release gives both back."""
    from extproc.decision.policies.prefix_aware.in_flight import InFlightBook

    book = InFlightBook()
    prefix = list(range(100))  # 100 pages of 16 tokens: a 1,600-token system prompt
    book.booked("w0", 1, 1672, 0, now=0.0, keys=[*prefix, 101, 102], block_size=16, output_tokens=32)
    # 1,672 prompt tokens: 102 full pages and 40 tokens past them, plus 32 of output: 72 tokens in 5 own pages.
    assert book.held_tokens("w0") == 102 * 16 + 80
    book.booked("w0", 2, 72, 1600, now=0.0, keys=[*prefix, 201, 202], block_size=16, output_tokens=32)
    assert book.held_tokens("w0") == 104 * 16 + 2 * 80  # the 100 shared pages once
    book.booked("w0", 3, 1672, 0, now=0.0, keys=[*range(500, 602)], block_size=16, output_tokens=0)
    assert book.held_tokens("w0") == 206 * 16 + 2 * 80 + 48  # another prefix: its pages too
    book.released("w0", 3, now=1.0)
    book.released("w0", 1, now=1.0)
    assert book.held_tokens("w0") == 102 * 16 + 80  # request 2 alone: the shared pages are still its
    # With outputs counted, the same prompts that fit a pool can leave a new one waiting for room.
    assert book.memory_wait_s("w0", 72, 1600, 1700) > 0.0
    book.released("w0", 2, now=1.0)
    assert book.held_tokens("w0") == 0.0


def test_an_open_requests_output_is_held_as_written_plus_sglangs_reserve_and_a_new_one_needs_all_of_its() -> None:
    """Output counts as the share of a residence written plus SGLang's floor reserve for the rest; the new
    request's own clipped output must fit too (SGLang's admission check)."""
    from extproc.decision.policies.prefix_aware.in_flight import InFlightBook

    book = InFlightBook()
    book.booked("w0", 1, 32, 0, now=0.0, keys=[1, 2], block_size=16, output_tokens=1000)
    book.released("w0", 1, now=2.0)  # residence 2 s
    book.booked("w0", 2, 32, 0, now=10.0, keys=[3, 4], block_size=16, output_tokens=1000)
    assert book.held_tokens("w0") == 32 + 1008  # without a clock: the whole output, in whole pages
    assert book.held_tokens("w0", now=10.0) == pytest.approx(32 + 98)  # nothing written, 9.8 % reserved
    assert book.held_tokens("w0", now=11.0) == pytest.approx(32 + 512 + 49)  # half written (32 pages)
    assert book.held_tokens("w0", now=13.0) == pytest.approx(32 + 1008)  # past a residence: all of it
    # 132 held at t=10 and a 32-token prompt fit a 1,000-token pool; with its 900-token output they do not.
    assert book.memory_wait_s("w0", 32, 0, 1000, now=10.0) == 0.0
    assert book.memory_wait_s("w0", 32, 0, 1000, output_tokens=900, now=10.0) > 0.0


def test_the_reserve_for_running_outputs_is_the_ratio_the_worker_reports() -> None:
    """SGLang reserves running requests' remaining outputs times its ``new_token_ratio`` (0.7 after idle, 0.098
    at its floor): at 0.61 a pool the floor ratio calls roomy is full, and the policy reads the worker's ratio."""
    from extproc.decision.policies.prefix_aware.in_flight import FLOOR_RESERVE_RATIO, InFlightBook

    book = InFlightBook()
    book.booked("w0", 0, 117, 2048, now=0.0, output_tokens=32)
    book.released("w0", 0, now=0.4)  # residence 0.4 s
    for i in range(1, 150):  # 150 short requests on one 2,048-token prefix, each with up to 1,000 tokens to write
        book.booked("w0", i, 117, 2048, now=10.0, output_tokens=1000)
    held_floor = book.held_tokens("w0", now=10.0)
    assert held_floor == pytest.approx(2048 + 149 * (117 + 1000 * FLOOR_RESERVE_RATIO))
    assert book.held_tokens("w0", now=10.0, reserve_ratio=0.61) == pytest.approx(2048 + 149 * (117 + 610))
    capacity = 100_000  # 34k held at the floor ratio, 110k at 0.61
    assert book.memory_wait_s("w0", 117, 2048, capacity, 1000, now=10.0) == 0.0
    assert book.memory_wait_s("w0", 117, 2048, capacity, 1000, now=10.0, reserve_ratio=0.61) > 0.0

    # The policy takes the ratio from each worker's report: two workers its book holds alike, one reporting 0.61.
    policy = as_policy(PrefixAwarePolicy, create_policy("prefix-aware"))
    workers = loopback_workers(2)
    now = time.monotonic()
    for w in workers:
        policy.book.booked(w.id, 0, 117, 2048, now=now - 1.0, output_tokens=32)
        policy.book.released(w.id, 0, now=now - 0.6)
        for i in range(1, 150):
            policy.book.booked(w.id, i, 117, 2048, now=now, output_tokens=1000)
    loads = [
        WorkerLoad(num_running_reqs=149, max_total_num_tokens=capacity, polled_at=now, new_token_ratio=ratio)
        for ratio in (None, 0.61)
    ]
    decision = _select(policy, _request(2165, max_new_tokens=1000), _candidates(workers, [128, 128], loads))
    assert decision.scores["w0"]["memory_wait_s"] == 0.0 < decision.scores["w1"]["memory_wait_s"]
    assert decision.ranked[0] is workers[0]


def _full_pools(waiting: int, matched: tuple[int, int] = (128, 0)) -> Decision:
    """Two workers whose pools the router's open requests fill (w0 a little more); w0 holds the prompt's
    2,048-token prefix. ``waiting``: the requests each worker reports queued."""
    policy = as_policy(PrefixAwarePolicy, create_policy("prefix-aware"))
    workers = loopback_workers(2)
    now = time.monotonic()
    capacity = 20_000
    for w, open_requests in zip(workers, (11, 9)):
        policy.book.booked(w.id, 0, 2000, 0, now=now - 3.0)
        policy.book.released(w.id, 0, now=now - 1.0)  # residence 2 s
        for i in range(1, open_requests + 1):  # sent over the last residence, the oldest first
            policy.book.booked(w.id, i, 2000, 0, now=now - 2.0 * (open_requests + 1 - i) / (open_requests + 1))
    loads = [
        WorkerLoad(num_running_reqs=10, num_waiting_reqs=waiting, max_total_num_tokens=capacity, polled_at=now)
        for _ in workers
    ]
    return _select(policy, _request(2165, max_new_tokens=32), _candidates(workers, list(matched), loads))


def test_on_full_pools_a_spill_pays_for_the_room_its_copy_of_the_prefix_takes_from_the_queue() -> None:
    """Past the knee with long prompts the KV pool bounds a worker: a request's new tokens hold room every
    request queued there waits for. The holder's queue for room is a little longer; with nobody reported
    waiting the prefix is copied to the other worker, with 20 waiting on each it stays with its holder.
    A request no candidate holds any of brings as many new tokens anywhere: nothing to choose, nothing charged."""
    calm = _full_pools(waiting=0)
    assert calm.ranked[0].id == "w1"  # the spill: a shorter wait for room than the holder's
    crowded = _full_pools(waiting=20)
    figures = crowded.scores
    assert figures["w0"]["memory_wait_s"] > figures["w1"]["memory_wait_s"] > 0  # both pools full
    # Only the room beyond what the fewest new tokens (the holder's 117) would hold anywhere is the choice's.
    assert figures["w1"]["memory_work_s"] > 0 == figures["w0"]["memory_work_s"]
    assert crowded.ranked[0].id == "w0" and crowded.reason == "prefix-hit"
    cold = _full_pools(waiting=20, matched=(0, 0))
    assert cold.scores["w0"]["memory_work_s"] == cold.scores["w1"]["memory_work_s"] == 0.0
    assert cold.ranked[0].id == "w1"  # the shorter wait for room
    # Where the pool has room, what the new tokens hold costs nothing (memory_work_s 0): the price is the prefill's.
    roomy = _select(
        as_policy(PrefixAwarePolicy, create_policy("prefix-aware")),
        _request(2165, max_new_tokens=32),
        _candidates(loopback_workers(2), [128, 0], [WorkerLoad(num_waiting_reqs=20, max_total_num_tokens=20_000)] * 2),
    )
    assert roomy.scores["w0"]["memory_work_s"] == roomy.scores["w1"]["memory_work_s"] == 0.0


def _loaded_fleet(holder_sends: int, output: int) -> Decision:
    """Three measured workers, each with room in a 24k-token pool: w0 holds 3,000 of a 3,200-token prompt
    behind ``holder_sends`` of the router's 1,800-token cold sends, w2 has one such send queued, w1 nothing.
    Two of the three candidates have a queue: the fleet is past its knee (``idle_fleet_busy_share`` 0.5)."""
    workers = loopback_workers(3)
    policy = as_policy(PrefixAwarePolicy, create_policy("prefix-aware"))
    now = time.monotonic()
    loads = [WorkerLoad(max_total_num_tokens=24576, polled_at=now) for _ in workers]
    for w, ld in zip(workers, loads):
        model = policy.cost_model(w)
        model.windows, model.utilization = 1, 0.1
        policy.on_load(w, ld)
    for _ in range(holder_sends):
        policy.cost_model(workers[0]).sent(1800, 0, now)
    policy.cost_model(workers[2]).sent(1800, 0, now)
    request = _request(3200, keys=[5], max_new_tokens=output)
    return policy.select(request, _candidates(workers, [188, 0, 0], loads))


def test_a_request_that_joins_a_forming_batch_pays_for_the_wait_it_adds_to_each_request_in_it() -> None:
    """SGLang prefills the requests waiting behind a running prefill as one batch and each gets its first token
    at its end: a request that joins the batch delays every one of them by its own prefill. w0 runs a cold
    prefill with one hit waiting behind it; a cold prompt there joins the hit's batch (no floor of its own) and
    its seconds cost one request more than on idle w1; with a second joiner, two more. A hit there pays none."""
    workers = loopback_workers(2)
    policy = as_policy(PrefixAwarePolicy, create_policy("prefix-aware"))
    now = 1000.0
    policy.clock = lambda: now + 0.02
    loads = [WorkerLoad(max_total_num_tokens=24576, polled_at=now) for _ in workers]
    for w, ld in zip(workers, loads):
        model = policy.cost_model(w)
        model.windows, model.utilization = 1, 0.1
        policy.on_load(w, ld)
        model.floor_per_batch = True  # the worker counts its prefill batches
    holder = policy.cost_model(workers[0])
    holder.sent(2048, 0, now)  # runs at once
    holder.sent(150, 2048, now + 0.01)  # waits behind it: opens the next batch
    assert holder.joins_forming_batch(now + 0.02) and holder.forming_requests == 1
    request = _request(2200, keys=[9])
    decision = policy.select(request, _candidates(workers, [0, 0], loads))
    joined, idle = decision.scores["w0"], decision.scores["w1"]
    assert joined["prefill_s"] < idle["prefill_s"]  # the batch pays the floor
    assert joined["work_price"] == pytest.approx(idle["work_price"] + 1)  # one request waits for its prefill
    assert joined["score"] - joined["ttft_s"] == pytest.approx(joined["work_price"] * joined["prefill_s"])
    assert decision.ranked[0].id == "w1"
    holder.sent(150, 2048, now + 0.02)  # a second request joins the batch
    assert holder.forming_requests == 2
    again = policy.select(request, _candidates(workers, [0, 0], loads)).scores["w0"]
    assert again["work_price"] == pytest.approx(idle["work_price"] + 2)
    # A hit on the worker that holds its prefix is not charged for joining: it adds little to the batch, and
    # charging it pushed sessions off their holders while the pools filled.
    hit = policy.select(_request(2200, keys=[9]), _candidates(workers, [128, 0], loads)).scores["w0"]
    assert hit["work_price"] == pytest.approx(idle["work_price"])


def test_past_the_knee_a_spill_pays_for_the_room_its_copy_takes_before_any_pool_is_full() -> None:
    """Once most candidates have a queue, the queue fills a pool within one request's hold: a copy of a held
    prefix made now holds room the queued requests will need, full pool or not. Without that charge the idle
    worker's score is below the holder's; with it the request stays, until the holder's queue is longer than
    the copy's prefill and room together. The room is held for the output's decode too: a longer output keeps
    it home. Below the knee nothing is charged."""
    kept = _loaded_fleet(holder_sends=6, output=256)
    f = kept.scores
    assert all(x["memory_wait_s"] == 0 for x in f.values())  # no pool is full
    assert f["w0"]["memory_work_s"] == 0 < f["w1"]["memory_work_s"] == f["w2"]["memory_work_s"]  # the copy's room
    assert f["w1"]["score"] - f["w1"]["memory_price"] * f["w1"]["memory_work_s"] < f["w0"]["score"]
    assert kept.reason == "prefix-hit" and kept.ranked[0].id == "w0"
    spilled = _loaded_fleet(holder_sends=10, output=256)
    assert spilled.reason == "prefix-spill" and spilled.ranked[0].id == "w1"
    long = _loaded_fleet(holder_sends=10, output=1000)
    assert long.reason == "prefix-hit" and long.scores["w1"]["memory_work_s"] > spilled.scores["w1"]["memory_work_s"]
    light = _light_fleet_with_a_busy_holder({})  # one of three candidates has a queue
    assert all(x["memory_work_s"] == 0 for x in light.scores.values()) and light.reason == "prefix-spill"


def test_the_fleet_mean_is_kept_as_running_sums() -> None:
    """Each refit replaces its worker's share; a worker that leaves drops out; nobody measured: no mean."""
    from extproc.decision.policies.prefix_aware.cost_model import FleetMean

    fleet = FleetMean()
    assert fleet.model is None
    a, b = object(), object()
    fleet.update(a, PrefillModel(0.02, 4e-5, 1e-9))
    fleet.update(b, PrefillModel(0.04, 2e-5, 3e-9))

    def constants(m: PrefillModel | None) -> tuple[float, float, float]:
        assert m is not None
        return (m.c0, m.a, m.b)

    assert constants(fleet.model) == pytest.approx((0.03, 3e-5, 2e-9))
    fleet.update(a, PrefillModel(0.06, 4e-5, 1e-9))  # a refit replaces a's share, it does not add one
    assert constants(fleet.model)[0] == pytest.approx(0.05)
    fleet.remove(a)
    assert constants(fleet.model) == pytest.approx((0.04, 2e-5, 3e-9))
    fleet.remove(b)
    assert fleet.model is None


def test_an_unmeasured_worker_borrows_the_fleet_mean_and_a_departed_one_leaves_it() -> None:
    policy = as_policy(PrefixAwarePolicy, create_policy("prefix-aware"))
    measured, fresh = loopback_workers(2)
    model = policy.cost_model(measured)
    # a worker twice as slow as the priors in every constant
    _feed(model, 1000, 6, lambda new: 2 * policy.cost_model(fresh).learned.seconds(new, 0))
    assert model.windows
    assert policy.cost_model(fresh).prefill == model.learned  # judged by the measured one, for queue and prefill
    policy.remove_worker(measured.id)
    assert policy.fleet.model is None and policy.cost_model(fresh).prefill == policy.cost_model(fresh).learned


FULL_CACHE = 24576 * 8 // 10 // 16 + 1  # blocks: past cache_full_fraction of a 24k pool (no room left)


def _doc_holder_with_cold_sends(
    stale: bool, busy_fleet: bool = False, evicted: list[int] | None = None, busy_others: int | None = None
) -> Decision:
    """w0 holds a 6,224-token document in a full 24k pool; a question about it arrives behind a cold 6.2k
    prompt the router just queued there. ``stale``: since the document was last used there, 18.7k other new
    tokens were stored on w0 (and prefilled), so the LRU order puts the document first in line for eviction.
    ``evicted``: w0's events say it evicted these blocks just before the question. ``busy_fleet``: the other
    two workers have a queue too (``busy_others``: that many of them)."""
    now = [1000.0]
    workers = loopback_workers(3)
    policy = as_policy(PrefixAwarePolicy, create_policy("prefix-aware"))
    policy.clock = lambda: now[0]
    loads = [WorkerLoad(max_total_num_tokens=24576, polled_at=now[0]) for _ in workers]
    for w, ld in zip(workers, loads):
        model = policy.cost_model(w)
        model.windows, model.utilization = 1, 0.1
        policy.on_load(w, ld)
    doc = list(range(1, 390))  # 389 blocks of 16

    def route(keys: list[int], matched: int, only_w0: bool = True) -> Decision:
        candidates = _candidates(workers[:1] if only_w0 else workers, [matched, 0, 0][: 1 if only_w0 else 3], loads)
        candidates[0].cached_blocks = FULL_CACHE  # w0's cache is full
        decision = policy.select(_request(len(keys) * 16, keys=keys), candidates)
        policy.on_routed(_request(len(keys) * 16, keys=keys), decision)
        return decision

    route([*doc, 10_000], 389)  # the document is used on w0
    if stale:
        for i in range(3):  # other cold prompts stored there since, long done
            route(list(range(20_000 + 1000 * i, 20_389 + 1000 * i)), 0)
        now[0] += 30.0
    for w in workers[1 : 1 + (busy_others if busy_others is not None else 2 if busy_fleet else 0)]:
        policy.cost_model(w).sent(4096, 0, now[0])
    route(list(range(50_000, 50_389)), 0)  # a cold prompt queued ahead of the question
    if evicted:
        policy.on_evicted("w0", evicted)
    if busy_fleet:
        policy.busy_average = 1.0  # and every worker had a queue over the last second: past the knee
    candidates = _candidates(workers, [389, 0, 0], loads)
    candidates[0].cached_blocks = FULL_CACHE
    return policy.select(_request(390 * 16, keys=[*doc, 10_001]), candidates)


def test_a_prefix_the_queued_sends_will_evict_is_not_predicted_as_a_hit() -> None:
    """SGLang evicts least recently used pages: a document used long ago goes first, one just used survives.
    w0 last evicted when 1,267 of its ledger's blocks had been used after the block it evicted (block 100 of the
    first prompt stored after the document): that is where its pool ends."""
    fresh = _doc_holder_with_cold_sends(stale=False, evicted=[20_100])
    assert fresh.scores["w0"]["lost_tokens"] == 0 and fresh.scores["w0"]["new_tokens"] == 16, fresh.scores
    stale = _doc_holder_with_cold_sends(stale=True, evicted=[20_100])
    assert stale.scores["w0"]["lost_tokens"] == 389 * 16, stale.scores
    assert stale.scores["w0"]["new_tokens"] == 16 + 389 * 16
    # Predicted as what it will be: the whole document computed again behind the queue.
    assert stale.scores["w0"]["prefill_s"] > 10 * fresh.scores["w0"]["prefill_s"]
    assert stale.ranked[0].id != "w0"
    # Where every worker has a queue (and had, on average over the last second) the prediction is not made:
    # spilling there evicts elsewhere. With two of the three queued (under ``eviction_lag_busy_share``, 80 %) it is.
    busy = _doc_holder_with_cold_sends(stale=True, busy_fleet=True, evicted=[20_100])
    assert busy.scores["w0"]["lost_tokens"] == 0
    mostly_busy = _doc_holder_with_cold_sends(stale=True, busy_others=1, evicted=[20_100])
    assert mostly_busy.scores["w0"]["lost_tokens"] == 389 * 16


def test_a_fleet_busy_for_a_moment_is_not_past_its_knee() -> None:
    """Every candidate queued now, but the fleet was light over the last second (the share averaged over
    decisions below ``idle_fleet_busy_share``): not past the knee, so the eviction lag is predicted and a
    request joining a forming batch pays for the wait it adds. Only a fleet busy now and on average is past it.
    The average follows the decisions over about a second."""
    policy = as_policy(PrefixAwarePolicy, create_policy("prefix-aware"))
    policy.busy_average = 0.2
    assert not policy.past_knee(1.0)  # all busy now, light on average
    assert not policy.past_knee(0.5)  # light now
    policy.busy_average = 0.9
    assert policy.past_knee(1.0)  # busy now and on average
    assert not policy.past_knee(0.5)  # a moment with half the fleet idle
    now = [10.0]
    averaged = as_policy(PrefixAwarePolicy, create_policy("prefix-aware"))
    averaged.clock = lambda: now[0]
    workers = loopback_workers(2)
    loads = [WorkerLoad(max_total_num_tokens=24576, polled_at=now[0]) for _ in workers]
    averaged.cost_model(workers[0]).sent(4096, 0, now[0])  # w0 has a queue, w1 none: half the fleet busy
    averaged.select(_request(64, keys=[1, 2, 3, 4]), _candidates(workers, [0, 0], loads))
    assert averaged.busy_average == 0.5  # the first decision sets it
    now[0] += 1.0  # a second later both are queued
    for worker in workers:
        averaged.cost_model(worker).sent(4096, 0, now[0])
    averaged.select(_request(64, keys=[1, 2, 3, 4]), _candidates(workers, [0, 0], loads))
    assert averaged.busy_average == pytest.approx(0.5 + 0.5 * (1 - math.exp(-1.0)))


def test_where_a_worker_evicts_is_learned_from_its_evictions() -> None:
    """Until w0 reports an eviction nothing is predicted gone (it has lost nothing but what its step under way
    may be evicting, and there is nothing to judge that by); then a block is gone once more were used after it
    than its own evictions measure. The stale document (1,945 blocks used after its deepest one) is kept when
    w0 evicted a block 1,945 had been used after, gone when it evicted one 1,267 had; the fresh one (778 used
    after it) is predicted gone when w0 evicted a block only 388 had."""
    never = _doc_holder_with_cold_sends(stale=True)
    assert never.scores["w0"]["lost_tokens"] == 0 and never.scores["w0"]["new_tokens"] == 16, never.scores
    kept = _doc_holder_with_cold_sends(stale=True, evicted=[10_000])  # the document's own extra block, deepest
    assert kept.scores["w0"]["lost_tokens"] == 0 and kept.scores["w0"]["new_tokens"] == 16, kept.scores
    gone = _doc_holder_with_cold_sends(stale=True, evicted=[20_100])
    assert gone.scores["w0"]["lost_tokens"] == 389 * 16
    fresh = _doc_holder_with_cold_sends(stale=False)
    assert fresh.scores["w0"]["lost_tokens"] == 0
    tight = _doc_holder_with_cold_sends(stale=False, evicted=[50_388])  # a pool that held less than thought
    assert tight.scores["w0"]["lost_tokens"] == 389 * 16, tight.scores


def test_the_orders_of_use_share_the_policys_part_of_the_memory_budget() -> None:
    """Each worker's ``RecencyLedger`` keeps twice its pool's cached share while the ``policy`` share allows
    it; the share is split evenly over the workers whose pool is known; one too small for the cached share
    keeps a sample of the keys, and one too small for a sample of 256 none, so the ledgers never hold more
    than the share (``/metrics`` shows what they hold)."""
    from extproc.memory import LEDGER_BYTES

    def fleet_of(count: int, budget: int) -> tuple[PrefixAwarePolicy, list[Worker]]:
        policy = as_policy(PrefixAwarePolicy, create_policy("prefix-aware"))
        policy.use_memory(budget)
        workers = loopback_workers(count)
        now = time.monotonic()
        for w in workers:
            policy.on_load(w, WorkerLoad(max_total_num_tokens=24576, polled_at=now))
        for i, w in enumerate(workers):
            req = _request(4096, keys=list(range(i * 1000, i * 1000 + 256)))
            scores = {"new_tokens": 4096.0, "cached_tokens": 0.0}
            policy.on_routed(req, Decision(ranked=[w], reason="test", scores={w.id: scores}))
        return policy, workers

    reach = math.ceil(0.8 * 24576 / 16) + 1  # cache_full_fraction's share of a 24,576-token pool, in blocks
    budget = 16 * 2 * reach * LEDGER_BYTES  # room for 16 full ledgers
    policy, workers = fleet_of(4, budget)
    assert [policy._recency[w.id].max_blocks for w in workers] == [2 * reach] * 4
    assert 0 < policy.memory_bytes() <= budget
    policy, workers = fleet_of(24, budget)  # each gets 16/24 of a full ledger: more than the cached share
    sizes = {policy._recency[w.id].max_blocks for w in workers}
    assert sizes == {budget // LEDGER_BYTES // 24} and reach < min(sizes)
    assert policy.memory_bytes() <= budget
    policy, workers = fleet_of(40, budget)  # 16/40 of a full ledger is less than the cached share: every 3rd key
    share = budget // LEDGER_BYTES // 40
    assert {(policy._recency[w.id].max_blocks, policy._recency[w.id].sample_every) for w in workers} == {
        (math.ceil(2 * reach / 3), 3)
    }
    assert math.ceil(2 * reach / 3) <= share and policy.memory_bytes() <= budget
    policy, workers = fleet_of(40, 40 * 255 * LEDGER_BYTES)  # under 256 keys a worker: too coarse a sample, none
    assert not policy._recency and policy.memory_bytes() == 0
    policy, workers = fleet_of(4, 0)  # the decode policy's part: nothing
    assert not policy._recency


def test_deep_past_the_knee_the_room_a_copy_takes_costs_a_saturated_workers_second() -> None:
    """Every candidate has a queue (the fleet is past its knee): a copy's KV room is priced at ``max_work_price``,
    not at the number its worker reports waiting now (none here): the queue grows while the copy holds the room.
    With one candidate idle the fleet is not past its knee and the room costs what waits, at least the price."""

    def fleet(busy: int) -> Decision:
        workers = loopback_workers(3)
        policy = as_policy(PrefixAwarePolicy, create_policy("prefix-aware"))
        now = time.monotonic()
        loads = [WorkerLoad(max_total_num_tokens=24576, polled_at=now) for _ in workers]
        for w, ld in zip(workers, loads):
            model = policy.cost_model(w)
            model.windows, model.utilization = 1, 0.1
            policy.on_load(w, ld)
        for w in workers[:busy]:
            policy.cost_model(w).sent(1800, 0, now)
        return policy.select(_request(3200, keys=[5], max_new_tokens=256), _candidates(workers, [188, 0, 0], loads))

    deep = fleet(busy=3).scores["w1"]
    assert deep["memory_work_s"] > 0 and deep["memory_price"] == PrefixAwareOptions().max_work_price
    assert deep["memory_price"] > deep["work_price"]
    two = fleet(busy=2).scores["w2"]  # the idle w2 is the copy's candidate now
    assert two["memory_work_s"] > 0 and two["memory_price"] == two["work_price"] < PrefixAwareOptions().max_work_price


def test_a_worker_whose_full_pool_has_requests_waiting_counts_as_having_a_queue() -> None:
    """A memory-bound worker's queue waits for KV room with its prefill done: the router's own prefill account
    there is empty, its report's waiting requests are the queue. With room in the pool, a report's waiting count
    does not count (it is up to a poll stale, and prefill queues are the router's own account)."""
    workers = loopback_workers(2)
    policy = as_policy(PrefixAwarePolicy, create_policy("prefix-aware"))
    full = WorkerLoad(num_waiting_reqs=12, token_usage=0.97, max_total_num_tokens=24576)
    roomy = WorkerLoad(num_waiting_reqs=12, token_usage=0.5, max_total_num_tokens=24576)
    assert policy.busy_share(_candidates(workers, [0, 0], [full, full]), policy.clock()) == 1.0
    assert policy.busy_share(_candidates(workers, [0, 0], [full, roomy]), policy.clock()) == 0.5
    assert policy.busy_share(_candidates(workers, [0, 0], [roomy, None]), policy.clock()) == 0.0


def test_a_fleet_whose_pools_are_full_with_requests_waiting_prices_a_second_as_saturated() -> None:
    """Two of three candidates report requests waiting with full pools: the fleet is memory-bound, not yet past
    its knee by the router's prefill account, and every second of prefill costs ``max_work_price`` (its measured
    prefill utilisation, 0.1, would price it at the least). A copy of the prompt w0 holds onto the idle w2 then
    costs more than waiting behind w0's queue. With one of three so, the price is the utilisation's."""
    cap = PrefixAwareOptions().max_work_price

    def fleet(full: int) -> Decision:
        workers = loopback_workers(3)
        policy = as_policy(PrefixAwarePolicy, create_policy("prefix-aware"))
        now = time.monotonic()
        loads = [
            WorkerLoad(
                num_waiting_reqs=12 if i < full else 0,
                token_usage=0.97 if i < full else 0.3,
                max_total_num_tokens=24576,
                polled_at=now,
            )
            for i in range(3)
        ]
        for w, ld in zip(workers, loads):
            model = policy.cost_model(w)
            model.windows, model.utilization = 1, 0.1
            policy.on_load(w, ld)
        policy.cost_model(workers[0]).sent(6000, 0, now)  # the holder has prefill queued
        return policy.select(_request(3200, keys=[5], max_new_tokens=256), _candidates(workers, [188, 0, 0], loads))

    bound = fleet(full=2)
    assert {f["work_price"] for f in bound.scores.values()} == {cap}
    assert bound.ranked[0].id == "w0" and bound.reason == "prefix-hit"
    roomy = fleet(full=1)
    assert all(f["work_price"] < cap for f in roomy.scores.values())
    assert roomy.ranked[0].id == "w2" and roomy.reason == "prefix-spill"

"""Scheduler and timing model: SGLang's admission, chunking, ordering and time on a simulated clock.

These run the real scheduler loop in-process (no HTTP needed to observe batch composition) with a
huge speedup, and check the simulated GPU clock against the timing formulas.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from functools import partial

import pytest

from sglang_workers.sim.timing import PROFILES, get_profile
from tests.support.sim_scheduler import PROFILE, VOCAB, Factory, finish, plain_scheduler, started


@pytest.fixture
async def make() -> AsyncIterator[Factory]:
    async with started(partial(plain_scheduler, speedup=1e9)) as factory:
        yield factory


def prefill_cost(new: int, cached: int = 0) -> float:
    return PROFILE.a * new + PROFILE.b * (new * new + 2 * cached * new)


async def test_prefill_time_follows_the_model(make: Factory) -> None:
    s = make()
    req = s.submit(list(range(4096)), 1)
    await finish(req)
    assert req.sim_first_token == pytest.approx(PROFILE.c0 + prefill_cost(4096))
    # A second request sharing 4000 tokens computes only the rest, attending to the cached part.
    other = s.submit(list(range(4000)) + [7] * 96, 1)
    await finish(other)
    assert other.cached_tokens == 4000
    assert other.sim_first_token is not None
    assert other.sim_first_token - other.sim_arrival == pytest.approx(PROFILE.c0 + prefill_cost(96, 4000))


async def test_long_prompt_is_chunked_and_chunks_continue_first(make: Factory) -> None:
    s = make(chunked_prefill_size=8192, max_prefill_tokens=16384)
    long = s.submit(list(range(20000)), 2)
    await finish(long)
    prefills = [st for st in s.steps if st.kind == "prefill"]
    assert [st.tokens for st in prefills] == [8192, 8192, 3616]
    expected = sum(PROFILE.c0 + prefill_cost(n, p) for n, p in ((8192, 0), (8192, 8192), (3616, 16384)))
    assert long.sim_first_token == pytest.approx(expected)


async def test_prefill_runs_before_decode(make: Factory) -> None:
    s = make()
    a = s.submit(list(range(100)), 50)
    while not a.output_ids:
        await asyncio.sleep(0)
    b = s.submit(list(range(500, 600)), 2)
    await finish(a, b)
    kinds = [(st.kind, st.rids) for st in s.steps]
    first_b = next(i for i, (_, rids) in enumerate(kinds) if b.rid in rids)
    assert kinds[first_b][0] == "prefill"
    # Decode steps produce one token per running request and last d0 + d1*B + d2*context.
    decode = next(st for st in s.steps if st.kind == "decode" and len(st.rids) == 2)
    assert decode.duration > PROFILE.d0 + 2 * PROFILE.d1
    assert a.sim_finished is not None and len(a.output_ids) == 50


async def test_max_running_requests_caps_the_batch(make: Factory) -> None:
    s = make(max_running_requests=2)
    reqs = [s.submit(list(range(i * 100, i * 100 + 40)), 5) for i in range(4)]
    await finish(*reqs)
    assert max(len(st.rids) for st in s.steps) == 2
    assert all(len(r.output_ids) == 5 for r in reqs)


async def test_lpm_admits_the_longest_cached_prefix_first(make: Factory) -> None:
    for policy, expected_first in (("lpm", "long"), ("fcfs", "short")):
        s = make(schedule_policy=policy, max_running_requests=1)
        warm = s.submit(list(range(1000)), 1)
        await finish(warm)
        blocker = s.submit(list(range(5000, 5040)), 20)  # occupies the single running slot
        while not blocker.output_ids:
            await asyncio.sleep(0)
        short = s.submit(list(range(100)) + [9] * 50, 1, rid="short")
        long = s.submit(list(range(900)) + [9] * 50, 1, rid="long")
        await finish(blocker, short, long)
        order = [st.rids[0] for st in s.steps if st.kind == "prefill" and st.rids[0] in ("short", "long")]
        assert order[0] == expected_first, policy


async def test_requests_queue_when_the_kv_pool_is_exhausted(make: Factory) -> None:
    s = make(capacity_tokens=1000, page_size=16)
    a = s.submit(list(range(600)), 30)
    b = s.submit(list(range(10000, 10600)), 30)  # cannot fit beside a: waits for it
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert s.load()["num_waiting_reqs"] == 1
    await finish(a, b)
    assert b.sim_first_token is not None and a.sim_finished is not None
    assert b.sim_first_token > a.sim_finished - 1e-12
    assert s.used_tokens <= 1000


async def test_decode_out_of_memory_retracts_and_still_finishes(make: Factory) -> None:
    s = make(capacity_tokens=700, page_size=1)
    reqs = [s.submit(list(range(i * 1000, i * 1000 + 100)), 150) for i in range(4)]
    await finish(*reqs)
    assert all(len(r.output_ids) == 150 for r in reqs)
    assert s.stats.num_retractions > 0
    assert s.free_tokens + s.cache.total_size == 700


async def test_same_seed_same_output(make: Factory) -> None:
    outputs = []
    for seed in (1, 1, 2):
        s = make(seed=seed)
        req = s.submit(list(range(50)), 20)
        await finish(req)
        outputs.append(req.output_ids)
        assert set(req.output_ids) <= set(VOCAB)
    assert outputs[0] == outputs[1] != outputs[2]


def test_profiles_match_published_figures() -> None:
    assert {
        "llama-3.1-8b-h100",
        "llama-3.1-8b-h200",
        "llama-3.1-70b-tp4-h100",
        "llama-3.1-70b-tp4-h200",
        "instant",
    } <= set(PROFILES)
    h100_8b = get_profile("llama-3.1-8b-h100")
    # Compute-only TTFT at 1k / 8k tokens: ~24 ms / ~224 ms (sglang-performance.md derivation).
    assert h100_8b.prefill_time([(1024, 0)]) - h100_8b.c0 == pytest.approx(0.024, rel=0.1)
    assert h100_8b.prefill_time([(8192, 0)]) - h100_8b.c0 == pytest.approx(0.224, rel=0.1)
    # SGLang v0.3, 70B TP4 H100, ShareGPT at low load: ITL ~21.7 ms at a small batch.
    assert get_profile("llama-3.1-70b-tp4-h100").decode_time(8, 8 * 600) == pytest.approx(0.0217, rel=0.15)
    assert get_profile("instant").prefill_time([(10_000, 0)]) == 0.0
    with pytest.raises(ValueError, match="unknown timing profile"):
        get_profile("nope")


async def test_flush_is_refused_while_requests_run_and_abort_ends_a_request(make: Factory) -> None:
    s = make(speedup=1000.0)  # 1000 decode steps of ~5 ms simulated take ~5 ms of wall time
    req = s.submit(list(range(64)), 1000)
    while not req.output_ids:
        await asyncio.sleep(0)
    assert s.flush_cache() is False
    s.abort(req)
    await finish(req)
    assert len(req.output_ids) < 1000
    assert s.flush_cache() is True and s.cache.total_size == 0


async def test_max_new_tokens_is_clipped_to_the_kv_pool(make: Factory) -> None:
    s = make(capacity_tokens=500)
    req = s.submit(list(range(100)), 10_000)
    await finish(req)
    assert len(req.output_ids) == s.capacity - 1 - 100 == 496 - 1 - 100


async def test_speedup_paces_wall_time_without_drift(make: Factory) -> None:
    s = make(speedup=20.0)
    req = s.submit(list(range(200)), 150)  # ~150 decode steps of ~5 ms simulated: 0.25 ms each in wall time
    loop = asyncio.get_running_loop()
    start = loop.time()
    await finish(req)
    wall = loop.time() - start
    expected = s.sim_time / 20.0
    assert expected > 0.03
    assert 0.9 * expected <= wall <= 2 * expected + 0.05


async def test_pool_is_handed_out_in_whole_pages(make: Factory) -> None:
    s = make(page_size=16, capacity_tokens=1000)
    assert s.capacity == 992
    req = s.submit(list(range(17)), 100)
    while not req.output_ids:
        await asyncio.sleep(0)
    # 16 prompt tokens in the tree (locked) + the 17th in a private page of its own.
    assert s.used_tokens == 32 and s.free_tokens == 992 - 32
    await finish(req)
    assert s.used_tokens == 0 and s.free_tokens + s.cache.evictable_size == 992


async def test_a_failing_step_fails_in_flight_requests_and_keeps_serving(
    make: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = make()
    original = s._decode_step

    def broken() -> None:
        raise RuntimeError("injected")

    monkeypatch.setattr(s, "_decode_step", broken)
    req = s.submit(list(range(40)), 5)
    await finish(req)
    assert req.error == "internal scheduler error"
    monkeypatch.setattr(s, "_decode_step", original)
    ok = s.submit(list(range(40)), 5)
    await finish(ok)
    assert ok.error is None and len(ok.output_ids) == 5


async def test_lpm_falls_back_to_fcfs_above_128_waiting(make: Factory) -> None:
    s = make(schedule_policy="lpm", max_running_requests=1)
    await finish(s.submit(list(range(1000)), 1))
    blocker = s.submit(list(range(5000, 5040)), 5)
    while not blocker.output_ids:
        await asyncio.sleep(0)
    fillers = [s.submit([20_000 + i] * 20, 1, rid=f"f{i}") for i in range(128)]
    long = s.submit(list(range(900)) + [9] * 50, 1, rid="long")  # the 129th waiting request
    await finish(blocker, long, *fillers)
    order = [st.rids[0] for st in s.steps if st.kind == "prefill" and st.rids[0] not in (blocker.rid,)]
    assert order[1] == "f0"  # queue order, not the long cached prefix


async def test_the_new_token_ratio_falls_per_decode_step_and_is_reset_when_idle(make: Factory) -> None:
    """SGLang 0.5.23: 0.7 at start, one 600th of the way to 0.098 per decode step, 0.7 again once idle
    (``on_idle``); ``sglang:new_token_ratio`` shows the ratio the last prefill batch was admitted with."""
    from sglang_workers.sim.scheduler import INIT_NEW_TOKEN_RATIO, MIN_NEW_TOKEN_RATIO, NEW_TOKEN_RATIO_DECAY

    assert round(MIN_NEW_TOKEN_RATIO, 6) == 0.098
    s = make()
    assert s.new_token_ratio == INIT_NEW_TOKEN_RATIO and s.reported_new_token_ratio == 0.0
    req = s.submit(list(range(100)), 41)
    while len(req.output_ids) < 21:  # the prefill's token, then 20 decode steps
        await asyncio.sleep(0)
    assert s.new_token_ratio == pytest.approx(INIT_NEW_TOKEN_RATIO - 20 * NEW_TOKEN_RATIO_DECAY)
    assert s.reported_new_token_ratio == INIT_NEW_TOKEN_RATIO  # admitted before any decode step
    late = s.submit(list(range(500, 600)), 2)
    while not late.output_ids:
        await asyncio.sleep(0)
    assert s.reported_new_token_ratio < INIT_NEW_TOKEN_RATIO  # this prefill was admitted at the lower ratio
    await finish(req, late)
    for _ in range(100):  # the loop's next pass finds it idle
        if s.new_token_ratio == INIT_NEW_TOKEN_RATIO:
            break
        await asyncio.sleep(0)
    assert s.idle and s.new_token_ratio == INIT_NEW_TOKEN_RATIO

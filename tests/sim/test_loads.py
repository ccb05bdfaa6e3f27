"""The simulator's /v1/loads counters, counted as SGLang 0.5.23's scheduler counts them (in-process).

``total_prefill_uncached_tokens`` / ``total_prefill_busy_us`` must give the timing profile's prefill
speed (that is what a router learns from their deltas), ``decode_moments`` the decode steps' sums,
``num_waiting_uncached_tokens`` the queued prefill work; health checks count nowhere.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from functools import partial

import pytest

from sglang_workers.sim.load_report import DECODE_LOG_INTERVAL
from tests.support.sim_scheduler import PROFILE, Factory, finish, plain_scheduler, started

SPEEDUP = 20.0  # the steps' wall time is what the counters report: profile time / speedup


@pytest.fixture
async def make() -> AsyncIterator[Factory]:
    async with started(partial(plain_scheduler, speedup=SPEEDUP)) as factory:
        yield factory


def prefill_s(new: int, cached: int = 0) -> float:
    """Wall seconds of one prefill at ``SPEEDUP`` (what the worker reports as busy time)."""
    return (PROFILE.c0 + PROFILE.a * new + PROFILE.b * (new * new + 2 * cached * new)) / SPEEDUP


async def test_prefill_counters_give_the_profiles_prefill_speed(make: Factory) -> None:
    s = make()
    await finish(s.submit(list(range(4096)), 1))
    load = s.load()
    assert load["total_prefill_uncached_tokens"] == 4096
    assert load["total_prefill_busy_us"] == pytest.approx(prefill_s(4096) * 1e6, abs=1)
    # A request sharing 4000 tokens adds only its 96 new ones and their (short) prefill.
    await finish(s.submit(list(range(4000)) + [7] * 96, 1))
    after = s.load()
    tokens = after["total_prefill_uncached_tokens"] - load["total_prefill_uncached_tokens"]
    busy_us = after["total_prefill_busy_us"] - load["total_prefill_busy_us"]
    assert tokens == 96
    assert busy_us == pytest.approx(prefill_s(96, 4000) * 1e6, abs=1)
    assert after["cache_hit_rate"] == pytest.approx(4000 / 4096, abs=1e-4)  # the last prefill batch's


async def test_decode_moments_sum_contiguous_decode_intervals(make: Factory) -> None:
    s = make()
    assert s.load()["decode_moments"] is None  # nothing measured yet: null, as in SGLang
    await finish(s.submit(list(range(100)), 11))  # a prefill (first token), then 10 decode steps
    decodes = [st for st in s.steps if st.kind == "decode"]
    assert len(decodes) == 10
    count, sum_b, sum_t, sum_bb, sum_bt, generated = s.load()["decode_moments"]
    # The first decode step follows a prefill: no interval. Each later one is timed from the previous launch.
    assert (count, sum_b, sum_bb, generated) == (9, 9, 9, 9)
    expected_us = sum(int(st.duration / SPEEDUP * 1e6) for st in decodes[:9])
    assert sum_t == pytest.approx(expected_us, abs=9) and sum_bt == sum_t


async def test_health_checks_count_nowhere(make: Factory) -> None:
    s = make()
    before = s.last_output_at
    s.probe_health()  # idle: runs a one-token generation of [0]
    while s.last_output_at == before:
        await asyncio.sleep(0)
    await asyncio.sleep(0.01)
    load = s.load()
    assert load["total_prefill_uncached_tokens"] == 0 and load["total_prefill_busy_us"] == 0
    assert s.stats.num_requests == 0 and s.stats.prompt_tokens == 0 and s.stats.generation_tokens == 0
    # Busy: no generation is queued; the probe is answered by the next batch's end.
    slow = make(speedup=1.0)
    req = slow.submit(list(range(64)), 50)
    while not req.output_ids:
        await asyncio.sleep(0)
    mark = slow.last_output_at
    waiting = len(slow.waiting)
    slow.probe_health()
    assert len(slow.waiting) == waiting
    while slow.last_output_at == mark:
        await asyncio.sleep(0.001)
    slow.abort(req)


async def test_waiting_uncached_tokens_and_total_tokens(make: Factory) -> None:
    for policy in ("lpm", "fcfs"):
        s = make(schedule_policy=policy, max_running_requests=1, speedup=1.0)
        await finish(s.submit(list(range(1000)), 1))  # 1000 tokens cached, hit rate 0 so far
        blocker = s.submit(list(range(5000, 5040)), 200)  # holds the only running slot for ~1 s
        while not blocker.output_ids:
            await asyncio.sleep(0)
        waiting = s.submit(list(range(900)) + [9] * 100, 1)
        load = s.load()
        assert load["num_waiting_reqs"] == 1 and load["num_running_reqs"] == 1
        assert load["num_total_tokens"] == load["num_used_tokens"] + 1000
        if policy == "lpm":  # the queue's prefixes are matched: 896 of 1000 cached (whole pages, not the last)
            assert load["num_waiting_uncached_tokens"] == 1000 - 896
        else:  # fcfs: length x recent miss rate (two cold prefills so far: miss rate 1)
            assert load["num_waiting_uncached_tokens"] == 1000
        s.abort(blocker)
        await finish(blocker, waiting)


async def test_gen_throughput_is_reported_every_40_decode_steps_and_zero_when_idle(make: Factory) -> None:
    s = make(speedup=1.0)
    req = s.submit(list(range(50)), DECODE_LOG_INTERVAL + 5)
    while len(req.output_ids) < 10:
        await asyncio.sleep(0.001)
    assert s.load()["gen_throughput"] == 0.0  # no report yet
    while len(req.output_ids) < DECODE_LOG_INTERVAL + 3:
        await asyncio.sleep(0.001)
    rate = s.load()["gen_throughput"]
    # ~40 tokens over ~40 decode steps of ~5.6 ms each (wall clock at speedup 1)
    assert 40 / (40 * 0.0056) / 3 < rate < 40 / (40 * 0.0056) * 1.5
    await finish(req)
    await asyncio.sleep(0.01)
    assert s.load()["gen_throughput"] == 0.0  # SGLang zeroes it once the worker is idle


async def test_retractions_show_in_queues(make: Factory) -> None:
    s = make(capacity_tokens=700, page_size=1)
    reqs = [s.submit(list(range(i * 1000, i * 1000 + 100)), 150) for i in range(4)]
    await finish(*reqs)
    assert s.stats.num_retractions > 0
    # Reported per stats interval, then reset; the cumulative count is on /metrics.
    assert 0 <= s.load()["queues"]["retracted"] <= s.stats.num_retractions

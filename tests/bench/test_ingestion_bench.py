"""The ingestion benchmark over real ZMQ: a full cache's events leave the index exactly what stayed stored."""

from __future__ import annotations

import asyncio

from benchmarks.probes.ingestion import FULL_AFTER, event_ingestion


def test_full_cache_ingestion_is_exact() -> None:
    workers, pages, batches = 3, 16, FULL_AFTER + 4
    run = asyncio.run(event_ingestion(workers, workers * pages * batches, full_cache=True))
    assert run.stored == workers * batches * pages
    assert run.removed == workers * (batches - FULL_AFTER) * pages
    assert run.held == run.expected_held == workers * FULL_AFTER * pages
    assert run.exact
    assert run.cpu_s > 0 and run.seconds > 0


def test_stored_only_ingestion_keeps_every_block() -> None:
    run = asyncio.run(event_ingestion(2, 2 * 16 * 3))
    assert (run.stored, run.removed) == (2 * 16 * 3, 0)
    assert run.held == run.stored and run.exact


def test_paced_ingestion_follows_the_schedule_and_measures_the_lag() -> None:
    workers, pages, batches, rate = 2, 16, FULL_AFTER + 12, 1600.0
    run = asyncio.run(event_ingestion(workers, workers * pages * batches, full_cache=True, rate=rate))
    assert run.exact and run.rate == rate
    # The publishers kept to the schedule: not all at once (the blocks before the last batch take their time).
    scheduled_s = (run.blocks - 2 * pages) / rate
    assert 0.9 * scheduled_s <= run.sent_s <= scheduled_s + 2.0
    assert run.lags_s and all(0 <= lag < 5 for lag in run.lags_s)
    assert 0 < run.lag_ms(0.5) <= run.lag_ms(0.99) <= run.lag_ms(1.0)
    assert run.cores > 0

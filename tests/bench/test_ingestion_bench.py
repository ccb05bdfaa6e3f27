"""The ingestion benchmark over real ZMQ: a full cache's events leave the index exactly what stayed stored."""

from __future__ import annotations

import asyncio

from benchmarks.decision_latency import FULL_AFTER, event_ingestion


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

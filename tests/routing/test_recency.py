"""The prefix-aware policy's shadow of each worker's LRU order (``RecencyLedger``), against a plain list."""

from __future__ import annotations

import random

import pytest

from extproc.decision.policies.prefix_aware.recency import RecencyLedger


def _newer(order: list[int], key: int) -> int | None:
    return len(order) - 1 - order.index(key) if key in order else None


@pytest.mark.parametrize("max_blocks", [5, 17, 64])
def test_blocks_used_after_a_key_are_counted_exactly_and_the_least_recent_forgotten(max_blocks: int) -> None:
    rng = random.Random(max_blocks)
    ledger = RecencyLedger(max_blocks)
    order: list[int] = []  # the same order kept by hand, least recent first
    for _ in range(400):  # enough uses to renumber many times
        keys = [rng.randrange(6) * 1000 + i for i in range(rng.randrange(1, 25))]
        ledger.touch(keys)
        for key in reversed(keys[:max_blocks]):  # deepest first: a shallower block is the more recent
            if key in order:
                order.remove(key)
            order.append(key)
        order = order[-max_blocks:]
        assert len(ledger) == len(order)
        for key in {*keys, *rng.sample(range(6000), 10)}:
            assert ledger.newer_than(key) == _newer(order, key)


def test_the_kept_depth_is_the_deepest_block_within_the_limit() -> None:
    ledger = RecencyLedger(1000)
    history = list(range(100, 140))  # a session's 40 blocks, used once
    ledger.touch(history)
    ledger.touch(list(range(500, 530)))  # 30 blocks of other prompts since
    assert ledger.newer_than(history[-1]) == 39 + 30 and ledger.newer_than(history[0]) == 30
    assert ledger.kept_depth(history, 40, limit=69) == 40  # nothing beyond the limit: all of it kept
    assert ledger.kept_depth(history, 40, limit=50) == 21  # blocks 21..39 had more than 50 used after them
    assert ledger.kept_depth(history, 40, limit=10) == 0
    assert ledger.kept_depth(history, 25, limit=50) == 21  # only the matched depth is asked about
    assert ledger.kept_depth([7, 8, 9], 3, limit=0) == 3  # never seen: nothing to say, the index stands
    assert ledger.kept_depth(history, 0, limit=0) == 0


def test_a_send_longer_than_the_ledger_keeps_its_shallowest_blocks() -> None:
    ledger = RecencyLedger(8)
    prompt = list(range(20))
    ledger.touch(prompt)
    assert len(ledger) == 8 and ledger.newer_than(0) == 0 and ledger.newer_than(7) == 7
    assert ledger.newer_than(8) is None
    with pytest.raises(ValueError, match="max_blocks must be positive"):
        RecencyLedger(0)


def test_a_sampled_ledger_estimates_the_counts_and_the_kept_depth_of_a_full_one() -> None:
    """Keeping every 4th key (block keys are hashes, so a key's residue picks it at random) and counting 4 blocks
    for each sampled one estimates what the full ledger counts exactly, in about a quarter of the memory: each
    count to within its sampling error (~ 2 * sqrt(4 * count)), the kept depth to within that many blocks."""
    rng = random.Random(7)
    full, sampled = RecencyLedger(40_000), RecencyLedger(10_000, sample_every=4)
    history = [rng.getrandbits(64) for _ in range(2000)]  # a long session's blocks, used once
    for ledger in (full, sampled):
        ledger.touch(history)
    for _ in range(20):  # other prompts since: 20 sends of 10-100 fresh blocks
        send = [rng.getrandbits(64) for _ in range(rng.randrange(10, 100))]
        full.touch(send)
        sampled.touch(send)
    assert len(sampled) < len(full) / 3
    assert sampled.memory_bytes() < full.memory_bytes() / 3
    checked = 0
    for key in history:
        exact, estimate = full.newer_than(key), sampled.newer_than(key)
        if not sampled.sampled(key):
            assert estimate is None
            continue
        assert exact is not None and estimate is not None
        assert abs(estimate - exact) <= 2 * (4 * exact) ** 0.5 + 4, (estimate, exact)
        checked += 1
    assert checked > 400
    newest = full.newer_than(history[0])
    assert newest is not None
    for depth in (500, 1000, 1500):
        limit = newest + depth  # the exact kept depth is about this many blocks deep
        exact_depth = full.kept_depth(history, 2000, limit)
        assert abs(exact_depth - depth) <= 1
        assert abs(sampled.kept_depth(history, 2000, limit) - exact_depth) <= 2 * (4 * limit) ** 0.5 + 4
    assert sampled.kept_depth(history, 2000, limit=10**9) == 2000  # within the limit: all of it kept
    first = next(i for i, key in enumerate(history) if sampled.sampled(key))
    assert sampled.kept_depth(history, 2000, limit=0) == first  # all beyond it: kept only before the first sample
    unsampled = [key for key in history[:40] if not sampled.sampled(key)][:3]
    assert sampled.kept_depth(unsampled, 3, limit=0) == 3  # no sampled block on the path: nothing to say
    # A decision asks each holder about one prompt (its sampled positions found once); another prompt is its own.
    assert sampled.kept_depth(history, 2000, limit=0) == first
    assert sampled.kept_depth(list(history), 2000, limit=0) == first
    with pytest.raises(ValueError, match="sample_every must be positive"):
        RecencyLedger(10, sample_every=0)


def test_an_eviction_measures_what_was_used_after_the_newest_block_it_took() -> None:
    """SGLang evicts least recently used first: what was used after the newest evicted block is what the pool held."""
    ledger = RecencyLedger(1000)
    old = list(range(100, 110))
    ledger.touch(old)
    ledger.touch(list(range(500, 520)))  # 20 blocks of other prompts since
    # An eviction of the old prompt's deepest blocks: the newest of them (old[5], used after old[6:]) had the
    # prompt's 5 shallower blocks and the 20 others used after it.
    assert ledger.used_after_newest(old[5:]) == 5 + 20 == ledger.newer_than(old[5])
    assert ledger.used_after_newest([*old[5:], 999_999]) == 25  # a block the ledger never saw says nothing
    assert ledger.used_after_newest([999_999]) is None
    assert ledger.used_after_newest([]) is None
    sampled = RecencyLedger(1000, sample_every=2)  # only even keys kept, each counting two blocks
    sampled.touch(old)
    sampled.touch(list(range(500, 520)))
    assert sampled.used_after_newest(old[5:]) == sampled.newer_than(106) == 2 * (3 + 10)
    assert sampled.used_after_newest([105, 107]) is None  # none of them sampled

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


def test_the_kept_depth_ends_where_the_run_of_blocks_one_send_used_last_goes_beyond_the_limit() -> None:
    """SGLang evicts a tree node whole, and every node one request matched carries that request's time: the blocks
    one send used last leave the pool together, not one by one as the count after each would say."""
    ledger = RecencyLedger(1000)
    history = list(range(100, 140))  # a session's 40 blocks, used once
    ledger.touch(history)
    ledger.touch(list(range(500, 530)))  # 30 blocks of other prompts since
    ledger.touch(history[:20])  # a later prompt that shares the session's first 20 blocks
    assert ledger.newer_than(history[-1]) == 19 + 30 + 20 and ledger.newer_than(history[20]) == 30 + 20
    assert ledger.newer_than(history[19]) == 19 and ledger.newer_than(history[0]) == 0
    assert ledger.kept_depth(history, 40, limit=69) == 40  # nothing beyond the limit: all of it held
    # Blocks 21..39 had more than 50 used after them; block 20, the first send's too, leaves with them.
    assert ledger.kept_depth(history, 40, limit=50) == 20
    assert ledger.kept_depth(history, 40, limit=19) == 20  # the later send's run fits within the limit
    assert ledger.kept_depth(history, 40, limit=10) == 0  # blocks 11..19 beyond it: the later send's run goes
    assert ledger.kept_depth(history, 25, limit=50) == 20  # only the matched depth is asked about
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
    count to within its sampling error (~ 2 * sqrt(4 * count)), the kept depth to the first sampled block of the
    run that goes."""
    rng = random.Random(7)
    full, sampled = RecencyLedger(40_000), RecencyLedger(10_000, sample_every=4)
    history = [rng.getrandbits(64) for _ in range(2000)]  # a long session's blocks
    for ledger in (full, sampled):
        ledger.touch(history)
    for cut in (1500, 1000, 500):  # shorter prompts sharing its start, each after 7 sends of 10-100 fresh blocks
        for _ in range(7):
            send = [rng.getrandbits(64) for _ in range(rng.randrange(10, 100))]
            full.touch(send)
            sampled.touch(send)
        full.touch(history[:cut])
        sampled.touch(history[:cut])
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
    for cut in (500, 1000, 1500):  # the runs of one send: 0..499, 500..999, 1000..1499, 1500..1999
        within, deepest = full.newer_than(history[cut - 1]), full.newer_than(history[cut + 499])
        assert within is not None and deepest is not None and deepest > within
        for limit in (within, (within + deepest) // 2, deepest - 1):
            assert full.kept_depth(history, 2000, limit) == cut  # the run that starts there goes whole
        assert full.kept_depth(history, 2000, deepest) == min(cut + 500, 2000)  # it fits: held whole
        # Sampled: the first sampled block of that run, as long as the limit is clear of the counts' error.
        limit = (within + deepest) // 2
        assert limit - within > 2 * (4 * limit) ** 0.5 + 4 < deepest - limit
        assert 0 <= sampled.kept_depth(history, 2000, limit) - cut <= 20
    assert sampled.kept_depth(history, 2000, limit=10**9) == 2000  # within the limit: all of it kept
    first = next(i for i, key in enumerate(history) if sampled.sampled(key))
    assert sampled.kept_depth(history, 2000, limit=0) == first  # all beyond it: held only before the first sample
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

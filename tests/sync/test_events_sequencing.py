"""Sequencing of one worker's event stream: gaps, replay answers, restarts, orphans, tiers."""

from __future__ import annotations

from extproc.fleet.blocks import block_keys, chain_seed
from extproc.fleet.index import BlockIndex
from extproc.sync.cache_view import WorkerCacheView
from tests.support.kv_batches import CLEARED, PAGE, removed, stored


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


A = list(range(1, 9))  # two pages
B = list(range(100, 104))  # one page, child of A's second page


def _keys(tokens: list[int]) -> list[int]:
    return block_keys(tokens, PAGE, chain_seed(""))


def _view(clock: Clock | None = None) -> tuple[WorkerCacheView, BlockIndex]:
    index = BlockIndex()
    view = WorkerCacheView("w", index, resync_after_s=30.0, clock=clock or Clock())
    assert view.ingest(0, CLEARED) is None and view.state == "synced"
    return view, index


def test_gap_is_filled_from_the_replay_answer() -> None:
    view, index = _view()
    assert view.ingest(1, stored(A, [11, 12])) is None
    # batch 2 (B) is lost on the way; batch 3 arrives
    assert view.ingest(3, removed([11, 12, 13])) == 2
    view.replayed([(2, stored(B, [13], parent=12)), (3, removed([11, 12, 13]))])
    assert view.last_seq == 3 and view.stats.gaps == 1 and view.stats.gaps_repaired == 1
    assert index.blocks("w") == set() and view.state == "synced"


def test_unanswered_replay_drops_the_worker_and_says_so() -> None:
    view, index = _view()
    view.ingest(1, stored(A, [11, 12]))
    assert view.ingest(3, stored(B, [13], parent=12)) == 2
    view.replayed(None)
    assert view.state == "unknown"
    assert index.blocks("w") == set()  # removals may have been missed: claim nothing
    assert view.stats.orphans == 1  # its parent's mapping went with the reset
    view.ingest(4, CLEARED)
    assert view.state == "synced"


def test_replay_buffer_that_no_longer_reaches_back_is_a_loss() -> None:
    view, index = _view()
    view.ingest(1, stored(A, [11, 12]))
    view.ingest(6, stored([7, 7, 7, 7], [99]))
    view.replayed([(5, stored([5, 5, 5, 5], [55])), (6, stored([7, 7, 7, 7], [99]))])
    assert view.state == "unknown" and view.stats.gaps_repaired == 0
    assert index.blocks("w") == set(_keys([5, 5, 5, 5]) + _keys([7, 7, 7, 7]))  # only what was seen since


def test_unknown_state_recovers_after_clean_events() -> None:
    clock = Clock()
    view, _ = _view(clock)
    view.ingest(2, stored(A, [11, 12]))
    view.replayed(None)
    assert view.state == "unknown"
    clock.now += 31
    assert view.state == "synced"


def test_seq_going_back_is_a_restart() -> None:
    view, index = _view()
    view.ingest(1, stored(A, [11, 12]))
    view.ingest(2, stored(B, [13], parent=12))
    assert index.size("w") == 3
    index.record_routed("w", _keys(A))
    assert view.ingest(0, CLEARED) is None
    assert view.stats.restarts == 1 and index.size("w") == 0 and view.state == "synced"
    assert index.match(_keys(A), ["w"]) == {"w": 0}  # the router's record of it went too
    assert view.ingest(1, stored(B, [13], parent=12)) is None  # a chain from before the restart
    assert view.stats.orphans == 1 and index.size("w") == 0


def test_a_flushed_cache_takes_the_routers_record_of_its_sends_with_it() -> None:
    """AllBlocksCleared in sequence (a flush, not a restart): no hit is predicted from what was sent before."""
    view, index = _view()
    view.ingest(1, stored(A, [11, 12]))
    index.record_routed("w", _keys(A))  # sent again just before the flush: the router's record says held
    assert index.match(_keys(A), ["w"]) == {"w": 2} and index.size("w") == 2
    clears = view.stats.clears
    assert view.ingest(2, CLEARED) is None
    assert view.stats.restarts == 0 and view.stats.clears == clears + 1 and view.state == "synced"
    assert index.match(_keys(A), ["w"]) == {"w": 0}


def test_undecodable_batch_marks_the_worker_unknown() -> None:
    view, _ = _view()
    view.ingest(1, b"\xc1not msgpack")
    assert view.stats.decode_errors == 1 and view.state == "unknown" and view.last_seq == 1


def test_first_batch_after_seq_zero_asks_for_a_replay_from_zero() -> None:
    index = BlockIndex()
    view = WorkerCacheView("w", index)
    assert view.state == "unknown"
    assert view.ingest(2, stored(B, [13], parent=12)) == 0
    view.replayed([(0, CLEARED), (1, stored(A, [11, 12])), (2, stored(B, [13], parent=12))])
    assert view.state == "synced" and index.blocks("w") == set(_keys(A + B))


def test_tiers_are_tracked_separately_through_the_hash_map() -> None:
    view, index = _view()
    view.ingest(1, stored(A, [11, 12]))
    view.ingest(2, stored(A, [11, 12], medium="CPU_PINNED"))  # offloaded copy
    view.ingest(3, removed([11, 12]))  # GPU copy evicted
    assert index.blocks("w", "gpu") == set()
    assert index.blocks("w", "host") == set(_keys(A))
    view.ingest(4, removed([11, 12], medium="CPU_PINNED"))
    assert index.blocks("w", "host") == set() and view._own == {}


def test_engine_hash_map_is_bounded() -> None:
    index = BlockIndex()
    view = WorkerCacheView("w", index, max_hashes=5)
    view.ingest(0, CLEARED)
    for i in range(1, 5):
        view.ingest(i, stored([i] * 8, [10 * i, 10 * i + 1]))
    assert len(view._own) == 5 and 41 in view._own and 10 not in view._own


def test_engine_hash_maps_share_one_bound_and_the_largest_gives_way() -> None:
    from extproc.memory import SharedBound

    index, bound = BlockIndex(), SharedBound(10)
    big = WorkerCacheView("big", index, hashes=bound)
    late = WorkerCacheView("late", index, hashes=bound)
    for view in (big, late):
        view.ingest(0, CLEARED)
    for i in range(1, 6):
        big.ingest(i, stored([i] * 8, [10 * i, 10 * i + 1]))
    assert len(big._own) == 10 and bound.used == 10
    late.ingest(1, stored([7] * 8, [700, 701]))
    late.ingest(2, stored([8] * 8, [800, 801]))
    # The worker that joined a full fleet keeps what it publishes; the largest map dropped its oldest.
    assert set(late._own) == {700, 701, 800, 801} and len(big._own) == 6 and bound.used == 10
    assert 10 not in big._own and 51 in big._own
    late.close()
    assert bound.used == 6 and bound.members == [big]

"""A worker's least-recently-used order as the router's own sends made it: how much was used there after a block.

SGLang frees room in a full KV pool by evicting the least recently used leaves of its radix tree, and
publishes a step's removals only when the step ends. So the router's index goes on showing, for the
length of a prefill step, prefixes that the step's admission has already evicted; and the sends queued
on a worker push out more before a later request is admitted. Neither shows in the index; both follow
from the order in which the worker's blocks were last used, which the router knows for its own sends:
a send uses every block of its prompt, the matched ones and the new ones.

``RecencyLedger`` keeps, per worker, each block key's last use by one of the router's sends, numbered
in order, and answers "how many distinct blocks were used after this one". A block that more blocks
were used after than the worker's pool holds is (predicted) gone; how many it holds, in the ledger's count,
the worker's own evictions say (``used_after_newest`` of the blocks it evicted). A send's blocks are used deepest
first, so that each block counts as used no earlier than the blocks below it in the tree, as SGLang
evicts leaves before their ancestors.

The count is exact over the keys kept (a Fenwick tree over use numbers; a send's new numbers are
consecutive, so it costs one range update for them and one per run of old numbers they replace); at
most ``max_blocks`` keys are kept, the least recently used forgotten first (a forgotten key answers
``None``: too old to say, which the caller treats as not predicted).

A ledger may keep only a sample of the keys (``sample_every`` n: the keys divisible by n, which, block
keys being hashes, is every n-th block on average), and counts n blocks for each sampled one used: the
spatial sampling that estimates an LRU cache's reuse distances from a fraction of its keys (SHARDS,
Waldspurger et al., FAST 2015). A pool too large for a full ledger in the memory the router gives it
gets a sampled one rather than none; the depth it predicts is then known to the nearest sampled block
(the deeper one: the blocks between a sample within the limit and the next beyond it count as kept, which
predicts less loss). What it does not see: other
routers' sends to the worker (fewer evictions predicted, never more), decode tokens stored when a
request ends, and requests served from the worker's cache without the router.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Sequence

__all__ = ["RecencyLedger"]

_KEY_BYTES = 208  # one kept key: its OrderedDict entry and its int objects (CPython 3.11, tracemalloc)

# The positions of one prompt's sampled keys, for the last (keys, n) asked: a decision asks every holder's
# ledger about the same prompt, and with like pools they sample alike.
_positions: tuple[Sequence[int], int, list[int]] | None = None


def _sampled_positions(keys: Sequence[int], every: int) -> list[int]:
    global _positions
    last = _positions
    if last is not None and last[0] is keys and last[1] == every:
        return last[2]
    found = [i for i, key in enumerate(keys) if key % every == 0]
    _positions = (keys, every, found)
    return found


class RecencyLedger:
    """One worker's blocks in the order the router's sends last used them."""

    def __init__(self, max_blocks: int, sample_every: int = 1) -> None:
        if max_blocks <= 0:
            raise ValueError("max_blocks must be positive")
        if sample_every <= 0:
            raise ValueError("sample_every must be positive")
        self.max_blocks = max_blocks  # sampled keys kept
        self.sample_every = sample_every
        self._last: OrderedDict[int, int] = OrderedDict()  # key -> use number, least recent first
        self._seq = 0  # the last use number given
        self._size = 2 * max_blocks + 2  # use numbers run to here, then are renumbered from 1
        self._b1 = array("q", bytes(8 * (self._size + 1)))
        self._b2 = array("q", bytes(8 * (self._size + 1)))

    def __len__(self) -> int:
        return len(self._last)

    def memory_bytes(self) -> int:
        """Estimated bytes held: the Fenwick arrays (allocated whole) and an entry per key kept (measured ~208 B)."""
        return 16 * len(self._b1) + _KEY_BYTES * len(self._last)

    def sampled(self, key: int) -> bool:
        """Whether the ledger keeps ``key`` (every key when it keeps them all)."""
        return key % self.sample_every == 0

    def touch(self, keys: Sequence[int]) -> None:
        """A send used ``keys`` (a prompt's block keys, in prompt order), deepest first."""
        if self.sample_every > 1:
            keys = [key for key in keys if key % self.sample_every == 0]
        if not keys:
            return
        keys = keys[: self.max_blocks]  # the deeper ones would be forgotten at once (used first, so oldest)
        if self._seq + len(keys) > self._size:
            self._renumber()
        last = self._last
        start = self._seq + 1
        seq = self._seq
        run_start = run_end = -1  # a run of consecutive old numbers, released as one range
        for key in reversed(keys):
            old = last.get(key)
            seq += 1
            last[key] = seq
            if old is None:
                continue
            last.move_to_end(key)
            if old == run_end + 1:
                run_end = old
            else:
                if run_start > 0:
                    self._add(run_start, run_end, -1)
                run_start = run_end = old
        if run_start > 0:
            self._add(run_start, run_end, -1)
        self._add(start, seq, 1)
        self._seq = seq
        excess = len(last) - self.max_blocks
        if excess > 0:  # forget the least recent, releasing their numbers run by run (they are in order)
            run_start = run_end = -1
            for _ in range(excess):
                _, oldest = last.popitem(last=False)
                if oldest == run_end + 1:
                    run_end = oldest
                    continue
                if run_start > 0:
                    self._add(run_start, run_end, -1)
                run_start = run_end = oldest
            self._add(run_start, run_end, -1)

    def newer_than(self, key: int) -> int | None:
        """Distinct blocks used after ``key`` was last used (estimated from the sample, when sampled); None for
        a key not kept (never seen, forgotten, or not in the sample)."""
        seq = self._last.get(key)
        return self._used_after(seq) if seq is not None else None

    def used_after_newest(self, keys: Sequence[int]) -> int | None:
        """Distinct blocks used after the most recently used of ``keys`` that the ledger keeps (None: it keeps none).

        Called with the blocks a worker just evicted: SGLang evicts least recently used first, so what was used
        after the newest of them is what the pool still held, in the ledger's count (one dict lookup a key, one
        prefix sum an eviction).
        """
        last = self._last
        newest = max((last.get(key, 0) for key in keys), default=0)
        return self._used_after(newest) if newest else None

    def _used_after(self, seq: int) -> int:
        """Distinct blocks whose last use is numbered after ``seq`` (times the sampling, estimated)."""
        return (len(self._last) - self._prefix(seq)) * self.sample_every

    def kept_depth(self, keys: Sequence[int], depth: int, limit: float) -> int:
        """How many of the first ``depth`` blocks of ``keys`` the pool still holds, if ``limit`` blocks fit after them.

        The blocks one send used last leave the pool together: SGLang stamps every tree node a request matches
        with one access time and evicts a node whole, the nodes of one stamp one after another (leaves first).
        Such a run stays only while it and every block used after it fit within ``limit``: while its deepest
        block (numbered first, ``touch``) has at most ``limit`` blocks used after it. So the first block beyond
        the limit takes its whole run with it. Judging each block by its own count instead had kept 77 of a
        2k-token prompt's 128 blocks where the worker had evicted all of them (virtual fleet, gsp, 4 workers,
        0.5 x knee, seed 6).

        Along one path a shallower block was used no earlier than a deeper one, so the count only falls
        toward the root and the first block beyond the limit is a binary search over the path's kept
        blocks; so is the start of its run (its use numbers are consecutive). A deepest block not kept says
        nothing: ``depth``. Sampled, a block between a kept one within the limit and the next kept one beyond
        it counts as held (the answer is the first sampled block of the run that goes).
        """
        depth = min(depth, len(keys))
        if depth <= 0:
            return 0
        if self.sample_every == 1:
            at: Sequence[int] = range(depth)
            count = depth
        else:
            at = _sampled_positions(keys, self.sample_every)
            count = bisect_left(at, depth)  # the sampled blocks among the first ``depth``
        if not count:
            return depth
        newer = self.newer_than(keys[at[count - 1]])
        if newer is None or newer <= limit:
            return depth
        low, high = -1, count - 1  # at[high] is beyond the limit; find the first sampled block beyond it
        while high - low > 1:
            mid = (low + high) // 2
            used = self.newer_than(keys[at[mid]])
            if used is None or used <= limit:
                low = mid
            else:
                high = mid
        return at[self._run_start(keys, at, high)]

    def _run_start(self, keys: Sequence[int], at: Sequence[int], end: int) -> int:
        """The shallowest ``i <= end`` such that the path's kept blocks ``at[i..end]`` were last used by one send.

        One send numbers its blocks consecutively, deepest first, so they are that run exactly when each is
        numbered one more than the next deeper one; a later use of a shallower block numbers it higher still,
        so the test holds over one interval ending at ``end`` and a binary search finds its start.
        """
        last = self._last
        base = last[keys[at[end]]]
        low, high = -1, end
        while high - low > 1:
            mid = (low + high) // 2
            seq = last.get(keys[at[mid]])
            if seq is not None and seq - base == end - mid:
                high = mid
            else:
                low = mid
        return high

    # -- the Fenwick tree: point counts of live use numbers, range updates, prefix sums -------------
    def _add(self, lo: int, hi: int, value: int) -> None:
        """Add ``value`` to the count of every use number in ``lo..hi``."""
        self._update(lo, value, value * (lo - 1))
        self._update(hi + 1, -value, -value * hi)

    def _update(self, i: int, v1: int, v2: int) -> None:
        b1, b2, size = self._b1, self._b2, self._size
        while i <= size:
            b1[i] += v1
            b2[i] += v2
            i += i & -i

    def _prefix(self, i: int) -> int:
        """Live use numbers in ``1..i``."""
        b1, b2 = self._b1, self._b2
        s1 = s2 = 0
        j = i
        while j > 0:
            s1 += b1[j]
            s2 += b2[j]
            j -= j & -j
        return s1 * i - s2

    def _renumber(self) -> None:
        """Number the kept keys 1..n again, in their order (every ``max_blocks`` or more uses)."""
        self._b1 = array("q", bytes(8 * (self._size + 1)))
        self._b2 = array("q", bytes(8 * (self._size + 1)))
        last = self._last
        for seq, key in enumerate(last, 1):
            last[key] = seq
        self._seq = len(last)
        if last:
            self._add(1, len(last), 1)

"""One memory budget for all of the router's caches (``memory.budget_bytes``), split into fixed shares.

The router holds seven kinds of state that grow with traffic; each gets a share of the budget and
turns it into a count with a measured cost per entry (CPython 3.11, 64-bit; ``tracemalloc`` over
200k entries, rounded up):

| part | holds | cost per entry | share |
|---|---|---|---|
| ``index`` | confirmed blocks, all workers, ranks and tiers together | 232 B per block | 35 % |
| ``engine_hashes`` | engine hash -> own key, per event stream (for ``BlockRemoved``) | 150 B per block | 25 % |
| ``speculative`` | the router's own record of what it sent where | 290 B per block | 10 % |
| ``key_cache`` | token bytes and block keys of recent prompts | counted exactly | 10 % |
| ``piece_cache`` | tokenizer: text piece -> token ids | counted exactly | 10 % |
| ``shared_state`` | decisions queued for the other replicas | 48 B per key | 5 % |
| ``policy`` | the routing policy's per-worker state (prefix-aware: order of use) | 240 B per block | 5 % |

Every part evicts its oldest entries once full, which only ever under-claims a cache (a lookup
finds less than a worker holds, never more). ``/metrics`` shows what each part holds and its
limit (``prefix_router_memory_bytes`` / ``prefix_router_memory_limit_bytes``). What the process
needs besides (interpreter, gRPC, tokenizer vocabularies, buffers of requests in flight, allocator
slack) is outside the budget: about 100 MB at rest; with every part of the default budget full the
whole process measured about 410 MB (docs/deploy.md has the soak figures).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "BLOCK_BYTES",
    "HASH_BYTES",
    "LEDGER_BYTES",
    "RECENT_BYTES",
    "SHARED_KEY_BYTES",
    "BoundMember",
    "MemoryPlan",
    "SharedBound",
]

# One confirmed (key, worker slot) entry: holders dict + per-slot LRU order. Measured with one holder per key on a
# 256-worker fleet (benchmarks/suites/scale.py: 203 B at 16 workers, 231 B at 256: a high slot's bitmask is a
# longer int).
BLOCK_BYTES = 232
HASH_BYTES = 150  # one engine hash -> (own key, tier bits) mapping of an event stream
RECENT_BYTES = 290  # one key of the router's own record: per-key dict + the decision FIFO
SHARED_KEY_BYTES = 48  # one block key waiting in the shared-state queue
# One block of a worker's order of use (``RecencyLedger``: its key's entry and its share of the Fenwick arrays),
# measured full at 2,460 to 20,000 blocks: 222-238 B.
LEDGER_BYTES = 240

SHARES = {
    "index": 0.35,
    "engine_hashes": 0.25,
    "speculative": 0.10,
    "key_cache": 0.10,
    "piece_cache": 0.10,
    "shared_state": 0.05,
    "policy": 0.05,
}


@dataclass(frozen=True)
class MemoryPlan:
    """Each part's limit, derived from one budget."""

    budget_bytes: int
    index_blocks: int
    engine_hashes: int
    recent_keys: int
    key_cache_bytes: int
    piece_cache_bytes: int
    shared_keys: int
    policy_bytes: int

    @classmethod
    def from_budget(cls, budget_bytes: int) -> MemoryPlan:
        def share(part: str) -> int:
            return int(budget_bytes * SHARES[part])

        return cls(
            budget_bytes=budget_bytes,
            index_blocks=max(1, share("index") // BLOCK_BYTES),
            engine_hashes=max(1, share("engine_hashes") // HASH_BYTES),
            recent_keys=max(1, share("speculative") // RECENT_BYTES),
            key_cache_bytes=share("key_cache"),
            piece_cache_bytes=share("piece_cache"),
            shared_keys=max(1, share("shared_state") // SHARED_KEY_BYTES),
            policy_bytes=share("policy"),
        )

    def limits(self) -> dict[str, int]:
        """Bytes each part may hold."""
        return {
            "index": self.index_blocks * BLOCK_BYTES,
            "engine_hashes": self.engine_hashes * HASH_BYTES,
            "speculative": self.recent_keys * RECENT_BYTES,
            "key_cache": self.key_cache_bytes,
            "piece_cache": self.piece_cache_bytes,
            "shared_state": self.shared_keys * SHARED_KEY_BYTES,
            "policy": self.policy_bytes,
        }


class BoundMember(Protocol):
    def bound_size(self) -> int:
        """Entries this member holds against the bound."""

    def shrink(self, count: int) -> int:
        """Drop up to ``count`` of its oldest entries (and take them off ``used``); returns how many went."""


class SharedBound:
    """A count several members fill together (every event stream's engine-hash map): ``used`` of ``limit``.

    Over the limit, the largest member gives up its oldest entries first, so a worker that joins a
    full fleet still keeps what it publishes.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.members: list[BoundMember] = []

    def reclaim(self) -> None:
        while self.used > self.limit and self.members:
            largest = max(self.members, key=lambda m: m.bound_size())
            if not largest.shrink(self.used - self.limit):
                return

"""``gie-prefix``: the Gateway API Inference Extension / llm-d approximate prefix scorer.

The prompt text is cut into ``block_chars``-character blocks (64 = 16 tokens x 4 characters),
hashed as an xxhash64 chain seeded by the model name, at most ``max_blocks`` of them. Each server
remembers (LRU, ``lru_capacity`` blocks) the blocks of the requests the picker sent it. Scores:
prefix = matched leading blocks / total blocks; queue = (max - own) / (max - min) of the reported
waiting requests (1 when all equal); KV = 1 - KV usage. The weighted sum (3 / 2 / 2) picks the
maximum, ties broken at random. No worker feedback beyond load: that is the peer's design.
"""

from __future__ import annotations

from collections import OrderedDict

import xxhash
from pydantic import Field

from extproc.decision.policies.base import (
    Candidate,
    Decision,
    RandomTieBreakOptions,
    RandomTieBreakPolicy,
    RoutingRequest,
)

__all__ = ["GiePrefixOptions", "GiePrefixPolicy"]


class GiePrefixOptions(RandomTieBreakOptions):
    """GIE / llm-d approximate prefix scorer defaults."""

    block_chars: int = Field(64, gt=0, description="Characters per hashed block (16 tokens x 4 chars).")
    max_blocks: int = Field(256, gt=0, description="At most this many leading blocks are hashed.")
    lru_capacity: int = Field(31_250, gt=0, description="Blocks remembered per server.")
    prefix_weight: float = Field(3.0, description="Weight of the prefix-match scorer.")
    queue_weight: float = Field(2.0, description="Weight of the queue-depth scorer.")
    kv_weight: float = Field(2.0, description="Weight of the KV-utilisation scorer.")


class GiePrefixPolicy(RandomTieBreakPolicy[GiePrefixOptions]):
    name = "gie-prefix"
    needs_text = True

    def setup(self) -> None:
        self._servers: dict[str, OrderedDict[int, None]] = {}
        super().setup()  # the seeded tie-break generator

    def hashes(self, model: str, text: str) -> list[int]:
        size = self.opts.block_chars
        count = min(len(text) // size, self.opts.max_blocks)
        prev = xxhash.xxh64_intdigest(model.encode())
        out = []
        for i in range(count):
            prev = xxhash.xxh64_intdigest(prev.to_bytes(8, "little") + text[i * size : (i + 1) * size].encode())
            out.append(prev)
        return out

    def select(self, request: RoutingRequest, candidates: list[Candidate]) -> Decision:
        hashes = self.hashes(request.model, request.prompt_text)
        waiting = {c.worker.id: (c.load.num_waiting_reqs if c.load else 0) for c in candidates}
        high, low = max(waiting.values()), min(waiting.values())
        scores: dict[str, dict[str, float]] = {}
        for c in candidates:
            cache = self._servers.get(c.worker.id)
            matched = 0
            if cache is not None:
                for h in hashes:
                    if h not in cache:
                        break
                    matched += 1
            prefix = matched / len(hashes) if hashes else 0.0
            queue = 1.0 if high == low else (high - waiting[c.worker.id]) / (high - low)
            kv = 1.0 - (c.load.token_usage if c.load else 0.0)
            total = self.opts.prefix_weight * prefix + self.opts.queue_weight * queue + self.opts.kv_weight * kv
            scores[c.worker.id] = {
                "prefix": prefix,
                "queue": queue,
                "kv": kv,
                "score": total,
                "matched_blocks": matched,
            }
        shuffled = list(candidates)
        self._rng.shuffle(shuffled)  # random tie-break: sort is stable
        ranked = sorted(shuffled, key=lambda c: -scores[c.worker.id]["score"])
        return Decision(ranked=[c.worker for c in ranked], reason="gie-prefix", scores=scores)

    def on_routed(self, request: RoutingRequest, decision: Decision) -> None:
        hashes = self.hashes(request.model, request.prompt_text)
        cache = self._servers.setdefault(decision.ranked[0].id, OrderedDict())
        for h in hashes:
            cache[h] = None
            cache.move_to_end(h)
        while len(cache) > self.opts.lru_capacity:
            cache.popitem(last=False)

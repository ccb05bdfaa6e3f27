"""The pooled-cache oracle: the hit rate one cache with the whole cluster's capacity would reach.

A router spreads requests over N workers, each with its own KV cache; no router can beat one
cache of N x capacity that sees every request. The oracle replays the request sequence (arrival
order) through one LRU prefix cache of full pages, like SGLang's radix cache with ``page_size``:
a request hits its longest cached run of leading pages, then its pages are inserted. Eviction is
LRU over pages with leaves going first (a page is touched no earlier than its children), which is
what SGLang's radix-cache eviction does. Running requests do not pin pages here. It is a reference,
not a strict bound: LRU is not optimal, and N separate caches can occasionally beat one pooled LRU
(a huge prompt flushes one worker instead of the whole pool).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from extproc.fleet.blocks import block_keys

__all__ = ["PooledCache", "oracle_hit_rate"]


class PooledCache:
    """An LRU cache of chained page keys with a capacity in tokens."""

    def __init__(self, capacity_tokens: int, page_size: int) -> None:
        if page_size <= 0 or capacity_tokens < 0:
            raise ValueError("page size must be positive and capacity non-negative")
        self.page_size = page_size
        self.capacity_pages = capacity_tokens // page_size
        self._pages: OrderedDict[int, None] = OrderedDict()
        self.hit_tokens = 0
        self.prompt_tokens = 0

    def access(self, tokens: Sequence[int]) -> int:
        """Look ``tokens`` up, count the hit, insert its full pages; returns the cached tokens."""
        keys = block_keys(tokens, self.page_size)
        matched = 0
        for key in keys:
            if key not in self._pages:
                break
            matched += 1
        cached = matched * self.page_size
        # SGLang always computes at least the last token, so a fully cached prompt hits len-1.
        cached = min(cached, max(0, len(tokens) - 1))
        self.hit_tokens += cached
        self.prompt_tokens += len(tokens)
        # Touch deepest first so ancestors end up most recent: leaves are evicted before their parents.
        for key in reversed(keys):
            self._pages[key] = None
            self._pages.move_to_end(key)
        while len(self._pages) > self.capacity_pages:
            self._pages.popitem(last=False)
        return cached

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def oracle_hit_rate(
    token_sequences: Iterable[Sequence[int]], capacity_tokens: int, page_size: int, max_prompt_tokens: int | None = None
) -> float:
    """Hit rate of one pooled cache of ``capacity_tokens`` over the requests in order.

    Prompts longer than ``max_prompt_tokens`` (one worker's pool: every worker rejects them, so no
    contender's hit rate counts them) are skipped here too.
    """
    cache = PooledCache(capacity_tokens, page_size)
    for tokens in token_sequences:
        if max_prompt_tokens is None or len(tokens) <= max_prompt_tokens:
            cache.access(tokens)
    return cache.hit_rate

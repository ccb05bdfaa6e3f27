"""``sgl-cache-aware``: sgl-router's ``cache_aware`` policy, for comparisons on equal terms.

One approximate radix tree of raw prompt *characters*, built only from the router's own decisions
(no worker feedback). If the load is imbalanced (``max - min > balance_abs_threshold`` and
``max > min * balance_rel_threshold`` over in-flight counts) the least loaded worker wins;
otherwise the worker with the longest character match if ``match_rate > cache_threshold``, else
the worker with the smallest tree. Each worker's share of the tree is bounded
(``max_tree_size`` characters) by evicting its least recently used leaves.
"""

from __future__ import annotations

from pydantic import Field

from extproc.clock import MONOTONIC, Clock
from extproc.decision.policies.base import Candidate, Decision, Policy, PolicyOptions, RoutingRequest

__all__ = ["CharRadixTree", "SglCacheAwareOptions", "SglCacheAwarePolicy"]


class SglCacheAwareOptions(PolicyOptions):
    """sgl-router ``cache_aware`` defaults (a faithful peer for comparisons)."""

    cache_threshold: float = Field(0.3, description="Minimum character match rate to follow the cache.")
    balance_abs_threshold: int = Field(64, description="Imbalanced when max-min in-flight exceeds this ...")
    balance_rel_threshold: float = Field(1.5, description="... and max exceeds min times this.")
    max_tree_size: int = Field(2**26, gt=0, description="Characters per worker kept in the tree (LRU eviction beyond).")


class _Node:
    __slots__ = ("children", "parent", "tenants", "text")

    def __init__(self, text: str, parent: _Node | None) -> None:
        self.text = text
        self.parent = parent
        self.children: dict[str, _Node] = {}
        self.tenants: dict[str, float] = {}  # tenant -> last access


def _common(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class CharRadixTree:
    """Compressed character trie shared by all tenants (workers), as in sgl-router."""

    def __init__(self, clock: Clock = MONOTONIC) -> None:
        self.root = _Node("", None)
        self.chars: dict[str, int] = {}
        self.clock = clock  # stamps tenants' last access (LRU eviction order)

    def insert(self, text: str, tenant: str) -> None:
        now = self.clock()
        node = self.root
        node.tenants[tenant] = now
        rest = text
        while rest:
            child = node.children.get(rest[0])
            if child is None:
                child = _Node(rest, node)
                node.children[rest[0]] = child
            else:
                n = _common(child.text, rest)
                if n < len(child.text):  # split the edge
                    mid = _Node(child.text[:n], node)
                    mid.tenants = dict(child.tenants)
                    child.text = child.text[n:]
                    child.parent = mid
                    mid.children[child.text[0]] = child
                    node.children[mid.text[0]] = mid
                    child = mid
            if tenant not in child.tenants:
                self.chars[tenant] = self.chars.get(tenant, 0) + len(child.text)
            child.tenants[tenant] = now
            rest = rest[len(child.text) :]
            node = child

    def prefix_match(self, text: str, tenants: set[str]) -> tuple[int, str | None]:
        """Longest matched prefix (characters) held by one of ``tenants``, and that tenant."""
        node, rest, matched = self.root, text, 0
        best: tuple[int, str | None] = (0, None)
        while rest:
            child = node.children.get(rest[0])
            if child is None:
                break
            n = _common(child.text, rest)
            holders = [t for t in child.tenants if t in tenants]
            if not holders:
                break
            matched += n
            best = (matched, max(holders, key=lambda t: child.tenants[t]))
            if n < len(child.text):
                break
            rest = rest[n:]
            node = child
        return best

    def evict(self, tenant: str, max_chars: int) -> None:
        """Drop the tenant from its least recently used leaves until it holds ``max_chars``."""
        while self.chars.get(tenant, 0) > max_chars:
            leaves = []
            stack = [self.root]
            while stack:
                node = stack.pop()
                below = [c for c in node.children.values() if tenant in c.tenants]
                if below:
                    stack.extend(below)
                elif node is not self.root and tenant in node.tenants:
                    leaves.append(node)
            if not leaves:
                return
            leaves.sort(key=lambda n: n.tenants[tenant])
            for leaf in leaves:
                del leaf.tenants[tenant]
                self.chars[tenant] -= len(leaf.text)
                if not leaf.tenants and not leaf.children and leaf.parent is not None:
                    del leaf.parent.children[leaf.text[0]]
                if self.chars[tenant] <= max_chars:
                    return


class SglCacheAwarePolicy(Policy[SglCacheAwareOptions]):
    name = "sgl-cache-aware"
    needs_text = True

    def setup(self) -> None:
        self.tree = CharRadixTree(self.clock)

    def select(self, request: RoutingRequest, candidates: list[Candidate]) -> Decision:
        loads = {c.worker.id: c.in_flight for c in candidates}
        high, low = max(loads.values()), min(loads.values())
        by_load = sorted(candidates, key=lambda c: loads[c.worker.id])
        if high - low > self.opts.balance_abs_threshold and high > low * self.opts.balance_rel_threshold:
            return Decision(ranked=[c.worker for c in by_load], reason="imbalanced-least-load")
        text = request.prompt_text
        matched, tenant = self.tree.prefix_match(text, set(loads))
        rate = matched / len(text) if text else 0.0
        if tenant is not None and rate > self.opts.cache_threshold:
            chosen = next(c for c in candidates if c.worker.id == tenant)
            reason = "cache-match"
        else:
            chosen = min(candidates, key=lambda c: (self.tree.chars.get(c.worker.id, 0), loads[c.worker.id]))
            reason = "smallest-tree"
        ranked = [chosen.worker, *(c.worker for c in by_load if c is not chosen)]
        # Figures are keyed by worker (``Decision.scores``): the match rate belongs to the worker whose tree matched.
        scores = {tenant: {"match_rate": rate}} if tenant is not None else {}
        return Decision(ranked=ranked, reason=reason, scores=scores)

    def on_routed(self, request: RoutingRequest, decision: Decision) -> None:
        tenant = decision.ranked[0].id
        self.tree.insert(request.prompt_text, tenant)
        if self.tree.chars.get(tenant, 0) > self.opts.max_tree_size:
            self.tree.evict(tenant, self.opts.max_tree_size)

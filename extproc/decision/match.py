"""Match: how many leading blocks of the prompt each worker holds, per tier, in one index lookup per key chain.

Workers sharing page size and model share one key chain, so a fleet of one page size and one model
is matched with one lookup. A worker running ``--dp-size N`` has N radix caches (index slots); its
match is its best rank's, and each rank's is kept so that the pipeline can pin the rank that holds
the most of the prompt.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from extproc.decision.prompt import Chain
from extproc.decision.pruning import Depth
from extproc.fleet.index import BlockIndex
from extproc.fleet.layout import WorkerLayout
from extproc.fleet.workers import Worker

__all__ = ["Match", "match_fleet"]


@dataclass
class Match:
    """The prompt against the fleet: each worker's depth, in fleet order, and the keys behind it."""

    depths: list[Depth]  # (storage tier, host memory, GPU) leading blocks, each cumulative
    first_keys: list[int]  # the first chain's keys (what the policy's request carries)
    keys_of: dict[Chain, list[int]] = field(default_factory=dict)
    rank_matches: dict[str, list[int]] = field(default_factory=dict)  # worker id -> each DP rank's depth


def match_fleet(
    index: BlockIndex,
    workers: list[Worker],
    shapes: list[WorkerLayout],
    sizes: list[int],
    keys_for: Callable[[Chain], list[int]],
    shared_tier: bool,
) -> Match:
    """Each worker's match depth; ``keys_for(chain)`` gives the prompt's keys of one (page size, model) chain."""
    chain_of = [(size, w.model or "") for w, size in zip(workers, sizes)]
    groups: dict[Chain, Sequence[int]]
    if chain_of.count(chain_of[0]) == len(chain_of):  # the usual fleet: one page size, one model
        groups = {chain_of[0]: range(len(workers))}
    else:
        mixed: dict[Chain, list[int]] = {}
        for i, chain in enumerate(chain_of):
            mixed.setdefault(chain, []).append(i)
        groups = dict(mixed)
    out = Match(depths=[(0, 0, 0)] * len(workers), first_keys=[])
    depths, rank_matches = out.depths, out.rank_matches
    first: list[int] | None = None
    lower = index.has_tier("host") or index.has_tier("shared")
    for chain, members in groups.items():
        keys = keys_for(chain)
        if first is None:
            first = keys
        out.keys_of[chain] = keys
        ids = [slot for i in members for slot in shapes[i].slots]
        if lower:  # GPU, then host memory, then the storage tier each shares (every rank shares it)
            groups_of = {s: shapes[i].storage_group if shared_tier else None for i in members for s in shapes[i].slots}
            tiers = index.match_tiers(keys, ids, groups_of)
            for i in members:
                mine = [tiers[s] for s in shapes[i].slots]
                gpu = max(d.gpu for d in mine)
                host = max(gpu, *(d.local for d in mine))
                depths[i] = (max(host, *(d.shared for d in mine)), host, gpu)
                if len(mine) > 1:
                    rank_matches[workers[i].id] = [d.local for d in mine]
            continue
        matched = index.match(keys, ids, "gpu")
        if len(ids) == len(members):  # one rank each: the answers come in the members' order
            for i, depth in zip(members, matched.values()):
                if depth:
                    depths[i] = (depth, depth, depth)
            continue
        for i in members:
            slots = shapes[i].slots
            depth = max(matched[s] for s in slots)
            if len(slots) > 1:
                rank_matches[workers[i].id] = [matched[s] for s in slots]
            if depth:
                depths[i] = (depth, depth, depth)
    out.first_keys = first or []
    return out

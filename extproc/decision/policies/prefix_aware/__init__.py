"""``prefix-aware``, the default policy, with its internals: the learned per-worker cost model
(``cost_model``) and the cost of serving a prefix from host memory or shared storage (``tier_cost``)."""

from __future__ import annotations

from extproc.decision.policies.prefix_aware.policy import PrefixAwareOptions, PrefixAwarePolicy

__all__ = ["PrefixAwareOptions", "PrefixAwarePolicy"]

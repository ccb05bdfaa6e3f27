"""Routing policies, one module each, created by name from config.

Baselines and our policy live side by side so that benchmarks compare them on equal terms.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from extproc.policies.base import Candidate, Decision, Policy, PolicyError, RoutingRequest, WorkerLoad

__all__ = ["POLICIES", "Candidate", "Decision", "Policy", "PolicyError", "RoutingRequest", "WorkerLoad", "create_policy"]

# name -> "module:Class" (imported on use).
POLICIES: dict[str, str] = {
    "round-robin": "extproc.policies.round_robin:RoundRobinPolicy",
    "least-load": "extproc.policies.least_load:LeastLoadPolicy",
    "prefix-aware": "extproc.policies.prefix_aware:PrefixAwarePolicy",
    "session": "extproc.policies.session:SessionPolicy",
    "sgl-cache-aware": "extproc.policies.sgl_cache_aware:SglCacheAwarePolicy",
    "gie-prefix": "extproc.policies.gie_prefix:GiePrefixPolicy",
    "dynamo-cost": "extproc.policies.dynamo_cost:DynamoCostPolicy",
}


def create_policy(name: str, options: Mapping[str, Any] | None = None) -> Policy:
    """Instantiate the policy called ``name``; unknown names list the known ones."""
    target = POLICIES.get(name)
    if target is None:
        raise PolicyError(f"unknown policy {name!r}; choose one of: {', '.join(sorted(POLICIES))}")
    module_name, class_name = target.split(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(options)  # type: ignore[no-any-return]

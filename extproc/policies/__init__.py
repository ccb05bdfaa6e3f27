"""Routing policies, one module each, created by name from one registry.

Baselines and our policy live side by side so that benchmarks compare them on equal terms.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from extproc.clock import MONOTONIC, Clock
from extproc.config import PolicyConfig
from extproc.policies.base import Candidate, Decision, Policy, PolicyError, PolicyOptions, RoutingRequest, WorkerLoad

__all__ = [
    "POLICIES",
    "Candidate",
    "Decision",
    "Policy",
    "PolicyError",
    "PolicyOptions",
    "RoutingRequest",
    "WorkerLoad",
    "create_policy",
    "policy_from_config",
]

# name -> "module:Class" (imported on use).
POLICIES: dict[str, str] = {
    "round-robin": "extproc.policies.round_robin:RoundRobinPolicy",
    "least-load": "extproc.policies.least_load:LeastLoadPolicy",
    "prefix-aware": "extproc.policies.prefix_aware:PrefixAwarePolicy",
    "session": "extproc.policies.session:SessionPolicy",
    "sgl-cache-aware": "extproc.policies.sgl_cache_aware:SglCacheAwarePolicy",
    "gie-prefix": "extproc.policies.gie_prefix:GiePrefixPolicy",
    "dynamo-cost": "extproc.policies.dynamo_cost:DynamoCostPolicy",
    "decode-load": "extproc.policies.decode_load:DecodeLoadPolicy",
}


def create_policy(
    name: str,
    options: Mapping[str, Any] | None = None,
    sections: Mapping[str, Mapping[str, Any]] | None = None,
    clock: Clock = MONOTONIC,
) -> Policy:
    """Instantiate the policy called ``name``; unknown names list the known ones."""
    target = POLICIES.get(name)
    if target is None:
        raise PolicyError(f"unknown policy {name!r}; choose one of: {', '.join(sorted(POLICIES))}")
    module_name, class_name = target.split(":")
    cls: type[Policy] = getattr(importlib.import_module(module_name), class_name)
    return cls(options, sections, clock)


def policy_from_config(config: PolicyConfig, clock: Clock = MONOTONIC) -> Policy:
    """The configured policy, with its section (and ``options``) validated by the policy itself."""
    sections = config.sections()
    unknown = sorted(name for name in sections if name not in POLICIES and name != config.name)
    if unknown:
        raise PolicyError(
            f"policy.{unknown[0].replace('-', '_')}: no policy of that name; "
            f"sections are named after one of: {', '.join(sorted(POLICIES))}"
        )
    return create_policy(config.name, sections.get(config.name), sections, clock)

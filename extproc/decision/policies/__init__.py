"""Routing policies, one module each, chosen by name from one registry of explicit imports.

Baselines and our policy live side by side so that benchmarks compare them on equal terms. Every
policy has one constructor (``Policy(options, sections, clock)``, its state built in ``setup``); a
policy made of others (``session``) is handed this registry's factory in ``compose``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from extproc.clock import MONOTONIC, Clock
from extproc.config import PolicyConfig
from extproc.decision.policies.base import Candidate, Decision, Policy, PolicyError, PolicyOptions, RoutingRequest
from extproc.decision.policies.decode_load import DecodeLoadPolicy
from extproc.decision.policies.dynamo_cost import DynamoCostPolicy
from extproc.decision.policies.gie_prefix import GiePrefixPolicy
from extproc.decision.policies.least_load import LeastLoadPolicy
from extproc.decision.policies.prefix_aware import PrefixAwarePolicy
from extproc.decision.policies.round_robin import RoundRobinPolicy
from extproc.decision.policies.session import SessionPolicy
from extproc.decision.policies.sgl_cache_aware import SglCacheAwarePolicy

__all__ = [
    "POLICIES",
    "Candidate",
    "Decision",
    "Policy",
    "PolicyError",
    "PolicyOptions",
    "RoutingRequest",
    "create_policy",
    "policy_from_config",
]

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (
        RoundRobinPolicy,
        LeastLoadPolicy,
        PrefixAwarePolicy,
        SessionPolicy,
        SglCacheAwarePolicy,
        GiePrefixPolicy,
        DynamoCostPolicy,
        DecodeLoadPolicy,
    )
}


def create_policy(
    name: str,
    options: Mapping[str, Any] | None = None,
    sections: Mapping[str, Mapping[str, Any]] | None = None,
    clock: Clock = MONOTONIC,
) -> Policy:
    """Instantiate the policy called ``name``; unknown names list the known ones."""
    cls = POLICIES.get(name)
    if cls is None:
        raise PolicyError(f"unknown policy {name!r}; choose one of: {', '.join(sorted(POLICIES))}")
    policy = cls(options, sections, clock)
    policy.compose(lambda other: create_policy(other, (sections or {}).get(other), sections, clock))
    return policy


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

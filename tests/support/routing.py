"""Workers and policies for the tests that drive the decision in process, with no worker running."""

from __future__ import annotations

from typing import TypeVar

from extproc.decision.policies import Policy
from extproc.fleet.workers import Worker

T = TypeVar("T", bound=Policy)


def loopback_workers(count: int, first_port: int = 40000) -> list[Worker]:
    """Workers ``w0``, ``w1``, ... on consecutive loopback ports from ``first_port`` (nothing listens there)."""
    return [
        Worker(id=f"w{i}", url=f"http://127.0.0.1:{first_port + i}", ip="127.0.0.1", port=first_port + i)
        for i in range(count)
    ]


def as_policy(cls: type[T], policy: Policy) -> T:
    """The policy as its concrete class, for the tests that read its internals."""
    assert isinstance(policy, cls)
    return policy

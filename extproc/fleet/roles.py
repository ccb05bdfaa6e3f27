"""The fleet by prefill/decode role: which workers a decision pairs, and which it routes alone."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from extproc.fleet.info import disaggregation_role
from extproc.fleet.workers import Worker

__all__ = ["FleetRoles", "split_roles"]


@dataclass
class FleetRoles:
    """The candidates by role."""

    aggregated: list[Worker] = field(default_factory=list)
    prefill: list[Worker] = field(default_factory=list)
    decode: list[Worker] = field(default_factory=list)

    @property
    def disaggregated(self) -> bool:
        """Whether a pair can be formed (at least one prefill and one decode worker)."""
        return bool(self.prefill and self.decode)


def split_roles(workers: Iterable[Worker]) -> FleetRoles:
    """Sort workers by their configured or discovered role."""
    roles = FleetRoles()
    for worker in workers:
        getattr(roles, disaggregation_role(worker)).append(worker)
    return roles

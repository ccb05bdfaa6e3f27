"""The gateways a benchmark compares, by name, each started in front of a given worker set.

- ``envoy-rr``, ``envoy-lr``, ``envoy-ringhash``: plain Envoy's own load balancing (``envoy_baselines``).
- ``sgl-router``, ``smg``, ``smg-grpc``: SGLang's routers (``sgl_routers``).
- ``dynamo``: NVIDIA Dynamo's real KV router behind a thin proxy (``dynamo``); needs the ``dynamo`` extra.
- ``ours:<policy>``: this project's ext_proc router behind Envoy, with any registered policy.

The PD contenders (in front of a prefill/decode fleet) are in ``pd_contenders``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from benchmarks.fleet.dynamo import DynamoRouter
from benchmarks.fleet.envoy_baselines import LB_POLICIES, EnvoyBaseline
from benchmarks.fleet.process import Contender, ContenderError
from benchmarks.fleet.sgl_routers import SglRouter, Smg

__all__ = ["CONTENDERS", "OursGateway", "create_contender", "validate_contender_names"]


class OursGateway(Contender):
    """This project's router + Envoy, via the gateway's programmatic stack."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self.name = f"ours:{policy}"
        self._stack: Any = None

    async def start(self, worker_urls: Sequence[str]) -> str:
        try:
            from prefix_router.stack import GatewayStack
        except ImportError as exc:
            raise ContenderError(f"our gateway stack is unavailable: {exc}") from None
        try:
            self._stack = GatewayStack(worker_urls=list(worker_urls), policy=self.policy)
            await self._stack.start()
        except Exception as exc:  # report any start failure in the row, with its cause
            await self.stop()
            raise ContenderError(f"{type(exc).__name__}: {exc}") from None
        return str(self._stack.url)

    async def stop(self) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            await stack.stop()


CONTENDERS = ("envoy-rr", "envoy-lr", "envoy-ringhash", "sgl-router", "smg", "smg-grpc", "dynamo", "ours:<policy>")


def create_contender(name: str, page_size: int = 16) -> Contender:
    """A contender by name: one of ``CONTENDERS`` (``ours:<policy>`` with any registered policy).

    ``page_size`` is the workers' KV page size (contenders that must be told it match it).
    """
    if name in LB_POLICIES:
        return EnvoyBaseline(name)
    if name == "sgl-router":
        return SglRouter()
    if name == "smg":
        return Smg("http", page_size)
    if name == "smg-grpc":
        return Smg("grpc", page_size)
    if name == "dynamo":
        return DynamoRouter(page_size)
    if name.startswith("ours:") and len(name) > 5:
        return OursGateway(name[5:])
    if name == "ours":
        return OursGateway("prefix-aware")
    raise ValueError(f"unknown contender {name!r}; choose from {', '.join(CONTENDERS)}")


def validate_contender_names(names: Sequence[str]) -> None:
    """Fail fast on typos (before any cluster starts); ``ours:<policy>`` policies are checked at start."""
    for name in names:
        create_contender(name)

"""The gateways a PD benchmark compares, each started in front of a prefill/decode fleet (``--suite pd``).

- ``smg-pd``: smg 1.13 in PD mode as its documentation sets it up: ``--pd-disaggregation --prefill URL
  BOOTSTRAP_PORT ... --decode URL ... --prefill-policy cache_aware --decode-policy power_of_two`` (round_robin
  over a single decode worker, where smg refuses power_of_two and every policy picks the same worker).
- ``sgl-router-minilb``: sgl-router's mini load balancer (``python -m sglang_router.launch_router
  --pd-disaggregation --mini-lb``), SGLang's own reference PD proxy: a random prefill and a random decode per
  request.
- ``ours-pd:<policy>``: this project's router + Envoy over all the fleet's workers; the router learns each
  worker's side from its ``/server_info`` (``disaggregation_mode``), picks the prefill worker with ``<policy>``
  and the decode worker with ``pd.decode_policy``, and sends the prefill leg itself (``extproc/pd/bootstrap.py``).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from abc import abstractmethod
from collections.abc import Sequence

from benchmarks.fleet.cluster import PdTargets
from benchmarks.fleet.contenders import OursGateway
from benchmarks.fleet.process import Contender, ContenderError, ProcessContender, wait_http
from benchmarks.fleet.sgl_routers import Smg
from prefix_common.addresses import free_port

__all__ = ["PD_CONTENDERS", "MiniLb", "OursPd", "PdContender", "SmgPd", "create_pd_contender"]

PD_CONTENDERS = ("smg-pd", "sgl-router-minilb", "ours-pd:<policy>")
READY_TIMEOUT_S = 60.0


class PdContender(Contender):
    """A gateway in front of a PD fleet: ``start_pd`` returns the base URL clients send to (``start``, over an
    aggregated fleet, is refused)."""

    async def start(self, worker_urls: Sequence[str]) -> str:
        raise ContenderError(f"{self.name} runs in front of a PD fleet (--suite pd)")

    @abstractmethod
    async def start_pd(self, targets: PdTargets) -> str: ...


class SmgPd(Smg, PdContender):
    """smg 1.13 in PD mode: cache-aware prefill choice, power-of-two decode choice (its documented example)."""

    def __init__(self, prefill_policy: str = "cache_aware", decode_policy: str = "power_of_two") -> None:
        Smg.__init__(self, "http")
        self.name = "smg-pd"
        self.prefill_policy = prefill_policy
        self.decode_policy = decode_policy

    def decode_policy_for(self, decode_workers: int) -> str:
        """smg refuses power_of_two over one decode worker (where every policy picks the same): round_robin there."""
        return "round_robin" if self.decode_policy == "power_of_two" and decode_workers < 2 else self.decode_policy

    def pd_argv(self, port: int, metrics_port: int, targets: PdTargets) -> list[str]:
        routing = [
            "--pd-disaggregation",
            *targets.prefill_args(),
            "--prefill-policy",
            self.prefill_policy,
            "--decode-policy",
            self.decode_policy_for(len(targets.decode)),
        ]
        return self.launch_argv(port, metrics_port, routing)

    async def start_pd(self, targets: PdTargets) -> str:
        if importlib.util.find_spec("smg") is None:
            raise ContenderError("smg is not installed (pip install 'smg==1.13.*')")
        port, metrics_port = free_port(), free_port()
        env = {**os.environ, "RUST_LOG": "warn", "HF_HUB_OFFLINE": "1"}
        proc = self._spawn(self.pd_argv(port, metrics_port, targets), env=env)
        base = f"http://127.0.0.1:{port}"
        await self._until_ready(self._ready(base, len(targets.urls), proc, READY_TIMEOUT_S))
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        return base


class MiniLb(ProcessContender, PdContender):
    """sgl-router's mini load balancer in PD mode (Python; random pairs; SGLang's reference PD proxy)."""

    name = "sgl-router-minilb"

    def __init__(self) -> None:
        ProcessContender.__init__(self)

    def pd_argv(self, port: int, targets: PdTargets) -> list[str]:
        return [
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            "--pd-disaggregation",
            "--mini-lb",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *targets.prefill_args(),
        ]

    async def start_pd(self, targets: PdTargets) -> str:
        if importlib.util.find_spec("sglang_router") is None:
            raise ContenderError("sglang-router is not installed (pip install sglang-router)")
        port = free_port()
        proc = self._spawn(self.pd_argv(port, targets), env={**os.environ, "RUST_LOG": "warn"})
        base = f"http://127.0.0.1:{port}"
        await self._until_ready(wait_http(base + "/health", READY_TIMEOUT_S, proc))
        return base


class OursPd(OursGateway, PdContender):
    """Our router + Envoy over every worker of the PD fleet (the router finds each one's side itself)."""

    def __init__(self, policy: str) -> None:
        OursGateway.__init__(self, policy)
        self.name = f"ours-pd:{policy}"

    async def start_pd(self, targets: PdTargets) -> str:
        return await OursGateway.start(self, targets.urls)


def create_pd_contender(name: str) -> PdContender:
    """A PD contender by name: one of ``PD_CONTENDERS`` (``ours-pd:<policy>`` with any registered policy)."""
    if name == "smg-pd":
        return SmgPd()
    if name == "sgl-router-minilb":
        return MiniLb()
    if name.startswith("ours-pd:") and len(name) > len("ours-pd:"):
        return OursPd(name[len("ours-pd:") :])
    if name == "ours-pd":
        return OursPd("prefix-aware")
    raise ValueError(f"unknown PD contender {name!r}; choose from {', '.join(PD_CONTENDERS)}")

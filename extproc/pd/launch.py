"""A disaggregated request's pair, launched: bootstrap fields in, prefill leg out, failures handled.

The router chose a prefill and a decode worker (``RouteOutcome.prefill``); this module gives the
body its bootstrap fields (``extproc.pd.bootstrap``), starts the prefill leg (``extproc.pd.prefill_leg``) and
answers Envoy with the decode destination. A leg that has to open a connection is waited for until
its request is on the wire before Envoy is answered; one that goes out on an idle keep-alive
connection to its worker (``PrefillClient.warm``) is not: nothing could refuse it, and the decode half
is the pair's critical path (the prefill worker computes only once decode's handshake reached its
bootstrap server). Such a leg is given the loop's next ``WARM_TURNS`` turns first, in which aiohttp
writes it (the request, then its body), so that the prefill worker has read it before decode's
handshake reaches it; then Envoy is answered (measured: docs/benchmarks.md, "Prefill/decode
disaggregation"). So:

- a prefill worker that refuses the connection is seen before anything reached the client: it
  leaves the candidates (as a refused load poll makes it) and the pair is chosen again, with a new
  room, up to ``pd.pair_attempts`` times, then 503 (a worker that died closed its pooled connections,
  so its next leg is a cold one, waited for);
- a leg that fails later (reset, non-200, timeout) aborts the decode side by ``rid``, again until
  decode's response begins (the decode request may still be on its way when the first abort
  lands), and the servicer turns decode's response into a 502 that names the prefill failure;
- when the decode side ends first (an error status, a client gone), the servicer cancels the leg;
- when every decode endpoint Envoy was given goes down before decode's response began, Envoy's
  ``override_host`` fallback may already have sent the decode half to some other worker of its
  cluster, a prefill worker included, where it would wait out SGLang's 300 s bootstrap timeout: the
  pair fails, the leg is cancelled and the request's rids are aborted on every worker.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any

from extproc.config import PdConfig
from extproc.decision.pipeline import NoWorkerError, RouteOutcome
from extproc.decision.request import RequestKind
from extproc.fleet.info import bootstrap_port
from extproc.fleet.workers import WorkerRegistry
from extproc.pd.bootstrap import PairPlan, bootstrap_body, new_room
from extproc.pd.prefill_leg import PrefillClient, PrefillError, PrefillLeg
from extproc.routing.router import Router
from extproc.routing.telemetry import Telemetry

__all__ = ["LaunchedPair", "PairLauncher"]

log = logging.getLogger(__name__)

# Loop turns a leg on a pooled connection is given before Envoy is answered: aiohttp writes the
# request in the first and its body in the second (a task of its own).
WARM_TURNS = 2

# Client headers the prefill leg carries as they came (the body is the router's; the rest is Envoy's business).
_FORWARDED_HEADERS = ("authorization", "x-api-key", "traceparent", "tracestate")


@dataclass
class LaunchedPair:
    """The prefill side of one request, as the servicer follows it."""

    plan: PairPlan
    leg: PrefillLeg
    warm: bool = False  # the leg went out on a pooled connection: Envoy's answer did not wait for it
    failure: str | None = None  # why the leg failed after Envoy was answered (None: it has not)
    response_started: bool = False  # decode's response headers reached the router
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    def cancel(self) -> None:
        """The decode side is over (or failed): a prefill leg still running is useless."""
        self.leg.cancel()


@dataclass
class PairLauncher:
    """Starts prefill legs for one router; knows nothing of gRPC.

    ``fallbacks``: how many decode fallbacks follow the primary in Envoy's destination list.
    """

    router: Router
    registry: WorkerRegistry
    telemetry: Telemetry
    client: PrefillClient
    config: PdConfig
    fallbacks: int = 0

    async def launch(
        self,
        outcome: RouteOutcome,
        reroute: Callable[[], Awaitable[RouteOutcome]],
        kind: RequestKind,
        path: str,
        body: bytes,
        headers: Mapping[str, str],
        on_retry: Callable[[float], Awaitable[None]] | None = None,
    ) -> tuple[RouteOutcome, bytes, LaunchedPair | None]:
        """Start the prefill leg of a paired decision; returns the pair Envoy sends on and the body it sends.

        A refused leg is chosen again with ``reroute`` (one ``router.aroute`` call) up to
        ``pd.pair_attempts`` pairs in all. ``on_retry`` is awaited with the seconds another pair may take
        (the servicer asks Envoy for that much more time). A retry that comes back aggregated (the fleet
        changed meanwhile) is returned as it is, with the body untouched and no pair.
        """
        last: PrefillError | None = None
        for attempt in range(self.config.pair_attempts):
            if attempt:
                if on_retry is not None:
                    await on_retry(self.config.connect_timeout_s)
                outcome = await reroute()
            prefill = outcome.prefill
            if prefill is None:  # the fleet is no longer disaggregated
                return outcome, body, None
            worker = prefill.worker
            port = bootstrap_port(worker, self.config.default_bootstrap_port)
            try:
                paired, plan = bootstrap_body(body, kind, worker.ip, port, new_room(), prefill.dp_rank)
            except Exception:
                self.router.finish(outcome)
                raise
            leg_headers = {k: v for k, v in headers.items() if k in _FORWARDED_HEADERS}
            leg_headers.update(prefill.upstream_headers)
            leg_headers["content-type"] = "application/json"
            warm = self.client.warm(worker)
            leg = self.client.send(worker, path, paired, leg_headers)
            try:
                if not warm:
                    await leg.wait_sent(self.config.connect_timeout_s)
                else:
                    for _ in range(WARM_TURNS):
                        await asyncio.sleep(0)
                    if leg.failure is not None and leg.failure.before_sent:  # it could not go out after all
                        raise leg.failure
            except PrefillError as exc:
                leg.cancel()
                self.router.finish(outcome)
                self.telemetry.prefill_failed(exc.reason, retried=True)
                self.registry.mark_unreachable(worker, f"prefill leg: {exc.detail}")
                log.warning("prefill worker %s failed before the pair was sent (%s); a new pair", worker.id, exc)
                last = exc
                continue
            except BaseException:  # the client went away while the leg connected: nothing may leak
                leg.cancel()
                self.router.finish(outcome)
                raise
            pair = LaunchedPair(plan=plan, leg=leg, warm=warm)
            assert leg.task is not None
            leg.task.add_done_callback(functools.partial(self._leg_ended, outcome, pair))
            self._spawn(pair, self._watch_decode(outcome, pair), "watch-decode")
            return outcome, paired, pair
        raise NoWorkerError(f"no prefill worker accepted the request after {self.config.pair_attempts} pairs: {last}")

    def _leg_ended(self, outcome: RouteOutcome, pair: LaunchedPair, _task: object) -> None:
        assert outcome.prefill is not None
        self.router.finish(outcome.prefill)  # the prefill worker's part is over
        leg = pair.leg
        if leg.task is None or leg.task.cancelled() or leg.failure is None or outcome.finished:
            return
        failure = leg.failure
        pair.failure = failure.detail
        self.telemetry.prefill_failed(failure.reason, retried=False)
        if failure.reason == "refused":
            self.registry.mark_unreachable(leg.worker, f"prefill leg: {failure.detail}")
        log.warning("prefill leg failed (%s); aborting decode on %s", failure.detail, outcome.worker.id)
        self._spawn(pair, self._abort_decode(outcome, pair), "abort-decode")

    @staticmethod
    def _spawn(pair: LaunchedPair, work: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.get_running_loop().create_task(work, name=name)
        pair.tasks.add(task)
        task.add_done_callback(pair.tasks.discard)

    async def _watch_decode(self, outcome: RouteOutcome, pair: LaunchedPair) -> None:
        """Until decode's response begins: fail the pair if every decode endpoint Envoy may use went down."""
        registry = self.registry
        while not (pair.response_started or outcome.finished or pair.failure is not None):
            await asyncio.sleep(self.config.abort_repeat_s)
            listed = set(outcome.endpoints(self.fallbacks))
            if any(w.healthy for w in registry.workers if w.endpoint in listed):
                continue
            if pair.response_started or outcome.finished or pair.failure is not None:
                return
            pair.failure = f"decode worker {outcome.worker.id} went down before it answered"
            self.telemetry.decode_lost()
            log.warning("%s; cancelling the prefill leg and aborting rid(s) %s", pair.failure, pair.plan.rids)
            pair.leg.cancel()
            await asyncio.gather(*(self.client.abort(w, pair.plan.rids) for w in registry.workers if w.healthy))
            return

    async def _abort_decode(self, outcome: RouteOutcome, pair: LaunchedPair) -> None:
        """Abort the decode side now, and again until its response begins (or the request ended)."""
        accepted = await self.client.abort(outcome.worker, pair.plan.rids)
        self.telemetry.decode_aborted(accepted)
        for _ in range(self.config.abort_repeats - 1):
            await asyncio.sleep(self.config.abort_repeat_s)
            if pair.response_started or outcome.finished:
                return
            await self.client.abort(outcome.worker, pair.plan.rids)

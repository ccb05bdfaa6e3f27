"""The prefill leg of a disaggregated request, sent by the router itself, and decode aborts.

The router answers Envoy with the decode worker as the destination and, at the same moment, POSTs
the same bootstrap-carrying body to the prefill worker. The prefill response is read to its end
and dropped: SGLang aborts a request whose client disconnects, and its response only completes
once the KV cache has been handed to decode. What matters is how the leg ends:

- refused before the request was sent (a dead prefill worker): nothing reached the client yet, so
  the caller retries the pair as a unit (``PrefillError.before_sent``);
- reset, a non-200 answer, or past ``pd.prefill_timeout_s``: decode would wait for KV that never
  comes (SGLang gives up after 300 s), so the caller aborts the decode side by ``rid``.

Its own ``aiohttp`` session: legs last as long as a prefill takes (no short total timeout, unlike
the sync path's polls), and one pool keeps connections to the prefill workers warm. ``PrefillClient.warm``
says whether a leg would go out on one of those (an idle keep-alive connection, not spoken for by a leg
still being sent): then "on the wire" only means "in a local socket buffer", the same thing it means a
moment later, so the caller need not wait for it (``extproc.pd.launch``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import aiohttp
from yarl import URL

from extproc.config import PdConfig
from extproc.fleet.workers import Worker

__all__ = ["PrefillClient", "PrefillError", "PrefillLeg"]

log = logging.getLogger(__name__)


class PrefillError(Exception):
    """The prefill leg failed; ``reason`` is a metric label, ``before_sent`` whether the pair may be retried."""

    def __init__(self, reason: str, detail: str, before_sent: bool) -> None:
        super().__init__(detail)
        self.reason = reason  # refused | reset | status | timeout
        self.detail = detail
        self.before_sent = before_sent


class PrefillLeg:
    """One prefill request in flight: ``sent`` once the request is on the wire, ``task`` until its end."""

    def __init__(self, worker: Worker, unsent: Counter[str] | None = None) -> None:
        self.worker = worker
        self.sent = asyncio.Event()
        self._unsent = unsent  # the client's count of legs not yet sent, per worker URL (this one counted once)
        self.failure: PrefillError | None = None
        self.status: int | None = None
        self.task: asyncio.Task[None] | None = None

    @property
    def done(self) -> bool:
        return self.task is not None and self.task.done()

    async def wait_sent(self, timeout_s: float) -> None:
        """Return once the request is sent; raise its ``PrefillError`` if it failed before (or by then)."""
        assert self.task is not None
        sent = asyncio.ensure_future(self.sent.wait())
        try:
            await asyncio.wait({sent, self.task}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            sent.cancel()
        if self.failure is not None and (self.failure.before_sent or not self.sent.is_set()):
            raise self.failure
        if not self.sent.is_set():
            self.cancel()
            raise PrefillError("timeout", f"not sent to {self.worker.id} within {timeout_s} s", before_sent=True)

    def mark_sent(self) -> None:
        """The request is on the wire (or the leg ended first): it no longer waits for a connection."""
        self.sent.set()
        self.settle()

    def settle(self) -> None:
        unsent, self._unsent = self._unsent, None
        if unsent is not None:
            unsent[self.worker.url] -= 1

    def cancel(self) -> None:
        """Stop the leg (the decode side ended): closing the connection makes SGLang abort the prefill."""
        if self.task is not None and not self.task.done():
            self.task.cancel()


async def _headers_sent(_session: Any, context: SimpleNamespace, _params: Any) -> None:
    leg = getattr(context, "trace_request_ctx", None)
    if isinstance(leg, PrefillLeg):
        leg.mark_sent()


class PrefillClient:
    """Sends prefill legs and decode aborts; created on first use inside the event loop, closed by its owner."""

    def __init__(self, config: PdConfig) -> None:
        self.config = config
        self._session: aiohttp.ClientSession | None = None
        self._unsent: Counter[str] = Counter()  # legs started but not yet on the wire, per worker URL

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            trace = aiohttp.TraceConfig()
            trace.on_request_headers_sent.append(_headers_sent)
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), trace_configs=[trace])
        return self._session

    def warm(self, worker: Worker) -> bool:
        """Whether a leg to ``worker`` started now would reuse an idle keep-alive connection, not open one.

        Counts the pool's connections to the worker that are still connected and idle at most
        ``pd.warm_idle_s`` (a worker that died or closed them is no longer counted once the loop saw
        their end), less the legs already started there and not yet sent (each will take one). Reads
        aiohttp's pool (``TCPConnector._conns``, aiohttp 3.x); where that is not there, nothing is warm
        and every leg is waited for.
        """
        limit = self.config.warm_idle_s
        if limit <= 0 or self._session is None or self._session.closed:
            return False
        pool = getattr(self._session.connector, "_conns", None)
        if not isinstance(pool, Mapping):
            return False
        url = URL(worker.url)
        now = time.monotonic()  # aiohttp stamps a connection's release with time.monotonic()
        idle = sum(
            1
            for key, conns in pool.items()
            if getattr(key, "host", None) == url.host and getattr(key, "port", None) == url.port
            for proto, released in conns
            if proto.is_connected() and now - released <= limit
        )
        return idle > self._unsent[worker.url]

    def send(self, worker: Worker, path: str, body: bytes, headers: Mapping[str, str]) -> PrefillLeg:
        """Start the leg to ``worker`` (``path`` as the client asked: /generate, chat, completions)."""
        self._unsent[worker.url] += 1
        leg = PrefillLeg(worker, self._unsent)
        leg.task = asyncio.create_task(self._run(leg, worker.url + path, body, dict(headers)), name="prefill-leg")
        leg.task.add_done_callback(lambda _: leg.settle())  # also when cancelled before it ever ran
        return leg

    async def _run(self, leg: PrefillLeg, url: str, body: bytes, headers: dict[str, str]) -> None:
        timeout = aiohttp.ClientTimeout(total=self.config.prefill_timeout_s, sock_connect=self.config.connect_timeout_s)
        try:
            async with self.session.post(
                url, data=body, headers=headers, timeout=timeout, trace_request_ctx=leg
            ) as response:
                leg.status = response.status
                answer = await response.read()  # to the end: the prefill completes after the KV transfer
            if leg.status != 200:
                text = answer[:300].decode("utf-8", "replace")
                leg.failure = PrefillError("status", f"{leg.worker.id} answered {leg.status}: {text}", False)
        except asyncio.CancelledError:
            raise
        except aiohttp.ClientConnectorError as exc:
            leg.failure = PrefillError("refused", f"cannot connect to {leg.worker.id}: {exc}", not leg.sent.is_set())
        except asyncio.TimeoutError:
            leg.failure = PrefillError("timeout", f"{leg.worker.id} timed out", not leg.sent.is_set())
        except (aiohttp.ClientError, OSError) as exc:
            detail = f"{leg.worker.id}: {type(exc).__name__}: {exc}"
            leg.failure = PrefillError("reset", detail, not leg.sent.is_set())

    async def abort(self, worker: Worker, rids: list[str]) -> bool:
        """``POST /abort_request`` for each rid on ``worker``; True when every one was answered 200."""
        timeout = aiohttp.ClientTimeout(total=self.config.abort_timeout_s)
        ok = True
        for rid in rids:
            try:
                async with self.session.post(
                    worker.url + "/abort_request", json={"rid": rid}, timeout=timeout
                ) as response:
                    await response.read()
                    ok = ok and response.status == 200
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
                log.warning("abort of %s on %s failed: %s", rid, worker.id, exc)
                ok = False
        return ok

    async def close(self) -> None:
        if self._session is not None:
            with contextlib.suppress(Exception):
                await self._session.close()
            self._session = None

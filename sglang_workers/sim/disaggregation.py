"""Prefill/decode disaggregation of a simulated worker, staged as SGLang 0.5.23 stages it.

A PD request is the same body sent to one prefill and one decode worker, with ``bootstrap_host`` /
``bootstrap_port`` / ``bootstrap_room``; without a room both refuse it (400, SGLang's message). The two
workers meet over real sockets, through the prefill worker's bootstrap server (its
``--disaggregation-bootstrap-port``), in SGLang's order:

* decode, **prealloc queue**: ``POST /sim/pd/handshake`` names the room (SGLang's decode receiver sends its
  KV indices to the prefill worker's sender); an unreachable bootstrap server fails the request
  ("Decode handshake failed ...", 500);
* prefill, **bootstrap queue**: the request waits for that handshake (at most the bootstrap timeout, then
  "... timed out ... in KVPoll.Bootstrapping", 500), then runs its prefill in the scheduler like any other
  (radix cache, KV events), sampling the first token;
* prefill, **inflight queue**: the KV transfer, ``kv_bytes_per_token`` x prompt tokens / the transfer
  bandwidth of simulated time; then the room is resolved and the prefill answers (finish_reason length 0);
* decode, **transfer queue**: ``GET /sim/pd/kv?room=`` waits for that (at most the waiting timeout, then
  "Decode transfer failed ... in KVPoll.WaitingForInput", 500); the KV arrives with the first token and
  the prefill side's cached-token count, and the request joins the decode scheduler with its prompt
  already computed: it reports the prefill's ``cached_tokens`` and its output starts with that token.

``/abort_request`` (by rid prefix, as SGLang matches it) ends a request in any of these queues with
finish_reason abort "Aborted by AbortReq."; a prefill aborted or failed before its transfer fails the room,
so its decode side fails at once instead of waiting out its timeout.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from .config import SimWorkerConfig
from .load_report import NULL_DISAGGREGATION
from .request import Request
from .responses import ApiError, ErrorKind
from .scheduler import Scheduler
from .timing import TimingProfile

__all__ = [
    "ABORTED_BY_REQUEST",
    "Bootstrap",
    "DecodeSide",
    "PrefillSide",
    "bootstrap_fields",
    "missing_room_error",
]

logger = logging.getLogger(__name__)

ABORTED_BY_REQUEST = "Aborted by AbortReq."  # SGLang's message for a request ended by /abort_request
HANDSHAKE_CONNECT_TIMEOUT_S = 10.0
ROOM_TTL_S = 900.0  # a room nobody claims is dropped after this (both timeouts are 300 s by default)


@dataclass(frozen=True)
class Bootstrap:
    """Where a PD request's two halves meet: the prefill worker's host and bootstrap port, and the room."""

    host: str | None
    port: int | None
    room: int | None


def _item(value: Any, index: int, count: int) -> Any:
    if isinstance(value, list):
        return value[index] if index < len(value) else None
    if isinstance(value, int) and not isinstance(value, bool) and count > 1:
        return value + index  # SGLang's io_struct: one room for a batch -> room + i per prompt
    return value


def bootstrap_fields(body: Mapping[str, Any], count: int) -> list[Bootstrap]:
    """The bootstrap fields of each of ``count`` prompts (a batch carries lists, or one room counted up)."""
    host, port, room = body.get("bootstrap_host"), body.get("bootstrap_port"), body.get("bootstrap_room")
    out = []
    for i in range(count):
        h = host[i] if isinstance(host, list) and i < len(host) else host
        p = port[i] if isinstance(port, list) and i < len(port) else port
        r = _item(room, i, count)
        if h is not None and not isinstance(h, str):
            raise ApiError(400, "bootstrap_host must be a string.", "generate")
        if p is not None and (not isinstance(p, int) or isinstance(p, bool)):
            raise ApiError(400, "bootstrap_port must be an integer.", "generate")
        if r is not None and (not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < 2**63):
            raise ApiError(400, "bootstrap_room must be an integer in [0, 2^63).", "generate")
        out.append(Bootstrap(h, p, r))
    return out


def missing_room_error(rid: str, kind: ErrorKind) -> ApiError:
    """SGLang's scheduler refusing a PD request without a room: a 400 its HTTP layer turns into a ValueError body."""
    message = f"Invalid request: Disaggregated request received without bootstrap room id. req.rid={rid!r}"
    return ApiError(400, message, kind)


def _fail(req: Request, message: str) -> None:
    """End a request with SGLang's PD failure (an HTTPException 500: ``{"object": "error", "type": "500"}`` on
    every API, /generate included, as SGLang's exception handler shapes it)."""
    if req.finished:
        return
    req.error = message
    req.pd_failure = True
    req.finished_at = time.monotonic()
    req.updates.put_nowait(None)


def _kv_error(room: int, reason: str) -> str:
    return f"KVTransferError(bootstrap_room={room}): {reason}"


@dataclass(eq=False)
class _Room:
    """One bootstrap room on the prefill side: the decode handshake and the KV hand-off."""

    created: float = field(default_factory=time.monotonic)
    decode_ready: asyncio.Event = field(default_factory=asyncio.Event)
    kv: asyncio.Future[dict[str, Any]] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class _Side:
    """What both sides share: the PD requests in flight (by rid, for ``/abort_request``)."""

    mode = "null"

    def __init__(self, config: SimWorkerConfig, scheduler: Scheduler) -> None:
        self.config = config
        self.scheduler = scheduler
        self.pending: dict[Request, asyncio.Task[None]] = {}
        scheduler.disaggregation_report = self.report

    def _track(self, req: Request, task: asyncio.Task[None]) -> None:
        self.pending[req] = task
        task.add_done_callback(lambda _: self.pending.pop(req, None))

    def abort(self, rid: str, abort_all: bool) -> int:
        """Abort the PD stages of requests whose rid starts with ``rid``; returns how many.

        Aborted while waiting for the other half, a request fails as SGLang's does there: a 500 naming the
        queue's stage and "Aborted by AbortReq." (a request already in the scheduler ends with finish_reason
        abort instead)."""
        hits = [r for r in self.pending if abort_all or r.rid.startswith(rid)]
        for req in hits:
            self.pending[req].cancel()
        return len(hits)

    def drop(self, req: Request) -> None:
        """The client went away: stop the request's PD stage (SGLang aborts a disconnected request)."""
        task = self.pending.get(req)
        if task is not None:
            task.cancel()

    def report(self) -> dict[str, Any]:
        """The ``disaggregation`` block of ``/v1/loads``: every key at its null value but the mode; each side
        fills in its own queues."""
        return dict(NULL_DISAGGREGATION, mode=self.mode)

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        for task in list(self.pending.values()):
            task.cancel()


class PrefillSide(_Side):
    """A prefill worker's bootstrap server and its requests' bootstrap and inflight (transfer) stages."""

    mode = "prefill"

    def __init__(self, config: SimWorkerConfig, scheduler: Scheduler, profile: TimingProfile) -> None:
        super().__init__(config, scheduler)
        self.profile = profile
        self.rooms: dict[int, _Room] = {}
        self.bootstrap_queue = 0
        self.inflight_queue = 0
        self.last_speed_gb_s = 0.0
        self.last_latency_ms = 0.0
        self._runner: web.AppRunner | None = None

    def report(self) -> dict[str, Any]:
        return super().report() | {
            "prefill_bootstrap_queue_reqs": self.bootstrap_queue,
            "prefill_inflight_queue_reqs": self.inflight_queue,
            "kv_transfer_speed_gb_s": round(self.last_speed_gb_s, 3),
            "kv_transfer_latency_ms": round(self.last_latency_ms, 3),
        }

    # -- the bootstrap server --------------------------------------------------------------------
    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_post("/sim/pd/handshake", self._handshake)
        app.router.add_get("/sim/pd/kv", self._kv)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(
            self._runner, self.config.host, self.config.disaggregation_bootstrap_port, reuse_address=True
        )
        await site.start()

    async def stop(self) -> None:
        await super().stop()
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    def _room(self, room: int) -> _Room:
        now = time.monotonic()
        for key in [k for k, r in self.rooms.items() if now - r.created > ROOM_TTL_S]:
            del self.rooms[key]
        return self.rooms.setdefault(room, _Room())

    @staticmethod
    async def _health(request: web.Request) -> web.Response:
        return web.Response(text="OK")

    @staticmethod
    def _room_id(raw: Any) -> int:
        try:
            return int(raw)
        except (TypeError, ValueError):
            raise web.HTTPBadRequest(text="room must be an integer") from None

    async def _handshake(self, request: web.Request) -> web.Response:
        """A decode worker is ready to receive the room's KV."""
        body = await request.json()
        self._room(self._room_id(body.get("room") if isinstance(body, dict) else None)).decode_ready.set()
        return web.json_response({"ok": True})

    async def _kv(self, request: web.Request) -> web.Response:
        """Long poll: answers when the room's KV has been sent (200) or its prefill failed (410)."""
        room_id = self._room_id(request.query.get("room"))
        room = self._room(room_id)
        try:
            handoff = await asyncio.shield(room.kv)
        except Exception as exc:  # the prefill failed or was aborted: the decode side fails now
            self.rooms.pop(room_id, None)
            return web.json_response({"error": str(exc)}, status=410)
        self.rooms.pop(room_id, None)
        return web.json_response(handoff)

    # -- one request -------------------------------------------------------------------------------
    def submit(self, req: Request, bootstrap: Bootstrap) -> None:
        assert bootstrap.room is not None
        req.max_new_tokens = min(req.max_new_tokens, 1)  # a prefill server samples the first token only
        room = self._room(bootstrap.room)
        self._track(req, asyncio.get_running_loop().create_task(self._run(req, bootstrap.room, room)))

    async def _run(self, req: Request, room_id: int, room: _Room) -> None:
        start = time.monotonic()
        where = f"rank=0 req.rid={req.rid!r} req.bootstrap_room={room_id}"
        computed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def on_computed(_: Request) -> None:
            if not computed.done():
                computed.set_result(None)

        req.finish_length = 0  # SGLang's prefill finishes with FINISH_LENGTH(length=0)
        req.on_computed = on_computed
        try:
            self.bootstrap_queue += 1
            try:
                await asyncio.wait_for(room.decode_ready.wait(), self.config.disaggregation_bootstrap_timeout)
            except asyncio.TimeoutError:
                reason = f"Request {room_id} timed out after {time.monotonic() - start:.1f}s in KVPoll.Bootstrapping"
                self._fail_room(room, reason)
                _fail(req, f"Prefill bootstrap failed for request {where} with exception {_kv_error(room_id, reason)}")
                return
            finally:
                self.bootstrap_queue -= 1
            self.scheduler.enqueue(req)
            await computed
            if req.abort_message is not None or req.error is not None:
                self._fail_room(room, req.abort_message or req.error or "prefill failed")
                req.updates.put_nowait(None)
                return
            self.inflight_queue += 1
            try:
                tokens = len(req.input_ids)
                nbytes = self.profile.kv_bytes(tokens)
                seconds = nbytes / (self.config.disaggregation_transfer_gbps * 1e9)
                await asyncio.sleep(seconds / self.config.speedup)
            finally:
                self.inflight_queue -= 1
            self.last_latency_ms = seconds * 1e3
            self.last_speed_gb_s = self.config.disaggregation_transfer_gbps if nbytes else 0.0
            if not room.kv.done():
                room.kv.set_result(
                    {
                        "first_token": req.output_ids[0] if req.output_ids else None,
                        "cached_tokens": max(req.cached_tokens, 0),
                        "prompt_tokens": tokens,
                    }
                )
            req.finished_at = time.monotonic()
            req.updates.put_nowait(None)
        except asyncio.CancelledError:  # /abort_request
            self._fail_room(room, ABORTED_BY_REQUEST)
            if computed.done():  # out of the scheduler, in the transfer: the response ends now
                req.abort_message = ABORTED_BY_REQUEST
                req.updates.put_nowait(None)
            elif not self.scheduler.abort_request(req) and req.abort_message is None:  # in the bootstrap queue
                error = _kv_error(room_id, ABORTED_BY_REQUEST)
                _fail(req, f"Prefill bootstrap failed for request {where} with exception {error}")

    @staticmethod
    def _fail_room(room: _Room, reason: str) -> None:
        if not room.kv.done():
            room.kv.set_exception(RuntimeError(reason))
            room.kv.exception()  # retrieved: no "never retrieved" warning when no decode polls it


class DecodeSide(_Side):
    """A decode worker's prealloc (handshake) and transfer (waiting for KV) stages, as a bootstrap client."""

    mode = "decode"

    def __init__(self, config: SimWorkerConfig, scheduler: Scheduler) -> None:
        super().__init__(config, scheduler)
        self.prealloc_queue = 0
        self.transfer_queue = 0
        self._session: aiohttp.ClientSession | None = None

    def report(self) -> dict[str, Any]:
        return super().report() | {
            "decode_prealloc_queue_reqs": self.prealloc_queue,
            "decode_transfer_queue_reqs": self.transfer_queue,
        }

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def stop(self) -> None:
        await super().stop()
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    def submit(self, req: Request, bootstrap: Bootstrap) -> None:
        self._track(req, asyncio.get_running_loop().create_task(self._run(req, bootstrap)))

    async def _run(self, req: Request, bootstrap: Bootstrap) -> None:
        assert self._session is not None and bootstrap.room is not None
        room = bootstrap.room
        host = bootstrap.host or "127.0.0.1"
        base = f"http://{host}:{bootstrap.port or self.config.disaggregation_bootstrap_port}"
        where = f"rank=0 decode_req.req.rid={req.rid!r} decode_req.req.bootstrap_room={room}"
        stage = "handshake"
        try:
            self.prealloc_queue += 1
            try:
                timeout = aiohttp.ClientTimeout(total=HANDSHAKE_CONNECT_TIMEOUT_S)
                async with self._session.post(f"{base}/sim/pd/handshake", json={"room": room}, timeout=timeout) as r:
                    if r.status != 200:
                        raise aiohttp.ClientResponseError(r.request_info, (), status=r.status)
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                reason = f"bootstrap server {base} unreachable: {exc!r}"
                _fail(req, f"Decode handshake failed for request {where} with exception {_kv_error(room, reason)}")
                return
            finally:
                self.prealloc_queue -= 1
            stage = "transfer"
            start = time.monotonic()
            self.transfer_queue += 1
            try:
                timeout = aiohttp.ClientTimeout(total=self.config.disaggregation_waiting_timeout)
                async with self._session.get(f"{base}/sim/pd/kv", params={"room": str(room)}, timeout=timeout) as r:
                    handoff = await r.json()
                    status = r.status
            except asyncio.TimeoutError:
                reason = f"Request {room} timed out after {time.monotonic() - start:.1f}s in KVPoll.WaitingForInput"
                _fail(req, f"Decode transfer failed for request {where} with exception {_kv_error(room, reason)}")
                return
            except aiohttp.ClientError as exc:
                reason = f"bootstrap server {base} went away: {exc!r}"
                _fail(req, f"Decode transfer failed for request {where} with exception {_kv_error(room, reason)}")
                return
            finally:
                self.transfer_queue -= 1
            if status != 200 or not isinstance(handoff, dict) or handoff.get("first_token") is None:
                detail = handoff.get("error") if isinstance(handoff, dict) else status
                _fail(req, f"Decode transfer failed for request {where} with exception {_kv_error(room, str(detail))}")
                return
            req.first_token = int(handoff["first_token"])
            req.cached_tokens = int(handoff["cached_tokens"])
            req.prebuilt = True
            req.admitted_at = time.monotonic()
            self.scheduler.enqueue(req)
        except asyncio.CancelledError:  # /abort_request
            error = _kv_error(room, ABORTED_BY_REQUEST)
            _fail(req, f"Decode {stage} failed for request {where} with exception {error}")

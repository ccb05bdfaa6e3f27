"""The simulated worker's HTTP API, shaped like SGLang's (``sglang.srt.entrypoints.http_server``).

Routers, benchmarks and users talk to it exactly as to SGLang: the generation APIs (``http_generation``),
``/v1/models``, health and readiness, ``/server_info`` with the ``kv_events`` block a router reads to subscribe,
``/model_info``, ``/v1/loads``, ``/metrics``, ``/flush_cache``. Errors are SGLang's JSON bodies
(``responses.error_body``) and never a stack trace; SGLang's HTTP request counters are kept per route.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from .http_generation import GenerationApi
from .http_validation import read_json, validation_error
from .metrics import HttpStats
from .prometheus import render_metrics
from .reports import LOAD_SECTIONS, loads_prometheus, loads_report, model_info_report, server_info_report
from .responses import ApiError, ErrorKind, error_body
from .worker import HEALTH_CHECK_TIMEOUT_S, HEALTH_POLL_S, SimWorker

__all__ = ["HttpServer", "error_response"]

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 1024 * 1024


def error_response(status: int, message: str, kind: ErrorKind = "openai", err_type: str | None = None) -> web.Response:
    return web.json_response(error_body(kind, status, message, err_type), status=status)


class HttpServer:
    """The HTTP front door of one :class:`SimWorker` (``start`` listens, ``stop`` closes)."""

    def __init__(self, worker: SimWorker) -> None:
        self.worker = worker
        self.generation = GenerationApi(worker)
        self.http_stats = HttpStats()
        self._runner: web.AppRunner | None = None

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0: any free port); returns the port (also ``worker.bound_port``)."""
        self._runner = web.AppRunner(self.build_app(), access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, reuse_address=True)
        await site.start()
        server = getattr(site, "_server", None)
        sockets = getattr(server, "sockets", None) or []
        self.worker.bound_port = sockets[0].getsockname()[1] if sockets else port
        return self.worker.bound_port

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    def build_app(self) -> web.Application:
        app = web.Application(middlewares=[self._count, self._errors], client_max_size=MAX_BODY_BYTES)
        r = app.router
        r.add_post("/generate", self.generation.generate)
        r.add_post("/v1/completions", self.generation.completions)
        r.add_post("/v1/chat/completions", self.generation.chat_completions)
        r.add_get("/v1/models", self.models)
        for path in ("/health", "/health_generate"):
            r.add_get(path, self.health)
        r.add_get("/ready", self.ready_check)
        for path in ("/server_info", "/get_server_info"):
            r.add_get(path, self.server_info)
        for path in ("/model_info", "/get_model_info"):
            r.add_get(path, self.model_info)
        r.add_get("/v1/loads", self.loads)
        r.add_get("/metrics", self.metrics)
        r.add_route("*", "/flush_cache", self.flush_cache)
        r.add_post("/abort_request", self.abort_request)
        return app

    @web.middleware
    async def _count(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """SGLang's http_requests_total / _active / http_responses_total, per route and method."""
        resource = request.match_info.route.resource
        endpoint = resource.canonical if resource is not None else request.path
        self.http_stats.started(endpoint, request.method)
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        finally:
            self.http_stats.finished(endpoint, request.method, status)

    @web.middleware
    async def _errors(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as exc:
            return error_response(exc.status, exc.message, exc.kind, exc.err_type)
        except web.HTTPNotFound:
            return error_response(404, "Not Found", "detail")
        except web.HTTPMethodNotAllowed:
            return error_response(405, "Method Not Allowed", "detail")
        except web.HTTPException:
            raise
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except Exception as exc:  # never leak a traceback to clients
            logger.exception("internal error on %s", request.path)
            return error_response(500, f"internal error: {type(exc).__name__}")

    async def models(self, request: web.Request) -> web.Response:
        cfg = self.worker.config
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": cfg.model,
                        "object": "model",
                        "created": int(self.worker.started_at),
                        "owned_by": "sglang",
                        "root": cfg.model,
                        "parent": None,
                        "max_model_len": cfg.context_length,
                    }
                ],
            }
        )

    # -- health and info ---------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        """``/health`` and ``/health_generate`` as SGLang 0.5.23 answers them: after 1 s at the earliest.

        SGLang pushes a one-token generation to the scheduler (or, when it is busy, asks for a signal after
        its next batch), then sleeps 1 s before it first checks whether the scheduler answered since, and
        keeps checking every second for up to 20 s. So a healthy worker answers 200 after about 1 s, a busy
        one after its current batch, a hung one 503 after 20 s (and turns unhealthy: ``/ready`` says 503
        until a later check succeeds). While starting it answers 503 at once.
        """
        worker = self.worker
        if not worker.ready or worker.scheduler is None:
            return web.Response(status=503)
        scheduler = worker.scheduler
        tic = time.monotonic()
        scheduler.probe_health()
        while time.monotonic() < tic + HEALTH_CHECK_TIMEOUT_S:
            await asyncio.sleep(HEALTH_POLL_S)
            if scheduler.last_output_at > tic:
                worker.healthy = True
                return web.Response(status=200)
        worker.healthy = False
        return web.Response(status=503)

    async def ready_check(self, request: web.Request) -> web.Response:
        """``/ready``: a flag, no work for the scheduler (200 once started, unless a /health check failed)."""
        return web.Response(status=200 if self.worker.ready and self.worker.healthy else 503)

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response(server_info_report(self.worker))

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response(model_info_report(self.worker))

    async def loads(self, request: web.Request) -> web.Response:
        """``/v1/loads`` as 0.5.23 serves it: one entry per DP rank, ``include`` sections, ``dp_rank`` filter."""
        scheduler = self.worker.require_ready()
        start = time.perf_counter()
        try:
            return self._loads(request)
        finally:
            scheduler.stats.loads_served.observe(time.perf_counter() - start)

    def _loads(self, request: web.Request) -> web.Response:
        raw_rank = request.query.get("dp_rank")
        try:
            dp_rank = int(raw_rank) if raw_rank is not None else None
        except ValueError:
            raise ApiError(
                400,
                f"dp_rank: Input should be a valid integer, unable to parse string as an integer: {raw_rank!r}",
                "validation",
            ) from None
        include = request.query.get("include")
        sections = {s.strip() for s in include.split(",")} if include else None
        if sections is not None and not sections <= {"core", "all", *LOAD_SECTIONS}:
            # SGLang validates ``include`` outside its error handling: an unknown section is a bare 500.
            return web.Response(status=500, text="Internal Server Error")
        report = loads_report(self.worker, sections, dp_rank)
        if request.query.get("format") == "prometheus":
            return web.Response(text=loads_prometheus(report["loads"]), content_type="text/plain", charset="utf-8")
        return web.json_response(report)

    async def metrics(self, request: web.Request) -> web.Response:
        scheduler = self.worker.require_ready()
        return web.Response(
            text=render_metrics(scheduler, self.worker.config.model, self.http_stats),
            content_type="text/plain",
            charset="utf-8",
        )

    async def abort_request(self, request: web.Request) -> web.Response:
        """SGLang's ``/abort_request`` (``{"rid": ..., "abort_all": false}``): 200 with an empty body, whether or
        not a request matched; the aborted requests answer with finish_reason abort."""
        body = await read_json(request)
        rid, abort_all = body.get("rid", ""), body.get("abort_all", False)
        if not isinstance(rid, str):
            raise validation_error("rid", "Input should be a valid string")
        if not isinstance(abort_all, bool):
            raise validation_error("abort_all", "Input should be a valid boolean")
        self.worker.abort_request(rid, abort_all)
        return web.Response(status=200)

    async def flush_cache(self, request: web.Request) -> web.Response:
        if request.method not in ("GET", "POST"):
            raise ApiError(405, "Method Not Allowed", "detail")
        schedulers = self.worker.schedulers
        self.worker.require_ready()
        if all(s.idle for s in schedulers) and all([s.flush_cache() for s in schedulers]):  # noqa: C419 (flush every rank)
            return web.Response(
                text="Cache flushed.\nPlease check backend logs for more details. "
                "(When there are running or waiting requests, the operation will not be performed.)\n"
            )
        return web.Response(status=400, text="Flush cache failed.\n")

"""The simulated worker's HTTP API, shaped like SGLang's (``sglang.srt.entrypoints.http_server``).

Routers, benchmarks and users talk to it exactly as to SGLang: native ``/generate``, the OpenAI
``/v1/completions`` and ``/v1/chat/completions`` (SSE streaming ending in ``data: [DONE]``, ``usage``
with ``prompt_tokens_details.cached_tokens`` as under ``--enable-cache-report``), ``/v1/models``,
health and readiness, ``/server_info`` with the ``kv_events`` block a router reads to subscribe,
``/model_info``, ``/v1/loads``, ``/metrics``, ``/flush_cache``. Errors are OpenAI-style JSON bodies
(``{"object": "error", "message", "type", "param", "code"}``) and never a stack trace.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime, timezone
from typing import Any

from aiohttp import web

from extproc.tokenization import (
    DEFAULT_TOKENIZER_DIR,
    ChatTemplateError,
    ModelTokenizer,
    TokenizerLoadError,
    load_tokenizer,
)

from .config import SimWorkerConfig
from .hiradix_cache import HiRadixCache, host_pool_tokens
from .kv_events import KVEventPublisher
from .metrics import GRAPH_PHASES, HttpStats, render_metrics
from .radix_cache import RadixCache
from .responses import ErrorKind, error_body, meta_info, model_info, usage, weight_versions
from .scheduler import Request, Scheduler, device_pool_tokens
from .timing import get_profile, profile_list

__all__ = ["SGLANG_VERSION", "SimWorker"]

logger = logging.getLogger(__name__)

SGLANG_VERSION = "0.5.23"  # the SGLang release whose wire behaviour this simulator reproduces
STORAGE_BACKEND_CLASS = {"file": "HiCacheFile"}  # what cached_tokens_details.storage_backend names
HEALTH_POLL_S = 1.0  # SGLang's health_generate sleeps this long before it first looks for an answer
HEALTH_CHECK_TIMEOUT_S = 20.0  # SGLANG_HEALTH_CHECK_TIMEOUT default: no answer by then -> 503, unhealthy
LOAD_SECTIONS = {
    "memory": "memory",
    "spec": "speculative",
    "lora": "lora",
    "disagg": "disaggregation",
    "queues": "queues",
}
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's (and SGLang's) default for /v1/completions


class ApiError(Exception):
    """A client-visible error: becomes the JSON body SGLang gives this kind of refusal (``responses.error_body``)."""

    def __init__(self, status: int, message: str, kind: ErrorKind = "openai") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind


def error_response(status: int, message: str, kind: ErrorKind = "openai") -> web.Response:
    return web.json_response(error_body(kind, status, message), status=status)


def validation_error(field: str, problem: str) -> ApiError:
    """What SGLang's pydantic request models answer for a body that does not parse (400, "Bad Request")."""
    return ApiError(400, f"1 validation error:\n  {{'loc': ('body', {field!r}), 'msg': {problem!r}}}", "validation")


def _distinct_prompts(reqs: list[Request]) -> list[Request]:
    """One request per prompt (``n`` choices of one prompt share it): SGLang counts prompt tokens once."""
    seen: dict[tuple[int, ...], Request] = {}
    for req in reqs:
        seen.setdefault(tuple(req.input_ids), req)
    return list(seen.values())


def output_vocabulary(tokenizer: ModelTokenizer) -> list[int]:
    """Ids the simulated model 'generates': plain lower-case words, so outputs read as text.

    Special and added tokens are never produced (a real model emits them only to stop).
    """
    special = set(tokenizer.tokenizer.get_added_tokens_decoder())
    vocab = tokenizer.tokenizer.get_vocab()
    words = sorted(i for tok, i in vocab.items() if i not in special and re.fullmatch(r"(Ġ|▁)[a-z]{3,}", tok))
    if len(words) >= 64:
        return words
    return sorted(i for i in vocab.values() if i not in special)


class SimWorker:
    """One simulated SGLang worker: tokenizer, radix cache, scheduler, KV-event publisher, HTTP app."""

    def __init__(self, config: SimWorkerConfig) -> None:
        self.config = config
        # ``--profile a,b`` cycles the profiles over the DP ranks (one worker, mixed GPUs); rank 0's
        # profile describes the worker where one figure is reported for all of it.
        self.profiles = [get_profile(name) for name in profile_list(config.profile)]
        self.profile = self.profiles[0]
        try:
            self.tokenizer = load_tokenizer(config.tokenizer, config.chat_template)
        except TokenizerLoadError as exc:
            raise ValueError(str(exc)) from exc
        self.host_tokens = 0  # HiCache host pool (0: no host tier)
        if config.enable_hierarchical_cache:
            device = device_pool_tokens(config, self.profile)
            self.host_tokens = host_pool_tokens(
                device, config.page_size, config.hicache_ratio, config.hicache_size, self.profile.kv_bytes_per_token
            )
            if self.host_tokens <= device:  # SGLang warns too; the host tier then adds little
                logger.warning(
                    "host pool (%d tokens) is smaller than the device pool (%d tokens): "
                    "L2 cache effectiveness is reduced",
                    self.host_tokens,
                    device,
                )
            if config.hicache_storage_backend == "file":
                try:
                    config.storage_dir().mkdir(parents=True, exist_ok=True)
                except OSError as exc:
                    raise ValueError(f"cannot create the HiCache file storage directory: {exc}") from None
        self.ready = False  # weights "loaded" and warmed up (SGLang's ServerStatus leaves Starting)
        self.healthy = True  # False after a /health found no answer in time (SGLang's ServerStatus.UnHealthy)
        self.publishers: list[KVEventPublisher] = []  # one per data-parallel rank
        self.schedulers: list[Scheduler] = []  # one per data-parallel rank, each with its own radix cache
        self._next_rank = 0  # SGLang's default load balancing of unpinned requests: round robin
        # SGLang applies x-override-* request headers only with this set (its header-override mechanism).
        self.header_overrides = os.environ.get("SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES", "").lower() in ("1", "true")
        self.started_at = time.time()
        self._runner: web.AppRunner | None = None
        self.bound_port: int | None = None
        self.http_stats = HttpStats()

    @property
    def tokenizer_path(self) -> str:
        """Where the tokenizer lives (the built-in one's directory by default), for routers that load it."""
        return self.config.tokenizer or str(DEFAULT_TOKENIZER_DIR)

    # -- lifecycle ---------------------------------------------------------------------------------
    @property
    def scheduler(self) -> Scheduler | None:
        """Rank 0's scheduler (the only one without ``--dp-size``)."""
        return self.schedulers[0] if self.schedulers else None

    @property
    def publisher(self) -> KVEventPublisher | None:
        return self.publishers[0] if self.publishers else None

    async def start(self) -> None:
        cfg = self.config
        vocab = output_vocabulary(self.tokenizer)
        for rank in range(cfg.dp_size):
            rank_cfg = cfg.rank(rank)
            publisher = None
            if cfg.kv_events:
                publisher = KVEventPublisher(
                    host=rank_cfg.kv_events_host,
                    port=rank_cfg.kv_events_port,
                    replay_port=rank_cfg.replay_port,
                    topic=rank_cfg.kv_topic,
                    buffer_steps=rank_cfg.kv_buffer_steps,
                    dp_rank=rank_cfg.dp_rank,
                    event_format=rank_cfg.event_format,
                    replay_format=rank_cfg.replay_format,
                )
                publisher.start()
                self.publishers.append(publisher)
            cache = (
                HiRadixCache(
                    cfg.page_size,
                    enable_events=cfg.kv_events,
                    host_capacity=self.host_tokens,
                    write_policy=cfg.hicache_write_policy,
                )
                if cfg.enable_hierarchical_cache
                else RadixCache(cfg.page_size, enable_events=cfg.kv_events)
            )
            scheduler = Scheduler(rank_cfg, self.profiles[rank % len(self.profiles)], cache, publisher, vocab)
            scheduler.start()
            self.schedulers.append(scheduler)
        app = self.build_app()
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, cfg.host, cfg.port, reuse_address=True)
        await site.start()
        server = getattr(site, "_server", None)
        sockets = getattr(server, "sockets", None) or []
        self.bound_port = sockets[0].getsockname()[1] if sockets else cfg.port
        if cfg.load_time > 0:
            asyncio.get_running_loop().call_later(cfg.load_time, self._set_ready)
        else:
            self._set_ready()

    def _set_ready(self) -> None:
        self.ready = True

    async def stop(self) -> None:
        self.ready = False
        if self._runner is not None:
            await self._runner.cleanup()
        for scheduler in self.schedulers:
            await scheduler.stop()
        for publisher in self.publishers:
            await publisher.close()

    # -- app ---------------------------------------------------------------------------------------
    def build_app(self) -> web.Application:
        app = web.Application(middlewares=[self._count, self._errors], client_max_size=64 * 1024 * 1024)
        r = app.router
        r.add_post("/generate", self.generate)
        r.add_post("/v1/completions", self.completions)
        r.add_post("/v1/chat/completions", self.chat_completions)
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
            return error_response(exc.status, exc.message, exc.kind)
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

    # -- helpers -----------------------------------------------------------------------------------
    def _require_ready(self) -> Scheduler:
        if not self.ready or self.scheduler is None:
            raise ApiError(503, "The server is not ready yet.")
        return self.scheduler

    @staticmethod
    async def _json(request: web.Request) -> dict[str, Any]:
        raw = await request.read()
        try:
            body = json.loads(raw or b"null")
        except ValueError as exc:
            raise validation_error("body", f"JSON decode error: {exc}") from None
        if not isinstance(body, dict):
            raise validation_error("body", "Input should be a valid dictionary or object")
        return body

    def _check_input_ids(self, ids: list[Any], field: str, kind: ErrorKind) -> list[int]:
        """Integer ids (else a validation error), none negative.

        A negative id kills a real SGLang 0.5.23 worker (its embedding lookup raises in the scheduler); the
        simulator refuses it instead. Ids beyond a vocabulary are served: the simulator has no embedding
        table, and synthetic workloads use any ids (the router refuses them where ``models[].vocab_size``
        says so).
        """
        if not all(type(t) is int for t in ids):
            raise validation_error(field, "Input should be a valid integer")
        if ids and min(ids) < 0:
            raise ApiError(400, f"token id {min(ids)} is negative.", kind)
        return ids

    def _check_length(self, input_ids: list[int], kind: ErrorKind, max_new_tokens: int | None = None) -> None:
        """SGLang's length checks, in its order: the prompt against the context length, prompt plus the
        requested ``max_new_tokens`` against it (only when the client asked for a number: SGLang's
        validate_total_tokens), then the prompt against what the KV pool can hold (scheduler side)."""
        context = self.config.context_length
        if len(input_ids) >= context:
            raise ApiError(
                400,
                f"The input ({len(input_ids)} tokens) is longer than the model's context length ({context} tokens).",
                kind,
            )
        if max_new_tokens is not None and len(input_ids) + max_new_tokens > context:
            total = len(input_ids) + max_new_tokens
            raise ApiError(
                400,
                f"Requested token count exceeds the model's maximum context length of {context} tokens. You "
                f"requested a total of {total} tokens: {len(input_ids)} tokens from the input messages and "
                f"{max_new_tokens} tokens for the completion. Please reduce the number of tokens in the input "
                "messages or the completion to fit within the limit.",
                kind,
            )
        limit = min(self.config.context_length - 1, self._require_ready().capacity - 1) - 5  # max_req_input_len
        if len(input_ids) >= limit:
            raise ApiError(
                400,
                f"Input length ({len(input_ids)} tokens) exceeds the maximum allowed length ({limit} tokens). "
                "Use a shorter input or enable --allow-auto-truncate.",
                kind,
            )

    @staticmethod
    def _max_tokens(value: Any, field: str, default: int, kind: ErrorKind) -> int:
        if value is None:
            return default
        if not isinstance(value, int) or isinstance(value, bool):
            raise validation_error(field, "Input should be a valid integer")
        if value < 0:
            raise ApiError(400, f"max_new_tokens must be at least 0, got {value}.", kind)
        return value

    @staticmethod
    def _cache_salt(body: dict[str, Any]) -> str | None:
        salt = body.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            raise validation_error("cache_salt", "Input should be a valid string")
        return salt or None

    def submit(
        self,
        input_ids: list[int],
        max_new_tokens: int,
        salt: str | None,
        rid: str | None,
        rank: int | None = None,
        stream: bool = False,
        kind: ErrorKind = "openai",
        requested: bool = True,
    ) -> Request:
        """Check and queue one tokenized request: the admission path of both front doors (HTTP and gRPC).

        ``requested``: the client named ``max_new_tokens`` (else SGLang does not check prompt + output
        against the context length)."""
        self._require_ready()
        self._check_length(input_ids, kind, max_new_tokens if requested else None)
        return self._rank_scheduler(rank).submit(input_ids, max_new_tokens, salt, rid, stream)

    def _rank_scheduler(self, rank: int | None) -> Scheduler:
        """The scheduler of ``rank``, or the next one round robin (SGLang's default for unpinned requests)."""
        if rank is None:
            rank = self._next_rank
            self._next_rank = (self._next_rank + 1) % len(self.schedulers)
        return self.schedulers[rank]

    def _routed_rank(self, request: web.Request, body: dict[str, Any], api: str) -> int | None:
        """The DP rank a request names, read as SGLang 0.5.23 reads it; None lets the worker choose.

        Body ``routed_dp_rank`` (or the deprecated ``data_parallel_rank``); on the OpenAI APIs the
        ``X-Data-Parallel-Rank`` header wins over it; on /generate and chat the header-override mechanism's
        ``x-override-routed-dp-rank`` wins over both, only with SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES=1.
        A rank out of range is a 400; rank 0 on a single-rank worker is ignored.
        """
        value: Any = body.get("routed_dp_rank", body.get("data_parallel_rank"))
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise ApiError(400, "'routed_dp_rank' must be an integer.")
        headers: list[tuple[str, str]] = []
        if api in ("chat", "completions"):
            headers.append(("x-data-parallel-rank", "Invalid X-Data-Parallel-Rank header: must be an integer"))
        if api in ("chat", "generate") and self.header_overrides:
            headers.append(("x-override-routed-dp-rank", "invalid x-override-routed-dp-rank header"))
        for name, problem in headers:
            raw = request.headers.get(name)
            if raw is not None:
                try:
                    value = int(raw)
                except ValueError:
                    raise ApiError(400, f"{problem}, got {raw!r}") from None
        if value is None:
            return None
        size = len(self.schedulers)
        if size <= 1 and value == 0:
            return None
        if not 0 <= value < size:
            raise ApiError(400, f"routed_dp_rank={value} out of range [0, {size})")
        return int(value)

    async def _tokens(self, req: Request) -> AsyncIterator[list[int]]:
        """The request's tokens as the scheduler produces them; aborts it if the client goes away."""
        try:
            while True:
                item = await req.updates.get()
                if item is None:
                    return
                yield item
        finally:  # also runs when the handler stops early (client gone, write failed, cancelled)
            if not req.finished and self.schedulers:
                self.schedulers[req.dp_rank].abort(req)

    async def _wait(self, req: Request) -> None:
        async for _ in self._tokens(req):
            pass
        if req.error is not None:
            raise ApiError(500, req.error)

    async def _stream_failed(self, resp: web.StreamResponse, req: Request) -> bool:
        """After a stream's last token: if the request failed, end the stream with an error event."""
        if req.error is None:
            return False
        await self._send(resp, {"error": {"message": req.error, "type": "InternalServerError", "code": 500}})
        await self._send(resp, "[DONE]")
        await resp.write_eof()
        return True

    def _cached_details(self, req: Request) -> dict[str, Any] | None:
        """SGLang's ``get_cached_tokens_details``: cached tokens by tier (None when nothing was cached)."""
        backend = self.config.hicache_storage_backend
        if req.cached_device > 0 or req.cached_host > 0 or req.cached_storage > 0:
            details: dict[str, Any] = {"device": req.cached_device, "host": req.cached_host}
            if req.cached_storage > 0 or backend is not None:
                details["storage"] = req.cached_storage
            if backend is not None:
                details["storage_backend"] = STORAGE_BACKEND_CLASS[backend]
            return details
        if req.cached_tokens > 0:
            return {"device": req.cached_tokens, "host": 0}
        return None

    def _sglext_field(self, body: dict[str, Any], req: Request) -> dict[str, Any]:
        sglext = self._sglext(body, req)
        return {"sglext": sglext} if sglext is not None else {}

    def _sglext(self, body: dict[str, Any], req: Request) -> dict[str, Any] | None:
        """The response-level ``sglext`` block: cached-token details when the request asks for them."""
        if body.get("return_cached_tokens_details") is not True:
            return None
        details = self._cached_details(req)
        return {"cached_tokens_details": details} if details is not None else None

    @staticmethod
    def _usage(reqs: list[Request], details: bool = True) -> dict[str, Any]:
        """One usage for the choices of one request: prompts counted once per distinct prompt (as SGLang)."""
        prompts = _distinct_prompts(reqs)
        return usage(
            sum(len(r.input_ids) for r in prompts),
            sum(len(r.output_ids) for r in reqs),
            sum(max(r.cached_tokens, 0) for r in prompts),
            details,
        )

    @staticmethod
    async def _sse(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        return resp

    @staticmethod
    async def _send(resp: web.StreamResponse, data: Any) -> None:
        payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
        await resp.write(f"data: {payload}\n\n".encode())

    # -- /generate ---------------------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await self._json(request)
        text, ids = body.get("text"), body.get("input_ids")
        if text is None and ids is None:
            raise ApiError(400, "Either text, input_ids or input_embeds should be provided.", "generate")
        prompts: list[list[int]]
        if ids is not None:  # input_ids win over text, as in SGLang
            if not isinstance(ids, list):
                raise validation_error("input_ids", "Input should be a valid list")
            batch = bool(ids) and isinstance(ids[0], list)
            if not ids or (batch and not all(ids)):
                raise ApiError(400, "input_ids cannot be empty.", "generate")
            items = ids if batch else [ids]
            if not all(isinstance(p, list) for p in items):
                raise validation_error("input_ids", "Input should be a valid list")
            prompts = [self._check_input_ids(p, "input_ids", "generate") for p in items]
        else:
            batch = isinstance(text, list)
            texts: list[Any] = text if isinstance(text, list) else [text]
            if not texts or not all(isinstance(t, str) for t in texts):
                raise validation_error("text", "Input should be a valid string")
            prompts = [self.tokenizer.encode_text(str(t)) for t in texts]
            if not all(prompts):
                raise ApiError(400, "input_ids cannot be empty.", "generate")
        params = body.get("sampling_params") or {}
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts) or not all(isinstance(p, dict) for p in params_list):
            raise validation_error("sampling_params", "Input should be a valid dictionary")
        max_new = []
        requested = [p.get("max_new_tokens") is not None for p in params_list]
        for p in params_list:
            value = p.get("max_new_tokens")
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                # SGLang parses sampling params in Rust: its serde message, as a bare string
                raise ApiError(400, f"invalid type: {type(value).__name__} {json.dumps(value)}, expected i64", "plain")
            max_new.append(self._max_tokens(value, "max_new_tokens", self.config.default_max_new_tokens, "generate"))
        salt = self._cache_salt(body)
        rid = body.get("rid") if isinstance(body.get("rid"), str) else None
        stream = bool(body.get("stream", False))
        if stream and batch:
            raise ApiError(400, "Streaming is not supported for batched /generate requests.", "generate")
        for p, n, asked in zip(prompts, max_new, requested):  # check all before queueing any
            self._check_length(p, "generate", n if asked else None)
        self._require_ready()
        rank = self._routed_rank(request, body, "generate")
        reqs = [
            self._rank_scheduler(rank).submit(p, n, salt, rid if not batch else None, stream)
            for p, n in zip(prompts, max_new)
        ]

        if not stream:
            await asyncio.gather(*(self._wait(r) for r in reqs))
            out = [
                {
                    "text": self.tokenizer.decode(r.output_ids),
                    "output_ids": list(r.output_ids),
                    "meta_info": meta_info(r, True, details=self._cached_details(r)),
                }
                for r in reqs
            ]
            return web.json_response(out if batch else out[0])

        req = reqs[0]
        resp = await self._sse(request)
        first = True
        async for _ in self._tokens(req):
            await self._send(
                resp,
                {
                    "text": self.tokenizer.decode(req.output_ids),
                    "output_ids": list(req.output_ids),
                    "meta_info": meta_info(req, req.finished, first, self._cached_details(req)),
                },
            )
            first = False
        if await self._stream_failed(resp, req):
            return resp
        if not req.output_ids or not req.finished:
            await self._send(
                resp,
                {
                    "text": self.tokenizer.decode(req.output_ids),
                    "output_ids": list(req.output_ids),
                    "meta_info": meta_info(req, True, details=self._cached_details(req)),
                },
            )
        await self._send(resp, "[DONE]")
        await resp.write_eof()
        return resp

    # -- OpenAI ------------------------------------------------------------------------------------
    def _completion_prompts(self, prompt: Any) -> list[list[int]]:
        """``prompt`` as SGLang's CompletionRequest accepts it: str, [str], [int] or [[int]]; one list per item."""
        if isinstance(prompt, str):
            items: list[Any] = [prompt]
        elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            items = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            items = prompt
        else:
            raise validation_error("prompt", "Input should be a valid string or list")
        out = []
        for item in items:
            if isinstance(item, str):
                ids = self.tokenizer.encode_text(item)
            elif isinstance(item, list) and item and all(type(t) is int for t in item):
                ids = self._check_input_ids(item, "prompt", "openai")
            else:
                raise validation_error("prompt", "Input should be a valid list of integers")
            if not ids:
                raise ApiError(400, "The prompt is empty.")
            out.append(ids)
        return out

    @staticmethod
    def _choices(body: dict[str, Any]) -> int:
        n = body.get("n", 1)
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise validation_error("n", "Input should be greater than or equal to 1")
        return n

    @staticmethod
    def _model(body: dict[str, Any]) -> str:
        model = body.get("model")
        return model if isinstance(model, str) else "default"

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._json(request)
        if "prompt" not in body:
            raise validation_error("prompt", "Field required")
        prompts = self._completion_prompts(body["prompt"])
        limit = body.get("max_tokens")
        if isinstance(limit, int) and not isinstance(limit, bool) and limit <= 0:
            raise validation_error("max_tokens", "Value error, max_tokens must be positive")
        max_new = self._max_tokens(limit, "max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS, "openai")
        n = self._choices(body)
        salt = self._cache_salt(body)
        for ids in prompts:  # max_tokens has a default here (16): always checked
            self._check_length(ids, "openai", max_new)
        stream = bool(body.get("stream"))
        rank = self._routed_rank(request, body, "completions")
        reqs = [self.submit(ids, max_new, salt, None, rank, stream) for ids in prompts for _ in range(n)]
        model = self._model(body)
        cid, created = uuid.uuid4().hex, int(time.time())

        def choice(index: int, text: str, finish: str | None) -> dict[str, Any]:
            return {"index": index, "text": text, "logprobs": None, "finish_reason": finish, "matched_stop": None}

        if not body.get("stream"):
            await asyncio.gather(*(self._wait(r) for r in reqs))
            return web.json_response(
                {
                    "id": cid,
                    "object": "text_completion",
                    "created": created,
                    "model": model,
                    "choices": [choice(i, self.tokenizer.decode(r.output_ids), "length") for i, r in enumerate(reqs)],
                    "usage": self._usage(reqs),
                    "metadata": {
                        "weight_version": "default",
                        "weight_versions": weight_versions(len(reqs[0].output_ids)),
                    },
                }
                | self._sglext_field(body, reqs[0])
            )

        def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
            return {
                "id": cid,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": choices,
                "usage": None,
            }

        resp = await self._sse(request)
        for index, req in enumerate(reqs):
            async for tokens in self._tokens(req):
                await self._send(resp, chunk([choice(index, self.tokenizer.decode(tokens), None)]))
            if await self._stream_failed(resp, req):
                return resp
            await self._send(resp, chunk([choice(index, "", "length")]))
        sglext = self._sglext(body, reqs[0])
        if sglext is not None:  # a chunk of its own, before the usage chunk
            await self._send(
                resp,
                {"id": cid, "object": "text_completion", "created": created, "model": model, "choices": []}
                | {"sglext": sglext},
            )
        if (body.get("stream_options") or {}).get("include_usage"):
            await self._send(
                resp,
                {
                    "id": cid,
                    "object": "text_completion",
                    "created": created,
                    "model": model,
                    "choices": [],
                    "usage": self._usage(reqs, details=False),
                },
            )
        await self._send(resp, "[DONE]")
        await resp.write_eof()
        return resp

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._json(request)
        messages = body.get("messages")
        if "messages" not in body:
            raise validation_error("messages", "Field required")
        if not isinstance(messages, list):
            raise validation_error("messages", "Input should be a valid list")
        if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise validation_error("messages", "Field required: role")
        if not messages:
            raise ApiError(400, "Messages cannot be empty.")
        tools = body.get("tools") if isinstance(body.get("tools"), list) else None
        try:
            input_ids = self.tokenizer.encode_chat(messages, tools)
        except ChatTemplateError as exc:
            raise ApiError(400, f"Cannot apply the chat template: {exc}") from None
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        max_new = self._max_tokens(limit, "max_tokens", self.config.default_max_new_tokens, "openai")
        n = self._choices(body)
        salt = self._cache_salt(body)
        asked = limit is not None
        self._check_length(input_ids, "openai", max_new if asked else None)
        rank = self._routed_rank(request, body, "chat")
        stream = bool(body.get("stream"))
        reqs = [self.submit(input_ids, max_new, salt, None, rank, stream, requested=asked) for _ in range(n)]
        model = self._model(body)
        cid, created = uuid.uuid4().hex, int(time.time())

        if not body.get("stream"):
            await asyncio.gather(*(self._wait(r) for r in reqs))
            return web.json_response(
                {
                    "id": cid,
                    "object": "chat.completion",
                    "created": created,
                    "model": model,
                    "choices": [
                        {
                            "index": i,
                            "message": {
                                "role": "assistant",
                                "content": self.tokenizer.decode(r.output_ids),
                                "reasoning_content": None,
                            },
                            "logprobs": None,
                            "finish_reason": "length",
                            "matched_stop": None,
                        }
                        for i, r in enumerate(reqs)
                    ],
                    "usage": self._usage(reqs),
                    "metadata": {
                        "weight_version": "default",
                        "weight_versions": weight_versions(len(reqs[0].output_ids)),
                    },
                }
                | self._sglext_field(body, reqs[0])
            )

        def chunk(index: int, delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
            return {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [
                    {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish, "matched_stop": None}
                ],
            }

        resp = await self._sse(request)
        for index, req in enumerate(reqs):
            first = True
            async for tokens in self._tokens(req):
                if first:  # SGLang names the role in a chunk of its own (empty content) before the first token
                    await self._send(
                        resp, chunk(index, {"reasoning_content": None, "role": "assistant", "content": ""}, None)
                    )
                    first = False
                delta = {"reasoning_content": None, "content": self.tokenizer.decode(tokens)}
                await self._send(resp, chunk(index, delta, None))
            if await self._stream_failed(resp, req):
                return resp
            await self._send(resp, chunk(index, {"reasoning_content": None}, "length"))
        sglext = self._sglext(body, reqs[0])
        if sglext is not None:  # SGLang sends it in a chunk of its own, before the usage chunk
            await self._send(
                resp,
                {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": []}
                | {"sglext": sglext},
            )
        if (body.get("stream_options") or {}).get("include_usage"):
            await self._send(
                resp,
                {
                    "id": cid,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": model,
                    "choices": [],
                    "usage": self._usage(reqs),
                },
            )
        await self._send(resp, "[DONE]")
        await resp.write_eof()
        return resp

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.config.model,
                        "object": "model",
                        "created": int(self.started_at),
                        "owned_by": "sglang",
                        "root": self.config.model,
                        "parent": None,
                        "max_model_len": self.config.context_length,
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
        if not self.ready or self.scheduler is None:
            return web.Response(status=503)
        scheduler = self.scheduler
        tic = time.monotonic()
        scheduler.probe_health()
        while time.monotonic() < tic + HEALTH_CHECK_TIMEOUT_S:
            await asyncio.sleep(HEALTH_POLL_S)
            if scheduler.last_output_at > tic:
                self.healthy = True
                return web.Response(status=200)
        self.healthy = False
        return web.Response(status=503)

    async def ready_check(self, request: web.Request) -> web.Response:
        """``/ready``: a flag, no work for the scheduler (200 once started, unless a /health check failed)."""
        return web.Response(status=200 if self.ready and self.healthy else 503)

    def kv_events_info(self) -> dict[str, Any] | None:
        cfg = self.config
        if not cfg.kv_events:
            return None
        return {
            "publisher": "zmq",
            "endpoint_host": cfg.kv_events_host,
            "endpoint_port_base": cfg.kv_events_port,
            "topic": cfg.kv_topic,
            "block_size": cfg.page_size,
            "dp_size": cfg.dp_size,
            "replay_endpoint_port_base": cfg.replay_port,
        }

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response(self.server_info_report())

    def server_info_report(self) -> dict[str, Any]:
        """The body of ``/server_info`` (also the gRPC ``GetServerInfo.server_args``).

        The server arguments a router, sgl-router, smg or a dashboard reads, under SGLang's names and types
        (the differential conformance test compares them with a real worker's), plus a ``simulator`` block.
        """
        cfg = self.config
        scheduler = self.scheduler
        kv_cfg = None
        if cfg.kv_events:
            kv_cfg = json.dumps(
                {
                    "publisher": "zmq",
                    "endpoint": f"tcp://{cfg.kv_events_host}:{cfg.kv_events_port}",
                    "topic": cfg.kv_topic,
                    "replay_endpoint": f"tcp://{cfg.kv_events_host}:{cfg.replay_port}",
                    "buffer_steps": cfg.kv_buffer_steps,
                }
            )
        load = scheduler.load() if scheduler else {}
        capacity = scheduler.capacity if scheduler else 0
        profile = self.profile
        graphs = dict.fromkeys(GRAPH_PHASES, 0.0)
        return {
            "model_path": cfg.model,
            "tokenizer_path": self.tokenizer_path,
            "served_model_name": cfg.model,
            "host": cfg.host,
            "port": self.bound_port or cfg.port,
            "skip_tokenizer_init": False,
            "is_embedding": False,
            "dtype": "bfloat16",
            "kv_cache_dtype": "auto",
            "device": "cuda",
            "context_length": cfg.context_length,
            "page_size": cfg.page_size,
            "chunked_prefill_size": cfg.chunked_prefill_size,
            "max_prefill_tokens": cfg.max_prefill_tokens,
            "max_running_requests": cfg.max_running_requests,
            "max_total_tokens": cfg.capacity_tokens,
            "schedule_policy": cfg.schedule_policy,
            "random_seed": cfg.seed,
            "tp_size": profile.num_gpus,
            "pp_size": 1,
            "dp_size": cfg.dp_size,
            "load_balance_method": "round_robin",
            "enable_dp_attention": False,
            "disable_radix_cache": False,
            "speculative_algorithm": None,
            "disaggregation_mode": "null",
            "enable_metrics": True,
            "enable_cache_report": True,
            "kv_events_config": kv_cfg,
            "max_total_num_tokens": capacity,
            "status": "ready" if self.ready else "starting",
            **self.hicache_info(),
            "internal_states": [
                {
                    "effective_max_running_requests_per_dp": cfg.max_running_requests,
                    "last_gen_throughput": load.get("gen_throughput", 0.0),
                    "memory_usage": {
                        "weight": profile.weight_gb,
                        "kvcache": load.get("memory", {}).get("kv_cache_gb", 0.0),
                        "startup_available": 0.0,
                        "token_capacity": capacity,
                        "token_capacity_swa": None,
                        "graph": {**graphs, "decode": profile.graph_gb},
                    },
                }
            ],
            "version": SGLANG_VERSION,
            "kv_events": self.kv_events_info(),
            "simulator": {
                "profile": cfg.profile,
                "speedup": cfg.speedup,
                "seed": cfg.seed,
                "event_format": cfg.event_format,
                "replay_format": cfg.replay_format,
                # Simulated GPU seconds spent so far, all ranks (what a fleet's compute costs; no SGLang field).
                "busy_seconds": {
                    "prefill": sum(s.stats.busy_prefill_s for s in self.schedulers),
                    "decode": sum(s.stats.busy_decode_s for s in self.schedulers),
                },
                "host_pool_tokens": self.host_tokens,
            },
        }

    def hicache_info(self) -> dict[str, Any]:
        """The HiCache server args as SGLang 0.5.23 reports them, and its L3 layout block."""
        cfg = self.config
        reason = (
            "Hierarchical cache is disabled"
            if not cfg.enable_hierarchical_cache
            else "Mooncake storage is not attached"
        )
        return {
            "enable_hierarchical_cache": cfg.enable_hierarchical_cache,
            "hicache_host_memory_mode": "cache",
            "hicache_ratio": cfg.hicache_ratio,
            "hicache_size": cfg.hicache_size,
            "hicache_write_policy": cfg.hicache_write_policy,
            "hicache_io_backend": cfg.hicache_io_backend,
            "hicache_mem_layout": cfg.hicache_mem_layout,
            "hicache_storage_backend": cfg.hicache_storage_backend,
            "hicache_storage_prefetch_policy": cfg.hicache_storage_prefetch_policy,
            "hicache_storage_backend_extra_config": cfg.hicache_storage_backend_extra_config,
            "hicache_storage_prefetch_retry_poll_interval": 8,
            "hicache_storage_prefetch_retry_max_attempts": 8,
            "hicache_host_memory_fraction": 0.8 if cfg.hicache_size == 0 else None,
            "file_storage_path": cfg.file_storage_path,
            "hicache_object_layout": {
                "enabled": False,
                "backend": cfg.hicache_storage_backend if cfg.enable_hierarchical_cache else None,
                "page_size": cfg.page_size,
                "hicache_object_layout": {"pools": []},
                "reason": reason,
            },
        }

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response(self.model_info_report())

    def model_info_report(self) -> dict[str, Any]:
        """The body of ``/model_info`` (the gRPC ``GetModelInfo`` carries the same fields)."""
        return model_info(self.config.model, self.tokenizer_path)

    async def loads(self, request: web.Request) -> web.Response:
        """``/v1/loads`` as 0.5.23 serves it: one entry per DP rank, ``include`` sections, ``dp_rank`` filter."""
        scheduler = self._require_ready()
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
        report = self.loads_report(sections, dp_rank)
        if request.query.get("format") == "prometheus":
            return web.Response(
                text=self._loads_prometheus(report["loads"]), content_type="text/plain", charset="utf-8"
            )
        return web.json_response(report)

    def loads_report(self, sections: set[str] | None = None, dp_rank: int | None = None) -> dict[str, Any]:
        """The body of ``/v1/loads``; the gRPC ``GetLoads`` is built from it, so the two always agree."""
        self._require_ready()
        loads = [load for load in (s.load() for s in self.schedulers) if dp_rank is None or load["dp_rank"] == dp_rank]
        return {
            "timestamp": datetime.now(timezone.utc).isoformat(),
            "version": SGLANG_VERSION,
            "accelerator": self.profile.gpu_name,
            "num_accelerators": self.profile.num_gpus,
            "loads": [self._load_sections(load, sections) for load in loads],
        }

    @staticmethod
    def _load_sections(load: dict[str, Any], sections: set[str] | None) -> dict[str, Any]:
        """``LoadSnapshot.to_dict``: the flat keys always, the sections asked for (all by default)."""
        if sections is None or "all" in sections:
            return load
        keep = {LOAD_SECTIONS[s] for s in sections if s in LOAD_SECTIONS}
        return {k: v for k, v in load.items() if not isinstance(v, dict) or k in keep}

    @staticmethod
    def _loads_prometheus(loads: list[dict[str, Any]]) -> str:
        """``format=prometheus``: one gauge per number, ``sglang_<key>`` or ``sglang_<section>_<key>``."""
        prefixes = {"speculative": "spec", "disaggregation": "disagg"}
        samples: dict[str, list[tuple[int, float]]] = {}
        for load in loads:
            rank = load["dp_rank"]
            for key, value in load.items():
                if key == "dp_rank":
                    continue
                if isinstance(value, dict):
                    for sub, sub_value in value.items():
                        if isinstance(sub_value, (int, float)) and not isinstance(sub_value, bool):
                            samples.setdefault(f"sglang_{prefixes.get(key, key)}_{sub}", []).append((rank, sub_value))
                elif isinstance(value, (int, float)) and not isinstance(value, bool):
                    samples.setdefault(f"sglang_{key}", []).append((rank, value))
        lines = []
        for name, values in samples.items():
            lines.append(f"# TYPE {name} gauge")
            lines.extend(f'{name}{{dp_rank="{rank}"}} {value}' for rank, value in values)
        return "\n".join(lines) + "\n"

    async def metrics(self, request: web.Request) -> web.Response:
        scheduler = self._require_ready()
        return web.Response(
            text=render_metrics(scheduler, self.config.model, self.http_stats),
            content_type="text/plain",
            charset="utf-8",
        )

    async def flush_cache(self, request: web.Request) -> web.Response:
        if request.method not in ("GET", "POST"):
            raise ApiError(405, "Method Not Allowed", "detail")
        self._require_ready()
        if all(s.idle for s in self.schedulers) and all([s.flush_cache() for s in self.schedulers]):  # noqa: C419 (flush every rank)
            return web.Response(
                text="Cache flushed.\nPlease check backend logs for more details. "
                "(When there are running or waiting requests, the operation will not be performed.)\n"
            )
        return web.Response(status=400, text="Flush cache failed.\n")

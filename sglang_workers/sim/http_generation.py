"""The three generation APIs of a simulated worker, as SGLang 0.5.23 serves them, streaming or not.

Native ``/generate`` (single or batched prompts, text or ids), the OpenAI ``/v1/completions`` and
``/v1/chat/completions``: SSE streams end in ``data: [DONE]``, ``usage`` carries
``prompt_tokens_details.cached_tokens`` as under ``--enable-cache-report``, and ``sglext`` the cached-token
details by tier when asked for. A client that goes away aborts its request in the scheduler.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from prefix_common.tokenization import ChatTemplateError

from .disaggregation import bootstrap_fields
from .http_validation import (
    Api,
    cache_salt,
    check_input_ids,
    choices,
    completion_prompts,
    max_tokens,
    model_name,
    read_json,
    routed_rank,
    validation_error,
)
from .request import Request
from .responses import ApiError, finish_reason_name, meta_info, usage, weight_versions
from .worker import SimWorker

__all__ = ["GenerationApi"]

STORAGE_BACKEND_CLASS = {"file": "HiCacheFile"}  # what cached_tokens_details.storage_backend names
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's (and SGLang's) default for /v1/completions


def _distinct_prompts(reqs: list[Request]) -> list[Request]:
    """One request per prompt (``n`` choices of one prompt share it): SGLang counts prompt tokens once."""
    seen: dict[tuple[int, ...], Request] = {}
    for req in reqs:
        seen.setdefault(tuple(req.input_ids), req)
    return list(seen.values())


class GenerationApi:
    """``/generate``, ``/v1/completions`` and ``/v1/chat/completions`` over one :class:`SimWorker`."""

    def __init__(self, worker: SimWorker) -> None:
        self.worker = worker
        self.tokenizer = worker.tokenizer

    @staticmethod
    def _rid(body: dict[str, Any], count: int) -> str | None:
        """The client's ``rid`` (what ``/abort_request`` names), for a request of one choice."""
        rid = body.get("rid")
        return rid if isinstance(rid, str) and count == 1 else None

    def _rank(self, request: web.Request, body: dict[str, Any], api: Api) -> int | None:
        return routed_rank(request, body, api, len(self.worker.schedulers), self.worker.header_overrides)

    async def _tokens(self, req: Request) -> AsyncIterator[list[int]]:
        """The request's tokens as the scheduler produces them; aborts it if the client goes away."""
        try:
            while True:
                item = await req.updates.get()
                if item is None:
                    return
                yield item
        finally:  # also runs when the handler stops early (client gone, write failed, cancelled)
            if not req.finished and self.worker.schedulers:
                if self.worker.disaggregation is not None:  # still waiting for its PD hand-off
                    self.worker.disaggregation.drop(req)
                self.worker.schedulers[req.dp_rank].abort(req)

    async def _wait(self, req: Request) -> None:
        async for _ in self._tokens(req):
            pass
        if req.error is not None and req.pd_failure:  # an HTTPException(500): SGLang's handler shapes it so
            raise ApiError(500, req.error, "openai", err_type="500")
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

    def _whole_response(
        self, head: dict[str, Any], choices: list[dict[str, Any]], body: dict[str, Any], reqs: list[Request]
    ) -> web.Response:
        """A whole (not streamed) OpenAI response as SGLang sends it: ``head`` (id, object, created, model), the
        choices, their usage, the weight versions, and ``sglext`` when the request asks for it."""
        metadata = {"weight_version": "default", "weight_versions": weight_versions(len(reqs[0].output_ids))}
        whole = head | {"choices": choices, "usage": self._usage(reqs), "metadata": metadata}
        return web.json_response(whole | self._sglext_field(body, reqs[0]))

    async def _end_openai_stream(
        self,
        resp: web.StreamResponse,
        head: dict[str, Any],
        body: dict[str, Any],
        reqs: list[Request],
        usage_details: bool,
    ) -> web.StreamResponse:
        """The end of an OpenAI stream as SGLang sends it: ``sglext`` in a chunk of its own, then the usage chunk
        (``stream_options.include_usage``), then ``[DONE]``. ``head``: the chunks' id, object, created, model."""
        sglext = self._sglext(body, reqs[0])
        if sglext is not None:
            await self._send(resp, head | {"choices": [], "sglext": sglext})
        if (body.get("stream_options") or {}).get("include_usage"):
            await self._send(resp, head | {"choices": [], "usage": self._usage(reqs, details=usage_details)})
        await self._send(resp, "[DONE]")
        await resp.write_eof()
        return resp

    def _cached_details(self, req: Request) -> dict[str, Any] | None:
        """SGLang's ``get_cached_tokens_details``: cached tokens by tier (None when nothing was cached)."""
        backend = self.worker.config.hicache_storage_backend
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

    def _generate_prompts(self, body: dict[str, Any]) -> tuple[list[list[int]], bool]:
        """``/generate``'s prompts as token ids (``input_ids`` win over ``text``, as in SGLang) and whether batched."""
        text, ids = body.get("text"), body.get("input_ids")
        if text is None and ids is None:
            raise ApiError(400, "Either text, input_ids or input_embeds should be provided.", "generate")
        if ids is not None:
            if not isinstance(ids, list):
                raise validation_error("input_ids", "Input should be a valid list")
            batch = bool(ids) and isinstance(ids[0], list)
            if not ids or (batch and not all(ids)):
                raise ApiError(400, "input_ids cannot be empty.", "generate")
            items = ids if batch else [ids]
            if not all(isinstance(p, list) for p in items):
                raise validation_error("input_ids", "Input should be a valid list")
            return [check_input_ids(p, "input_ids", "generate") for p in items], batch
        texts: list[Any] = text if isinstance(text, list) else [text]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise validation_error("text", "Input should be a valid string")
        prompts = [self.tokenizer.encode_text(str(t)) for t in texts]
        if not all(prompts):
            raise ApiError(400, "input_ids cannot be empty.", "generate")
        return prompts, isinstance(text, list)

    # -- /generate ---------------------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await read_json(request)
        prompts, batch = self._generate_prompts(body)
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
            max_new.append(max_tokens(value, "max_new_tokens", self.worker.config.default_max_new_tokens, "generate"))
        salt = cache_salt(body)
        rid = body.get("rid") if isinstance(body.get("rid"), str) else None
        stream = bool(body.get("stream", False))
        if stream and batch:
            raise ApiError(400, "Streaming is not supported for batched /generate requests.", "generate")
        for p, n, asked in zip(prompts, max_new, requested):  # check all before queueing any
            self.worker.check_length(p, "generate", n if asked else None)
        self.worker.require_ready()
        rank = self._rank(request, body, "generate")
        boots = bootstrap_fields(body, len(prompts))
        reqs = [
            self.worker.enqueue(
                self.worker.rank_scheduler(rank), p, n, salt, rid if not batch else None, stream, "generate", b
            )
            for p, n, b in zip(prompts, max_new, boots)
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

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await read_json(request)
        if "prompt" not in body:
            raise validation_error("prompt", "Field required")
        prompts = completion_prompts(self.tokenizer, body["prompt"])
        limit = body.get("max_tokens")
        if isinstance(limit, int) and not isinstance(limit, bool) and limit <= 0:
            raise validation_error("max_tokens", "Value error, max_tokens must be positive")
        max_new = max_tokens(limit, "max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS, "openai")
        n = choices(body)
        salt = cache_salt(body)
        for ids in prompts:  # max_tokens has a default here (16): always checked
            self.worker.check_length(ids, "openai", max_new)
        stream = bool(body.get("stream"))
        rank = self._rank(request, body, "completions")
        count = len(prompts) * n
        rid, boots = self._rid(body, count), bootstrap_fields(body, count)
        reqs = [
            self.worker.submit(ids, max_new, salt, rid, rank, stream, bootstrap=boots[i * n + j])
            for i, ids in enumerate(prompts)
            for j in range(n)
        ]
        model = model_name(body)
        cid, created = uuid.uuid4().hex, int(time.time())

        def choice(index: int, text: str, finish: str | None) -> dict[str, Any]:
            return {"index": index, "text": text, "logprobs": None, "finish_reason": finish, "matched_stop": None}

        head: dict[str, Any] = {"id": cid, "object": "text_completion", "created": created, "model": model}
        if not body.get("stream"):
            await asyncio.gather(*(self._wait(r) for r in reqs))
            texts = [choice(i, self.tokenizer.decode(r.output_ids), finish_reason_name(r)) for i, r in enumerate(reqs)]
            return self._whole_response(head, texts, body, reqs)

        def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
            return head | {"choices": choices, "usage": None}

        resp = await self._sse(request)
        for index, req in enumerate(reqs):
            async for tokens in self._tokens(req):
                await self._send(resp, chunk([choice(index, self.tokenizer.decode(tokens), None)]))
            if await self._stream_failed(resp, req):
                return resp
            await self._send(resp, chunk([choice(index, "", finish_reason_name(req))]))
        return await self._end_openai_stream(resp, head, body, reqs, usage_details=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await read_json(request)
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
        max_new = max_tokens(limit, "max_tokens", self.worker.config.default_max_new_tokens, "openai")
        n = choices(body)
        salt = cache_salt(body)
        asked = limit is not None
        self.worker.check_length(input_ids, "openai", max_new if asked else None)
        rank = self._rank(request, body, "chat")
        stream = bool(body.get("stream"))
        rid, boots = self._rid(body, n), bootstrap_fields(body, n)
        reqs = [
            self.worker.submit(input_ids, max_new, salt, rid, rank, stream, requested=asked, bootstrap=boots[i])
            for i in range(n)
        ]
        model = model_name(body)
        cid, created = uuid.uuid4().hex, int(time.time())

        if not body.get("stream"):
            await asyncio.gather(*(self._wait(r) for r in reqs))
            messages = [
                {
                    "index": i,
                    "message": {
                        "role": "assistant",
                        "content": self.tokenizer.decode(r.output_ids),
                        "reasoning_content": None,
                    },
                    "logprobs": None,
                    "finish_reason": finish_reason_name(r),
                    "matched_stop": None,
                }
                for i, r in enumerate(reqs)
            ]
            whole = {"id": cid, "object": "chat.completion", "created": created, "model": model}
            return self._whole_response(whole, messages, body, reqs)

        head: dict[str, Any] = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model}

        def chunk(index: int, delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish, "matched_stop": None}
            return head | {"choices": [choice]}

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
            await self._send(resp, chunk(index, {"reasoning_content": None}, finish_reason_name(req)))
        return await self._end_openai_stream(resp, head, body, reqs, usage_details=True)

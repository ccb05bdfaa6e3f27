"""The thinnest gateway that puts Dynamo's real KV router in front of the bench's workers.

Dynamo 1.6.1's ``python -m dynamo.select_service`` (PyPI ``ai-dynamo-runtime``) is its KV router
without the Dynamo runtime: it subscribes to each worker's ZMQ KV events itself (its own indexer), and
answers ``POST /select_and_reserve`` with the worker its cost function picks, booking the request's
load; the caller reports ``prefill_complete`` at the first streamed token and ``DELETE``s the
reservation at the end. It forwards nothing, so this proxy does the rest, per request:

1. parse the body and tokenize it as the workers do (this project's tokenizer and chat template,
   the same ids the workers compute);
2. hash its full blocks with Dynamo's own ``compute_block_hash_for_seq`` (the hashes its indexer
   derives from the events' token ids), and chain them into sequence hashes for the booking;
3. ``select_and_reserve``, forward to the chosen worker, stream the answer back with
   ``x-upstream-host`` set, then ``prefill_complete`` and ``DELETE``.

Selection uses the router's defaults (its documented recommended settings): nothing is tuned here.
The ``dynamo`` contender (``fleet/dynamo.py``) starts it as a child process
(``python -m benchmarks.fleet.dynamo_proxy``); it is not a command of its own.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
from collections.abc import Sequence
from typing import Any

import aiohttp
import xxhash
from aiohttp import web

from benchmarks.client import UPSTREAM_HEADER
from extproc.decision.key_cache import KeyCache
from extproc.decision.prompt import PromptPreparer
from extproc.decision.request import RequestError, generation_kind, parse_request

__all__ = ["main", "sequence_hashes"]

MODEL_GROUP = "default"


def _signed(value: int) -> int:
    """A 64-bit hash as the service's JSON wants it (i64, two's complement)."""
    value &= 2**64 - 1
    return value - 2**64 if value >= 2**63 else value


def sequence_hashes(block_hashes: Sequence[int]) -> list[int]:
    """Chained identities of the prompt's prefixes (what Dynamo books active load by); signed 64-bit."""
    out, parent = [], 0
    for block in block_hashes:
        parent = xxhash.xxh3_64_intdigest(parent.to_bytes(8, "little") + (block & (2**64 - 1)).to_bytes(8, "little"))
        out.append(_signed(parent))
    return out


class DynamoProxy:
    def __init__(self, select_url: str, workers: dict[int, str], block_size: int, model: str) -> None:
        from dynamo.llm import compute_block_hash_for_seq

        self._hash = compute_block_hash_for_seq
        self.select_url = select_url.rstrip("/")
        self.workers = workers
        self.block_size = block_size
        self.model = model
        self.prompts = PromptPreparer([], KeyCache(1 << 20), 1 << 20, True, False)
        self._ids = itertools.count()
        self._http: aiohttp.ClientSession | None = None

    async def start(self, app: web.Application) -> None:
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))

    async def close(self, app: web.Application) -> None:
        if self._http is not None:
            await self._http.close()

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def handle(self, request: web.Request) -> web.StreamResponse:
        kind = generation_kind(request.method, request.path)
        body = await request.read()
        if kind is None:
            return web.json_response({"error": f"not a generation route: {request.path}"}, status=404)
        try:
            parsed = parse_request(kind, request.path, body, {k.lower(): v for k, v in request.headers.items()})
        except RequestError as exc:
            return web.json_response({"error": {"message": exc.message, "type": exc.type}}, status=exc.status)
        prompt = self.prompts.prepare(parsed, set())
        tokens = (prompt.tokens if prompt is not None else None) or []
        blocks = [_signed(int(h)) for h in self._hash(list(tokens), self.block_size)] if tokens else []
        selection_id = f"bench-{next(self._ids)}"
        assert self._http is not None
        choice = await self._post(
            "/select_and_reserve",
            {
                "selection_id": selection_id,
                "model_name": self.model,
                "routing_group": MODEL_GROUP,
                "block_hashes": blocks,
                "sequence_hashes": sequence_hashes(blocks),
                "isl_tokens": len(tokens),
            },
        )
        if choice is None or int(choice.get("worker_id", -1)) not in self.workers:
            return web.json_response({"error": f"dynamo selection failed: {choice}"}, status=503)
        url = self.workers[int(choice["worker_id"])]
        first = True
        try:
            headers = {"content-type": request.headers.get("content-type", "application/json")}
            async with self._http.post(url + request.path, data=body, headers=headers) as upstream:
                response = web.StreamResponse(status=upstream.status)
                response.content_type = upstream.content_type
                response.headers[UPSTREAM_HEADER] = url.split("://", 1)[-1]
                await response.prepare(request)
                async for chunk in upstream.content.iter_any():
                    if first:
                        first = False
                        await self._post(f"/reservations/{selection_id}/prefill_complete", None)
                    await response.write(chunk)
                await response.write_eof()
                return response
        finally:
            await self._delete(f"/reservations/{selection_id}")

    async def _post(self, path: str, payload: dict[str, Any] | None) -> dict[str, Any] | None:
        assert self._http is not None
        try:
            async with self._http.post(self.select_url + path, json=payload) as resp:
                data = await resp.json(content_type=None) if resp.status < 300 else None
                return data if isinstance(data, dict) else None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return None

    async def _delete(self, path: str) -> None:
        assert self._http is not None
        try:
            async with self._http.delete(self.select_url + path) as resp:
                await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            pass


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--select-url", required=True, help="Base URL of dynamo.select_service.")
    parser.add_argument("--worker", action="append", default=[], metavar="ID=URL", help="A worker (repeatable).")
    parser.add_argument("--block-size", type=int, default=16, help="The workers' KV page size.")
    parser.add_argument("--model", default="default", help="Model name the workers were registered under.")
    args = parser.parse_args(argv)
    workers = {}
    for item in args.worker:
        wid, _, url = item.partition("=")
        if not wid.isdigit() or not url:
            parser.error(f"--worker wants ID=URL with a numeric id, not {item!r}")
        workers[int(wid)] = url.rstrip("/")
    proxy = DynamoProxy(args.select_url, workers, args.block_size, args.model)
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.on_startup.append(proxy.start)
    app.on_cleanup.append(proxy.close)
    app.router.add_get("/health", proxy.health)
    app.router.add_route("POST", "/{tail:.*}", proxy.handle)
    web.run_app(app, host="127.0.0.1", port=args.port, print=None)
    return 0


if __name__ == "__main__":  # the child process the dynamo contender starts
    sys.exit(main())

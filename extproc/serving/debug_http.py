"""The debug endpoints on the metrics port, read-only: a page, the fleet, the last decisions, an explained prompt.

- ``GET /debug/``: one self-contained HTML page (``debug_page.html``, no external assets) that draws
  the fleet and the recent decisions from the JSON below and explains a pasted request body.
- ``GET /debug/workers``: each worker's health, load, learned costs and cached blocks by tier.
- ``GET /debug/decisions?limit=N``: the last decisions (``debug.decisions`` are kept), newest first.
- ``POST /debug/explain?path=/v1/chat/completions``: the body a client would send; each worker's
  matched prefix and figures and the worker the policy would choose, without routing it.

Access: with ``debug.token`` set, every JSON endpoint wants ``Authorization: Bearer <token>`` (401
otherwise). Without one they answer only while the metrics port is bound to loopback; on any other
bind they answer 403 saying how to turn them on. The page itself holds no data and is always served
(it reads a token from its URL's ``#token=`` fragment, which never leaves the browser). Every error is
JSON in the OpenAI shape, with a status that says what was wrong; never a stack trace.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable
from importlib import resources

import orjson
from aiohttp import web

from extproc.decision.pipeline import NoWorkerError
from extproc.decision.request import GENERATION_PATHS, RequestError, parse_request
from extproc.exchange.response import error_body
from extproc.serving.debug_view import RouterParts, decisions_view, explain_view, workers_view
from prefix_common.addresses import is_loopback

__all__ = ["DebugRoutes"]

log = logging.getLogger(__name__)

PREFIX = "/debug"
_PAGE = "debug_page.html"
_JSON = "application/json"
# Request headers an explained body is not given (they are the debug request's own, not a client's).
_OWN_HEADERS = frozenset({"authorization", "cookie", "host", "content-length", "content-type", "x-request-id"})

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=error_body(status, message), content_type=_JSON, headers=headers)


def _json(data: object) -> web.Response:
    return web.Response(body=orjson.dumps(data, option=orjson.OPT_NON_STR_KEYS), content_type=_JSON)


class DebugRoutes:
    """The ``/debug`` routes over one router's parts (a ``RouterApp``), added to the metrics port's application."""

    def __init__(self, app: RouterParts, bind_host: str) -> None:
        self.app = app
        self.token = app.config.debug.token
        self.open = self.token is None and is_loopback(bind_host)
        self.bind_host = bind_host
        self.max_body_bytes = app.config.server.max_body_bytes

    def install(self, web_app: web.Application) -> None:
        web_app.middlewares.append(self._guard)
        router = web_app.router
        router.add_get(PREFIX, self._page)
        router.add_get(PREFIX + "/", self._page)
        router.add_get(PREFIX + "/workers", self._workers)
        router.add_get(PREFIX + "/decisions", self._decisions)
        router.add_post(PREFIX + "/explain", self._explain)

    # -- access and errors ---------------------------------------------------------------------------
    @web.middleware
    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Debug paths: access checked (the page excepted), every failure a JSON error."""
        path = request.path
        if path != PREFIX and not path.startswith(PREFIX + "/"):
            return await handler(request)
        if path not in (PREFIX, PREFIX + "/"):
            refused = self._refusal(request)
            if refused is not None:
                return refused
        try:
            return await handler(request)
        except web.HTTPNotFound:
            return _error(
                404,
                f"no debug endpoint {path}: GET {PREFIX}/, {PREFIX}/workers, {PREFIX}/decisions; POST {PREFIX}/explain",
            )
        except web.HTTPException as exc:  # aiohttp's own (405, ...): the same shape as ours
            allow = exc.headers.get("Allow")
            return _error(exc.status, f"{request.method} {path}: {exc.reason}", {"Allow": allow} if allow else None)
        except Exception:
            log.exception("debug endpoint %s failed", path)
            return _error(500, f"the router failed to answer {path}; its log has the details")

    def _refusal(self, request: web.Request) -> web.Response | None:
        if self.token is not None:
            given = request.headers.get("Authorization", "")
            scheme, _, value = given.partition(" ")
            if scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), self.token.encode()):
                return None
            return _error(
                401,
                "the debug endpoints need 'Authorization: Bearer <token>' with the router's debug.token",
                {"WWW-Authenticate": 'Bearer realm="prefix-router debug"'},
            )
        if self.open:
            return None
        return _error(
            403,
            f"the debug endpoints are off: the metrics port listens on {self.bind_host}, not loopback, and no "
            "debug.token is set. Set debug.token in the config (or PREFIX_ROUTER_DEBUG__TOKEN) and send "
            "'Authorization: Bearer <token>'; or bind the metrics port to 127.0.0.1.",
        )

    # -- the endpoints -------------------------------------------------------------------------------
    async def _page(self, request: web.Request) -> web.Response:
        if request.path == PREFIX:  # the page reads its JSON by relative paths, from /debug/
            return web.Response(status=301, headers={"Location": PREFIX + "/"})
        page = resources.files("extproc.serving").joinpath(_PAGE).read_bytes()
        return web.Response(body=page, content_type="text/html", charset="utf-8")

    async def _workers(self, request: web.Request) -> web.Response:
        return _json(workers_view(self.app))

    async def _decisions(self, request: web.Request) -> web.Response:
        raw = request.query.get("limit")
        limit: int | None = None
        if raw is not None:
            if not raw.isdigit() or int(raw) < 1:
                return _error(400, f"limit must be a positive whole number, not {raw!r}")
            limit = int(raw)
        return _json(decisions_view(self.app, limit))

    async def _explain(self, request: web.Request) -> web.Response:
        path = request.query.get("path", "/v1/chat/completions")
        kind = GENERATION_PATHS.get(path)
        if kind is None:
            known = ", ".join(GENERATION_PATHS)
            return _error(400, f"cannot explain path {path!r}: give ?path= one of {known}")
        body = await self._body(request)
        if body is None:
            return _error(413, f"request body is over {self.max_body_bytes} bytes (server.max_body_bytes)")
        headers = {k.lower(): v for k, v in request.headers.items() if k.lower() not in _OWN_HEADERS}
        try:
            parsed = parse_request(kind, path, body, headers, self.max_body_bytes)
            explained = await self.app.router.explain(parsed)
        except RequestError as exc:
            return _error(exc.status, exc.message)
        except NoWorkerError as exc:
            return _error(503, str(exc))
        return _json(explain_view(self.app, explained))

    async def _body(self, request: web.Request) -> bytes | None:
        """The body, or None past ``max_body_bytes`` (read no further than that)."""
        length = request.content_length
        if length is not None and length > self.max_body_bytes:
            return None
        body = bytearray()
        async for chunk in request.content.iter_chunked(64 * 1024):
            body += chunk
            if len(body) > self.max_body_bytes:
                return None
        return bytes(body)

"""Open-loop load generator: streamed chat completions sent on a fixed schedule.

Open loop means a request is sent at its scheduled time whether or not earlier ones finished, so a
slow gateway faces the same offered load as a fast one and queueing shows up in its latencies
(a closed loop would hide it by slowing down the sender). Bodies are serialized before the clock
starts, so the client spends its CPU on sockets, not on JSON, while the run is timed.

TTFT is the time from sending the request to the first chunk that carries content, the definition
SGLang's bench_serving uses; prompt, cached and output token counts come from the final ``usage``
chunk (``stream_options.include_usage``), as the workers report them.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aiohttp

from benchmarks.metrics import RequestResult
from benchmarks.workloads.base import BenchRequest, prefix_hash

__all__ = ["PREFIX_HEADER", "UPSTREAM_HEADER", "ClientOptions", "LatencyProbe", "run_load"]

PREFIX_HEADER = "x-prefix-hash"  # ring-hash key, computed by the client from the prompt's first characters
UPSTREAM_HEADER = "x-upstream-host"  # the worker that served the request, when the gateway reports it
SESSION_HEADER = "x-session-id"


@dataclass(frozen=True)
class ClientOptions:
    model: str = "default"
    request_timeout_s: float = 600.0
    prefix_chars: int = 8192  # characters hashed into PREFIX_HEADER


@dataclass(frozen=True)
class _Prepared:
    request: BenchRequest
    body: bytes
    headers: dict[str, str]


def prepare(requests: Sequence[BenchRequest], options: ClientOptions) -> list[_Prepared]:
    """Serialize every body and header once; all contenders then send exactly these bytes."""
    out = []
    for r in requests:
        body = {
            "model": options.model,
            "messages": r.messages,
            "max_tokens": r.max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
        }
        headers = {
            "content-type": "application/json",
            PREFIX_HEADER: prefix_hash(r.prompt_chars(), options.prefix_chars),
        }
        if r.session:
            headers[SESSION_HEADER] = r.session
        out.append(_Prepared(r, json.dumps(body).encode(), headers))
    return out


async def _send(
    session: aiohttp.ClientSession, url: str, item: _Prepared, t0: float, timeout: aiohttp.ClientTimeout
) -> RequestResult:
    sent = time.perf_counter()
    result = RequestResult(index=item.request.index, sent_s=sent - t0)
    chunks = 0
    try:
        async with session.post(url, data=item.body, headers=item.headers, timeout=timeout) as resp:
            result.upstream = resp.headers.get(UPSTREAM_HEADER)
            if resp.status != 200:
                text = (await resp.text())[:200].replace("\n", " ")
                result.error = f"HTTP {resp.status}: {text}"
                return result
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = f"stream error: {str(event['error'])[:200]}"
                    break
                for choice in event.get("choices") or ():
                    if (choice.get("delta") or {}).get("content"):
                        chunks += 1
                        if result.ttft_s is None:
                            result.ttft_s = time.perf_counter() - sent
                usage = event.get("usage")
                if usage:
                    result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    result.output_tokens = int(usage.get("completion_tokens") or 0)
                    details = usage.get("prompt_tokens_details") or {}
                    result.cached_tokens = int(details.get("cached_tokens") or 0)
        result.e2e_s = time.perf_counter() - sent
        if result.error is None and result.ttft_s is None:
            result.error = "no content in the response stream"
        if not result.output_tokens:
            result.output_tokens = chunks
    except asyncio.TimeoutError:
        result.error = f"timeout after {timeout.total:.0f} s"
    except (aiohttp.ClientError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {str(exc)[:200]}"
    return result


async def run_load(
    base_url: str,
    requests: Sequence[BenchRequest],
    options: ClientOptions,
    on_done: Callable[[RequestResult], None] | None = None,
) -> list[RequestResult]:
    """Send ``requests`` to ``base_url`` at their arrival times; results in request order."""
    prepared = prepare(requests, options)
    url = base_url.rstrip("/") + "/v1/chat/completions"
    timeout = aiohttp.ClientTimeout(total=options.request_timeout_s)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as session:
        t0 = time.perf_counter()

        async def one(item: _Prepared) -> RequestResult:
            delay = item.request.arrival_s - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            result = await _send(session, url, item, t0, timeout)
            if on_done is not None:
                on_done(result)
            return result

        return list(await asyncio.gather(*(one(p) for p in prepared)))


async def _timed_post(session: aiohttp.ClientSession, url: str, body: bytes) -> float:
    start = time.perf_counter()
    async with session.post(url, data=body, headers={"content-type": "application/json"}) as resp:
        payload = await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{url} answered {resp.status}: {payload[:200]!r}")
    return time.perf_counter() - start


class LatencyProbe:
    """Closed-loop load on each of several gateways (the overhead suite's requests per second)."""

    def __init__(self, base_urls: dict[str, str]) -> None:
        self.urls = {name: url.rstrip("/") + "/v1/chat/completions" for name, url in base_urls.items()}
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> LatencyProbe:
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()

    async def throughput(self, name: str, bodies: Sequence[bytes], concurrency: int, duration_s: float) -> float:
        """Completed requests per second with ``concurrency`` requests always in flight (closed loop)."""
        assert self._session is not None
        session, url = self._session, self.urls[name]
        done = 0
        stop_at = time.perf_counter() + duration_s

        async def worker(offset: int) -> None:
            nonlocal done
            i = offset
            while time.perf_counter() < stop_at:
                await _timed_post(session, url, bodies[i % len(bodies)])
                done += 1
                i += concurrency

        start = time.perf_counter()
        await asyncio.gather(*(worker(k) for k in range(concurrency)))
        return done / (time.perf_counter() - start)

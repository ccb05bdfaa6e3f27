"""Tiny stdlib HTTP helpers for the gateway tests (real sockets, no client library in between)."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import urllib.request
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from tests.support.waiting import wait_until


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def _host(url: str) -> str:
    host = urlsplit(url).hostname
    assert host is not None, f"no host in {url!r}"
    return host


def request(
    url: str,
    method: str = "GET",
    body: bytes | dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 10.0,
) -> Reply:
    parts = urlsplit(url)
    payload = json.dumps(body).encode() if isinstance(body, dict) else body
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    conn = http.client.HTTPConnection(_host(url), parts.port, timeout=timeout)
    try:
        conn.request(method, target, body=payload, headers={"content-type": "application/json", **(headers or {})})
        response = conn.getresponse()
        return Reply(response.status, {k.lower(): v for k, v in response.getheaders()}, response.read())
    finally:
        conn.close()


def post(url: str, body: bytes | dict[str, Any], headers: dict[str, str] | None = None, timeout: float = 10.0) -> Reply:
    return request(url, "POST", body, headers, timeout)


def flush_cache(worker_url: str, timeout: float = 60.0) -> None:
    """``POST /flush_cache`` until it succeeds. SGLang flushes only an idle cache and answers 400 ("Flush cache
    failed.") while a request is queued or running there, which includes one whose response the client has
    already read but which is still leaving the scheduler; CI has seen that on real SGLang more than once."""
    wait_until(lambda: request(worker_url + "/flush_cache", "POST").status == 200, f"{worker_url} idle", timeout, 0.2)


def stream_lines(url: str, body: dict[str, Any], timeout: float = 10.0) -> Generator[tuple[float, bytes], None, None]:
    """POST and yield (arrival time, line) for each line of the response as it arrives."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(_host(url), parts.port, timeout=timeout)
    try:
        conn.request("POST", parts.path, body=json.dumps(body).encode(), headers={"content-type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200, response.read()
        while True:
            line = response.readline()  # de-chunked; returns b"" at the end of the body
            if not line:
                return
            yield time.monotonic(), line
    finally:
        conn.close()


def sse_data(url: str, body: dict[str, Any], timeout: float = 10.0) -> list[tuple[float, bytes]]:
    """POST a streamed request: the ``data:`` lines of its response, each with the time it arrived."""
    return [(t, line) for t, line in stream_lines(url, body, timeout) if line.startswith(b"data:")]


def assert_streams_as_generated(url: str, chat: dict[str, Any], timeout: float = 10.0) -> None:
    """48 tokens streamed through the gateway at ``url`` arrive spread over their decode, not at once: nothing on
    the way (Envoy, the router) buffers the SSE body. ``chat``: a chat completion body for a simulated worker."""
    body = {**chat, "max_tokens": 48, "stream": True, "ignore_eos": True}
    events = sse_data(url + "/v1/chat/completions", body, timeout)
    assert events[-1][1].strip() == b"data: [DONE]"
    assert len(events) >= 40
    # 48 decode steps of the simulated GPU take ~0.35 s: buffered, every event would arrive at once.
    assert events[-1][0] - events[0][0] > 0.15


def envoy_stats(admin_url: str) -> dict[str, int]:
    """Envoy's counters and gauges by name (from its admin endpoint)."""
    with urllib.request.urlopen(admin_url + "/stats?format=json", timeout=5) as response:
        data = json.load(response)
    return {s["name"]: int(s["value"]) for s in data["stats"] if isinstance(s.get("value"), int)}


class SpoofTarget:
    """A listening socket a spoofed destination header points at; counts connections it receives."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.1)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()

    def __enter__(self) -> SpoofTarget:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def envoy_host_healthy(admin_url: str, host: str) -> bool:
    """True when every cluster of Envoy that has ``host`` (``ip:port``) as a member counts it healthy.

    Envoy keeps its own view (active health checks, outlier ejection): after a worker restarts, the router may
    trust it again before Envoy does, and Envoy then serves the router's choice on the next endpoint of its list.
    """
    with urllib.request.urlopen(admin_url + "/clusters", timeout=5) as response:
        flags = [
            line.rsplit("::", 1)[1]
            for line in response.read().decode().splitlines()
            if f"::{host}::health_flags::" in line
        ]
    return bool(flags) and all(flag == "healthy" for flag in flags)

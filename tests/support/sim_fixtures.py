"""Helpers for the sim-worker tests: HTTP calls, a KV-event subscriber, golden data location."""

from __future__ import annotations

import hashlib
import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import zmq

from sglang_workers.process import WorkerProcess
from sglang_workers.sim.kv_events import KVEvent, decode_payload

GOLDEN_DIR = Path(__file__).resolve().parents[2].parent / "shared" / "sglang-events"


def http(method: str, url: str, body: Any = None, raw: bytes | None = None, timeout: float = 10.0) -> tuple[int, bytes]:
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def post_json(worker: WorkerProcess, path: str, body: Any) -> tuple[int, Any]:
    status, data = http("POST", worker.url + path, body)
    return status, json.loads(data) if data and not data.startswith(b"data:") else data


def get_json(worker: WorkerProcess, path: str) -> tuple[int, Any]:
    status, data = http("GET", worker.url + path)
    return status, json.loads(data)


def sse_events(raw: bytes) -> list[str]:
    """The ``data:`` payloads of an SSE body, in order."""
    return [line[len("data: ") :] for line in raw.decode().split("\n\n") if line.startswith("data: ")]


def sha256_chain(tokens: list[int], page_size: int, salt: str | None = None) -> list[int]:
    """Independent SGLang block-hash chain (u32 LE tokens, prior digest, int64 of digest[:8] BE)."""
    prior = hashlib.sha256(b"sglang-cache-salt-v1\0" + salt.encode()).digest() if salt else b""
    out = []
    for start in range(0, len(tokens) - len(tokens) % page_size, page_size):
        prior = hashlib.sha256(
            prior + b"".join(t.to_bytes(4, "little") for t in tokens[start : start + page_size])
        ).digest()
        out.append(int.from_bytes(prior[:8], "big", signed=True))
    return out


class EventSubscriber:
    """A real ZMQ SUB socket on a worker's publisher, synchronised past the slow-joiner window."""

    def __init__(self, worker: WorkerProcess, topic: bytes = b"") -> None:
        self.worker = worker
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic)
        self.sock.connect(worker.kv_events_endpoint)

    def sync(self, timeout: float = 10.0) -> None:
        """Flush the (idle) worker's cache until its AllBlocksCleared arrives, then drain."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status, _ = http("POST", self.worker.url + "/flush_cache")
            assert status == 200
            if self.sock.poll(200):
                self.drain()
                return
        raise AssertionError("no KV events received from the worker")

    def drain(self, wait: float = 0.1) -> list[tuple[int, list[KVEvent], bytes]]:
        out = []
        while self.sock.poll(int(wait * 1000)):
            _topic, seq, payload = self.sock.recv_multipart()
            out.append((int.from_bytes(seq, "big"), decode_payload(payload)[1], payload))
        return out

    def recv(self, timeout: float = 5.0) -> tuple[bytes, int, bytes]:
        if not self.sock.poll(int(timeout * 1000)):
            raise AssertionError("timed out waiting for a KV-event batch")
        topic, seq, payload = self.sock.recv_multipart()
        return topic, int.from_bytes(seq, "big"), payload

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()

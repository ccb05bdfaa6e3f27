"""What the router adds to a request's latency: Envoy -> worker versus Envoy -> ext_proc -> worker.

Two kinds of gateway over the same simulated workers with the ``instant`` timing profile (no
simulated GPU time, so the worker costs only its HTTP handling and tokenization, the same in both
paths): a plain Envoy (least-request, no ext_proc) and the full gateway (header strip, ext_proc, the
router's policy, ORIGINAL_DST), one per policy. One client sends chat requests one at a time over a
kept-alive connection, alternating between the plain Envoy and the gateway so that machine noise
hits both alike, for prompts of about 1k, 8k and 32k tokens, in two cases:

- cold: every prompt is a document never seen before (nothing in the router's piece cache);
- warm: one shared document (a system prompt / RAG context) and a new question each time, the
  common case for prefix-aware routing: the document's tokens come from the piece cache.

It prints p50 and p99 of both paths, the difference, and the router's CPU time per request (what
bounds one router's throughput) with its idle background work (health checks, load polls)
measured beforehand and subtracted.

Run: ``python -m benchmarks.router_overhead`` (``--help`` for the knobs).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from extproc.gateway.stack import GatewayStack
from extproc.tokenization import load_tokenizer

__all__ = ["OverheadRow", "format_table", "main", "measure_overhead"]

DEFAULT_SIZES = (1024, 8192, 32768)
DEFAULT_POLICIES = ("round-robin", "prefix-aware")
CASES = ("cold", "warm")
BODY_MODES = ("buffered", "streamed")  # Envoy's ext_proc body mode: BUFFERED or FULL_DUPLEX_STREAMED
_WORDS = [
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
    "mike",
    "november",
    "oscar",
    "papa",
    "quebec",
    "romeo",
    "sierra",
    "tango",
    "uniform",
    "victor",
    "whiskey",
    "xray",
    "yankee",
    "zulu",
    "gateway",
    "router",
    "worker",
    "cache",
    "prefix",
    "token",
    "block",
    "envoy",
    "filter",
    "stream",
    "header",
    "metadata",
    "cluster",
    "health",
    "policy",
]


@dataclass
class OverheadRow:
    """Latency figures for one policy, case and prompt size, in milliseconds."""

    policy: str
    case: str
    prompt_tokens: int
    requests: int
    direct_p50: float
    direct_p99: float
    router_p50: float
    router_p99: float

    router_cpu_ms: float | None = None  # router CPU per routed request, idle background subtracted (Linux only)
    body_mode: str = "buffered"

    @property
    def added_p50(self) -> float:
        return self.router_p50 - self.direct_p50

    @property
    def added_p99(self) -> float:
        return self.router_p99 - self.direct_p99


def _document(tokens: int, rng: random.Random, tokenizer: object) -> str:
    """Paragraphs of about ``tokens`` tokens under the default tokenizer, unique per call."""
    paragraphs = []
    words = 0
    while words < tokens:
        count = rng.randint(30, 90)
        paragraphs.append(f"{rng.randrange(10**9)} " + " ".join(rng.choice(_WORDS) for _ in range(count)) + ".")
        words += count + 4
    text = "\n\n".join(paragraphs)
    ids = tokenizer.encode_text(text)  # type: ignore[attr-defined]
    return text if len(ids) <= tokens else tokenizer.decode(ids[:tokens])  # type: ignore[attr-defined]


class _Prompts:
    """Request bodies for one case: cold = a new document each time; warm = one document, new questions."""

    def __init__(self, case: str, tokens: int, rng: random.Random, tokenizer: object) -> None:
        self.case, self.tokens, self.rng, self.tokenizer = case, tokens, rng, tokenizer
        self.shared = _document(tokens, rng, tokenizer) if case == "warm" else ""

    def body(self, i: int) -> bytes:
        # Cold bodies are new for each path too: a worker must not have seen the other path's copy.
        document = self.shared or _document(self.tokens, self.rng, self.tokenizer)
        question = f"Question {i} ({self.rng.randrange(10**9)}): what does paragraph {i % 7} say?"
        return json.dumps(
            {
                "model": "default",
                "max_tokens": 1,
                "messages": [{"role": "system", "content": document}, {"role": "user", "content": question}],
            }
        ).encode()


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process, from /proc (None where there is no /proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _idle_cpu_rate(pid: int, seconds: float = 2.0) -> float | None:
    """The router's CPU seconds per second with no traffic (health checks, load polls, event loop)."""
    before = _cpu_seconds(pid)
    start = time.perf_counter()
    time.sleep(seconds)
    after = _cpu_seconds(pid)
    return None if before is None or after is None else (after - before) / (time.perf_counter() - start)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class _Client:
    """One kept-alive HTTP/1.1 connection; returns the wall time of each request in ms."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=60)

    def chat(self, body: bytes) -> float:
        start = time.perf_counter()
        self.conn.request("POST", "/v1/chat/completions", body=body, headers={"content-type": "application/json"})
        response = self.conn.getresponse()
        response_body = response.read()
        elapsed = (time.perf_counter() - start) * 1000
        if response.status != 200:
            raise RuntimeError(f"gateway answered {response.status}: {response_body[:200]!r}")
        return elapsed

    def close(self) -> None:
        self.conn.close()


def _measure(
    policy: str,
    case: str,
    size: int,
    requests: int,
    warmup: int,
    clients: dict[str, _Client],
    router_pid: int,
    idle_rate: float | None,
    rng: random.Random,
    tokenizer: object,
) -> OverheadRow:
    prompts = _Prompts(case, size, rng, tokenizer)
    paths = ("direct", "router")
    bodies = [{name: prompts.body(i) for name in paths} for i in range(warmup + requests)]  # before the clock
    times: dict[str, list[float]] = {"direct": [], "router": []}
    cpu_before, start = _cpu_seconds(router_pid), time.perf_counter()
    for i, body in enumerate(bodies):
        order = paths if i % 2 == 0 else paths[::-1]
        for name in order:
            elapsed = clients[name].chat(body[name])
            if i >= warmup:
                times[name].append(elapsed)
    cpu_after, wall = _cpu_seconds(router_pid), time.perf_counter() - start
    cpu_ms = None
    if cpu_before is not None and cpu_after is not None and idle_rate is not None:
        cpu_ms = max(0.0, cpu_after - cpu_before - idle_rate * wall) * 1000 / len(bodies)
    return OverheadRow(
        policy,
        case,
        size,
        requests,
        statistics.median(times["direct"]),
        _percentile(times["direct"], 0.99),
        statistics.median(times["router"]),
        _percentile(times["router"], 0.99),
        cpu_ms,
    )


def measure_overhead(
    sizes: tuple[int, ...] = DEFAULT_SIZES,
    requests: int = 200,
    warmup: int = 10,
    workers: int = 2,
    policies: tuple[str, ...] = DEFAULT_POLICIES,
    cases: tuple[str, ...] = CASES,
    seed: int = 0,
    body_modes: tuple[str, ...] = ("buffered",),
) -> list[OverheadRow]:
    """Start a plain Envoy and one gateway per policy over ``workers`` instant sim workers, measure, stop."""
    from sglang_workers.process import start_sim_workers

    tokenizer = load_tokenizer()
    rng = random.Random(seed)
    sims = start_sim_workers(workers, profile="instant", no_kv_events=True)
    urls = [s.url for s in sims]
    rows: list[OverheadRow] = []
    try:
        with GatewayStack(worker_urls=urls, router=False, upstream_host_header=False) as direct:
            for policy, body_mode in [(p, m) for p in policies for m in body_modes]:
                with GatewayStack(
                    worker_urls=urls, policy=policy, upstream_host_header=False, body_mode=body_mode
                ) as routed:
                    clients = {"direct": _Client(direct.url), "router": _Client(routed.url)}
                    try:
                        router_pid = routed.router_process.pid if routed.router_process else 0
                        idle_rate = _idle_cpu_rate(router_pid)
                        for case in cases:
                            for size in sizes:
                                row = _measure(
                                    policy,
                                    case,
                                    size,
                                    requests,
                                    warmup,
                                    clients,
                                    router_pid,
                                    idle_rate,
                                    rng,
                                    tokenizer,
                                )
                                row.body_mode = body_mode
                                rows.append(row)
                    finally:
                        for client in clients.values():
                            client.close()
    finally:
        for sim in sims:
            sim.stop()
    return rows


def format_table(rows: list[OverheadRow]) -> str:
    lines = [
        "Router overhead (instant sim workers; sequential requests; ms)",
        "",
        "| policy | body mode | case | prompt tokens | requests | direct p50 | direct p99 | via router p50 "
        "| via router p99 | added p50 | added p99 | router CPU / request |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        cpu = "n/a" if r.router_cpu_ms is None else f"{r.router_cpu_ms:.2f}"
        lines.append(
            f"| {r.policy} | {r.body_mode} | {r.case} | {r.prompt_tokens} | {r.requests} | {r.direct_p50:.2f} | "
            f"{r.direct_p99:.2f} | {r.router_p50:.2f} | {r.router_p99:.2f} | {r.added_p50:+.2f} | "
            f"{r.added_p99:+.2f} | {cpu} |"
        )
    return "\n".join(lines)


def _names(value: str, allowed: tuple[str, ...] | None = None) -> tuple[str, ...]:
    names = tuple(v.strip() for v in value.split(",") if v.strip())
    if not names or (allowed is not None and not set(names) <= set(allowed)):
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list{' of ' + ', '.join(allowed) if allowed else ''}"
        )
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.router_overhead",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--requests", type=int, default=200, help="Measured requests per row and path.")
    parser.add_argument("--warmup", type=int, default=10, help="Unmeasured requests first (per row).")
    parser.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="Prompt sizes in tokens.")
    parser.add_argument(
        "--policies",
        "--policy",
        type=_names,
        default=DEFAULT_POLICIES,
        help="Router policies, comma-separated (default: round-robin,prefix-aware).",
    )
    parser.add_argument(
        "--cases",
        type=lambda v: _names(v, CASES),
        default=CASES,
        help="cold (unique documents), warm (shared document, new question), or both (default).",
    )
    parser.add_argument("--workers", type=int, default=2, help="Simulated workers behind both gateways.")
    parser.add_argument(
        "--body-modes",
        type=lambda v: _names(v, BODY_MODES),
        default=("buffered",),
        help="Envoy's ext_proc body mode of the gateway: buffered, streamed (FULL_DUPLEX_STREAMED), or both.",
    )
    args = parser.parse_args(argv)
    try:
        sizes = tuple(int(s) for s in args.sizes.split(",") if s.strip())
    except ValueError:
        parser.error(f"--sizes wants comma-separated integers, got {args.sizes!r}")
    try:
        rows = measure_overhead(
            sizes, args.requests, args.warmup, args.workers, args.policies, args.cases, body_modes=args.body_modes
        )
    except Exception as exc:  # a failed start names the part and quotes its log
        print(f"router_overhead: {exc}", file=sys.stderr)
        return 1
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

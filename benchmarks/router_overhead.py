"""What the router adds to a request's latency: Envoy -> worker versus Envoy -> ext_proc -> worker.

Two gateways over the same simulated workers with the ``instant`` timing profile (no simulated GPU
time, so the worker costs only its HTTP handling and tokenization, the same in both paths): a plain
Envoy (least-request, no ext_proc) and the full gateway (header strip, ext_proc, the router's policy,
ORIGINAL_DST). One client sends chat requests one at a time over a kept-alive connection,
alternating between the two gateways so that machine noise hits both alike, for prompts of about
1k, 8k and 32k tokens. It prints p50 and p99 of both, the difference, and the router process's CPU
time per request (what bounds one router's throughput).

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

from extproc.stack import GatewayStack
from extproc.tokenization import load_tokenizer

__all__ = ["OverheadRow", "format_table", "main", "measure_overhead"]

DEFAULT_SIZES = (1024, 8192, 32768)
_WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
          "quebec romeo sierra tango uniform victor whiskey xray yankee zulu gateway router worker cache "
          "prefix token block envoy filter stream header metadata cluster health policy").split()


@dataclass
class OverheadRow:
    """Latency figures for one prompt size, in milliseconds."""

    prompt_tokens: int
    requests: int
    direct_p50: float
    direct_p99: float
    router_p50: float
    router_p99: float

    router_cpu_ms: float | None = None  # router process CPU time per routed request (Linux only)

    @property
    def added_p50(self) -> float:
        return self.router_p50 - self.direct_p50

    @property
    def added_p99(self) -> float:
        return self.router_p99 - self.direct_p99


def _prompt(tokens: int, rng: random.Random, tokenizer: object) -> str:
    """Text of about ``tokens`` tokens under the default tokenizer, unique per call (no shared prefix)."""
    words = [f"{rng.randrange(10**9)}"] + [rng.choice(_WORDS) for _ in range(tokens)]
    text = " ".join(words)
    ids = tokenizer.encode_text(text)  # type: ignore[attr-defined]
    return text if len(ids) <= tokens else tokenizer.decode(ids[:tokens])  # type: ignore[attr-defined]


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process, from /proc (None where there is no /proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class _Client:
    """One kept-alive HTTP/1.1 connection; returns the wall time of each request in ms."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)

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


def measure_overhead(sizes: tuple[int, ...] = DEFAULT_SIZES, requests: int = 200, warmup: int = 10,
                     workers: int = 2, policy: str | None = None, seed: int = 0) -> list[OverheadRow]:
    """Start both gateways over ``workers`` instant sim workers, measure, stop everything."""
    from sglang_workers.process import start_sim_workers

    tokenizer = load_tokenizer()
    rng = random.Random(seed)
    sims = start_sim_workers(workers, profile="instant", no_kv_events=True)
    urls = [s.url for s in sims]
    rows: list[OverheadRow] = []
    try:
        with GatewayStack(worker_urls=urls, router=False, upstream_host_header=False) as direct, \
                GatewayStack(worker_urls=urls, policy=policy, upstream_host_header=False) as routed:
            clients = {"direct": _Client(direct.url), "router": _Client(routed.url)}
            try:
                router_pid = routed.router_process.pid if routed.router_process else 0
                for size in sizes:
                    times: dict[str, list[float]] = {"direct": [], "router": []}
                    cpu_before = _cpu_seconds(router_pid)
                    for i in range(warmup + requests):
                        body = json.dumps({"model": "default", "max_tokens": 1, "messages": [
                            {"role": "user", "content": _prompt(size, rng, tokenizer)}]}).encode()
                        order = ("direct", "router") if i % 2 == 0 else ("router", "direct")
                        for name in order:
                            elapsed = clients[name].chat(body)
                            if i >= warmup:
                                times[name].append(elapsed)
                    cpu_after = _cpu_seconds(router_pid)
                    cpu_ms = (None if cpu_before is None or cpu_after is None
                              else (cpu_after - cpu_before) * 1000 / (warmup + requests))
                    rows.append(OverheadRow(size, requests,
                                            statistics.median(times["direct"]), _percentile(times["direct"], 0.99),
                                            statistics.median(times["router"]), _percentile(times["router"], 0.99),
                                            cpu_ms))
            finally:
                for client in clients.values():
                    client.close()
    finally:
        for sim in sims:
            sim.stop()
    return rows


def format_table(rows: list[OverheadRow], policy: str) -> str:
    lines = [f"Router overhead (policy {policy}; instant sim workers; sequential requests, ms)",
             "",
             "| prompt tokens | requests | direct p50 | direct p99 | via router p50 | via router p99 "
             "| added p50 | added p99 | router CPU / request |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        cpu = "n/a" if r.router_cpu_ms is None else f"{r.router_cpu_ms:.2f}"
        lines.append(f"| {r.prompt_tokens} | {r.requests} | {r.direct_p50:.2f} | {r.direct_p99:.2f} | "
                     f"{r.router_p50:.2f} | {r.router_p99:.2f} | {r.added_p50:+.2f} | {r.added_p99:+.2f} | {cpu} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.router_overhead", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200, help="Measured requests per prompt size and path.")
    parser.add_argument("--warmup", type=int, default=10, help="Unmeasured requests first.")
    parser.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="Prompt sizes in tokens.")
    parser.add_argument("--policy", help="Router policy (default: the config default, prefix-aware).")
    parser.add_argument("--workers", type=int, default=2, help="Simulated workers behind both gateways.")
    args = parser.parse_args(argv)
    try:
        sizes = tuple(int(s) for s in args.sizes.split(",") if s.strip())
    except ValueError:
        parser.error(f"--sizes wants comma-separated integers, got {args.sizes!r}")
    from extproc.config import PolicyConfig

    policy = args.policy or PolicyConfig().name
    try:
        rows = measure_overhead(sizes, args.requests, args.warmup, args.workers, policy)
    except Exception as exc:  # a failed start names the part and quotes its log
        print(f"router_overhead: {exc}", file=sys.stderr)
        return 1
    print(format_table(rows, policy))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``prefix-router bench --suite overhead``: what a gateway adds to a request's latency, Envoy -> worker
against Envoy -> ext_proc -> worker (and the peers), on instant workers.

Over the same simulated workers with the ``instant`` timing profile (no simulated GPU time, so the
worker costs only its HTTP handling and tokenization, the same on every path): a plain Envoy
(least-request, no ext_proc, ``envoy-direct``), the full gateway (header strip, ext_proc, the router's
policy, ORIGINAL_DST) once per policy, and each peer gateway (default sgl-router, its own Rust proxy, so
its "added" figure compares two different proxies). One client sends chat requests one at a time over
one kept-alive connection per gateway, every gateway in turn (the order rotating request by request so
that machine noise hits all alike), for prompts of about 1k, 8k and 32k tokens, in two cases:

- cold: every prompt is a document never seen before (nothing in the router's piece cache), new for
  each gateway too (a worker must not have seen another path's copy);
- warm: one shared document (a system prompt / RAG context) and a new question each time, the
  common case for prefix-aware routing: the document's tokens come from the piece cache.

It prints p50 and p99 of every path, the difference to ``envoy-direct``, and each router's CPU time per
request (what bounds one router's throughput) with its idle background work (health checks, load
polls) measured beforehand and subtracted; then, with ``--throughput-s``, each gateway's completed
requests per second under closed-loop load (``--throughput-concurrency`` requests always in flight).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from benchmarks.argtypes import names, positive_list
from benchmarks.fleet.procs import cpu_seconds
from benchmarks.stats import percentile
from benchmarks.suites.shared import versions
from benchmarks.workloads.base import PLAIN_WORDS
from prefix_common.tokenization import load_tokenizer
from prefix_router.stack import GatewayStack

__all__ = ["OverheadResult", "OverheadRow", "configure", "format_table", "main", "measure_overhead"]

DEFAULT_SIZES = (1024, 8192, 32768)
DEFAULT_POLICIES = ("round-robin", "prefix-aware")
DEFAULT_PEERS = ("sgl-router",)
CASES = ("cold", "warm")
DIRECT = "envoy-direct"  # plain Envoy, least-request, no ext_proc: what every other gateway is compared to
FLOOR = "floor:python-ext_proc"  # the real Envoy + a Python ext_proc server that decides nothing (--extproc-floor)
BODY_MODES = ("buffered", "streamed")  # Envoy's ext_proc body mode: BUFFERED or FULL_DUPLEX_STREAMED


@dataclass
class OverheadRow:
    """Latency figures of one gateway for one case and prompt size, in milliseconds."""

    gateway: str  # ours:<policy> or a peer's name
    case: str
    prompt_tokens: int
    requests: int
    direct_p50: float  # envoy-direct, measured in the same rounds
    direct_p99: float
    p50: float
    p99: float

    router_cpu_ms: float | None = None  # our router's CPU per request, idle background subtracted (Linux only)

    @property
    def added_p50(self) -> float:
        return self.p50 - self.direct_p50

    @property
    def added_p99(self) -> float:
        return self.p99 - self.direct_p99


@dataclass
class OverheadResult:
    """Everything one run measured: latency rows and closed-loop requests per second per gateway."""

    rows: list[OverheadRow]
    requests_per_s: dict[str, float]


def _document(tokens: int, rng: random.Random, tokenizer: object) -> str:
    """Paragraphs of about ``tokens`` tokens under the default tokenizer, unique per call."""
    paragraphs = []
    words = 0
    while words < tokens:
        count = rng.randint(30, 90)
        paragraphs.append(f"{rng.randrange(10**9)} " + " ".join(rng.choice(PLAIN_WORDS) for _ in range(count)) + ".")
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


def _idle_cpu_rates(pids: dict[str, int], seconds: float = 2.0) -> dict[str, float | None]:
    """Each router's CPU seconds per second with no traffic (health checks, load polls, event loop)."""
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    start = time.perf_counter()
    time.sleep(seconds)
    wall = time.perf_counter() - start
    out: dict[str, float | None] = {}
    for name, pid in pids.items():
        after, was = cpu_seconds(pid), before[name]
        out[name] = None if was is None or after is None else (after - was) / wall
    return out


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
    case: str,
    size: int,
    requests: int,
    warmup: int,
    clients: dict[str, _Client],
    router_pids: dict[str, int],
    idle_rates: dict[str, float | None],
    rng: random.Random,
    tokenizer: object,
) -> list[OverheadRow]:
    """One case and size: every gateway in turn per request (rotating), then one row per gateway."""
    prompts = _Prompts(case, size, rng, tokenizer)
    paths = list(clients)
    bodies = [{name: prompts.body(i) for name in paths} for i in range(warmup + requests)]  # before the clock
    times: dict[str, list[float]] = {name: [] for name in paths}
    cpu_before, start = {n: cpu_seconds(pid) for n, pid in router_pids.items()}, time.perf_counter()
    for i, body in enumerate(bodies):
        shift = i % len(paths)
        for name in paths[shift:] + paths[:shift]:
            elapsed = clients[name].chat(body[name])
            if i >= warmup:
                times[name].append(elapsed)
    wall = time.perf_counter() - start
    cpu_ms: dict[str, float] = {}
    for name, pid in router_pids.items():
        before, after, idle = cpu_before[name], cpu_seconds(pid), idle_rates.get(name)
        if before is not None and after is not None and idle is not None:
            cpu_ms[name] = max(0.0, after - before - idle * wall) * 1000 / len(bodies)
    direct = times[DIRECT]
    return [
        OverheadRow(
            name,
            case,
            size,
            requests,
            percentile(direct, 50),
            percentile(direct, 99),
            percentile(values, 50),
            percentile(values, 99),
            cpu_ms.get(name),
        )
        for name, values in times.items()
        if name != DIRECT
    ]


def _closed_loop(
    urls: dict[str, str], tokenizer: object, seed: int, concurrency: int, seconds: float
) -> dict[str, float]:
    """Completed requests per second of each gateway, one after the other, ``concurrency`` always in flight."""
    import asyncio

    from benchmarks.client import LatencyProbe

    prompts = _Prompts("cold", 1024, random.Random(seed + 1), tokenizer)
    bodies = [prompts.body(i) for i in range(256)]

    async def run() -> dict[str, float]:
        async with LatencyProbe(urls) as probe:
            return {name: await probe.throughput(name, bodies, concurrency, seconds) for name in urls}

    return asyncio.run(run())


def _start_peers(names: tuple[str, ...], worker_urls: list[str]) -> tuple[dict[str, str], list[Any]]:
    """Start each peer gateway over the workers: name -> URL (a peer that fails is said and left out)."""
    import asyncio

    from benchmarks.fleet.contenders import create_contender
    from benchmarks.fleet.process import ContenderError

    urls: dict[str, str] = {}
    started: list[Any] = []
    for name in names:
        peer = create_contender(name)
        started.append(peer)
        try:
            urls[name] = asyncio.run(peer.start(worker_urls))
        except ContenderError as exc:
            print(f"  {name} did not start: {exc}", file=sys.stderr)
    return urls, started


def measure_overhead(
    sizes: tuple[int, ...] = DEFAULT_SIZES,
    requests: int = 100,
    warmup: int = 10,
    workers: int = 2,
    policies: tuple[str, ...] = DEFAULT_POLICIES,
    cases: tuple[str, ...] = CASES,
    seed: int = 0,
    peers: tuple[str, ...] = DEFAULT_PEERS,
    throughput_s: float = 5.0,
    throughput_concurrency: int = 16,
    body_modes: tuple[str, ...] = ("buffered",),
    extproc_floor: bool = False,
) -> OverheadResult:
    """Start ``workers`` instant sim workers, envoy-direct, one gateway per policy and the peers; measure; stop."""
    import asyncio

    from prefix_router.fleet import start_fleet

    tokenizer = load_tokenizer()
    rng = random.Random(seed)
    sims = start_fleet("sim", workers, profile="instant", no_kv_events=True)
    urls = [s.url for s in sims]
    peer_processes: list[Any] = []
    try:
        with contextlib.ExitStack() as stack:
            gateways = {
                DIRECT: stack.enter_context(
                    GatewayStack(worker_urls=urls, router=False, upstream_host_header=False)
                ).url
            }
            router_pids: dict[str, int] = {}
            for policy in policies:
                for mode in body_modes:
                    name = f"ours:{policy}" if mode == "buffered" else f"ours:{policy} ({mode})"
                    routed = stack.enter_context(
                        GatewayStack(worker_urls=urls, policy=policy, upstream_host_header=False, body_mode=mode)
                    )
                    gateways[name] = routed.url
                    if routed.router_process is not None:
                        router_pids[name] = routed.router_process.pid
            if extproc_floor:
                # Our gateway's Envoy config and reply shape, the decision left out: every body goes to the
                # first worker (``benchmarks/fleet/floor_server.py`` with the router's routing reply).
                from benchmarks.fleet.floor_server import floor_command

                floor = stack.enter_context(
                    GatewayStack(
                        worker_urls=urls,
                        router_command=floor_command("{port}", urls[0].split("://", 1)[-1]),
                        upstream_host_header=False,
                        metrics_port=None,
                    )
                )
                gateways[FLOOR] = floor.url
                if floor.router_process is not None:
                    router_pids[FLOOR] = floor.router_process.pid
            peer_urls, peer_processes = _start_peers(peers, urls)
            gateways.update(peer_urls)
            clients = {name: _Client(url) for name, url in gateways.items()}
            try:
                idle_rates = _idle_cpu_rates(router_pids)
                rows = [
                    row
                    for case in cases
                    for size in sizes
                    for row in _measure(case, size, requests, warmup, clients, router_pids, idle_rates, rng, tokenizer)
                ]
            finally:
                for client in clients.values():
                    client.close()
            rates = (
                _closed_loop(gateways, tokenizer, seed, throughput_concurrency, throughput_s) if throughput_s else {}
            )
    finally:
        for peer in peer_processes:
            asyncio.run(peer.stop())
        for sim in sims:
            sim.stop()
    return OverheadResult(rows, rates)


def format_table(result: OverheadResult) -> str:
    lines = [
        "**Gateway overhead** (instant sim workers; sequential non-streamed requests, every gateway in turn; ms)",
        "",
        "| gateway | case | prompt tokens | requests | direct p50 | direct p99 | via gateway p50 | via gateway p99 "
        "| added p50 | added p99 | router CPU / request |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result.rows:
        cpu = "n/a" if r.router_cpu_ms is None else f"{r.router_cpu_ms:.2f}"
        lines.append(
            f"| {r.gateway} | {r.case} | {r.prompt_tokens} | {r.requests} | {r.direct_p50:.2f} | "
            f"{r.direct_p99:.2f} | {r.p50:.2f} | {r.p99:.2f} | {r.added_p50:+.2f} | "
            f"{r.added_p99:+.2f} | {cpu} |"
        )
    if result.requests_per_s:
        lines += ["", "| gateway | requests/s (routing decisions/s), closed loop |", "|---|---:|"]
        lines += [f"| {name} | {value:.0f} |" for name, value in result.requests_per_s.items()]
    return "\n".join(lines) + "\n"


def _peers(value: str) -> tuple[str, ...]:
    """Peer gateways: contenders over the workers' HTTP API that are not ours (``none`` for no peer)."""
    from benchmarks.fleet.contenders import create_contender

    if value.strip() == "none":
        return ()
    peers = names()(value)
    for name in peers:
        try:
            peer = create_contender(name)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        if name.startswith("ours:") or peer.worker_transport != "http":
            raise argparse.ArgumentTypeError(f"{name}: not a peer over HTTP workers (ours: use --policies)")
    return peers


def configure(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("overhead (instant workers; see docs/benchmarks.md)")
    g.add_argument("--requests", type=int, default=100, help="Measured requests per row and gateway.")
    g.add_argument("--warmup", type=int, default=10, help="Unmeasured requests first (per row).")
    g.add_argument(
        "--sizes",
        type=positive_list(int),
        default=",".join(map(str, DEFAULT_SIZES)),
        help="Prompt sizes in tokens, comma-separated.",
    )
    g.add_argument(
        "--policies",
        "--policy",
        type=names(),
        default=",".join(DEFAULT_POLICIES),
        help="Our router's policies, one gateway each, comma-separated.",
    )
    g.add_argument(
        "--cases",
        type=names(CASES),
        default=",".join(CASES),
        help="cold (unique documents), warm (shared document, new question), or both.",
    )
    g.add_argument(
        "--peers",
        type=_peers,
        default=",".join(DEFAULT_PEERS),
        help="Peer gateways over the same workers, comma-separated (sgl-router, smg, envoy-rr, ...; none: no peer).",
    )
    g.add_argument("--workers", type=int, default=2, help="Simulated workers behind every gateway.")
    g.add_argument(
        "--throughput-s",
        type=float,
        default=5.0,
        help="Seconds of closed-loop load per gateway after the latency rows (0: none).",
    )
    g.add_argument(
        "--throughput-concurrency", type=int, default=16, help="Requests in flight during the closed-loop load."
    )
    g.add_argument(
        "--body-modes",
        type=names(BODY_MODES),
        default=("buffered",),
        help="Envoy's ext_proc body mode of our gateways: buffered, streamed (FULL_DUPLEX_STREAMED), or both "
        "(one gateway per policy and mode; streamed ones are named 'ours:POLICY (streamed)').",
    )
    g.add_argument(
        "--extproc-floor",
        action="store_true",
        help=f"Also measure '{FLOOR}': the same Envoy gateway with a Python ext_proc server that decides "
        "nothing (grpc.aio, a fixed routing reply): what any Python ext_proc adds before a decision.",
    )
    g.add_argument("--seed", type=int, default=0, help="Seed of the prompt text.")
    g.add_argument("--json", type=Path, default=None, help="Write the rows and requests/s as JSON here.")


def main(args: argparse.Namespace) -> int:
    if args.requests < 1 or args.warmup < 0 or args.workers < 1 or args.throughput_concurrency < 1:
        print(
            "prefix-router bench: --requests, --workers and --throughput-concurrency must be at least 1",
            file=sys.stderr,
        )
        return 2
    try:
        result = measure_overhead(
            args.sizes,
            args.requests,
            args.warmup,
            args.workers,
            args.policies,
            args.cases,
            args.seed,
            args.peers,
            args.throughput_s,
            args.throughput_concurrency,
            args.body_modes,
            args.extproc_floor,
        )
    except Exception as exc:  # a failed start names the part and quotes its log
        print(f"prefix-router bench: {exc}", file=sys.stderr)
        return 1
    print(format_table(result))
    if args.json is not None:
        data = {
            "suite": "overhead",
            "rows": [{**asdict(r), "added_p50": r.added_p50, "added_p99": r.added_p99} for r in result.rows],
            "requests_per_s": result.requests_per_s,
            "setup": {"workers": args.workers, "warmup": args.warmup, "seed": args.seed, "argv": sys.argv[1:]},
            "versions": versions(),
        }
        args.json.write_text(json.dumps(data, indent=2) + "\n")
        print(f"results written to {args.json}", file=sys.stderr)
    return 0

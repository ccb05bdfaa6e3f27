"""``prefix-router bench --suite sim-worker-throughput``: how many requests per second one sim-worker process
sustains with the timing model off.

A fleet of 4-8 simulated workers shares the benchmark machine's cores with the router and Envoy, so the
simulator's own overhead (HTTP, tokenization, radix cache, events) must stay far below what a real
GPU worker would take per request. This starts one real worker process with ``--profile instant``
and drives it with concurrent aiohttp clients for a fixed time (``--workers 4``: four processes
sharing the machine, the clients spread over them).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from typing import Any

import aiohttp

from benchmarks.argtypes import positive
from benchmarks.stats import sorted_percentile
from prefix_router.fleet import start_fleet

__all__ = ["configure", "main", "run"]


def _body(endpoint: str, rng: random.Random, shared: list[int], args: argparse.Namespace) -> dict[str, Any]:
    tail = [rng.randrange(10, 8000) for _ in range(args.prompt_tokens - len(shared))]
    if endpoint == "generate":
        return {"input_ids": shared + tail, "sampling_params": {"max_new_tokens": args.max_new_tokens}}
    if endpoint == "completions":
        return {"model": "sim", "prompt": shared + tail, "max_tokens": args.max_new_tokens}
    words = " ".join(f"w{t}" for t in tail[: max(1, len(tail) // 2)])
    return {
        "model": "sim",
        "max_tokens": args.max_new_tokens,
        "messages": [
            {"role": "system", "content": "shared system prompt " * (len(shared) // 3)},
            {"role": "user", "content": words},
        ],
    }


async def run(urls: list[str], args: argparse.Namespace) -> dict[str, float]:
    path = {"generate": "/generate", "completions": "/v1/completions", "chat": "/v1/chat/completions"}[args.endpoint]
    rng = random.Random(args.seed)
    shared = [rng.randrange(10, 8000) for _ in range(args.shared_prefix_tokens)]
    latencies: list[float] = []
    errors = 0
    deadline = time.perf_counter() + args.warmup + args.duration
    measure_from = time.perf_counter() + args.warmup

    async def client(session: aiohttp.ClientSession, seed: int) -> None:
        nonlocal errors
        crng = random.Random(seed)
        url = urls[seed % len(urls)]  # clients spread evenly over the workers
        while (now := time.perf_counter()) < deadline:
            async with session.post(url + path, json=_body(args.endpoint, crng, shared, args)) as resp:
                await resp.read()
                ok = resp.status == 200
            if now >= measure_from:
                if ok:
                    latencies.append(time.perf_counter() - now)
                else:
                    errors += 1

    connector = aiohttp.TCPConnector(limit=args.concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(client(session, args.seed + i) for i in range(args.concurrency)))
    latencies.sort()
    n = len(latencies)
    return {
        "requests": n,
        "errors": errors,
        "req_per_s": n / args.duration,
        "p50_ms": 1000 * sorted_percentile(latencies, 50) if n else 0.0,
        "p99_ms": 1000 * sorted_percentile(latencies, 99) if n else 0.0,
    }


def configure(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("load")
    g.add_argument(
        "--endpoint",
        choices=["generate", "completions", "chat"],
        default="generate",
        help="API to drive (chat adds chat-template rendering and tokenization).",
    )
    g.add_argument("--concurrency", type=positive(int), default=64, help="Concurrent client connections.")
    g.add_argument("--duration", type=positive(float), default=10.0, help="Measured seconds.")
    g.add_argument("--warmup", type=float, default=1.0, help="Seconds before measuring.")
    g.add_argument("--prompt-tokens", type=positive(int), default=512, help="Prompt length in tokens.")
    g.add_argument("--shared-prefix-tokens", type=int, default=256, help="Prefix shared by all prompts.")
    g.add_argument("--max-new-tokens", type=positive(int), default=16, help="Output tokens per request.")
    g.add_argument("--page-size", type=positive(int), default=16, help="Worker page size.")
    g.add_argument("--seed", type=int, default=0, help="Workload seed.")
    g.add_argument(
        "--workers",
        type=positive(int),
        default=1,
        help="Worker processes sharing the machine (clients spread over them); 1 = one worker's capacity.",
    )


def main(args: argparse.Namespace) -> int:
    args.shared_prefix_tokens = min(args.shared_prefix_tokens, args.prompt_tokens - 1)
    workers = start_fleet("sim", args.workers, profile="instant", page_size=args.page_size, log_level="warning")
    try:
        result = asyncio.run(run([w.url for w in workers], args))
    finally:
        for worker in workers:
            worker.stop()
    print(
        f"sim-worker throughput ({args.workers} worker process(es), profile instant, /{args.endpoint}, "
        f"{args.prompt_tokens}-token prompts, {args.max_new_tokens} output tokens, concurrency {args.concurrency}, "
        f"{args.duration:.0f}s):"
    )
    print(
        f"  {result['req_per_s']:.0f} requests/s  ({result['requests']:.0f} ok, {result['errors']:.0f} errors)  "
        f"latency p50 {result['p50_ms']:.1f} ms, p99 {result['p99_ms']:.1f} ms"
    )
    return 0 if result["errors"] == 0 else 1

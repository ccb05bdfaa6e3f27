"""How many requests per second one sim-worker process sustains with the timing model off.

A fleet of 4-8 simulated workers shares the benchmark machine's cores with the router and Envoy, so the
simulator's own overhead (HTTP, tokenization, radix cache, events) must stay far below what a real
GPU worker would take per request. This starts one real worker process with ``--profile instant``
and drives it with concurrent aiohttp clients for a fixed time::

    python -m benchmarks.sim_throughput --concurrency 64 --duration 10
    python -m benchmarks.sim_throughput --workers 4      # four processes sharing the machine
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from typing import Any

import aiohttp

from prefix_router.fleet import start_fleet

__all__ = ["main", "run"]


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
        "p50_ms": 1000 * statistics.median(latencies) if n else 0.0,
        "p99_ms": 1000 * latencies[min(n - 1, int(n * 0.99))] if n else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.sim_throughput",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--endpoint",
        choices=["generate", "completions", "chat"],
        default="generate",
        help="API to drive (chat adds chat-template rendering and tokenization).",
    )
    parser.add_argument("--concurrency", type=int, default=64, help="Concurrent client connections.")
    parser.add_argument("--duration", type=float, default=10.0, help="Measured seconds.")
    parser.add_argument("--warmup", type=float, default=1.0, help="Seconds before measuring.")
    parser.add_argument("--prompt-tokens", type=int, default=512, help="Prompt length in tokens.")
    parser.add_argument("--shared-prefix-tokens", type=int, default=256, help="Prefix shared by all prompts.")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="Output tokens per request.")
    parser.add_argument("--page-size", type=int, default=16, help="Worker page size.")
    parser.add_argument("--seed", type=int, default=0, help="Workload seed.")
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="Worker processes sharing the machine (clients spread over them); 1 = one worker's capacity.",
    )
    args = parser.parse_args(argv)
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


if __name__ == "__main__":
    raise SystemExit(main())

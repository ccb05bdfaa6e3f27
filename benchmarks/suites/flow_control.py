"""``prefix-router bench --suite flow-control``: past saturation with two priority bands, flow control in the
router against the same load without it.

Two simulated workers behind the full gateway (real Envoy in FULL_DUPLEX_STREAMED mode, as GIE
gateways run an endpoint picker; the router's ``least-load`` policy). An open-loop client sends
streamed chat requests in two classes, each a Poisson stream: *critical* (objective ``critical``,
priority 10) and *sheddable* (objective ``batch``, priority -1), together well past what the two
workers can serve. The same load runs twice on fresh workers: with flow control off (every request
placed at once) and on (at most ``--max-in-flight`` requests per worker, critical first, sheddable
shed with 429 while saturated, queue TTL ``--ttl``).

For each run and class it prints requests sent, answered 200, 429, 5xx, other failures, hung
streams (no end within ``--hang-s``), lost (never answered), and the TTFT p50 / p99 of the
completed ones, measured at the client (the wait in the router included).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from benchmarks.argtypes import positive
from benchmarks.stats import percentile
from prefix_router.stack import GatewayStack

__all__ = ["ClassResult", "configure", "main", "run_load"]

CLASSES = {"critical": "critical", "sheddable": "batch"}  # class -> objective header value


@dataclass
class ClassResult:
    """What one class of requests got in one run."""

    sent: int = 0
    ok: int = 0
    shed: int = 0
    server_errors: int = 0
    other: int = 0
    hung: int = 0
    ttfts: list[float] = field(default_factory=list)

    @property
    def lost(self) -> int:
        return self.sent - self.ok - self.shed - self.server_errors - self.other - self.hung

    def ttft(self, q: float) -> float | None:
        """The ``q``-th percentile (0-100) of the completed requests' TTFTs; None without any."""
        return percentile(self.ttfts, q) if self.ttfts else None


def _body(rng: random.Random, words: int, max_tokens: int) -> bytes:
    text = " ".join(f"w{rng.randrange(50_000)}" for _ in range(words))  # unique: no prefix to reuse
    return json.dumps(
        {
            "model": "default",
            "stream": True,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": text}],
        }
    ).encode()


async def _one(
    session: aiohttp.ClientSession, url: str, objective: str, body: bytes, result: ClassResult, hang_s: float
) -> None:
    result.sent += 1
    try:
        await asyncio.wait_for(_attempt(session, url, objective, body, result), hang_s)
    except TimeoutError:
        result.hung += 1
    except aiohttp.ClientError:
        result.other += 1


async def _attempt(session: aiohttp.ClientSession, url: str, objective: str, body: bytes, result: ClassResult) -> None:
    start = time.monotonic()
    async with session.post(
        url + "/v1/chat/completions",
        data=body,
        headers={"content-type": "application/json", "x-gateway-inference-objective": objective},
    ) as response:
        if response.status == 429:
            await response.read()
            if response.headers.get("retry-after") is None:  # a 429 must say when to come back
                result.other += 1
            else:
                result.shed += 1
            return
        if response.status >= 500:
            await response.read()
            result.server_errors += 1
            return
        if response.status != 200:
            await response.read()
            result.other += 1
            return
        first: float | None = None
        done = False
        async for line in response.content:
            if line.startswith(b"data:"):
                if first is None:
                    first = time.monotonic() - start
                if line.strip() == b"data: [DONE]":
                    done = True
        if done and first is not None:
            result.ok += 1
            result.ttfts.append(first)
        else:
            result.other += 1


async def _load(
    url: str, rates: dict[str, float], duration_s: float, args: argparse.Namespace
) -> dict[str, ClassResult]:
    results = {name: ClassResult() for name in CLASSES}
    rng = random.Random(args.seed)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        tasks: list[asyncio.Task[None]] = []

        async def arrivals(name: str, rate: float) -> None:
            class_rng = random.Random(f"{args.seed}-{name}")
            end = time.monotonic() + duration_s
            while (now := time.monotonic()) < end:
                body = _body(rng, args.prompt_words, args.max_tokens)
                tasks.append(asyncio.create_task(_one(session, url, CLASSES[name], body, results[name], args.hang_s)))
                await asyncio.sleep(max(0.0, class_rng.expovariate(rate) - (time.monotonic() - now)))

        await asyncio.gather(*(arrivals(name, rate) for name, rate in rates.items()))
        await asyncio.gather(*tasks)
    return results


def _router_config(flow: bool, args: argparse.Namespace) -> str:
    lines = ["events: {enabled: false}"]
    if flow:
        lines += [
            "flow_control:",
            "  enabled: true",
            f"  max_in_flight_per_worker: {args.max_in_flight}",
            f"  sheddable_share: {args.sheddable_share}",
            f"  queue_ttl_s: {args.ttl}",
            "  retry_after_s: 1",
            "  objectives: {critical: {priority: 10}, batch: {priority: -1}}",
        ]
    return "\n".join(lines) + "\n"


def run_load(args: argparse.Namespace) -> dict[str, dict[str, ClassResult]]:
    """The same load without and with flow control, each on a fresh stack."""
    out: dict[str, dict[str, ClassResult]] = {}
    rates = {"critical": args.critical_rate, "sheddable": args.sheddable_rate}
    for label, flow in (("without flow control", False), ("with flow control", True)):
        with tempfile.TemporaryDirectory() as tmp:
            config = Path(tmp) / "router.yaml"
            config.write_text(_router_config(flow, args))
            stack = GatewayStack(
                sim_workers=args.workers,
                sim_worker_options={"no_kv_events": True, "speedup": args.speedup},
                policy="least-load",
                config=config,
                body_mode="streamed",
                max_message_timeout_ms=int(args.ttl * 1000) + 2000,
                upstream_host_header=False,
            )
            with stack:
                out[label] = asyncio.run(_load(stack.url, rates, args.duration, args))
    return out


def format_table(results: dict[str, dict[str, ClassResult]], target_s: float) -> str:
    lines = [
        f"Flow control past saturation (TTFT target of critical: {target_s:g} s; seconds)",
        "",
        "| run | class | sent | 200 | 429 | 5xx | other | hung | lost | TTFT p50 | TTFT p99 |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, classes in results.items():
        for name, r in classes.items():
            p50, p99 = r.ttft(50), r.ttft(99)
            lines.append(
                f"| {label} | {name} | {r.sent} | {r.ok} | {r.shed} | {r.server_errors} | {r.other} | {r.hung} | "
                f"{r.lost} | {'-' if p50 is None else f'{p50:.3f}'} | {'-' if p99 is None else f'{p99:.3f}'} |"
            )
    return "\n".join(lines)


def configure(parser: argparse.ArgumentParser) -> None:
    load = parser.add_argument_group("load (two Poisson streams of unique streamed chats)")
    load.add_argument("--duration", type=positive(float), default=40.0, help="Seconds of arrivals per run.")
    load.add_argument("--critical-rate", type=positive(float), default=6.0, help="Critical requests per second.")
    load.add_argument("--sheddable-rate", type=positive(float), default=12.0, help="Sheddable requests per second.")
    load.add_argument("--prompt-words", type=positive(int), default=1500, help="Words of each (unique) prompt.")
    load.add_argument("--max-tokens", type=positive(int), default=128, help="Tokens generated per request.")
    load.add_argument(
        "--target", type=positive(float), default=1.0, help="TTFT target of the critical class (s), reported."
    )
    load.add_argument("--hang-s", type=positive(float), default=120.0, help="A stream not finished after this is hung.")
    load.add_argument("--seed", type=int, default=0, help="Seed of the prompts and arrivals.")
    flow = parser.add_argument_group("the workers and flow control")
    flow.add_argument("--workers", type=positive(int), default=2, help="Simulated workers.")
    flow.add_argument(
        "--speedup", type=positive(float), default=1.0, help="Simulated workers run this many times faster."
    )
    flow.add_argument("--max-in-flight", type=positive(int), default=8, help="Flow control's bound per worker.")
    flow.add_argument(
        "--sheddable-share", type=float, default=0.5, help="Share of that bound sheddable requests may use."
    )
    flow.add_argument("--ttl", type=positive(float), default=10.0, help="Flow control's queue TTL (s).")


def main(args: argparse.Namespace) -> int:
    try:
        results = run_load(args)
    except Exception as exc:  # a failed start names the part and quotes its log
        print(f"prefix-router bench: {exc}", file=sys.stderr)
        return 1
    print(format_table(results, args.target))
    critical = results["with flow control"]["critical"]
    p99 = critical.ttft(99)
    print()
    print(
        f"critical TTFT p99 with flow control: {'-' if p99 is None else f'{p99:.3f} s'} "
        f"({'within' if p99 is not None and p99 <= args.target else 'NOT within'} the {args.target:g} s target); "
        f"mean TTFT without: {statistics.fmean(results['without flow control']['critical'].ttfts or [0.0]):.3f} s"
    )
    return 0

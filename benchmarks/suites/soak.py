"""``prefix-router bench --suite soak``: minutes of load at about 80 % of capacity while workers and the router
are killed on a schedule.

One supervised ``GatewayStack`` (simulated workers with GPU pacing, the router, Envoy), as
``prefix-router up`` runs it. First a closed-loop burst measures what the stack serves per second;
then an open-loop client sends chat requests at ``--load`` times that rate (conversations sharing
system prompts, so prefix routing has work to do) for ``--duration`` seconds while a schedule
SIGKILLs one worker every ``--kill-worker-every`` seconds and the router every ``--kill-router-every``
seconds; the supervisor restarts each. It reports:

- requests lost: every failure except those in flight on a worker when it was killed (sent before
  the kill, ended within seconds after it, by that worker or with no worker named). Target: none.
  Half of the requests stream: a request reset before its worker answered is retried on the next
  worker by Envoy, so what a killed worker costs is the streams it had already started;
- in flight at the end: the router's count per worker, each worker's running and waiting requests
  and Envoy's active upstream requests, once the client has stopped. Target: all zero;
- RSS over time of the router (whichever process is current) and of Envoy.

The default run takes about four minutes. For the memory bound, ``--distinct-words 300
--kill-worker-every 0 --kill-router-every 0`` gives every request a prompt never seen before, so the
router's index and caches fill to ``memory.budget_bytes``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.argtypes import positive
from benchmarks.fleet.procs import rss_mb
from benchmarks.stats import sorted_percentile
from benchmarks.workloads.base import PLAIN_WORDS
from prefix_router.stack import GatewayStack

__all__ = ["SoakReport", "configure", "main", "run_soak"]


@dataclass
class _Result:
    sent: float
    done: float
    status: int | str
    upstream: str | None
    error: str = ""


@dataclass
class Kill:
    at: float
    what: str  # "worker http://..." or "router"
    host: str | None = None  # ip:port of a killed worker


@dataclass
class SoakReport:
    capacity_rps: float
    rate_rps: float
    duration_s: float
    sent: int = 0
    ok: int = 0
    in_flight_on_killed: int = 0
    lost: list[dict[str, Any]] = field(default_factory=list)
    latency_p50_s: float = 0.0
    latency_p99_s: float = 0.0
    kills: list[dict[str, Any]] = field(default_factory=list)
    restarts: list[str] = field(default_factory=list)
    in_flight_at_end: dict[str, float] = field(default_factory=dict)
    memory_mb: dict[str, str] = field(default_factory=dict)  # part -> "held / limit" at the end
    rss_mb: list[dict[str, float]] = field(default_factory=list)

    def format(self) -> str:
        lines = [
            f"capacity (closed loop)     {self.capacity_rps:.1f} req/s",
            f"offered load               {self.rate_rps:.1f} req/s for {self.duration_s:.0f} s",
            f"requests sent              {self.sent}",
            f"  succeeded                {self.ok}",
            f"  in flight on a killed worker (failed, expected)  {self.in_flight_on_killed}",
            f"  lost (any other failure) {len(self.lost)}",
            f"latency p50 / p99          {self.latency_p50_s * 1000:.0f} / {self.latency_p99_s * 1000:.0f} ms",
            "kills                      " + ", ".join(f"{k['what']} at {k['at_s']:.0f}s" for k in self.kills),
            "in flight at the end       " + ", ".join(f"{k}={v:g}" for k, v in self.in_flight_at_end.items()),
            "router caches (MB)         " + ", ".join(f"{k} {v}" for k, v in self.memory_mb.items()),
            "RSS over time (MB)         t_s: router / envoy",
        ]
        lines += [
            f"    {r['t_s']:5.0f}: "
            + (f"{r['router']:6.1f}" if r["router"] else "(restarting)")
            + f" / {r['envoy']:6.1f}"
            for r in self.rss_mb
        ]
        lines += ["supervisor"] + [f"    {line}" for line in self.restarts]
        for item in self.lost[:20]:
            lines.append(f"  lost: {item}")
        return "\n".join(lines)


def _conversation(rng: random.Random, systems: list[str], i: int, distinct_words: int = 0) -> dict[str, Any]:
    system = rng.choice(systems)
    if distinct_words:  # a prompt never seen before: fills the router's index and caches (memory check)
        system = f"Document {i}: " + " ".join(
            f"{rng.choice(_WORDS)}{rng.randrange(10**6)}" for _ in range(distinct_words)
        )
    return {
        "stream": i % 2 == 1,  # half of them streamed: a killed worker's streams end cut short
        "model": "default",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": f"question {i}: " + " ".join(rng.choice(_WORDS) for _ in range(40))},
        ],
        "max_tokens": 32,
    }


_WORDS = PLAIN_WORDS[:15]


async def _post(session: aiohttp.ClientSession, url: str, body: dict[str, Any], t0: float) -> _Result:
    sent = time.monotonic() - t0
    try:
        async with session.post(url + "/v1/chat/completions", json=body) as response:
            data = await response.read()
            status: int | str = response.status
            error = "" if status == 200 else data[:160].decode(errors="replace")
            if status == 200 and body.get("stream") and not data.rstrip().endswith(b"data: [DONE]"):
                status, error = "incomplete stream", data[-160:].decode(errors="replace")
            return _Result(sent, time.monotonic() - t0, status, response.headers.get("x-upstream-host"), error)
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return _Result(sent, time.monotonic() - t0, type(exc).__name__, None, str(exc)[:160])


async def _capacity(url: str, systems: list[str], concurrency: int, seconds: float, distinct_words: int) -> float:
    rng = random.Random(1)
    done = 0
    deadline = time.monotonic() + seconds
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:

        async def client(k: int) -> None:
            nonlocal done
            i = k
            while time.monotonic() < deadline:
                result = await _post(session, url, _conversation(rng, systems, -1 - i, distinct_words), 0.0)
                done += result.status == 200
                i += concurrency

        started = time.monotonic()
        await asyncio.gather(*(client(k) for k in range(concurrency)))
    return done / (time.monotonic() - started)


def _parts(text: str, name: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith(name + '{part="'):
            out[line.split('"')[1]] = float(line.rsplit(" ", 1)[1])
    return out


async def _in_flight(stack: GatewayStack) -> tuple[dict[str, float], dict[str, str]]:
    """Requests still in flight (router, workers, Envoy) and the router's caches ("held/limit" MB)."""
    out: dict[str, float] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        async with session.get(f"http://127.0.0.1:{stack.metrics_port}/metrics") as r:
            text = await r.text()
        held = _parts(text, "prefix_router_memory_bytes")
        limits = _parts(text, "prefix_router_memory_limit_bytes")
        memory = {p: f"{held.get(p, 0) / 2**20:.1f}/{limits[p] / 2**20:.1f}" for p in limits}
        out["router"] = sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("prefix_router_worker_in_flight{")
        )
        workers = 0.0
        for url in stack.worker_urls:
            async with session.get(url + "/v1/loads?include=core&format=json") as r:
                loads = (await r.json())["loads"]
            workers += sum(rank["num_running_reqs"] + rank["num_waiting_reqs"] for rank in loads)
        out["workers"] = workers
        async with session.get(stack.admin_url + "/stats?format=json") as r:
            stats = (await r.json())["stats"]
        out["envoy_upstream_active"] = sum(
            s["value"] for s in stats if s.get("name", "").endswith(".upstream_rq_active") and "value" in s
        )
    return out, memory


def _tally(report: SoakReport, results: list[_Result], kills: list[Kill], grace_s: float) -> None:
    """Count each request as served, ended in flight on a worker that was killed (within ``grace_s``), or lost."""
    worker_kills = [k for k in kills if k.host is not None]
    ok_latencies = []
    for r in results:
        report.sent += 1
        if r.status == 200:
            report.ok += 1
            ok_latencies.append(r.done - r.sent)
            continue
        in_flight = any(
            k.at >= r.sent and r.done - k.at < grace_s and r.upstream in (None, k.host) for k in worker_kills
        )
        if in_flight:
            report.in_flight_on_killed += 1
        else:
            report.lost.append(
                {"sent_s": round(r.sent, 2), "status": r.status, "upstream": r.upstream, "error": r.error}
            )
    if ok_latencies:
        ok_latencies.sort()
        report.latency_p50_s = sorted_percentile(ok_latencies, 50)
        report.latency_p99_s = sorted_percentile(ok_latencies, 99)


async def run_soak(args: argparse.Namespace) -> SoakReport:
    rng = random.Random(args.seed)
    systems = [
        f"You are assistant number {k}. " + " ".join(rng.choice(_WORDS) for _ in range(args.system_words))
        for k in range(args.systems)
    ]
    stack = GatewayStack(
        sim_workers=args.workers,
        sim_worker_options={"speedup": args.speedup, "capacity_tokens": args.capacity_tokens},
        policy=args.policy,
        access_log=False,
        own_sessions=True,
    )
    await stack.start()
    said: list[str] = []
    t0 = time.monotonic()

    def say(line: str) -> None:
        said.append(f"{time.monotonic() - t0:6.1f}s {line}")

    stop = asyncio.Event()
    supervisor = asyncio.create_task(stack.supervise(stop, say))
    try:
        capacity = args.rate or await _capacity(stack.url, systems, args.concurrency, args.probe_s, args.distinct_words)
        rate = capacity * args.load if not args.rate else args.rate
        report = SoakReport(capacity_rps=capacity, rate_rps=rate, duration_s=args.duration)
        kills: list[Kill] = []
        results: list[_Result] = []
        t0 = time.monotonic()

        async def schedule() -> None:
            next_worker, next_router = args.kill_worker_every, args.kill_router_every
            victim = 0
            while True:
                now = time.monotonic() - t0
                if now >= args.duration - 5:
                    return
                if args.kill_worker_every and now >= next_worker:
                    sim = stack.sim_processes[victim % len(stack.sim_processes)]
                    victim += 1
                    if sim.alive():
                        os.kill(sim.process.pid, signal.SIGKILL)
                        kills.append(Kill(now, f"worker {sim.url}", sim.url.removeprefix("http://")))
                    next_worker += args.kill_worker_every
                if args.kill_router_every and now >= next_router:
                    router = stack.router_process
                    if router is not None and router.poll() is None:
                        router.kill()
                        kills.append(Kill(now, "router"))
                    next_router += args.kill_router_every
                await asyncio.sleep(0.05)

        async def sample_rss() -> None:
            while True:
                envoy = stack._envoy.process.pid if stack._envoy is not None else None
                router = stack.router_process.pid if stack.router_process is not None else None
                report.rss_mb.append({"t_s": time.monotonic() - t0, "router": rss_mb(router), "envoy": rss_mb(envoy)})
                await asyncio.sleep(args.rss_every)

        killer = asyncio.create_task(schedule())
        sampler = asyncio.create_task(sample_rss())
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=args.request_timeout)) as session:
            tasks = []
            i = 0
            while (elapsed := time.monotonic() - t0) < args.duration:
                body = _conversation(rng, systems, i, args.distinct_words)
                tasks.append(asyncio.create_task(_post(session, stack.url, body, t0)))
                i += 1
                await asyncio.sleep(max(0.0, i / rate - elapsed))
            results = await asyncio.gather(*tasks)
        killer.cancel()
        await asyncio.sleep(1.0)  # let the last stream ends reach the router
        report.in_flight_at_end, report.memory_mb = await _in_flight(stack)
        sampler.cancel()
        report.rss_mb.append(
            {
                "t_s": time.monotonic() - t0,
                "router": rss_mb(stack.router_process.pid if stack.router_process else None),
                "envoy": rss_mb(stack._envoy.process.pid if stack._envoy else None),
            }
        )
    finally:
        stop.set()
        await asyncio.gather(supervisor, return_exceptions=True)
        await stack.stop()

    _tally(report, results, kills, args.grace_s)
    report.kills = [{"what": k.what, "at_s": round(k.at, 1)} for k in kills]
    report.restarts = said
    return report


def configure(parser: argparse.ArgumentParser) -> None:
    load = parser.add_argument_group("load")
    load.add_argument("--duration", type=positive(float), default=180.0, help="Seconds of open-loop load.")
    load.add_argument("--load", type=positive(float), default=0.8, help="Offered load as a fraction of capacity.")
    load.add_argument("--rate", type=float, default=0.0, help="Requests per second (skips the capacity probe).")
    load.add_argument("--concurrency", type=positive(int), default=32, help="Clients of the capacity probe.")
    load.add_argument("--probe-s", type=positive(float), default=15.0, help="Seconds of the capacity probe.")
    load.add_argument(
        "--request-timeout", type=positive(float), default=60.0, help="Client timeout per request (a hang fails)."
    )
    load.add_argument("--systems", type=positive(int), default=8, help="Distinct system prompts the requests share.")
    load.add_argument("--system-words", type=positive(int), default=300, help="Words per system prompt.")
    load.add_argument(
        "--distinct-words",
        type=int,
        default=0,
        help="Give every request a system prompt of this many new words (about 6 tokens each): fills the caches.",
    )
    load.add_argument("--seed", type=int, default=0, help="Seed of the prompts.")
    stack = parser.add_argument_group("stack and kills")
    stack.add_argument("--workers", type=positive(int), default=3, help="Simulated workers.")
    stack.add_argument("--policy", default="prefix-aware", help="Routing policy.")
    stack.add_argument("--speedup", type=positive(float), default=1.0, help="Simulated GPU speed-up of the workers.")
    stack.add_argument(
        "--capacity-tokens",
        type=positive(int),
        default=None,
        help="KV pool of each worker (default: the profile's); a large one lets the index outgrow the budget.",
    )
    stack.add_argument(
        "--kill-worker-every", type=float, default=30.0, help="SIGKILL a worker this often in seconds (0: never)."
    )
    stack.add_argument(
        "--kill-router-every", type=float, default=45.0, help="SIGKILL the router this often in seconds (0: never)."
    )
    stack.add_argument(
        "--grace-s", type=float, default=5.0, help="A failure this soon after a worker kill counts as in flight."
    )
    stack.add_argument("--rss-every", type=positive(float), default=15.0, help="Seconds between RSS samples.")
    stack.add_argument("--json", type=Path, help="Also write the report as JSON here.")


def main(args: argparse.Namespace) -> int:
    report = asyncio.run(run_soak(args))
    print(report.format())
    if args.json:
        args.json.write_text(json.dumps(report.__dict__, indent=2))
    failed = report.lost or any(v for v in report.in_flight_at_end.values())
    return 1 if failed else 0

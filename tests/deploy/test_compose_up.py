"""The compose stack, up for real: images built, containers started, requests through the gateway's port.

A Docker engine of the test's own (``tests/support/container_engine.py``: dockerd with its own socket,
data, bridge and containerd, stopped by PID) builds every image the ``sim`` profile needs without an
image registry (``tests/support/local_images.py``), then the repository's own ``docker-compose.yml``
runs as a user runs it, ``docker compose --env-file deploy/compose/local-images.env --profile sim up -d
--build``: Envoy, two router replicas sharing decisions through Valkey, two simulated workers,
Prometheus, and OTLP receivers. What is checked, in order: every generation path streamed and not; a
repeated long prompt served from cache by one worker through both replicas; prefix bursts kept on their
first holder; a router replica and a worker killed (and Valkey stopped) under a steady request loop,
with no request lost beyond those in flight on the killed worker and every container back by itself;
Prometheus's own API showing every target up; spans arriving over OTLP; ``down -v`` leaving nothing.

Stand-ins, said where they matter: Valkey is Debian's Redis 7.0 (bookworm has no Valkey); the
OpenTelemetry Collector and Jaeger are Rotel (PyPI ``rotel``), which really receives OTLP, so the span
check proves spans leave the router and cross two OTLP hops, not that the real collector's config is
right. Needs root, the Debian packages docker.io, containerd, iptables and debootstrap, and the package
indexes (Debian, PyPI); skipped with the reason otherwise. ~3 minutes from nothing on 2 cores; set
PREFIX_ROUTER_DOCKER_ROOT to a directory to keep the engine's images there between runs.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from benchmarks.suites.compose_replicas import (
    MODEL,
    compose_argv,
    measure,
    replica_decisions,
    small_burst,
    wait_for_gateway,
)
from benchmarks.workloads.base import block_text
from prefix_common.addresses import free_port
from tests.support.container_engine import DockerEngine, engine_unavailable_reason
from tests.support.local_images import ENV_FILE, build_local_images, images_unavailable_reason

pytestmark = [pytest.mark.compose, pytest.mark.timeout(1800)]

PROJECT = "prefix-router-test"
WORKER_SERVICES = ("sim-worker-0", "sim-worker-1")
ROUTER_SERVICE = "router-sim"


@dataclass
class Stack:
    """The running stack: its engine, the published ports (``env``, for compose) and the test's reporter."""

    engine: DockerEngine
    env: dict[str, str]
    gateway: str
    prometheus: str
    say: Callable[[str], None]
    down_done: bool = False

    def compose(self, *args: str, check: bool = True, timeout: float = 900) -> subprocess.CompletedProcess[str]:
        """``docker compose`` on the repository's file, the local images' env file, this project, profile sim."""
        argv = compose_argv(PROJECT, ENV_FILE)[2:]  # without "docker compose"
        return self.engine.compose(*argv, *args, env=self.env, check=check, timeout=timeout)

    def containers(self, service: str) -> list[str]:
        ids = self.compose("ps", "-q", service).stdout.split()
        return [self.inspect(i, "{{.Name}}").lstrip("/") for i in ids]

    def inspect(self, container: str, template: str) -> str:
        return self.engine.docker("inspect", "-f", template, container).stdout.strip()

    def address(self, container: str) -> str:
        return self.inspect(container, "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}")

    def describe(self, container: str) -> str:
        """State, restarts and the end of the log of one container: what a failure message needs."""
        state = self.inspect(container, "{{.State.Status}} restarts={{.RestartCount}} started={{.State.StartedAt}}")
        log = self.engine.docker("logs", "--tail", "40", container, check=False)
        return f"{container}: {state}\n{log.stdout[-3000:]}{log.stderr[-3000:]}"

    def logs(self, service: str) -> str:
        return self.compose("logs", "--no-color", service, check=False).stdout


def _reporter(request: pytest.FixtureRequest) -> Callable[[str], None]:
    terminal = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")

    def say(text: str) -> None:
        # Straight to the terminal, past output capture, so the CI log shows the figures of a passing run.
        if terminal is not None and capture is not None:
            with capture.global_and_fixture_disabled():
                terminal.write_line(f"[compose] {text}")

    return say


@pytest.fixture(scope="module")
def stack(request: pytest.FixtureRequest) -> Iterator[Stack]:
    reason = engine_unavailable_reason() or images_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    say = _reporter(request)
    kept = os.environ.get("PREFIX_ROUTER_DOCKER_ROOT")
    with tempfile.TemporaryDirectory(prefix="prefix-router-docker-") as tmp:
        root = Path(kept) if kept else Path(tmp)
        started = time.monotonic()
        with DockerEngine(root.resolve(), keep_data=bool(kept)) as engine:
            say(
                f"engine: dockerd {engine.docker('version', '--format', '{{.Server.Version}}').stdout.strip()} "
                f"under {root}, bridge {engine.bridge}, started in {time.monotonic() - started:.0f} s"
            )
            build_local_images(engine, log=say)
            ports = {name: free_port() for name in ("GATEWAY_PORT", "PROMETHEUS_PORT", "JAEGER_UI_PORT")}
            env = {key: str(value) for key, value in ports.items()}
            up = Stack(
                engine,
                env,
                gateway=f"http://127.0.0.1:{ports['GATEWAY_PORT']}",
                prometheus=f"http://127.0.0.1:{ports['PROMETHEUS_PORT']}",
                say=say,
            )
            step = time.monotonic()
            try:
                up.compose("up", "-d", "--build")
                replicas = [up.address(c) for c in up.containers(ROUTER_SERVICE)]
                asyncio.run(wait_for_gateway(up.gateway, replicas))
                say(f"docker compose --profile sim up -d --build: serving in {time.monotonic() - step:.0f} s")
                yield up
            finally:
                if not up.down_done:
                    up.compose("down", "-v", "--remove-orphans", check=False)
                say(f"whole compose test: {time.monotonic() - started:.0f} s")


# -- requests --------------------------------------------------------------------------------------------------


@dataclass
class Reply:
    status: int
    upstream: str | None
    body: dict[str, Any] | None = None  # the JSON body (not streamed)
    events: list[dict[str, Any]] = field(default_factory=list)  # the SSE events (streamed)
    done: bool = False  # a stream ended with [DONE]
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.status == 200 and (self.body is not None or self.done)

    @property
    def cached_tokens(self) -> int:
        for part in [self.body or {}, *self.events]:
            details = (part.get("usage") or {}).get("prompt_tokens_details") or {}
            cached = details.get("cached_tokens") or (part.get("meta_info") or {}).get("cached_tokens")
            if cached:
                return int(cached)
        return 0


async def _send(session: aiohttp.ClientSession, base: str, path: str, payload: dict[str, Any]) -> Reply:
    try:
        async with session.post(base + path, json=payload) as response:
            reply = Reply(response.status, response.headers.get("x-upstream-host"))
            if not payload.get("stream"):
                reply.body = await response.json(content_type=None)
                return reply
            async for raw in response.content:
                line = raw.strip()
                if line.startswith(b"data:"):
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        reply.done = True
                    else:
                        reply.events.append(json.loads(data))
            return reply
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        return Reply(0, None, error=f"{type(exc).__name__}: {exc}")


def _payload(path: str, text: str, stream: bool, max_tokens: int = 8) -> dict[str, Any]:
    if path == "/generate":
        return {"text": text, "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0}, "stream": stream}
    body: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if path == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    return body


def _session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))


def _router_metric(address: str, name: str, label: str = "") -> float:
    """The sum of one counter's samples on a router replica's metrics port (the engine's bridge is routable)."""
    with urllib.request.urlopen(f"http://{address}:9102/metrics", timeout=5) as response:
        text = response.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and (not label or label in line) and not line.startswith("#")
    )


# -- the checks, in order --------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/generate"])
async def test_every_generation_path_through_the_gateway(stack: Stack, path: str, stream: bool) -> None:
    async with _session() as session:
        reply = await _send(session, stack.gateway, path, _payload(path, f"tell me about {path} {stream}", stream))
    assert reply.ok, reply
    assert reply.upstream, "the gateway names the worker that served (x-upstream-host)"
    if stream:
        assert reply.events, "no events before [DONE]"
        text = "".join(
            str((c.get("delta") or {}).get("content") or c.get("text") or "")
            for e in reply.events
            for c in e.get("choices") or [{"text": e.get("text", "")}]
        )
    else:
        assert reply.body is not None
        choices = reply.body.get("choices") or [{"text": reply.body.get("text", "")}]
        text = str((choices[0].get("message") or {}).get("content") or choices[0].get("text") or "")
    assert text.strip(), f"{path} stream={stream}: no generated text in {reply}"
    stack.say(f"{path} stream={stream}: 200 from {reply.upstream}")


async def test_a_repeated_long_prompt_is_served_from_one_workers_cache_through_both_replicas(stack: Stack) -> None:
    replicas = {c: stack.address(c) for c in stack.containers(ROUTER_SERVICE)}
    assert len(replicas) == 2, replicas

    def decisions(container: str) -> float:
        try:
            return replica_decisions(replicas[container])
        except OSError as exc:
            where = f"metrics of {container} at {replicas[container]}"
            raise AssertionError(f"{where}: {exc}\n{stack.describe(container)}") from exc

    before = {c: decisions(c) for c in replicas}
    prompt = block_text("compose-test/long", 0, 1200)  # 1,200 tokens of the default tokenizer
    replies = []
    async with _session() as session:
        for i in range(8):  # Envoy spreads ext_proc streams round robin: 8 requests reach both replicas
            stream = i % 2 == 1
            replies.append(
                await _send(session, stack.gateway, "/v1/completions", _payload("/v1/completions", prompt, stream))
            )
    assert all(r.ok for r in replies), replies
    decided = {c: decisions(c) - before[c] for c in replicas}
    assert all(count >= 1 for count in decided.values()), f"decisions per replica: {decided}"
    upstreams = {r.upstream for r in replies}
    assert len(upstreams) == 1, f"the prompt went to {upstreams}"
    cached = [r.cached_tokens for r in replies]
    assert all(c > 0 for c in cached[1:]), f"cached tokens per request: {cached}"
    stack.say(f"long prompt x8: one worker {upstreams.pop()}, cached tokens {cached}, decisions per replica {decided}")


async def test_prefix_bursts_stay_on_their_first_holder(stack: Stack) -> None:
    """benchmarks/suites/compose_replicas.py's measurement on a small burst workload (its figures are printed)."""
    figures = await measure(stack.gateway, small_burst(seed=7), shared_state="redis", seed=7)
    assert figures.errors == 0, figures
    assert figures.hit_rate > 0.5, figures  # the 2nd..4th request of a burst and every 2nd burst reuse the prefix
    assert figures.first_holder_share >= 0.75, figures
    stack.say(
        f"bursts: {figures.requests} requests, hit rate {figures.hit_rate:.3f}, first-holder share "
        f"{figures.first_holder_share:.3f}, TTFT p50/p99 {figures.ttft_p50_s * 1000:.0f}/"
        f"{figures.ttft_p99_s * 1000:.0f} ms, per worker {figures.requests_per_worker}"
    )


# -- kills under a steady loop -----------------------------------------------------------------------------------


@dataclass
class Sent:
    start: float
    end: float
    reply: Reply


async def _request_loop(stack: Stack, client: int, stop: asyncio.Event, out: list[Sent]) -> None:
    system = block_text("compose-test/loop-system", client, 96)  # each client's own shared prefix (6 blocks)
    async with _session() as session:
        for i in range(1_000_000):
            if stop.is_set():
                return
            stream = i % 2 == 0
            path = "/v1/chat/completions" if i % 3 else "/v1/completions"
            payload = _payload(path, f"{system} question {i}", stream, max_tokens=16)
            start = time.monotonic()
            reply = await _send(session, stack.gateway, path, payload)
            out.append(Sent(start, time.monotonic(), reply))


async def _shared_decisions(replicas: list[str], direction: str) -> list[float]:
    """Each replica's count of decisions shared with the others in one direction (published, dropped)."""
    return [
        await asyncio.to_thread(
            _router_metric, address, "prefix_router_shared_decisions_total", f'direction="{direction}"'
        )
        for address in replicas
    ]


async def _wait_back(stack: Stack, container: str, restarts_before: int, timeout_s: float = 120) -> float:
    """Seconds until ``container`` restarted by itself (restart policy) and reports healthy again."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        state = await asyncio.to_thread(
            stack.inspect,
            container,
            "{{.State.Status}} {{.RestartCount}} {{if .State.Health}}{{.State.Health.Status}}{{end}}",
        )
        status, restarts, *health = state.split()
        if status == "running" and int(restarts) > restarts_before and health == ["healthy"]:
            return time.monotonic() - started
        await asyncio.sleep(0.5)
    raise AssertionError(f"{container} not back after {timeout_s:.0f} s: {state}")


async def _crash(stack: Stack, container: str) -> tuple[float, int]:
    """SIGKILL the container's main process from the host (a crash, not `docker stop`); (when, restarts before)."""
    pid = int(await asyncio.to_thread(stack.inspect, container, "{{.State.Pid}}"))
    restarts = int(await asyncio.to_thread(stack.inspect, container, "{{.RestartCount}}"))
    at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    return at, restarts


async def test_kills_under_a_steady_loop_lose_only_what_was_in_flight_and_the_stack_heals(stack: Stack) -> None:
    (router,) = [c for c in stack.containers(ROUTER_SERVICE) if c.endswith("-1")]
    (worker,) = stack.containers(WORKER_SERVICES[0])
    (valkey,) = stack.containers("valkey")
    worker_address = f"{stack.address(worker)}:30000"
    sent: list[Sent] = []
    stop = asyncio.Event()
    clients = [asyncio.create_task(_request_loop(stack, c, stop, sent)) for c in range(4)]
    events: list[str] = []
    try:
        await asyncio.sleep(3)
        killed_router_at, restarts = await _crash(stack, router)
        back = await _wait_back(stack, router, restarts)
        events.append(f"router replica {router} SIGKILLed: back and healthy after {back:.1f} s")
        await asyncio.sleep(2)
        killed_worker_at, restarts = await _crash(stack, worker)
        back = await _wait_back(stack, worker, restarts)
        events.append(f"worker {worker} ({worker_address}) SIGKILLed: back and healthy after {back:.1f} s")
        await asyncio.sleep(2)
        replicas = [stack.address(c) for c in stack.containers(ROUTER_SERVICE)]  # the restarted one may have moved
        await asyncio.to_thread(stack.engine.docker, "stop", "-t", "2", valkey)
        valkey_stopped_at = time.monotonic()
        await asyncio.sleep(4)
        dropped = sum(await _shared_decisions(replicas, "dropped"))
        await asyncio.to_thread(stack.engine.docker, "start", valkey)
        valkey_started_at = time.monotonic()
        events.append(
            f"valkey stopped for {valkey_started_at - valkey_stopped_at:.1f} s: {dropped:.0f} decisions not shared"
        )
        published = await _shared_decisions(replicas, "published")
        await asyncio.sleep(6)
        published_after = await _shared_decisions(replicas, "published")
    finally:
        stop.set()
        await asyncio.gather(*clients)
    failed = [s for s in sent if not s.reply.ok]
    in_flight_on_worker = [
        s for s in failed if s.start <= killed_worker_at <= s.end and s.reply.upstream in (None, worker_address)
    ]
    others = [s for s in failed if s not in in_flight_on_worker]
    for line in events:
        stack.say(line)
    stack.say(
        f"steady loop (4 clients, chat/completions, half streamed): {len(sent)} requests, {len(sent) - len(failed)} "
        f"served, {len(in_flight_on_worker)} failed in flight on the killed worker, {len(others)} other failures"
    )
    assert len(sent) > 100, "the loop hardly ran"
    assert not others, [(round(s.start - killed_router_at, 2), s.reply) for s in others[:5]]
    during_valkey = [s for s in sent if valkey_stopped_at <= s.start <= valkey_started_at]
    assert during_valkey and all(s.reply.ok for s in during_valkey), "routing must go on with Valkey down"
    assert dropped > 0, "with Valkey down the replicas' decisions were not even attempted"
    assert all(b > a for a, b in zip(published, published_after)), (
        f"the replicas publish again once Valkey is back: {published} -> {published_after}"
    )
    # Full strength again, by itself: every container of the stack running, every healthcheck healthy.
    for service in (ROUTER_SERVICE, *WORKER_SERVICES, "envoy", "valkey", "prometheus", "otel-collector", "jaeger"):
        for container in stack.containers(service):
            state = stack.inspect(container, "{{.State.Status}} {{if .State.Health}}{{.State.Health.Status}}{{end}}")
            assert state.split()[0] == "running" and state.split()[1:] in ([], ["healthy"]), (container, state)


# -- observability ---------------------------------------------------------------------------------------------------


def test_prometheus_api_shows_every_target_up(stack: Stack) -> None:
    expected = {"router": 2, "workers": 2, "envoy": 1, "prometheus": 1}
    deadline = time.monotonic() + 90  # DNS discovery refreshes every 10 s; a restarted replica may move
    while True:
        with urllib.request.urlopen(f"{stack.prometheus}/api/v1/targets?state=active", timeout=10) as response:
            targets = json.loads(response.read())["data"]["activeTargets"]
        up: dict[str, list[str]] = {}
        down: list[str] = []
        for target in targets:
            (up.setdefault(target["labels"]["job"], []) if target["health"] == "up" else down).append(
                target["labels"]["instance"]
            )
        if {job: len(instances) for job, instances in up.items()} == expected and not down:
            break
        assert time.monotonic() < deadline, f"targets up {up}, not up {down}"
        time.sleep(2)
    stack.say(f"prometheus /api/v1/targets: every target up: {dict(sorted(up.items()))}")


def test_routing_spans_arrive_over_otlp(stack: Stack) -> None:
    """Router -> OTLP/gRPC -> the collector's stand-in -> OTLP/gRPC -> Jaeger's stand-in, which logs each span."""
    deadline = time.monotonic() + 60  # the router's batch processor sends every 5 s
    while True:
        log = stack.logs("jaeger")
        spans = log.count("Name           : route")
        if spans and "service.name: Str(prefix-router)" in log and "router.chosen" in log:
            break
        assert time.monotonic() < deadline, f"no routing span reached the trace store:\n{log[-2000:]}"
        time.sleep(2)
    stack.say(f"spans: {spans} `route` spans of service prefix-router reached Jaeger's stand-in (Rotel) over OTLP")


def test_down_removes_every_container_network_and_volume(stack: Stack) -> None:
    stack.compose("down", "-v", "--remove-orphans")
    stack.down_done = True
    label = f"label=com.docker.compose.project={PROJECT}"
    left = {
        kind: stack.engine.docker(
            kind, "ls", *(["-a"] if kind == "container" else []), "-q", "--filter", label
        ).stdout.split()
        for kind in ("container", "network", "volume")
    }
    assert left == {"container": [], "network": [], "volume": []}, left
    stack.say("docker compose down -v: no container, network or volume of the project left")

"""A gateway that keeps serving: dead workers, a dead router, supervision (real Envoy, router, workers).

Every test sends real HTTP requests through Envoy on loopback while it kills a child with SIGKILL,
and checks what clients saw: no request sent after a kill fails (requests in flight on a killed
worker may, with a JSON 503, never a hang), and the supervisor brings the child back.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from prefix_common.addresses import free_port
from prefix_router.stack import CrashLoopError, GatewayStack
from tests.support.gateway_http import post
from tests.support.up import gather_stderr, start_up, stop_up

pytestmark = pytest.mark.timeout(180)

PICKED = "cluster.prefix_router_picked"


@dataclass
class Outcome:
    sent: float  # monotonic time the request was sent
    done: float
    status: int | str  # HTTP status, or the exception's name
    upstream: str | None
    body: bytes


async def _send(session: aiohttp.ClientSession, url: str, i: int, stream: bool = False) -> Outcome:
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": f"request number {i}: say something"}],
        "max_tokens": 12,
        "stream": stream,
    }
    sent = time.monotonic()
    try:
        async with session.post(url + "/v1/chat/completions", json=body) as response:
            data = await response.read()
            status: int | str = response.status
            if stream and status == 200 and not data.rstrip().endswith(b"data: [DONE]"):
                status = "incomplete stream"
            return Outcome(sent, time.monotonic(), status, response.headers.get("x-upstream-host"), data)
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return Outcome(sent, time.monotonic(), type(exc).__name__, None, b"")


async def _load(url: str, count: int, rate: float, stream_every: int = 0) -> list[Outcome]:
    """``count`` requests at ``rate`` per second, each on its own task; all awaited (15 s client timeout)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as session:
        tasks = []
        for i in range(count):
            stream = bool(stream_every) and i % stream_every == 0
            tasks.append(asyncio.create_task(_send(session, url, i, stream)))
            await asyncio.sleep(1 / rate)
        return await asyncio.gather(*tasks)


async def _stats(stack: GatewayStack) -> dict[str, int]:
    async with aiohttp.ClientSession() as session, session.get(stack.admin_url + "/stats?format=json") as r:
        data = await r.json()
    return {s["name"]: int(s["value"]) for s in data["stats"] if isinstance(s.get("value"), int)}


async def _router_metric(stack: GatewayStack, name: str, worker: str) -> float | None:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{stack.metrics_port}/metrics") as r,
    ):
        text = await r.text()
    for line in text.splitlines():
        if line.startswith(f'{name}{{worker="{worker}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return None


@pytest.fixture
async def supervised(envoy_bin: str, tmp_path: Path) -> AsyncIterator[tuple[GatewayStack, list[str]]]:
    """Three simulated workers (real GPU pacing, so requests are in flight), round-robin, supervised."""
    stack = GatewayStack(sim_workers=3, policy="round-robin", log_dir=tmp_path / "logs")
    await stack.start()
    said: list[str] = []
    stop = asyncio.Event()
    supervisor = asyncio.create_task(stack.supervise(stop, said.append))
    try:
        yield stack, said
    finally:
        stop.set()
        await supervisor
        await stack.stop()


async def test_killed_worker_costs_only_its_in_flight_requests_and_comes_back(
    supervised: tuple[GatewayStack, list[str]],
) -> None:
    stack, said = supervised
    victim = stack.sim_processes[0]
    victim_host = victim.url.removeprefix("http://")
    load = asyncio.create_task(_load(stack.url, 120, 40.0, stream_every=2))
    await asyncio.sleep(1.5)
    os.kill(victim.process.pid, signal.SIGKILL)
    killed = time.monotonic()
    outcomes = await load
    failed = [o for o in outcomes if o.status != 200]
    after = [o for o in failed if o.sent > killed]
    assert not after, f"requests sent after the kill failed: {after}"
    for o in failed:  # only what was in flight on the victim: a stream cut short, ended at once (no hang)
        assert o.status in ("ClientPayloadError", "incomplete stream") or (o.status == 503 and b'"error"' in o.body), o
        assert o.done - killed < 5.0
    assert any(f"worker {victim.url} exited (killed by SIGKILL)" in line for line in said), said
    deadline = time.monotonic() + 15
    while not any(f"worker {victim.url} is back" in line for line in said):
        assert time.monotonic() < deadline, f"worker not restarted: {said}"
        await asyncio.sleep(0.1)
    # Back in the rotation: the router's health checks take it in again and route to it.
    deadline = time.monotonic() + 10
    while True:
        served = {o.upstream for o in await _load(stack.url, 9, 30.0)}
        if victim_host in served:
            break
        assert time.monotonic() < deadline, f"restarted worker never served again: {served}"


async def test_refused_connection_is_retried_on_the_routers_fallback(envoy_bin: str, tmp_path: Path) -> None:
    """The router is never told the worker died (health and load polls an hour apart, none sooner), so it keeps
    naming it first: every such request must be served by the fallback Envoy retries on."""
    config = tmp_path / "router.yaml"
    config.write_text("health: {interval_s: 3600}\nload: {poll_interval_s: 3600, startup_poll_interval_s: 0}\n")
    async with GatewayStack(
        sim_workers=2,
        sim_worker_options={"profile": "instant"},
        policy="round-robin",
        config=config,
        log_dir=tmp_path / "logs",
    ) as stack:
        victim = stack.sim_processes[1]
        victim.process.kill()
        victim.process.wait()
        outcomes = await _load(stack.url, 20, 50.0)
        stats = await _stats(stack)
    assert [o.status for o in outcomes] == [200] * 20, [o for o in outcomes if o.status != 200]
    victim_host = victim.url.removeprefix("http://")
    assert victim_host not in {o.upstream for o in outcomes}
    # Round-robin named the dead worker first for half of them; each was retried once and served.
    assert stats[f"{PICKED}.upstream_rq_retry_success"] >= 8
    assert stats[f"{PICKED}.upstream_rq_retry_success"] == stats[f"{PICKED}.upstream_rq_retry"]


async def test_router_marks_a_refusing_worker_out_before_any_health_check(envoy_bin: str, tmp_path: Path) -> None:
    config = tmp_path / "router.yaml"
    config.write_text("health: {interval_s: 3600}\nload: {poll_interval_s: 0.2}\n")
    options = {"profile": "instant"}
    async with GatewayStack(
        sim_workers=2, sim_worker_options=options, config=config, log_dir=tmp_path / "logs"
    ) as stack:
        victim = stack.sim_processes[0]
        worker_id = victim.url.removeprefix("http://")
        assert await _router_metric(stack, "prefix_router_worker_healthy", worker_id) == 1.0
        victim.process.kill()
        killed = time.monotonic()
        while await _router_metric(stack, "prefix_router_worker_healthy", worker_id) != 0.0:
            assert time.monotonic() - killed < 3.0, "the router kept the dead worker as a candidate"
            await asyncio.sleep(0.05)


async def test_killed_router_is_restarted_and_nothing_fails_meanwhile(
    supervised: tuple[GatewayStack, list[str]],
) -> None:
    stack, said = supervised
    first = stack.router_process
    assert first is not None
    load = asyncio.create_task(_load(stack.url, 150, 40.0))
    await asyncio.sleep(1.0)
    first.kill()
    outcomes = await load
    assert [o.status for o in outcomes] == [200] * len(outcomes), [o for o in outcomes if o.status != 200]
    assert any("router exited (killed by SIGKILL)" in line for line in said), said
    deadline = time.monotonic() + 20
    while not any("router is back" in line for line in said):
        assert time.monotonic() < deadline, said
        await asyncio.sleep(0.1)
    assert stack.router_process is not None and stack.router_process.pid != first.pid
    stats = await _stats(stack)
    assert stats["http.gateway.ext_proc.failure_mode_allowed"] > 0  # served fail-open while it was down
    before = stats[f"{PICKED}.upstream_rq_total"]
    await _load(stack.url, 6, 30.0)
    assert (await _stats(stack))[f"{PICKED}.upstream_rq_total"] >= before + 6  # the new router decides again


async def test_a_crash_loop_stops_the_supervisor_naming_the_child(envoy_bin: str, tmp_path: Path) -> None:
    options = {"profile": "instant"}
    async with GatewayStack(
        sim_workers=1, sim_worker_options=options, router=False, log_dir=tmp_path / "logs"
    ) as stack:
        worker = stack.sim_processes[0]
        # every restart now exits at once
        worker.launch = dataclasses.replace(worker.launch, argv=[*worker.launch.argv, "--profile", "no-such-profile"])
        worker.process.kill()
        said: list[str] = []
        with pytest.raises(CrashLoopError, match=f"worker {worker.url} exited 3 times"):
            await asyncio.wait_for(stack.supervise(asyncio.Event(), said.append, max_restarts=2), 60)
        assert sum("restarting" in line for line in said) == 2


async def test_ports_taken_before_the_router_and_envoy_bind_them_are_picked_again(
    envoy_bin: str, tmp_path: Path
) -> None:
    """Ports the stack picked itself may be taken before its children bind them (tests run side by side): the
    router and Envoy are started again on new ones."""
    stack = GatewayStack(sim_workers=1, sim_worker_options={"profile": "instant"}, log_dir=tmp_path / "logs")
    taken = {"router_port": stack.router_port, "port": stack.port}
    with socket.socket() as for_router, socket.socket() as for_envoy:
        for sock, port in ((for_router, stack.router_port), (for_envoy, stack.port)):
            sock.bind(("127.0.0.1", port))
            sock.listen()
        async with stack:
            assert stack.router_port != taken["router_port"] and stack.port != taken["port"]
            chat = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            reply = await asyncio.to_thread(post, stack.url + "/v1/chat/completions", chat)
            assert reply.status == 200 and reply.headers.get("x-upstream-host")


def _children(pid: int) -> dict[int, str]:
    """Child pid -> command line, read from /proc."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out[int(entry)] = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError, IndexError):
            continue
    return out


def test_up_restarts_a_killed_worker_and_router_and_serves_throughout(envoy_bin: str) -> None:
    port = free_port()
    up = start_up("--workers", "2", "--port", str(port), "--quiet")
    errors = gather_stderr(up)
    url = f"http://127.0.0.1:{port}"
    chat = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    try:
        deadline = time.monotonic() + 60
        while "Ctrl-C" not in (up.stdout.readline() if up.stdout else ""):
            assert time.monotonic() < deadline and up.poll() is None, "".join(errors)
        children = _children(up.pid)
        (router,) = [pid for pid, cmd in children.items() if " serve " in cmd]
        worker = next(pid for pid, cmd in children.items() if " sim-worker " in cmd)
        for victim, name in ((worker, "worker http://"), (router, "router")):
            os.kill(victim, signal.SIGKILL)
            statuses = [post(url + "/v1/chat/completions", chat).status for _ in range(20)]
            assert statuses == [200] * 20, statuses
            deadline = time.monotonic() + 20
            while not any(name in line and "is back" in line for line in errors):
                assert time.monotonic() < deadline and up.poll() is None, "".join(errors)
                time.sleep(0.1)
        assert any("exited (killed by SIGKILL); restarting" in line for line in errors), errors
        assert up.poll() is None  # one death does not stop the stack any more
        up.send_signal(signal.SIGTERM)
        assert up.wait(30) == 0, "".join(errors)
        assert not _children(up.pid)
    finally:
        stop_up(up)


def _descendants(pid: int) -> dict[int, str]:
    """Every process below ``pid`` (children, their children, ...), pid -> command line."""
    out: dict[int, str] = {}
    frontier = [pid]
    while frontier:
        found = _children(frontier.pop())
        out.update(found)
        frontier.extend(found)
    return out


def _gone(pid: int, cmdline: str) -> bool:
    """Dead: no such process, a zombie (dead, waiting to be reaped), or the pid reused by another command."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        now = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except (OSError, IndexError):
        return True
    return state in ("Z", "X") or now != cmdline


def test_no_child_outlives_up_even_when_up_is_killed(envoy_bin: str) -> None:
    """SIGKILL runs no cleanup in ``up``: the kernel kills its children (PR_SET_PDEATHSIG), restarted ones too."""
    port = free_port()
    up = start_up("--workers", "2", "--port", str(port), "--quiet")  # its own session: only the kill below reaches it
    errors = gather_stderr(up)
    children: dict[int, str] = {}
    try:
        deadline = time.monotonic() + 60
        while "gateway is up" not in (up.stdout.readline() if up.stdout else ""):
            assert time.monotonic() < deadline and up.poll() is None, "".join(errors)
        # A restarted worker is spawned again (from another thread of ``up``): it must die with ``up`` too.
        worker = next(pid for pid, cmd in _children(up.pid).items() if " sim-worker " in cmd)
        os.kill(worker, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not any("is back" in line for line in errors):
            assert time.monotonic() < deadline and up.poll() is None, "".join(errors)
            time.sleep(0.1)
        children = _descendants(up.pid)
        kinds = [cmd for cmd in children.values() if " sim-worker " in cmd]
        assert len(kinds) == 2 and worker not in children, children
        assert any(" serve " in cmd for cmd in children.values()), children
        assert any("envoy" in cmd and " serve " not in cmd and " sim-worker " not in cmd for cmd in children.values())
        up.kill()
        up.wait(10)
        deadline = time.monotonic() + 5
        while not all(_gone(pid, cmd) for pid, cmd in children.items()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert {pid: cmd for pid, cmd in children.items() if not _gone(pid, cmd)} == {}
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        for pid, cmd in children.items():  # whatever survived a failed run must not leak into the next test
            if not _gone(pid, cmd):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

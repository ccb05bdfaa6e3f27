"""``prefix-router serve --processes N`` behind the real Envoy: every process decides, a killed one costs nothing."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import yaml

from prefix_common.addresses import free_port, free_port_run, split_host_port
from prefix_router.envoy_config import GatewaySpec, bootstrap
from prefix_router.fleet import start_fleet
from sglang_workers.process import WorkerProcess

pytestmark = pytest.mark.timeout(180)

PROCESSES = 2


def _wait_http(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        assert time.monotonic() < deadline, f"{url} never answered"
        time.sleep(0.2)


def _pids(log: Path) -> dict[int, int]:
    """Process index -> its latest pid, from the supervisor's log lines."""
    found: dict[int, int] = {}
    for match in re.finditer(r"router process (\d+) \(pid (\d+)\)", log.read_text(errors="replace")):
        found[int(match.group(1))] = int(match.group(2))
    return found


def _decisions(metrics_port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("prefix_router_decisions_total")
    )


@pytest.fixture
def gateway(envoy_bin: str, tmp_path: Path) -> Iterator[tuple[str, int, Path, subprocess.Popen[bytes]]]:
    workers: list[WorkerProcess] = start_fleet("sim", 2)
    port, metrics = free_port_run(PROCESSES), free_port_run(PROCESSES)
    log = tmp_path / "router.log"
    urls = [w.url for w in workers]
    router = subprocess.Popen(
        [sys.executable, "-m", "prefix_router", "serve", "--processes", str(PROCESSES), "--port", str(port)]
        + ["--metrics-port", str(metrics), *(f"--worker={u}" for u in urls)],
        stdout=subprocess.DEVNULL,
        stderr=log.open("wb"),
    )
    listen, admin = free_port(), free_port()
    spec = GatewaySpec(
        workers=[split_host_port(u) for u in urls],
        extproc=("127.0.0.1", port),
        extproc_processes=PROCESSES,
        listen=("127.0.0.1", listen),
        admin=("127.0.0.1", admin),
    )
    config = tmp_path / "envoy.yaml"
    config.write_text(yaml.safe_dump(bootstrap(spec)))
    envoy = subprocess.Popen(
        [envoy_bin, "-c", str(config), "--concurrency", "1", "--base-id", str(os.getpid() % 60000), "-l", "warning"],
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "envoy.log").open("wb"),
    )
    try:
        for i in range(PROCESSES):
            _wait_http(f"http://127.0.0.1:{metrics + i}/metrics")
        _wait_http(f"http://127.0.0.1:{admin}/ready")
        yield f"http://127.0.0.1:{listen}", metrics, log, router
    finally:
        envoy.terminate()
        router.send_signal(signal.SIGTERM)
        for proc in (envoy, router):
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        for w in workers:
            w.stop()


async def _send(session: aiohttp.ClientSession, url: str, i: int) -> int | str:
    body = {"model": "default", "messages": [{"role": "user", "content": f"request {i}: say hi"}], "max_tokens": 8}
    try:
        async with session.post(url + "/v1/chat/completions", json=body) as reply:
            await reply.read()
            return reply.status
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return type(exc).__name__


async def _load(url: str, count: int, rate: float) -> list[int | str]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        tasks = []
        for i in range(count):
            tasks.append(asyncio.create_task(_send(session, url, i)))
            await asyncio.sleep(1 / rate)
        return list(await asyncio.gather(*tasks))


def test_every_process_decides_and_a_killed_one_loses_no_request(
    gateway: tuple[str, int, Path, subprocess.Popen[bytes]],
) -> None:
    url, metrics, log, router = gateway
    statuses = asyncio.run(_load(url, 40, 40.0))
    assert statuses == [200] * 40
    per_process = [_decisions(metrics + i) for i in range(PROCESSES)]
    assert all(d > 0 for d in per_process), per_process  # Envoy spread the streams over every process
    assert sum(per_process) >= 40

    before = _pids(log)
    assert sorted(before) == list(range(PROCESSES))

    async def kill_during_load() -> list[int | str]:
        load = asyncio.create_task(_load(url, 120, 40.0))
        await asyncio.sleep(1.0)
        os.kill(before[1], signal.SIGKILL)
        return await load

    statuses = asyncio.run(kill_during_load())
    assert statuses == [200] * len(statuses), [s for s in statuses if s != 200]
    deadline = time.monotonic() + 60
    while _pids(log).get(1) == before[1]:
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)
    _wait_http(f"http://127.0.0.1:{metrics + 1}/metrics")
    assert router.poll() is None  # the supervisor kept serving
    assert asyncio.run(_load(url, 10, 20.0)) == [200] * 10

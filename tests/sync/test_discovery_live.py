"""Live worker discovery, for real: a DNS server on loopback, config file reload, SIGHUP.

The router runs as ``prefix-router serve`` (a child process) and reports its worker set on its
metrics port; simulated workers listen on one port at several loopback addresses (127.0.0.2, .3),
which is how the workers behind one DNS name look (a compose service, a headless Service). The DNS
server is dnslib's, answering from records the test changes while the router runs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from extproc.sync.sources import pod_worker
from prefix_common.addresses import free_port, free_ports
from sglang_workers.sim.launch import sim_worker_argv
from tests.support.waiting import wait_until

dnslib = pytest.importorskip("dnslib")
from dnslib import RR, A  # noqa: E402
from dnslib.server import BaseResolver, DNSServer  # noqa: E402

pytestmark = pytest.mark.timeout(120)


class _Records(BaseResolver):
    """Answers A queries for one name from a list the test changes; NXDOMAIN for anything else."""

    def __init__(self, name: str) -> None:
        self.name = name.rstrip(".") + "."
        self.addresses: list[str] = []

    def resolve(self, request: Any, handler: Any) -> Any:
        reply = request.reply()
        qname = str(request.q.qname)
        if qname != self.name:
            reply.header.rcode = 3  # NXDOMAIN
        elif request.q.qtype == 1:  # A
            for address in list(self.addresses):
                reply.add_answer(RR(qname, rdata=A(address), ttl=1))
        return reply


@pytest.fixture
def dns_server() -> Iterator[tuple[_Records, int]]:
    records = _Records("workers.test")
    port = free_port()
    server = DNSServer(records, port=port, address="127.0.0.1")  # UDP
    server.start_thread()
    try:
        yield records, port
    finally:
        server.stop()


def _sim_worker(host: str, port: int) -> subprocess.Popen[bytes]:
    kv_port, replay_port = free_ports(2, host)
    argv = sim_worker_argv(host, port, kv_port, replay_port, "--profile", "instant")
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@pytest.fixture
def two_addresses() -> Iterator[int]:
    """Simulated workers on 127.0.0.2:P and 127.0.0.3:P (one port, two addresses)."""
    for _ in range(20):
        port = free_port("127.0.0.2")
        if port == free_port_on("127.0.0.3", port):
            break
    workers = [_sim_worker("127.0.0.2", port), _sim_worker("127.0.0.3", port)]
    try:
        hosts = ("127.0.0.2", "127.0.0.3")
        wait_until(lambda: all(_get(f"http://{h}:{port}/health") == 200 for h in hosts), "both sim workers")
        yield port
    finally:
        for worker in workers:
            worker.terminate()
            worker.wait(10)


def free_port_on(host: str, port: int) -> int:
    import socket

    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return -1
    return port


def _get(url: str) -> int | str:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return int(response.status) if "metrics" not in url else response.read().decode()
    except OSError:
        return -1


def _healthy(metrics_port: int) -> dict[str, float]:
    text = _get(f"http://127.0.0.1:{metrics_port}/metrics")
    out = {}
    for line in text.splitlines() if isinstance(text, str) else ():
        if line.startswith('prefix_router_worker_healthy{worker="'):
            out[line.split('"')[1]] = float(line.rsplit(" ", 1)[1])
    return out


def _serve(config: Path) -> tuple[subprocess.Popen[bytes], int]:
    metrics_port = free_port()
    router = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "prefix_router",
            "serve",
            "--config",
            str(config),
            "--port",
            str(free_port()),
            "--metrics-port",
            str(metrics_port),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    wait_until(lambda: isinstance(_get(f"http://127.0.0.1:{metrics_port}/metrics"), str), "router metrics")
    return router, metrics_port


def _stop(router: subprocess.Popen[bytes]) -> str:
    router.send_signal(signal.SIGTERM)
    _, err = router.communicate(timeout=20)
    return err.decode(errors="replace")


def test_every_address_of_a_dns_name_is_a_worker_and_follows_its_records(
    dns_server: tuple[_Records, int], two_addresses: int, tmp_path: Path
) -> None:
    records, dns_port = dns_server
    port = two_addresses
    records.addresses = ["127.0.0.2"]
    config = tmp_path / "router.yaml"
    config.write_text(
        "discovery:\n"
        f"  dns: [{{host: workers.test, port: {port}}}]\n"
        "  dns_interval_s: 0.2\n"
        f"  nameservers: ['127.0.0.1:{dns_port}']\n"
        "health: {interval_s: 0.2}\n"
    )
    first, second = f"workers.test/127.0.0.2:{port}", f"workers.test/127.0.0.3:{port}"
    router, metrics = _serve(config)
    try:
        wait_until(lambda: _healthy(metrics) == {first: 1.0}, "the one address")
        records.addresses = ["127.0.0.2", "127.0.0.3"]  # scaled up: the new address joins
        wait_until(lambda: _healthy(metrics) == {first: 1.0, second: 1.0}, "both addresses")
        records.addresses = ["127.0.0.3"]  # the first one went away
        wait_until(lambda: _healthy(metrics) == {second: 1.0}, "only the second")
        assert router.poll() is None
    finally:
        log = _stop(router)
    assert f"worker {first} left" in log and f"worker {second} joined" in log


def test_config_file_is_reloaded_on_change_and_on_sighup(two_addresses: int, tmp_path: Path) -> None:
    port = two_addresses
    a, b = f"127.0.0.2:{port}", f"127.0.0.3:{port}"
    config = tmp_path / "router.yaml"

    def write(workers: list[str], interval: float) -> None:
        lines = "".join(f"  - url: http://{w}\n" for w in workers)
        config.write_text(
            f"workers:\n{lines}discovery: {{reload_interval_s: {interval}}}\nhealth: {{interval_s: 0.2}}\n"
        )

    write([a], 0.2)
    router, metrics = _serve(config)
    try:
        wait_until(lambda: _healthy(metrics) == {a: 1.0}, "the first worker")
        write([a, b], 0.2)  # a changed file is picked up by itself
        wait_until(lambda: _healthy(metrics) == {a: 1.0, b: 1.0}, "the added worker")
        config.write_text("workers: [{url: 42}]\nno_such_section: {}\n")  # a broken file: keep serving as before
        time.sleep(1.0)
        assert router.poll() is None and _healthy(metrics) == {a: 1.0, b: 1.0}
    finally:
        log = _stop(router)
    assert "config reload (file changed) failed, keeping the running configuration" in log

    write([b], 3600)  # the file is not polled in time: only SIGHUP makes the router read it
    router, metrics = _serve(config)
    try:
        wait_until(lambda: _healthy(metrics) == {b: 1.0}, "the configured worker")
        write([a], 3600)
        time.sleep(0.5)
        assert _healthy(metrics) == {b: 1.0}
        os.kill(router.pid, signal.SIGHUP)
        wait_until(lambda: _healthy(metrics) == {a: 1.0}, "the worker named after SIGHUP")
    finally:
        log = _stop(router)
    assert "config reload (SIGHUP)" in log


def test_ready_pods_are_workers() -> None:
    """The Kubernetes provider's pod filter, on the official client's own V1Pod objects.

    No Kubernetes API server can be installed on this machine (see docs/deploy.md), so the watch
    itself is not exercised here; what it does with each pod is.
    """
    from kubernetes.client import V1ObjectMeta, V1Pod, V1PodCondition, V1PodStatus

    from extproc.config import KubernetesDiscoveryConfig

    config = KubernetesDiscoveryConfig(label_selector="app=sglang", port=30000)

    def pod(name: str, phase: str = "Running", ip: str | None = "10.1.0.7", ready: str = "True", **meta: Any) -> Any:
        return V1Pod(
            metadata=V1ObjectMeta(name=name, **meta),
            status=V1PodStatus(phase=phase, pod_ip=ip, conditions=[V1PodCondition(type="Ready", status=ready)]),
        )

    worker = pod_worker(pod("sglang-0"), config)
    assert worker is not None and (worker.id, worker.url, worker.endpoint) == (
        "sglang-0",
        "http://10.1.0.7:30000",
        "10.1.0.7:30000",
    )
    six = pod_worker(pod("sglang-1", ip="fd00::7"), config)
    assert six is not None and six.url == "http://[fd00::7]:30000" and six.endpoint == "[fd00::7]:30000"
    assert pod_worker(pod("starting", phase="Pending"), config) is None
    assert pod_worker(pod("no-ip", ip=None), config) is None
    assert pod_worker(pod("not-ready", ready="False"), config) is None
    from datetime import datetime, timezone

    assert pod_worker(pod("terminating", deletion_timestamp=datetime.now(timezone.utc)), config) is None
    from extproc.sync.sources import _KubernetesWatch

    changes: list[int] = []
    watch = _KubernetesWatch(config, lambda: changes.append(1))
    watch.apply("ADDED", pod("sglang-0", ready="False"))  # not ready yet: no worker, no change
    assert watch.pods == {} and not changes
    watch.apply("MODIFIED", pod("sglang-0"))
    assert set(watch.pods) == {"sglang-0"} and len(changes) == 1
    watch.apply("MODIFIED", pod("sglang-0"))  # nothing that matters changed
    assert len(changes) == 1
    watch.apply("MODIFIED", pod("sglang-0", ip="10.1.0.9"))  # rescheduled at another address
    assert watch.pods["sglang-0"].ip == "10.1.0.9" and len(changes) == 2
    watch.apply("DELETED", pod("sglang-0"))
    assert watch.pods == {} and len(changes) == 3

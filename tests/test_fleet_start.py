"""Starting a fleet survives a worker that lost its port to another process (stop 27's CI failure).

Real sim-worker processes and a real listening socket: the first start of the worker is given a port that is
already taken, its bind fails, and ``_spawn_ready`` must start it again on fresh ports; a failure that is not a lost
port (an unknown profile) must not be retried.
"""

from __future__ import annotations

import socket

import pytest

from prefix_router import fleet
from sglang_workers.process import WorkerProcess, WorkerStartError, reports_port_in_use
from sglang_workers.sim import launch


@pytest.mark.parametrize(
    ("log", "lost"),
    [
        ("ERROR: [Errno 98] error while attempting to bind on address ('127.0.0.1', 30000)", True),
        ("zmq.error.ZMQError: Address already in use (addr='tcp://127.0.0.1:5557')", True),
        ("prefix-router sim-worker: cannot listen: gRPC port 127.0.0.1:9 is in use or cannot be bound", True),
        ("ValueError: unknown profile 'nope'", False),
        ("", False),
    ],
)
def test_reports_port_in_use(log: str, lost: bool) -> None:
    assert reports_port_in_use(log) is lost


def test_worker_that_lost_its_port_is_started_again(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        free = launch.port_runs
        starts: list[int] = []

        def spawn(_: int) -> WorkerProcess:
            if not starts:  # the first start picks a port someone else has bound meanwhile
                monkeypatch.setattr(launch, "port_runs", lambda host, ranks: (taken, *free(host, ranks)[1:]))
            else:
                monkeypatch.setattr(launch, "port_runs", free)
            worker = launch.spawn_sim_worker({"profile": None}, startup_timeout_s=60)
            starts.append(int(worker.url.rsplit(":", 1)[1]))
            return worker

        workers = fleet._spawn_ready(1, spawn)
        try:
            assert starts[0] == taken
            assert len(starts) == 2 and starts[1] != taken
            assert workers[0].alive()
            assert workers[0].url.endswith(f":{starts[1]}")
        finally:
            for worker in workers:
                worker.stop()


def test_other_start_failures_are_not_retried() -> None:
    starts: list[WorkerProcess] = []

    def spawn(_: int) -> WorkerProcess:
        worker = launch.spawn_sim_worker({"profile": "no-such-profile"}, startup_timeout_s=60)
        starts.append(worker)
        return worker

    with pytest.raises(WorkerStartError) as caught:
        fleet._spawn_ready(1, spawn)
    assert not caught.value.port_lost
    assert "no-such-profile" in str(caught.value)
    assert len(starts) == 1
    assert not starts[0].alive()

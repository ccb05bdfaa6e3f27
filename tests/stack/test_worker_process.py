"""Workers started through ``sglang_workers.process`` die with the process that started them, even a SIGKILLed one.

``prefix-router up`` killed by its supervisor (TERM to its group, KILL 3 s later) used to leave workers behind; a
real SGLang worker's three processes hold 3.6 GB. Each test starts workers from a real parent process, SIGKILLs
it, and looks in /proc for what is left.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from prefix_router.fleet import start_fleet
from sglang_workers.process import GUARD_DIR, PARENT_ENV, WorkerProcess

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")

ROOT = Path(__file__).resolve().parents[2]

PARENT = """
import sys, time
from prefix_router.fleet import start_fleet
workers = start_fleet(sys.argv[1], 1, **eval(sys.argv[2]))
print(workers[0].pid, flush=True)
time.sleep(3600)
"""


def _running(pid: int) -> bool:
    """The process exists and is not a zombie (a SIGKILLed orphan may wait for a reaper that never comes)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _session(sid: int) -> list[int]:
    """Running processes of session ``sid`` (a real SGLang worker leads one: HTTP, scheduler, detokenizer)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] not in ("Z", "X"):  # fields after the name: state ppid pgrp session
            members.append(int(entry.name))
    return members


def _until_gone(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        left = [pid for pid in pids if _running(pid)]
        if not left:
            return []
        time.sleep(0.1)
    return [pid for pid in pids if _running(pid)]


def _start_parent(engine: str, options: dict[str, object], timeout: float) -> tuple[subprocess.Popen[str], int]:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, engine, repr(options)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert parent.stdout is not None
    result: list[str] = []
    reader = threading.Thread(target=lambda: result.append(parent.stdout.readline()), daemon=True)  # type: ignore[union-attr]
    reader.start()
    reader.join(timeout)
    if not result or not result[0].strip():
        parent.kill()
        _, err = parent.communicate(timeout=30)
        pytest.fail(f"the parent did not start its {engine} worker:\n{err[-3000:]}")
    return parent, int(result[0])


def test_a_sim_worker_dies_with_its_sigkilled_parent() -> None:
    parent, pid = _start_parent("sim", {"profile": "instant"}, timeout=60)
    try:
        assert _running(pid)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        assert _until_gone([pid], 5.0) == [], f"sim worker {pid} outlived its SIGKILLed parent"
    finally:
        parent.kill()
        parent.wait()
        if _running(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_worker_outlives_the_thread_that_started_it() -> None:
    """The kernel ties PR_SET_PDEATHSIG to the forking *thread*: callers start workers from ``asyncio.to_thread``,
    so the handle forks from a thread of its own, or the worker would die when the caller's thread ends."""
    started: list[WorkerProcess] = []
    thread = threading.Thread(target=lambda: started.extend(start_fleet("sim", 1, profile="instant")))
    thread.start()
    thread.join(60)
    assert len(started) == 1
    (worker,) = started
    try:
        time.sleep(0.5)  # time enough for a parent-death signal to land, had it been sent
        assert worker.alive()
        with urllib.request.urlopen(worker.url + "/ready", timeout=5) as response:
            assert response.status == 200
    finally:
        worker.stop()
    assert not worker.alive()


def test_the_guard_ends_a_child_whose_starter_is_already_gone() -> None:
    """A starter that died between fork and the guard's request: the child sees another parent, and exits."""
    env = {**os.environ, "PYTHONPATH": str(GUARD_DIR), PARENT_ENV: str(2**22 + 1)}  # no process has this pid
    done = subprocess.run([sys.executable, "-c", "print('served')"], env=env, capture_output=True, text=True)
    assert done.returncode == 1 and "served" not in done.stdout
    env[PARENT_ENV] = str(os.getpid())  # the real starter: the child runs
    done = subprocess.run([sys.executable, "-c", "print('served')"], env=env, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "served"


@pytest.mark.real_sglang
def test_no_process_of_a_real_sglang_worker_outlives_its_sigkilled_parent() -> None:
    from sglang_workers.real.installation import missing_install_reason

    reason = missing_install_reason()
    if reason is not None:
        pytest.skip(reason)
    parent, pid = _start_parent("sglang-cpu", {"capacity_tokens": 2048, "startup_timeout": 400}, timeout=420)
    try:
        tree = _session(pid)  # the worker leads its own session: launch_server, scheduler, detokenizer
        assert pid in tree and len(tree) >= 3, f"expected SGLang's three processes, found {tree}"
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        assert _until_gone(tree, 15.0) == [], f"processes of the SGLang worker outlived its parent: {tree}"
        assert _session(pid) == []
    finally:
        parent.kill()
        parent.wait()
        for member in _session(pid):
            os.kill(member, signal.SIGKILL)


def test_start_fleet_refuses_options_its_engine_does_not_take() -> None:
    with pytest.raises(ValueError, match="unknown engine 'vllm'"):
        start_fleet("vllm", 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sglang-cpu workers take no dp_size, profile"):
        start_fleet("sglang-cpu", 1, profile="instant", dp_size=2)
    with pytest.raises(ValueError, match="log_dir and extra_args apply to sglang-cpu"):
        start_fleet("sim", 1, extra_args=["--tp", "2"])
    assert start_fleet("sim", 0) == []

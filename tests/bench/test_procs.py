"""The suites' CPU accounting: a process tree's CPU seconds from /proc (``benchmarks/fleet/procs.py``)."""

from __future__ import annotations

import subprocess
import sys
import time

from benchmarks.fleet.procs import process_tree, tree_cpu_seconds

# A parent that only waits on a child that burns CPU until it is killed (as `serve --processes N` waits on its routers).
_PARENT = "import subprocess, sys\nsubprocess.run([sys.executable, '-c', 'while True: pass'])\n"


def test_cpu_of_a_tree_counts_its_children() -> None:
    parent = subprocess.Popen([sys.executable, "-c", _PARENT])
    try:
        deadline = time.monotonic() + 30
        while len(process_tree(parent.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = process_tree(parent.pid)
        assert pids[0] == parent.pid and len(pids) == 2
        start = tree_cpu_seconds([parent.pid])
        while tree_cpu_seconds([parent.pid]) - start < 0.3 and time.monotonic() < deadline:
            time.sleep(0.05)
        used = tree_cpu_seconds([parent.pid]) - start
        assert used >= 0.3, f"the child's CPU time was not counted: {used:.3f} s"
    finally:
        for pid in reversed(process_tree(parent.pid)):
            subprocess.run(["kill", str(pid)], check=False)
        parent.wait(30)


def test_cpu_of_a_gone_process_is_zero() -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert tree_cpu_seconds([dead.pid]) == 0.0

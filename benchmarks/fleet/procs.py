"""What a process has used so far, read from ``/proc`` (Linux): CPU seconds of a process or a process tree.

CPU seconds rather than wall time, because they hold on a machine shared with other jobs where wall
times do not; the suites that report a gateway's or a router's cost per request read them here.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

__all__ = ["cpu_seconds", "process_tree", "rss_mb", "tree_cpu_seconds"]

_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of one process (None where there is no /proc, or the process is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime: fields 14 and 15 of stat


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process below it (``serve --processes N`` runs its routers as children)."""
    out, todo = [], [pid]
    while todo:
        current = todo.pop()
        out.append(current)
        try:
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            continue
    return out


def tree_cpu_seconds(pids: Iterable[int]) -> float:
    """CPU seconds of ``pids`` and their descendants, each counted once (0 for any already gone)."""
    return sum(cpu_seconds(p) or 0.0 for p in {p for root in pids for p in process_tree(root)})


def rss_mb(pid: int | None) -> float:
    """Resident memory of a process in MiB (0 for none, or one that is gone)."""
    if pid is None:
        return 0.0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0

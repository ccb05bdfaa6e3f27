"""``prefix-router`` run as a user runs it, for the tests of what it prints and how it exits."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping


def run_cli(*args: str, timeout: float = 60, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``prefix-router ARGS`` to its end (``env``: added to this process's environment); its output as text."""
    return subprocess.run(
        [sys.executable, "-m", "prefix_router", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **env} if env is not None else None,
    )

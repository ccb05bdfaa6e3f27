"""``prefix-router sim-worker`` as a user meets it: --help, and clear one-line errors for bad input."""

from __future__ import annotations

import socket
import subprocess

from prefix_common.addresses import free_ports
from tests.support.cli import run_cli


def _run(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return run_cli("sim-worker", *args, timeout=timeout)


def test_help_explains_every_flag() -> None:
    done = _run("--help")
    assert done.returncode == 0
    for flag in (
        "--port",
        "--kv-events-port",
        "--kv-replay-port",
        "--page-size",
        "--capacity-tokens",
        "--profile",
        "--speedup",
        "--model",
        "--tokenizer",
        "--chat-template",
        "--schedule-policy",
        "--chunked-prefill-size",
        "--max-running-requests",
        "--context-length",
        "--seed",
        "--event-format",
        "--replay-format",
        "--load-time",
    ):
        assert flag in done.stdout, flag
    assert "llama-3.1-70b-tp4-h200" in done.stdout and "default:" in done.stdout


def test_bad_values_give_one_line_errors() -> None:
    for args, fragment in (
        (["--page-size", "0"], "page_size"),
        (["--speedup", "0"], "speedup"),
        (["--tokenizer", "/no/such/dir"], "no tokenizer.json"),
    ):
        done = _run(*args)
        assert done.returncode == 2, args
        assert fragment in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_port_in_use_is_reported() -> None:
    kv_port, replay_port = free_ports(2)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = _run("--port", str(port), "--kv-events-port", str(kv_port), "--kv-replay-port", str(replay_port))
    assert done.returncode == 1
    assert "cannot listen" in done.stderr and "Traceback" not in done.stderr

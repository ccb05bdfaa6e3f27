"""``prefix-router sglang-launch`` prints the exact SGLang command line the router needs."""

from __future__ import annotations

import importlib.util
import json
import shlex
import subprocess
import sys

import pytest


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "extproc", "sglang-launch", *args], capture_output=True, text=True, timeout=30
    )


def test_prints_launch_command_with_router_flags() -> None:
    done = _run(
        "--model-path",
        "meta-llama/Llama-3.1-8B-Instruct",
        "--port",
        "30001",
        "--page-size",
        "16",
        "--kv-events-port",
        "5557",
        "--tp-size",
        "2",
        "--",
        "--context-length",
        "8192",
    )
    assert done.returncode == 0, done.stderr
    argv = shlex.split(done.stdout)
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    flags = {argv[i]: argv[i + 1] for i in range(3, len(argv) - 1) if argv[i].startswith("--")}
    assert flags["--model-path"] == "meta-llama/Llama-3.1-8B-Instruct"
    assert flags["--port"] == "30001" and flags["--page-size"] == "16" and flags["--tp-size"] == "2"
    assert json.loads(flags["--kv-events-config"]) == {
        "publisher": "zmq",
        "endpoint": "tcp://*:5557",
        "topic": "",
        "replay_endpoint": "tcp://*:5558",
    }
    assert "--enable-metrics" in argv and "--enable-cache-report" in argv
    assert argv[-2:] == ["--context-length", "8192"]


def test_run_without_sglang_explains_how_to_install() -> None:
    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("SGLang is installed here: --run would really launch a server")
    done = _run("--model-path", "m", "--run")
    assert done.returncode == 1
    assert "prefix-router[sglang]" in done.stderr and "Traceback" not in done.stderr


def test_rejects_bad_page_size() -> None:
    done = _run("--model-path", "m", "--page-size", "0")
    assert done.returncode == 2 and "page-size" in done.stderr

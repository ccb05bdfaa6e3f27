"""The real sgl-router (PyPI ``sglang-router``) accepts a sim-worker and routes requests to it."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import tempfile
import time

import pytest

from prefix_common.addresses import free_ports
from prefix_router.fleet import start_fleet
from tests.support.sim_fixtures import http

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("sglang_router") is None,
    reason="sglang-router is not installed (pip install sglang-router)",
)


def test_sgl_router_registers_and_routes_to_the_sim_worker() -> None:
    with start_fleet("sim", 1, profile="instant", page_size=16, model="sim-llama")[0] as worker:
        (port,) = free_ports(1)
        router_url = f"http://127.0.0.1:{port}"
        with tempfile.TemporaryFile() as log:
            router = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "sglang_router.launch_router",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--worker-urls",
                    worker.url,
                    "--policy",
                    "cache_aware",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            try:
                # The router registers workers in the background (/health, /server_info, /model_info);
                # a request only succeeds once our worker passed that workflow.
                deadline = time.monotonic() + 30
                status, body = 0, b""
                prompt = {"text": "The capital of France is " * 8, "sampling_params": {"max_new_tokens": 4}}
                while time.monotonic() < deadline:
                    try:
                        status, body = http("POST", router_url + "/generate", prompt, timeout=2)
                    except OSError:
                        status = 0
                    if status == 200:
                        break
                    time.sleep(0.2)
                log.seek(0)
                assert status == 200, log.read().decode(errors="replace")[-3000:]
                first = json.loads(body)
                assert first["meta_info"]["completion_tokens"] == 4
                status, body = http("POST", router_url + "/generate", prompt)
                assert status == 200 and json.loads(body)["meta_info"]["cached_tokens"] > 0
                status, body = http(
                    "POST",
                    router_url + "/v1/chat/completions",
                    {"model": "sim-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
                )
                assert status == 200
                chat = json.loads(body)
                assert chat["object"] == "chat.completion" and chat["usage"]["completion_tokens"] == 3
            finally:
                router.terminate()
                try:
                    router.wait(10)
                except subprocess.TimeoutExpired:
                    router.kill()
                    router.wait()

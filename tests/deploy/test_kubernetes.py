"""The Kubernetes manifests as shipped: rendered by kustomize, validated offline.

``kubectl kustomize`` renders each overlay exactly as ``kubectl apply -k`` would (no cluster needed),
and so is each overlay with the other front door added, as their comments offer. Built-in kinds are
validated strictly (unknown fields rejected) against the Kubernetes OpenAPI JSON schemas that the
``kubernetes-validate`` package ships; the Gateway API and Inference Extension kinds against their
v1 CRDs' constraints (``tests/support/crd_schemas.py``). Every reference between objects (selectors,
ports, names, RBAC subjects, the router's discovery and shared-state settings) is resolved against
the rendered objects. Nothing here talks to an API server: none installs on this machine.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from importlib.metadata import metadata
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from extproc.config import RouterConfig, load_config
from tests.support.crd_schemas import CRD_SCHEMAS
from tests.support.deploy import envoy_validate, generated_envoy_config, sglang_launch_argv

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
K8S_VERSION = "1.30.0"  # validate against an older release than current: what clusters still run
# What users apply: the two overlays, and each with the other front door added (the overlays' comments
# and docs/deploy.md offer both).
RENDERINGS: dict[str, tuple[str, tuple[str, ...]]] = {
    "gpu": ("gpu", ()),
    "sim": ("sim", ()),
    "sim+inference-gateway": ("sim", ("inference-gateway",)),
    "gpu+envoy": ("gpu", ("envoy",)),
}
POD_KINDS = ("Deployment", "StatefulSet")
Objects = dict[tuple[str, str], dict[str, Any]]


def _kustomize(directory: Path) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed (its built-in kustomize renders the overlays)")
    result = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def render(overlay: str, components: Sequence[str] = (), **extra: Any) -> Objects:
    """``overlay`` with more ``components`` and kustomization fields, by (kind, name)."""
    if not components and not extra:
        docs = _kustomize(K8S / overlay)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            kustomization = {  # kustomize takes relative paths only
                "resources": [os.path.relpath(K8S / overlay, tmp)],
                "components": [os.path.relpath(K8S / "components" / c, tmp) for c in components],
                **extra,
            }
            (Path(tmp) / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
            docs = _kustomize(Path(tmp))
    by_kind = {(doc["kind"], doc["metadata"]["name"]): doc for doc in docs}
    assert len(by_kind) == len(docs), "duplicate object names"
    return by_kind


_RENDERED: dict[str, Objects] = {}


def objects_of(name: str) -> Objects:
    """A rendering of ``RENDERINGS``, rendered once per test session."""
    if name not in _RENDERED:
        overlay, components = RENDERINGS[name]
        _RENDERED[name] = render(overlay, components)
    return _RENDERED[name]


@pytest.fixture(scope="module", params=list(RENDERINGS))
def rendered(request: pytest.FixtureRequest) -> tuple[str, Objects]:
    return request.param, objects_of(request.param)


def pod_templates(objects: Objects) -> Iterator[tuple[str, dict[str, Any]]]:
    for (kind, name), doc in objects.items():
        if kind in POD_KINDS:
            yield name, doc["spec"]["template"]


def router_env(objects: Objects) -> dict[str, str]:
    container = objects[("Deployment", "prefix-router")]["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e["value"] for e in container.get("env", [])}


def router_config(objects: Objects, tmp_path: Path) -> RouterConfig:
    """The router's config as its pods see it: the mounted ConfigMap's file, then the container's environment."""
    deployment = objects[("Deployment", "prefix-router")]["spec"]["template"]["spec"]
    config_map_name = next(v["configMap"]["name"] for v in deployment["volumes"] if "configMap" in v)
    config_map = objects[("ConfigMap", config_map_name)]  # kustomize's hashed name is what the pod mounts
    (tmp_path / "router.yaml").write_text(config_map["data"]["router.yaml"])
    return load_config(tmp_path / "router.yaml", environ=router_env(objects))


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


# -- schemas ---------------------------------------------------------------------------------------------------


def test_builtin_kinds_validate_strictly(rendered: tuple[str, Objects]) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    _, objects = rendered
    builtin = [doc for doc in objects.values() if (doc["apiVersion"], doc["kind"]) not in CRD_SCHEMAS]
    assert {doc["kind"] for doc in builtin} >= {
        "Deployment",
        "Service",
        "StatefulSet",
        "ConfigMap",
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "NetworkPolicy",
    }
    for doc in builtin:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)  # raises ValidationError with the path


def test_crd_kinds_validate(rendered: tuple[str, Objects]) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    name, objects = rendered
    crds = [doc for doc in objects.values() if (doc["apiVersion"], doc["kind"]) in CRD_SCHEMAS]
    with_gateway = "inference-gateway" in RENDERINGS[name][1] or RENDERINGS[name][0] == "gpu"
    assert {doc["kind"] for doc in crds} == ({"InferencePool", "Gateway", "HTTPRoute"} if with_gateway else set())
    for doc in crds:
        jsonschema.validate(doc, CRD_SCHEMAS[(doc["apiVersion"], doc["kind"])])


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda s: s["targetPorts"].append({"number": 30001}), id="v1.0.0-takes-one-target-port"),
        pytest.param(lambda s: s["endpointPickerRef"].pop("port"), id="service-picker-needs-its-port-CEL"),
        pytest.param(lambda s: s.pop("endpointPickerRef"), id="v1.0.0-requires-the-picker"),
        pytest.param(lambda s: s["selector"]["matchLabels"].update(bad="-x-"), id="not-a-label-value"),
        pytest.param(lambda s: s["selector"].update(matchLabels={}), id="v1.6.0-at-least-one-label"),
        pytest.param(lambda s: s.update(appProtocol="http"), id="appProtocol-not-in-v1.0.0"),
        pytest.param(lambda s: s["endpointPickerRef"].update(failureMode="Open"), id="not-a-failure-mode"),
        pytest.param(lambda s: s["selector"].update(matchExpressions=[]), id="unknown-field"),
    ],
)
def test_inference_pool_schema_refuses_what_the_crd_refuses(change: Any) -> None:
    """The schema check can fail: each change breaks a rule of the v1 CRD (or of one of its releases)."""
    jsonschema = pytest.importorskip("jsonschema")
    pool = objects_of("gpu")[("InferencePool", "sglang-pool")]
    schema = CRD_SCHEMAS[(pool["apiVersion"], pool["kind"])]
    jsonschema.validate(pool, schema)
    broken = copy.deepcopy(pool)
    change(broken["spec"])
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)


# -- images, scraping, tokens ------------------------------------------------------------------------------------


def test_every_image_is_pinned(rendered: tuple[str, Objects]) -> None:
    """Every image names a release (kustomize `images:` overrides it); the router's is the project's version."""
    _, objects = rendered
    version = metadata("prefix-router")["Version"]
    for name, template in pod_templates(objects):
        for container in template["spec"]["containers"]:
            image = container["image"]
            repository, _, tag = image.rpartition(":")
            assert "@sha256:" in image or (repository and tag and tag != "latest" and "/" not in tag), (name, image)
            if repository == "prefix-router":
                assert tag == version, f"{name}: the router image is tagged {tag}, the project is {version}"


def test_every_pod_is_scraped(rendered: tuple[str, Objects]) -> None:
    """Prometheus' annotation-based discovery finds every component: the port is one its containers serve."""
    _, objects = rendered
    for name, template in pod_templates(objects):
        annotations = template["metadata"].get("annotations", {})
        assert annotations.get("prometheus.io/scrape") == "true", name
        ports = {p["containerPort"] for c in template["spec"]["containers"] for p in c.get("ports", [])}
        assert int(annotations["prometheus.io/port"]) in ports, name
        assert annotations.get("prometheus.io/path", "/metrics").startswith("/"), name


def test_only_the_router_gets_an_api_token_and_may_only_watch_pods(rendered: tuple[str, Objects]) -> None:
    """Pod discovery lists and watches pods (extproc/sync/sources.py); nothing else reads the API server."""
    _, objects = rendered
    router = objects[("Deployment", "prefix-router")]["spec"]["template"]["spec"]
    account = router["serviceAccountName"]
    assert objects[("ServiceAccount", account)]["automountServiceAccountToken"] is False
    assert router["automountServiceAccountToken"] is True
    for name, template in pod_templates(objects):
        if name != "prefix-router":
            assert template["spec"]["automountServiceAccountToken"] is False, name
            assert template["spec"].get("serviceAccountName", "default") != account, name
    bindings = [doc for (kind, _), doc in objects.items() if kind == "RoleBinding"]
    (binding,) = [b for b in bindings if any(s["name"] == account for s in b["subjects"])]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    role = objects[(binding["roleRef"]["kind"], binding["roleRef"]["name"])]
    assert role["kind"] == "Role"  # its own namespace only
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]}]


def test_role_binding_follows_the_namespace() -> None:
    """With kustomize `namespace:`, the binding's subject names that namespace (it would otherwise be the binding's)."""
    objects = render("sim", namespace="inference")
    binding = objects[("RoleBinding", "prefix-router-discovery")]
    assert binding["metadata"]["namespace"] == "inference"
    assert all(s.get("namespace", "inference") == "inference" for s in binding["subjects"])


def test_pods_run_as_non_root(rendered: tuple[str, Objects]) -> None:
    _, objects = rendered
    for name, template in pod_templates(objects):
        spec = template["spec"]
        if name == "sglang" and any("nvidia.com/gpu" in c["resources"].get("limits", {}) for c in spec["containers"]):
            continue  # the SGLang image runs as root and needs the GPU devices
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        for container in spec["containers"]:
            assert container["securityContext"]["readOnlyRootFilesystem"] is True, (name, container["name"])
            assert container["securityContext"]["allowPrivilegeEscalation"] is False, (name, container["name"])


# -- the worker selector, written once ---------------------------------------------------------------------------


def _worker_selector(objects: Objects) -> tuple[dict[str, str], int]:
    service = objects[("Service", "sglang-workers")]["spec"]
    (http,) = [p for p in service["ports"] if p["name"] == "http"]
    return service["selector"], http["targetPort"]


def test_router_and_pool_select_the_worker_pods(rendered: tuple[str, Objects], tmp_path: Path) -> None:
    _, objects = rendered
    selector, port = _worker_selector(objects)
    discovery = router_config(objects, tmp_path).discovery.kubernetes
    assert discovery is not None
    assert dict(pair.split("=", 1) for pair in discovery.label_selector.split(",")) == selector
    assert (discovery.port, discovery.scheme, discovery.namespace) == (port, "http", None)  # None: its own
    statefulset = objects[("StatefulSet", "sglang")]["spec"]
    labels = statefulset["template"]["metadata"]["labels"]
    assert selects(selector, labels) and selects(statefulset["selector"]["matchLabels"], labels)
    ports = {p["name"]: p["containerPort"] for p in statefulset["template"]["spec"]["containers"][0]["ports"]}
    assert ports["http"] == port
    # No other pod carries the worker labels: the router would take it for a worker.
    assert [name for name, t in pod_templates(objects) if selects(selector, t["metadata"]["labels"])] == ["sglang"]
    pool = objects.get(("InferencePool", "sglang-pool"))
    if pool is not None:
        assert pool["spec"]["selector"]["matchLabels"] == selector
        assert pool["spec"]["targetPorts"] == [{"number": port}]


def test_worker_selector_is_taken_from_the_worker_service(tmp_path: Path) -> None:
    """Edit the Service's selector value and port, nothing else: the router and the InferencePool follow."""
    tree = tmp_path / "kubernetes"
    shutil.copytree(K8S, tree)
    source = tree / "base" / "workers-service.yaml"
    service = yaml.safe_load(source.read_text())
    service["spec"]["selector"]["app.kubernetes.io/name"] = "llama-pool"
    service["spec"]["ports"][0]["targetPort"] = 31000
    source.write_text(yaml.safe_dump(service))
    objects = {(d["kind"], d["metadata"]["name"]): d for d in _kustomize(tree / "gpu")}
    env = router_env(objects)
    assert env["PREFIX_ROUTER_DISCOVERY__KUBERNETES__LABEL_SELECTOR"] == "app.kubernetes.io/name=llama-pool"
    assert env["PREFIX_ROUTER_DISCOVERY__KUBERNETES__PORT"] == "31000"
    pool = objects[("InferencePool", "sglang-pool")]["spec"]
    assert pool["selector"]["matchLabels"] == {"app.kubernetes.io/name": "llama-pool"}
    assert pool["targetPorts"] == [{"number": 31000}]


# -- the router's configuration ----------------------------------------------------------------------------------


def test_router_config_as_the_pods_load_it(rendered: tuple[str, Objects], tmp_path: Path) -> None:
    name, objects = rendered
    config = router_config(objects, tmp_path)
    deployment = objects[("Deployment", "prefix-router")]["spec"]["template"]["spec"]
    container = deployment["containers"][0]
    assert container["args"] == ["serve", "--config", "/etc/prefix-router/router.yaml"]
    assert config.server.host == "0.0.0.0" and config.server.port == 9002
    assert config.workers == [] and config.discovery.dns == []  # pod discovery only: a worker is never twice
    # TLS files come from the mounted secret (Envoy Gateway connects to endpoint pickers over TLS).
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert str(config.server.tls_cert).startswith(mounts["tls"]) and str(config.server.tls_key).startswith(
        mounts["tls"]
    )
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert (ports["grpc"], ports["metrics"]) == (config.server.port, config.server.metrics_port)
    # Traces: off, or sent to a Service the manifests deploy.
    if config.observability.exporter.startswith("otlp"):
        host = urlsplit(config.observability.otlp_endpoint or "").hostname or ""
        assert ("Service", host) in objects, f"{name}: traces go to {host}, which nothing deploys"
    else:
        assert config.observability.exporter == "none"
    if RENDERINGS[name][0] == "gpu":
        volumes = {v["name"]: v for v in deployment["volumes"]}
        assert volumes["models"]["persistentVolumeClaim"]["claimName"] == "models"
        assert str(config.models[0].tokenizer).startswith(mounts["models"])


def test_the_documented_trace_patch_turns_traces_on(tmp_path: Path) -> None:
    """docs/deploy.md's patch, added to an overlay, gives the router an OTLP exporter and endpoint."""
    docs = (ROOT / "docs" / "deploy.md").read_text()
    section = docs[docs.index("**Traces** are off") :]
    snippet = yaml.safe_load(section[section.index("```yaml") + 7 : section.index("```", section.index("```yaml") + 7)])
    objects = render("gpu", **snippet)
    observability = router_config(objects, tmp_path).observability
    assert observability.exporter == "otlp-grpc"
    assert urlsplit(observability.otlp_endpoint or "").port == 4317


def test_router_replicas_share_decisions_through_the_deployed_valkey(
    rendered: tuple[str, Objects], tmp_path: Path
) -> None:
    _, objects = rendered
    router = objects[("Deployment", "prefix-router")]
    assert router["spec"]["replicas"] >= 2
    shared = router_config(objects, tmp_path).shared_state
    assert shared.backend == "redis"
    url = urlsplit(shared.url)
    host = url.hostname or ""
    service = objects[("Service", host)]["spec"]
    (port,) = [p for p in service["ports"] if p["port"] == url.port]
    valkey = objects[("Deployment", host)]["spec"]["template"]
    assert selects(service["selector"], valkey["metadata"]["labels"])
    (server,) = [c for c in valkey["spec"]["containers"] if any(p["name"] == port["targetPort"] for p in c["ports"])]
    assert server["image"].startswith("valkey/valkey:8.")
    assert server["args"][0] == "valkey-server"
    # The NetworkPolicy lets the router pods (and only them) reach that port.
    policy = objects[("NetworkPolicy", host)]["spec"]
    assert selects(policy["podSelector"]["matchLabels"], valkey["metadata"]["labels"])
    (rule,) = [r for r in policy["ingress"] if {"port": port["targetPort"]} in r["ports"]]
    (peer,) = rule["from"]
    assert selects(peer["podSelector"]["matchLabels"], router["spec"]["template"]["metadata"]["labels"])


def test_a_config_change_rolls_the_router() -> None:
    """The config's ConfigMap is hash-named, so a changed config changes the router's pod template."""
    before = objects_of("sim")
    after = render(
        "sim",
        configMapGenerator=[
            {"name": "prefix-router-config", "behavior": "merge", "literals": ["note=a changed config"]}
        ],
    )

    def mounted(objects: Objects) -> str:
        volumes = objects[("Deployment", "prefix-router")]["spec"]["template"]["spec"]["volumes"]
        return next(v["configMap"]["name"] for v in volumes if "configMap" in v)

    assert mounted(before).startswith("prefix-router-config-") and mounted(after).startswith("prefix-router-config-")
    assert mounted(before) != mounted(after) and ("ConfigMap", mounted(after)) in after


def test_the_router_image_has_the_kubernetes_client() -> None:
    """Pod discovery imports the official client: the image installs the extra that brings it."""
    assert "kubernetes" in (metadata("prefix-router").get_all("Provides-Extra") or [])
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "pip install -r /tmp/requirements.lock" in dockerfile  # the image installs the lock ...
    locked = (ROOT / "deploy" / "docker" / "requirements.lock").read_text().splitlines()
    assert any(line.startswith("kubernetes==") for line in locked)  # ... and the lock has the extra's client


def test_files_named_in_the_manifests_exist() -> None:
    """Comments that point at a test or a doc point at one that exists."""
    named = {
        match
        for path in K8S.rglob("*.yaml")
        for match in re.findall(r"\b((?:tests|docs|extproc)/[\w/.-]+\.(?:py|md))", path.read_text())
    }
    assert named, "the manifests' comments name their tests"
    assert [n for n in sorted(named) if not (ROOT / n).exists()] == []


# -- front doors -------------------------------------------------------------------------------------------------


def test_inference_pool_picks_with_the_router() -> None:
    objects = objects_of("gpu")  # the overlay with components/inference-gateway
    pool = objects[("InferencePool", "sglang-pool")]["spec"]
    # The endpoint picker is the router's Service, on the port its pods serve ext_proc.
    picker = pool["endpointPickerRef"]
    service = objects[("Service", picker["name"])]["spec"]
    (svc_port,) = [p for p in service["ports"] if p["port"] == picker["port"]["number"]]
    router = objects[("Deployment", "prefix-router")]["spec"]
    assert selects(service["selector"], router["template"]["metadata"]["labels"])
    ports = {p["name"]: p["containerPort"] for p in router["template"]["spec"]["containers"][0]["ports"]}
    assert ports[svc_port["targetPort"]] == 9002
    assert svc_port["appProtocol"] == "kubernetes.io/h2c"  # gRPC: HTTP/2 cleartext or TLS
    # The gateway's ORIGINAL_DST cluster takes one ip:port: the router names the primary only.
    assert router_env(objects)["PREFIX_ROUTER_SERVER__FALLBACK_ENDPOINTS"] == "0"
    route = objects[("HTTPRoute", "sglang")]["spec"]
    assert route["parentRefs"][0]["name"] in {name for kind, name in objects if kind == "Gateway"}
    (backend,) = route["rules"][0]["backendRefs"]
    assert (backend["group"], backend["kind"], backend["name"]) == (
        "inference.networking.k8s.io",
        "InferencePool",
        "sglang-pool",
    )


def test_gpu_workers_run_the_launch_command(tmp_path: Path) -> None:
    objects = objects_of("gpu")
    statefulset = objects[("StatefulSet", "sglang")]["spec"]
    headless = objects[("Service", statefulset["serviceName"])]["spec"]
    assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"] is True
    sglang = statefulset["template"]["spec"]["containers"][0]
    assert sglang["command"] + sglang["args"] == sglang_launch_argv()
    assert sglang["resources"]["limits"]["nvidia.com/gpu"] == 1
    ports = {p["name"]: p["containerPort"] for p in sglang["ports"]}
    kv = yaml.safe_load(sglang["args"][sglang["args"].index("--kv-events-config") + 1])
    assert (
        kv["endpoint"] == f"tcp://*:{ports['kv-events']}" and kv["replay_endpoint"] == f"tcp://*:{ports['kv-replay']}"
    )
    # The router tokenizes for the model the workers serve.
    served = sglang["args"][sglang["args"].index("--served-model-name") + 1]
    assert [m.name for m in router_config(objects, tmp_path).models] == [served]


def test_in_cluster_envoy_is_generated_valid_and_wired(envoy_bin: str, tmp_path: Path) -> None:
    objects = objects_of("sim")  # the overlay with components/envoy
    from prefix_router import envoy_config

    source = K8S / "components" / "envoy" / "envoy.yaml"
    bootstrap = generated_envoy_config(source)
    spec = objects[("Deployment", "gateway-envoy")]["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    config_map = objects[("ConfigMap", volumes["config"]["configMap"]["name"])]
    assert yaml.safe_load(config_map["data"]["envoy.yaml"]) == yaml.safe_load(source.read_text())
    assert spec["containers"][0]["image"] == "envoyproxy/envoy:v1.40.0"
    # ext_proc: the headless router Service (every pod a host), over TLS verified with the secret's cert.
    clusters = {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}
    extproc = clusters[envoy_config.EXTPROC_CLUSTER]
    address = extproc["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    router_service = objects[("Service", address["address"])]["spec"]
    assert extproc["type"] == "STRICT_DNS" and router_service["clusterIP"] == "None"
    assert address["port_value"] in {p["port"] for p in router_service["ports"]}
    ca_path = extproc["transport_socket"]["typed_config"]["common_tls_context"]["validation_context"]["trusted_ca"][
        "filename"
    ]
    mounts = {m["name"]: m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
    assert ca_path == f"{mounts['router-ca']}/tls.crt"
    assert volumes["router-ca"]["secret"]["secretName"] == "prefix-router-tls"
    # The worker clusters resolve the headless worker Service: every worker pod the router can pick is a host.
    workers = clusters[envoy_config.FAILOPEN_CLUSTER]["load_assignment"]["endpoints"][0]["lb_endpoints"]
    (worker,) = [w["endpoint"]["address"]["socket_address"] for w in workers]
    worker_service = objects[("Service", worker["address"])]["spec"]
    assert worker_service["clusterIP"] == "None"
    assert worker["port_value"] == _worker_selector(objects)[1]
    # The admin port the scrape annotation names is the one Envoy's admin listener binds.
    annotations = objects[("Deployment", "gateway-envoy")]["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == bootstrap["admin"]["address"]["socket_address"]["port_value"]
    # envoy --mode validate needs the CA file to exist: validate a copy pointing at a fresh certificate.
    cert = tmp_path / "tls.crt"
    made = (
        subprocess.run(
            [
                "openssl",
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-nodes",
                "-days",
                "1",
                "-subj",
                "/CN=prefix-router",
                "-keyout",
                str(tmp_path / "tls.key"),
                "-out",
                str(cert),
            ],
            capture_output=True,
            timeout=30,
        )
        if shutil.which("openssl")
        else None
    )
    if made is None or made.returncode != 0:
        pytest.skip("openssl CLI not available to make a test certificate")
    copy = tmp_path / "envoy.yaml"
    copy.write_text(source.read_text().replace(ca_path, str(cert)))
    envoy_validate(envoy_bin, copy)

"""The Kubernetes manifests as shipped: rendered by kustomize, validated offline.

``kubectl kustomize`` renders each overlay exactly as ``kubectl apply -k`` would (no cluster needed);
built-in kinds are validated strictly (unknown fields rejected) against the Kubernetes OpenAPI JSON
schemas that the ``kubernetes-validate`` package ships. The Gateway API and Inference Extension
kinds are CRDs with no schema in that package, so they are checked against the fields of their v1
CRDs that we use (written out below), and every reference between objects (selectors, ports,
names, the router's worker list) is resolved against the rendered objects.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.config import load_config

# Helpers of the compose tests (same tests/ directory, which pytest puts on sys.path).
from tests.support.deploy import envoy_validate, generated_envoy_config, sglang_launch_argv

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
OVERLAYS = ["gpu", "sim"]
K8S_VERSION = "1.30.0"  # validate against an older release than current: what clusters still run

_NAME = {"type": "string", "minLength": 1, "maxLength": 253}
_PORT = {
    "type": "object",
    "required": ["number"],
    "additionalProperties": False,
    "properties": {"number": {"type": "integer", "minimum": 1, "maximum": 65535}},
}
_META = {"type": "object", "required": ["name"]}
# The fields of the v1 CRDs (inference.networking.k8s.io/v1 InferencePool; gateway.networking.k8s.io/v1
# Gateway, HTTPRoute) that the manifests use, with the CRDs' constraints; unknown fields are errors.
CRD_SCHEMAS: dict[tuple[str, str], dict[str, Any]] = {
    ("inference.networking.k8s.io/v1", "InferencePool"): {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "metadata": _META,
            "spec": {
                "type": "object",
                "additionalProperties": False,
                "required": ["selector", "targetPorts", "endpointPickerRef"],
                "properties": {
                    "selector": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["matchLabels"],
                        "properties": {
                            "matchLabels": {
                                "type": "object",
                                "minProperties": 1,
                                "additionalProperties": {"type": "string"},
                            }
                        },
                    },
                    "targetPorts": {"type": "array", "minItems": 1, "maxItems": 8, "items": _PORT},
                    "appProtocol": {"enum": ["http", "kubernetes.io/h2c"]},
                    "endpointPickerRef": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["name", "port"],
                        "properties": {
                            "group": {"type": "string"},
                            "kind": {"type": "string"},
                            "name": _NAME,
                            "port": _PORT,
                            "failureMode": {"enum": ["FailOpen", "FailClose"]},
                        },
                    },
                },
            },
        },
    },
    ("gateway.networking.k8s.io/v1", "Gateway"): {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "metadata": _META,
            "spec": {
                "type": "object",
                "additionalProperties": False,
                "required": ["gatewayClassName", "listeners"],
                "properties": {
                    "gatewayClassName": _NAME,
                    "listeners": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "additionalProperties": False,
                            "required": ["name", "port", "protocol"],
                            "properties": {
                                "name": _NAME,
                                "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                                "protocol": {"enum": ["HTTP", "HTTPS", "TLS", "TCP", "UDP"]},
                            },
                        },
                    },
                },
            },
        },
    },
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "metadata": _META,
            "spec": {
                "type": "object",
                "additionalProperties": False,
                "required": ["parentRefs", "rules"],
                "properties": {
                    "parentRefs": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "additionalProperties": False,
                            "required": ["name"],
                            "properties": {"group": {"type": "string"}, "kind": {"type": "string"}, "name": _NAME},
                        },
                    },
                    "rules": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {
                                "matches": {
                                    "type": "array",
                                    "items": {
                                        "type": "object",
                                        "properties": {
                                            "path": {
                                                "type": "object",
                                                "additionalProperties": False,
                                                "properties": {
                                                    "type": {"enum": ["Exact", "PathPrefix", "RegularExpression"]},
                                                    "value": {"type": "string"},
                                                },
                                            }
                                        },
                                    },
                                },
                                "backendRefs": {
                                    "type": "array",
                                    "minItems": 1,
                                    "items": {
                                        "type": "object",
                                        "additionalProperties": False,
                                        "required": ["name"],
                                        "properties": {
                                            "group": {"type": "string"},
                                            "kind": {"type": "string"},
                                            "name": _NAME,
                                            "port": {"type": "integer"},
                                            "weight": {"type": "integer"},
                                        },
                                    },
                                },
                                "timeouts": {
                                    "type": "object",
                                    "additionalProperties": False,
                                    "properties": {"request": {"type": "string"}, "backendRequest": {"type": "string"}},
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}


def _render(overlay: str) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed (its built-in kustomize renders the overlays)")
    result = subprocess.run([kubectl, "kustomize", str(K8S / overlay)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


_RENDERED: dict[str, dict[tuple[str, str], dict[str, Any]]] = {}


def objects_of(overlay: str) -> dict[tuple[str, str], dict[str, Any]]:
    """The overlay's rendered objects by (kind, name), rendered once per test session."""
    if overlay not in _RENDERED:
        docs = _render(overlay)
        by_kind = {(doc["kind"], doc["metadata"]["name"]): doc for doc in docs}
        assert len(by_kind) == len(docs), "duplicate object names"
        _RENDERED[overlay] = by_kind
    return _RENDERED[overlay]


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request: pytest.FixtureRequest) -> tuple[str, dict[tuple[str, str], dict[str, Any]]]:
    return request.param, objects_of(request.param)


def test_builtin_kinds_validate_strictly(rendered: tuple[str, dict]) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    _, objects = rendered
    builtin = [doc for doc in objects.values() if (doc["apiVersion"], doc["kind"]) not in CRD_SCHEMAS]
    assert {doc["kind"] for doc in builtin} >= {"Deployment", "Service", "StatefulSet", "ConfigMap", "ServiceAccount"}
    for doc in builtin:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)  # raises ValidationError with the path


def test_crd_kinds_validate(rendered: tuple[str, dict]) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    overlay, objects = rendered
    crds = [doc for doc in objects.values() if (doc["apiVersion"], doc["kind"]) in CRD_SCHEMAS]
    assert {doc["kind"] for doc in crds} == ({"InferencePool", "Gateway", "HTTPRoute"} if overlay == "gpu" else set())
    for doc in crds:
        jsonschema.validate(doc, CRD_SCHEMAS[(doc["apiVersion"], doc["kind"])])


def test_inference_pool_picks_with_the_router_and_selects_the_workers() -> None:
    objects = objects_of("gpu")  # the overlay with components/inference-gateway
    pool = objects[("InferencePool", "sglang-pool")]["spec"]
    workers = objects[("StatefulSet", "sglang")]["spec"]["template"]
    labels = workers["metadata"]["labels"]
    assert pool["selector"]["matchLabels"].items() <= labels.items()
    container_ports = {p["containerPort"] for c in workers["spec"]["containers"] for p in c["ports"]}
    assert {p["number"] for p in pool["targetPorts"]} <= container_ports
    # The endpoint picker is the router's Service, on the port its pods serve ext_proc.
    picker = pool["endpointPickerRef"]
    service = objects[("Service", picker["name"])]["spec"]
    (svc_port,) = [p for p in service["ports"] if p["port"] == picker["port"]["number"]]
    router = objects[("Deployment", "prefix-router")]["spec"]
    assert service["selector"].items() <= router["template"]["metadata"]["labels"].items()
    ports = {p["name"]: p["containerPort"] for p in router["template"]["spec"]["containers"][0]["ports"]}
    assert ports[svc_port["targetPort"]] == 9002
    assert svc_port["appProtocol"] == "kubernetes.io/h2c"  # gRPC: HTTP/2 cleartext or TLS
    # The gateway's ORIGINAL_DST cluster takes one ip:port: the router names the primary only.
    env = {e["name"]: e.get("value") for e in router["template"]["spec"]["containers"][0].get("env", [])}
    assert env["PREFIX_ROUTER_SERVER__FALLBACK_ENDPOINTS"] == "0"
    route = objects[("HTTPRoute", "sglang")]["spec"]
    assert route["parentRefs"][0]["name"] in {name for kind, name in objects if kind == "Gateway"}
    (backend,) = route["rules"][0]["backendRefs"]
    assert (backend["group"], backend["kind"], backend["name"]) == (
        "inference.networking.k8s.io",
        "InferencePool",
        "sglang-pool",
    )


def test_router_config_lists_every_worker_pod_by_stable_dns_name(rendered: tuple[str, dict], tmp_path: Path) -> None:
    overlay, objects = rendered
    deployment = objects[("Deployment", "prefix-router")]["spec"]["template"]["spec"]
    config_map_name = next(v["configMap"]["name"] for v in deployment["volumes"] if "configMap" in v)
    config_map = objects[("ConfigMap", config_map_name)]  # kustomize's hashed name is what the pod mounts
    (tmp_path / "router.yaml").write_text(config_map["data"]["router.yaml"])
    config = load_config(tmp_path / "router.yaml", environ={})
    container = deployment["containers"][0]
    assert container["args"] == ["serve", "--config", "/etc/prefix-router/router.yaml"]
    assert config.server.host == "0.0.0.0" and config.server.port == 9002
    # TLS files come from the mounted secret (Envoy Gateway connects to endpoint pickers over TLS).
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert str(config.server.tls_cert).startswith(mounts["tls"]) and str(config.server.tls_key).startswith(
        mounts["tls"]
    )
    statefulset = objects[("StatefulSet", "sglang")]["spec"]
    headless = objects[("Service", statefulset["serviceName"])]["spec"]
    assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"] is True
    expected = [f"http://sglang-{i}.{statefulset['serviceName']}:30000" for i in range(statefulset["replicas"])]
    assert [w.url for w in config.workers] == expected
    if overlay == "gpu":
        volumes = {v["name"]: v for v in deployment["volumes"]}
        assert volumes["models"]["persistentVolumeClaim"]["claimName"] == "models"
        assert str(config.models[0].tokenizer).startswith(mounts["models"])
        sglang = statefulset["template"]["spec"]["containers"][0]
        assert sglang["command"] + sglang["args"] == sglang_launch_argv()
        assert sglang["resources"]["limits"]["nvidia.com/gpu"] == 1
        ports = {p["name"]: p["containerPort"] for p in sglang["ports"]}
        kv = yaml.safe_load(sglang["args"][sglang["args"].index("--kv-events-config") + 1])
        assert (
            kv["endpoint"] == f"tcp://*:{ports['kv-events']}"
            and kv["replay_endpoint"] == f"tcp://*:{ports['kv-replay']}"
        )
        assert config.models[0].name == sglang["args"][sglang["args"].index("--served-model-name") + 1]


def test_pods_run_as_non_root(rendered: tuple[str, dict]) -> None:
    overlay, objects = rendered
    router = objects[("Deployment", "prefix-router")]["spec"]["template"]["spec"]
    assert router["securityContext"]["runAsNonRoot"] is True
    assert router["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True
    if overlay == "sim":
        sim = objects[("StatefulSet", "sglang")]["spec"]["template"]["spec"]
        assert sim["securityContext"]["runAsNonRoot"] is True


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
    workers = clusters[envoy_config.FAILOPEN_CLUSTER]["load_assignment"]["endpoints"][0]["lb_endpoints"]
    (worker,) = [w["endpoint"]["address"]["socket_address"] for w in workers]
    assert objects[("Service", worker["address"])]["spec"]["clusterIP"] == "None"
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

"""The router's configuration: one typed model, loaded from YAML, then environment, then CLI.

Precedence (later wins): built-in defaults < YAML file (``--config``) < environment variables
``PREFIX_ROUTER_<SECTION>__<FIELD>`` (e.g. ``PREFIX_ROUTER_POLICY__NAME=least-load``) < command-line
flags. Every tunable constant of the product lives here with its documented default; modules take
the section they need in their constructor instead of reading globals.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

__all__ = [
    "ConfigError",
    "EventsConfig",
    "HealthConfig",
    "IndexConfig",
    "LoadConfig",
    "ModelConfig",
    "ObservabilityConfig",
    "PolicyConfig",
    "RouterConfig",
    "ServerConfig",
    "WorkerConfig",
    "load_config",
]

ENV_PREFIX = "PREFIX_ROUTER_"


class ConfigError(Exception):
    """Configuration is invalid; the message says which field and why (no stack trace for users)."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ServerConfig(_Section):
    """The ext_proc gRPC listener."""

    host: str = Field("127.0.0.1", description="Bind address; loopback by default so only the local Envoy reaches it.")
    port: int = Field(9002, description="gRPC port of the ext_proc + health service.")
    metrics_port: int | None = Field(9102, description="Prometheus /metrics port on the same host; null disables.")
    max_body_bytes: int = Field(8 * 1024 * 1024, description="Bodies over this get 413 (Envoy's buffer limit should match).")
    tls_cert: Path | None = Field(None, description="PEM certificate for TLS on the ext_proc port (with tls_key).")
    tls_key: Path | None = Field(None, description="PEM private key for TLS on the ext_proc port.")
    tls_client_ca: Path | None = Field(None, description="If set, require client certificates signed by this CA (mTLS).")
    fallback_endpoints: int = Field(2, description="How many fallback endpoints follow the primary in the destination header.")
    grace_period_s: float = Field(5.0, description="On SIGTERM, how long in-flight streams may finish.")


class WorkerConfig(_Section):
    """One SGLang (or simulated) worker."""

    url: str = Field(description="Base URL, e.g. http://127.0.0.1:30001.")
    name: str | None = Field(None, description="Label in metrics and spans; defaults to host:port.")
    model: str | None = Field(None, description="Served model; read from /model_info when omitted.")
    kv_events_endpoint: str | None = Field(None, description="tcp://host:port of its KV-event publisher; read from /server_info when omitted.")
    replay_endpoint: str | None = Field(None, description="tcp://host:port of its replay socket; read from /server_info when omitted.")

    @field_validator("url")
    @classmethod
    def _strip(cls, value: str) -> str:
        value = value.strip().rstrip("/")
        if not value.startswith(("http://", "https://")):
            value = "http://" + value
        return value


class ModelConfig(_Section):
    """Tokenization settings for one served model."""

    name: str = Field(description="Model name as clients send it in the `model` field.")
    tokenizer: str | None = Field(None, description="HF tokenizer directory or tokenizer.json; null = built-in default.")
    chat_template: str | None = Field(None, description="Chat template file overriding the tokenizer's.")
    block_size: int | None = Field(None, description="Worker page size; read from /server_info when omitted.")


class PolicyConfig(_Section):
    """Routing policy and its constants (see docs/routing.md)."""

    name: str = Field("prefix-aware", description="prefix-aware | session | least-load | round-robin | sgl-cache-aware | gie-prefix | dynamo-cost")
    session_header: str = Field("x-session-id", description="Header whose value pins a session to a worker (policy `session`).")
    options: dict[str, Any] = Field(default_factory=dict, description="Policy-specific constants; each policy documents and validates its own.")


class IndexConfig(_Section):
    """The per-worker block index fed by KV events."""

    max_blocks_per_worker: int = Field(2_000_000, description="Memory bound: oldest entries beyond this are dropped.")
    speculative_ttl_s: float = Field(2.0, description="Entries inserted by routing decisions expire after this unless events confirm them.")
    max_lookup_blocks: int = Field(8192, description="At most this many leading blocks of a prompt are hashed and looked up.")


class EventsConfig(_Section):
    """The sync channel (ZMQ KV events) from the workers."""

    enabled: bool = Field(True, description="Subscribe to workers' KV events.")
    topic: str = Field("", description="ZMQ topic filter (SGLang's default topic is empty).")
    replay_timeout_s: float = Field(1.0, description="How long to wait for a replay reply before declaring the worker's state unknown.")


class LoadConfig(_Section):
    """Load reported by the workers."""

    poll_interval_s: float = Field(0.5, description="How often /v1/loads (or /metrics) is polled per worker.")
    timeout_s: float = Field(1.0, description="HTTP timeout of one load poll.")


class HealthConfig(_Section):
    """Worker health checks."""

    interval_s: float = Field(1.0, description="How often /health is polled per worker.")
    timeout_s: float = Field(1.0, description="HTTP timeout of one health check.")
    unhealthy_after: int = Field(2, description="Consecutive failures before a worker leaves the candidate set.")
    healthy_after: int = Field(1, description="Consecutive successes before it comes back.")


class ObservabilityConfig(_Section):
    """Tracing and metrics."""

    exporter: Literal["none", "console", "otlp-grpc", "otlp-http"] = Field("none", description="Where routing spans go.")
    otlp_endpoint: str | None = Field(None, description="OTLP endpoint, e.g. http://127.0.0.1:4317 (gRPC) or http://127.0.0.1:4318/v1/traces (HTTP).")
    service_name: str = Field("prefix-router", description="service.name resource attribute of the spans.")


class RouterConfig(_Section):
    """Everything `prefix-router serve` needs."""

    server: ServerConfig = Field(default_factory=ServerConfig)
    workers: list[WorkerConfig] = Field(default_factory=list)
    models: list[ModelConfig] = Field(default_factory=list)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    index: IndexConfig = Field(default_factory=IndexConfig)
    events: EventsConfig = Field(default_factory=EventsConfig)
    load: LoadConfig = Field(default_factory=LoadConfig)
    health: HealthConfig = Field(default_factory=HealthConfig)
    observability: ObservabilityConfig = Field(default_factory=ObservabilityConfig)


def _set_path(data: dict[str, Any], path: list[str], value: Any) -> None:
    node = data
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value


def _env_overrides(environ: dict[str, str]) -> dict[str, Any]:
    data: dict[str, Any] = {}
    for key, raw in environ.items():
        if not key.startswith(ENV_PREFIX) or "__" not in key:
            continue
        path = [part.lower() for part in key[len(ENV_PREFIX):].split("__")]
        _set_path(data, path, yaml.safe_load(raw) if raw else raw)
    return data


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None,
                environ: dict[str, str] | None = None) -> RouterConfig:
    """Build the config from a YAML file, environment and CLI overrides (nested dicts)."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path} is not valid YAML: {exc}") from exc
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping at the top level")
        data = loaded or {}
    data = _merge(data, _env_overrides(dict(os.environ if environ is None else environ)))
    data = _merge(data, overrides or {})
    try:
        return RouterConfig.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in exc.errors())
        raise ConfigError(f"invalid configuration: {problems}") from exc

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
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

__all__ = [
    "ConfigError",
    "DebugConfig",
    "DiscoveryConfig",
    "DnsWorkersConfig",
    "EventsConfig",
    "FlowControlConfig",
    "HealthConfig",
    "IndexConfig",
    "KubernetesDiscoveryConfig",
    "LoadConfig",
    "MemoryConfig",
    "ModelConfig",
    "ObjectiveConfig",
    "ObservabilityConfig",
    "PdConfig",
    "PolicyConfig",
    "RouterConfig",
    "Section",
    "ServerConfig",
    "SharedStateConfig",
    "WorkerConfig",
    "load_config",
]

ENV_PREFIX = "PREFIX_ROUTER_"

# A worker's part in prefill/decode disaggregation (SGLang's ``--disaggregation-mode``; "null" = aggregated).
WorkerRole = Literal["aggregated", "prefill", "decode"]


class ConfigError(Exception):
    """Configuration is invalid; the message says which field and why (no stack trace for users)."""


class Section(BaseModel):
    """A config section: unknown keys are refused, assignments validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ServerConfig(Section):
    """The ext_proc gRPC listener."""

    host: str = Field("127.0.0.1", description="Bind address; loopback by default so only the local Envoy reaches it.")
    port: int = Field(9002, description="gRPC port of the ext_proc + health service; 0: any free port.")
    metrics_port: int | None = Field(
        9102, description="Prometheus /metrics port on the same host; 0: any free port; null disables."
    )
    max_body_bytes: int = Field(
        8 * 1024 * 1024, description="Bodies over this get 413 (Envoy's buffer limit should match)."
    )
    tls_cert: Path | None = Field(None, description="PEM certificate for TLS on the ext_proc port (with tls_key).")
    tls_key: Path | None = Field(None, description="PEM private key for TLS on the ext_proc port.")
    tls_client_ca: Path | None = Field(
        None, description="If set, require client certificates signed by this CA (mTLS)."
    )
    fallback_endpoints: int = Field(
        2, description="How many fallback endpoints follow the primary in the destination header."
    )
    grace_period_s: float = Field(5.0, description="On SIGTERM, how long in-flight streams may finish.")
    tokenize_threads: int = Field(
        4,
        ge=1,
        description=(
            "Threads that tokenize and hash prompts off the gRPC event loop (tokenizers releases the GIL, so "
            "they also run in parallel)."
        ),
    )
    inline_tokenize_chars: int = Field(
        4096,
        ge=0,
        description=(
            "A prompt with at most this many characters missing the tokenizer's piece cache is tokenized on "
            "the event loop (cheaper than a thread hop); more goes to the tokenize threads."
        ),
    )


class WorkerConfig(Section):
    """One SGLang (or simulated) worker."""

    url: str = Field(description="Base URL, e.g. http://127.0.0.1:30001.")
    name: str | None = Field(None, description="Label in metrics and spans; defaults to host:port.")
    model: str | None = Field(None, description="Served model; read from /model_info when omitted.")
    kv_events_endpoint: str | None = Field(
        None, description="tcp://host:port of its KV-event publisher; read from /server_info when omitted."
    )
    replay_endpoint: str | None = Field(
        None, description="tcp://host:port of its replay socket; read from /server_info when omitted."
    )
    role: WorkerRole | None = Field(
        None,
        description=(
            "aggregated | prefill | decode (SGLang's --disaggregation-mode); read from /server_info's "
            "disaggregation_mode when omitted."
        ),
    )
    bootstrap_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="A prefill worker's KV bootstrap port; read from /server_info's disaggregation_bootstrap_port.",
    )

    @field_validator("url")
    @classmethod
    def _strip(cls, value: str) -> str:
        value = value.strip().rstrip("/")
        if not value.startswith(("http://", "https://")):
            value = "http://" + value
        return value


class ModelConfig(Section):
    """Tokenization settings for one served model."""

    name: str = Field(description="Model name as clients send it in the `model` field.")
    tokenizer: str | None = Field(
        None, description="HF tokenizer directory or tokenizer.json; null = built-in default."
    )
    chat_template: str | None = Field(None, description="Chat template file overriding the tokenizer's.")
    block_size: int | None = Field(None, description="Worker page size; read from /server_info when omitted.")
    vocab_size: int | None = Field(
        None,
        ge=1,
        description=(
            "Size of the model's vocabulary: a request carrying a token id at or above it is refused with 400 "
            "(SGLang's scheduler dies on an out-of-range id). Null: not checked (negative ids always are)."
        ),
    )


class PolicyConfig(Section):
    """The routing policy and its constants (see docs/routing.md).

    Besides ``name`` and ``options``, every key is one policy's own section, named after the policy
    with ``_`` for ``-`` (``prefix_aware``, ``session``, ``sgl_cache_aware``, ...). Each policy owns
    the model of its section and validates it when the router starts (``extproc.decision.policies``).
    """

    model_config = ConfigDict(extra="allow", validate_assignment=True)

    name: str = Field(
        "prefix-aware",
        description=(
            "prefix-aware | session | least-load | round-robin | sgl-cache-aware | gie-prefix | dynamo-cost | "
            "decode-load"
        ),
    )
    options: dict[str, Any] = Field(
        default_factory=dict, description="Overrides merged over the chosen policy's section."
    )
    max_candidates: int = Field(
        16,
        ge=2,
        description=(
            "Token-matching policies score at most this many workers per request: half that match the prompt "
            "longest, the rest least loaded (extproc/decision/pruning.py). A fleet this small or smaller is scored "
            "in full."
        ),
    )

    @model_validator(mode="after")
    def _sections_are_mappings(self) -> PolicyConfig:
        for key, value in (self.model_extra or {}).items():
            if not isinstance(value, dict):
                raise ValueError(f"policy.{key} must be a mapping of that policy's options")
        return self

    def sections(self) -> dict[str, dict[str, Any]]:
        """Every policy section by policy name, ``options`` merged over the chosen policy's."""
        out = {key.replace("_", "-"): dict(value) for key, value in (self.model_extra or {}).items()}
        out[self.name] = {**out.get(self.name, {}), **self.options}
        return out


class IndexConfig(Section):
    """The per-worker block index fed by KV events."""

    speculative_ttl_s: float = Field(
        2.0, description="Entries inserted by routing decisions expire after this unless events confirm them."
    )
    max_lookup_blocks: int = Field(
        8192, description="At most this many leading blocks of a prompt are hashed and looked up."
    )
    fallback_ttl_s: float = Field(
        120.0,
        description=(
            "While a worker's event state is unknown, the router trusts its own record of what it sent there "
            "for this long."
        ),
    )
    default_block_size: int = Field(
        16, gt=0, description="Block size when neither the model config nor /server_info nor events give the page size."
    )
    shared_tier: bool = Field(
        True,
        description=(
            "Credit a storage tier shared by HiCache workers: workers whose /server_info names the same storage "
            "backend and location (and model, TP size) share it, and every page one of them backs up to host "
            "memory counts for all of them."
        ),
    )


class MemoryConfig(Section):
    """One bound for all of the router's caches together (extproc/memory.py lists the parts and shares)."""

    budget_bytes: int = Field(
        256 * 1024 * 1024,
        ge=1024 * 1024,
        description=(
            "Bytes the router's caches may hold together: block index, engine-hash maps, its own routing "
            "record, block-key and tokenizer caches, shared-state queue (each a fixed share, oldest dropped "
            "first). The default keeps the whole process under about 512 MB."
        ),
    )


class EventsConfig(Section):
    """The sync channel (ZMQ KV events) from the workers."""

    enabled: bool = Field(True, description="Subscribe to workers' KV events.")
    topic: str = Field("", description="ZMQ topic filter (SGLang's default topic is empty).")
    replay_timeout_s: float = Field(
        1.0, description="How long to wait for a replay reply before declaring the worker's state unknown."
    )
    resync_after_s: float = Field(
        60.0,
        description=(
            "After an unrepaired gap, events received for this long (with entries reset at the gap) count as "
            "a full view again."
        ),
    )
    discovery_interval_s: float = Field(
        1.0, description="How often workers without a known event endpoint are asked for /server_info."
    )


class LoadConfig(Section):
    """Load reported by the workers."""

    poll_interval_s: float = Field(0.5, gt=0, description="How often /v1/loads (or /metrics) is polled per worker.")
    startup_poll_interval_s: float = Field(
        0.1,
        ge=0,
        description=(
            "Between the rounds that poll every worker every poll_interval_s, how often a worker is polled while "
            "the router has requests in flight there and no report has yet shown its prefill work between two "
            "polls (its speed is then still the priors'). A worker that reports no prefill counters, or a PD "
            "decode worker, is never polled sooner (0: never sooner)."
        ),
    )
    timeout_s: float = Field(1.0, description="HTTP timeout of one load poll.")
    read_prefill_batches: bool = Field(
        True,
        description=(
            "With each /v1/loads poll, also read the worker's count of prefill batches and its new_token_ratio "
            "from /metrics (SGLang's sglang:cuda_graph_passes_total, prefill modes, and sglang:new_token_ratio; "
            "needs --enable-metrics). The prefix-aware policy then learns its prefill floor per batch, as the GPU "
            "pays it, instead of per request (a worker that batched a burst would otherwise look faster per token "
            "than it is), and counts the KV room the worker reserves for running requests' outputs at the ratio "
            "it uses (the floor ratio, 0.098, without it). A worker whose /metrics has no usable count three "
            "polls in a row is not asked again for five minutes."
        ),
    )
    tier_poll_interval_s: float = Field(
        2.0,
        ge=0,
        description=(
            "How often /metrics of HiCache workers is read for their reported load-back and storage-prefetch "
            "costs (0: never; the documented priors are used)."
        ),
    )


class HealthConfig(Section):
    """Worker health checks: a cheap readiness probe at start-up, then liveness probes (see docs/real-sglang.md)."""

    interval_s: float = Field(
        1.0, gt=0, description="Pause between the end of one liveness probe of a worker and the start of the next."
    )
    timeout_s: float = Field(
        5.0,
        gt=0,
        description=(
            "HTTP timeout of one probe. SGLang's /health runs a one-token generation and answers after 1 s at "
            "the earliest (after the current batch when busy), so this must stay well above 1 s."
        ),
    )
    path: str = Field(
        "/health",
        description="Liveness probe: SGLang's /health proves the scheduler still produces output.",
    )
    ready_path: str | None = Field(
        "/ready",
        description=(
            "Readiness probe used when the router starts (SGLang: a flag, answered at once, 200 once warm-up "
            "is over). A worker answering it with 404 (older releases) is probed on `path` instead; null: "
            "always `path`."
        ),
    )
    unhealthy_after: int = Field(2, description="Consecutive failures before a worker leaves the candidate set.")
    keep_last_healthy_s: float = Field(
        5.0,
        ge=0,
        description=(
            "When no worker is healthy, route to those that left the candidates less than this long ago after "
            "failed probes (not refused connections), as Envoy's panic threshold does; past it, 503. 0: never."
        ),
    )
    healthy_after: int = Field(1, description="Consecutive successes before it comes back.")


class DnsWorkersConfig(Section):
    """A DNS name whose every address is a worker (a compose service, a Kubernetes headless Service)."""

    host: str = Field(description="The name to resolve, e.g. sglang-workers.default.svc.cluster.local.")
    port: int = Field(30000, ge=1, le=65535, description="The workers' HTTP port.")
    scheme: Literal["http", "https"] = Field("http", description="URL scheme of the workers.")
    model: str | None = Field(None, description="Served model; read from /model_info when omitted.")
    role: WorkerRole | None = Field(
        None, description="The role of every worker of this name; read from each one's /server_info when omitted."
    )


class KubernetesDiscoveryConfig(Section):
    """Workers are the ready pods of a label selector, watched through the Kubernetes API."""

    label_selector: str = Field(description="Pods matching this selector are workers, e.g. app=sglang.")
    namespace: str | None = Field(
        None, description="Namespace to watch; default: the router pod's own (service account), else 'default'."
    )
    port: int = Field(30000, ge=1, le=65535, description="The workers' HTTP port on each pod IP.")
    scheme: Literal["http", "https"] = Field("http", description="URL scheme of the workers.")
    kubeconfig: Path | None = Field(
        None, description="kubeconfig file to use outside a cluster; default: in-cluster config, else ~/.kube/config."
    )


class DiscoveryConfig(Section):
    """Live worker discovery: DNS re-resolution, config reload, Kubernetes pods (docs/deploy.md)."""

    dns: list[DnsWorkersConfig] = Field(
        default_factory=list, description="Names whose every address is a worker, re-resolved every dns_interval_s."
    )
    dns_interval_s: float = Field(
        5.0,
        gt=0,
        description=(
            "How often DNS names are resolved again (these and the host names of `workers:` entries): "
            "workers join and leave, a moved worker is followed."
        ),
    )
    nameservers: list[str] = Field(
        default_factory=list,
        description="DNS servers to ask ('ip' or 'ip:port'); empty: the system resolver (getaddrinfo).",
    )
    reload_config: bool = Field(
        True, description="Watch the --config file and apply changed `workers:` / `discovery.dns` (also on SIGHUP)."
    )
    reload_interval_s: float = Field(1.0, gt=0, description="How often the config file's modification time is read.")
    kubernetes: KubernetesDiscoveryConfig | None = Field(
        None, description="Watch the pods of a label selector (needs the `kubernetes` package)."
    )


class ObservabilityConfig(Section):
    """Tracing and metrics."""

    exporter: Literal["none", "console", "otlp-grpc", "otlp-http"] = Field(
        "none", description="Where routing spans go."
    )
    otlp_endpoint: str | None = Field(
        None, description="OTLP endpoint, e.g. http://127.0.0.1:4317 (gRPC) or http://127.0.0.1:4318/v1/traces (HTTP)."
    )
    service_name: str = Field("prefix-router", description="service.name resource attribute of the spans.")
    drift_sample_rate: float = Field(
        0.02,
        ge=0,
        le=1,
        description=(
            "Share of routed requests whose response the router reads to compare the cached prompt tokens it "
            "predicted on the worker with the engine's reported cached_tokens (index drift, docs/routing.md). Only "
            "sampled responses reach the router (Envoy is asked for their body then); 0: never, 1: every one."
        ),
    )


class DebugConfig(Section):
    """The read-only debug view on the metrics port: /debug/ (a page), /debug/workers, /decisions, /explain."""

    token: str | None = Field(
        None,
        description=(
            "Bearer token the debug endpoints require (Authorization: Bearer <token>). Unset: they answer only "
            "while the metrics port is bound to loopback, and 403 on any other bind (metrics stay public)."
        ),
    )
    decisions: int = Field(
        256, ge=0, description="The last this many routing decisions are kept for /debug/decisions (0: none kept)."
    )

    @field_validator("token", mode="before")
    @classmethod
    def _text(cls, value: Any) -> Any:
        # From the environment a token of digits reads as a number: it is still the token's text.
        return str(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value


class SharedStateConfig(Section):
    """Router replicas sharing their unconfirmed decisions (see extproc/sync/shared_state.py, docs/deploy.md)."""

    backend: Literal["none", "redis"] = Field(
        "none",
        description=(
            "none: each replica keeps its own decisions; redis: publish them to the other replicas over "
            "Redis/Valkey pub/sub."
        ),
    )
    url: str = Field(
        "redis://127.0.0.1:6379/0",
        description="Redis or Valkey URL (redis://[user:pass@]host:port/db, rediss:// for TLS).",
    )
    channel: str = Field(
        "prefix-router:decisions",
        description="Pub/sub channel; replicas of one fleet share it, other fleets use another.",
    )
    timeout_s: float = Field(1.0, gt=0, description="Connect and socket timeout towards the store.")
    retry_s: float = Field(1.0, gt=0, description="Pause before reconnecting after the store failed.")


class ObjectiveConfig(Section):
    """One inference objective, as a GIE ``InferenceObjective`` names it (``x-gateway-inference-objective``)."""

    priority: int = Field(
        0, description="Its band: higher is served first; a negative priority is sheddable (429 when saturated)."
    )


class FlowControlConfig(Section):
    """Requests wait in the router past saturation, in priority bands, fairly across fairness ids (docs/gateway.md).

    Off by default: a router without it places every request at once, as before.
    """

    enabled: bool = Field(False, description="Queue requests in the router while every eligible worker is saturated.")
    max_in_flight_per_worker: int = Field(
        16,
        ge=1,
        description=(
            "A worker is saturated while the router has this many requests in flight there (running plus "
            "queued in the worker: the bound on queued work); pick it near the worker's batch size."
        ),
    )
    sheddable_share: float = Field(
        0.5,
        gt=0,
        le=1,
        description=(
            "A sheddable request (negative priority) sees a worker as saturated once this share of "
            "max_in_flight_per_worker is in flight there: the rest is kept for the bands that must not be shed."
        ),
    )
    max_waiting_per_worker: int | None = Field(
        None,
        ge=0,
        description="Also saturated while the worker reports at least this many waiting requests (null: not used).",
    )
    queue_ttl_s: float = Field(
        30.0,
        gt=0,
        description=(
            "Longest wait in the router; then 429. Envoy's ext_proc max_message_timeout must exceed it "
            "(`prefix-router envoy-config --max-message-timeout-ms` sets it; its default covers this one's)."
        ),
    )
    retry_after_s: int = Field(1, ge=0, description="Retry-After (seconds) of a 429.")
    max_queued: int = Field(10_000, ge=0, description="At most this many requests wait; more get 429 at once.")
    poll_interval_s: float = Field(
        0.05, gt=0, description="While requests wait, room is checked this often (besides every request's end)."
    )
    default_priority: int = Field(0, description="Priority of a request without a known objective.")
    objectives: dict[str, ObjectiveConfig] = Field(
        default_factory=dict, description="Objective name -> its priority (what an InferenceObjective would give)."
    )

    def priority_of(self, objective: str | None) -> int:
        """The band of a request naming ``objective`` (the default for none or an unknown one)."""
        found = self.objectives.get(objective) if objective else None
        return found.priority if found is not None else self.default_priority


class PdConfig(Section):
    """Prefill/decode disaggregation: how the router pairs workers and sends the prefill leg (docs/routing.md)."""

    decode_policy: str = Field(
        "decode-load",
        description=(
            "The policy that picks the decode worker of a pair (any policy name; its section under `policy:`). "
            "The prefill worker is chosen by `policy.name` over the prefill workers."
        ),
    )
    pair_attempts: int = Field(
        3,
        ge=1,
        description=(
            "Pairs tried per request while the prefill worker refuses the connection before Envoy was answered "
            "(each try a new pair and bootstrap room); then 503."
        ),
    )
    connect_timeout_s: float = Field(
        0.2,
        gt=0,
        description=(
            "How long the prefill leg may take to connect and send the request before the pair is retried. Envoy "
            "waits for the router meanwhile: keep it below the ext_proc message_timeout (each retry asks Envoy "
            "for this much more time)."
        ),
    )
    warm_idle_s: float = Field(
        2.0,
        ge=0,
        description=(
            "A prefill leg that will go out on a keep-alive connection to its worker idle at most this long does "
            "not hold up Envoy's answer (the decode half leaves at once); any other leg is waited for until it is "
            "on the wire, so a refused connection still retries the pair. 0: always wait."
        ),
    )
    prefill_timeout_s: float = Field(
        600.0,
        gt=0,
        description=(
            "Longest prefill leg (queueing, prefill and KV transfer); past it the leg fails and decode is aborted."
        ),
    )
    abort_timeout_s: float = Field(2.0, gt=0, description="HTTP timeout of the /abort_request sent to a decode worker.")
    abort_repeat_s: float = Field(
        0.5,
        gt=0,
        description=(
            "After a failed prefill leg the decode side is aborted again this often until its response begins "
            "(the decode request may reach the worker after the first abort, which SGLang then ignores)."
        ),
    )
    abort_repeats: int = Field(40, ge=1, description="At most this many aborts per failed pair.")
    aggregate_below_tokens: int = Field(
        0,
        ge=0,
        description=(
            "On a fleet with aggregated workers beside the prefill/decode ones: a request whose uncached part "
            "(prompt tokens minus the best prefill worker's cached prefix) is shorter than this is served whole by "
            "an aggregated worker, without the KV transfer (llm-d's prefix-based decider). 0: always paired."
        ),
    )
    default_bootstrap_port: int = Field(
        8998,
        ge=1,
        le=65535,
        description=(
            "SGLang's default --disaggregation-bootstrap-port, used for a prefill worker whose /server_info "
            "does not report its own."
        ),
    )


class RouterConfig(Section):
    """Everything `prefix-router serve` needs."""

    server: ServerConfig = Field(default_factory=ServerConfig)
    workers: list[WorkerConfig] = Field(default_factory=list)
    models: list[ModelConfig] = Field(default_factory=list)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    index: IndexConfig = Field(default_factory=IndexConfig)
    memory: MemoryConfig = Field(default_factory=MemoryConfig)
    events: EventsConfig = Field(default_factory=EventsConfig)
    load: LoadConfig = Field(default_factory=LoadConfig)
    health: HealthConfig = Field(default_factory=HealthConfig)
    discovery: DiscoveryConfig = Field(default_factory=DiscoveryConfig)
    observability: ObservabilityConfig = Field(default_factory=ObservabilityConfig)
    debug: DebugConfig = Field(default_factory=DebugConfig)
    shared_state: SharedStateConfig = Field(default_factory=SharedStateConfig)
    flow_control: FlowControlConfig = Field(default_factory=FlowControlConfig)
    pd: PdConfig = Field(default_factory=PdConfig)


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
        path = [part.lower() for part in key[len(ENV_PREFIX) :].split("__")]
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


def load_config(
    path: str | Path | None = None, overrides: dict[str, Any] | None = None, environ: dict[str, str] | None = None
) -> RouterConfig:
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

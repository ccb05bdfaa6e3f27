"""The simulated worker's configuration: one typed model, filled from the command line.

Every tunable of the simulator lives here with the default SGLang uses (or, where SGLang derives a
value from the GPU, the default of the chosen timing profile), so the scheduler, the cache, the
publisher and the HTTP server each take this one object instead of reading flags or globals.
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["DisaggregationMode", "SimWorkerConfig", "StorageSettings", "parse_storage_extra_config"]

WritePolicy = Literal["write_back", "write_through", "write_through_selective"]
PrefetchPolicy = Literal["best_effort", "wait_complete", "timeout"]
DisaggregationMode = Literal["null", "prefill", "decode"]
FILE_STORAGE_DIR_ENV = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"  # SGLang's own override of the directory


class StorageSettings(BaseModel):
    """What ``--hicache-storage-backend-extra-config`` sets, with SGLang 0.5.23's defaults.

    ``prefetch_*`` are taken out of the config by SGLang's ``HybridCacheController`` (for every
    backend); ``file_storage_path`` goes to the ``file`` backend; ``sim_*`` are the cost knobs of
    SGLang's own ``sim`` benchmark backend (``storage/sim_storage.py``), which the simulated ``file``
    backend charges as its I/O time since a simulated worker has no real KV bytes to move.
    """

    model_config = ConfigDict(extra="ignore")

    prefetch_threshold: int = Field(256, ge=0, description="Fewest storage-hit tokens worth a prefetch.")
    prefetch_timeout_base: float = Field(1.0, ge=0, description="timeout policy: fixed part of the wait (s).")
    prefetch_timeout_per_ki_token: float = Field(
        0.25, ge=0, description="timeout policy: seconds of wait per 1024 requested tokens."
    )
    file_storage_path: str | None = Field(None, description="Directory of the file backend.")
    sim_read_gbps: float = Field(5.0, description="Storage read bandwidth per rank (GB/s; <= 0: infinite).")
    sim_write_gbps: float | None = Field(None, description="Storage write bandwidth (GB/s); default: the read one.")
    sim_op_latency_us: float = Field(100.0, ge=0, description="Latency of each storage operation (us).")


def parse_storage_extra_config(text: str | None) -> dict[str, Any]:
    """The extra config as SGLang reads it: a JSON object, or ``@file`` (.json, .toml, .yaml/.yml)."""
    if not text:
        return {}
    if text.startswith("@"):
        path = Path(text[1:])
        ext = path.suffix.lower()
        try:
            if ext == ".json":
                data = json.loads(path.read_text())
            elif ext == ".toml":
                try:  # the standard library has TOML from Python 3.11 on
                    tomllib = importlib.import_module("tomllib")
                except ModuleNotFoundError:
                    raise ValueError("a .toml extra config needs Python 3.11 or later") from None
                data = tomllib.loads(path.read_text())
            elif ext in (".yaml", ".yml"):
                import yaml

                data = yaml.safe_load(path.read_text())
            else:
                raise ValueError(f"unsupported config file {path} (use .json, .toml, .yaml or .yml)")
        except OSError as exc:
            raise ValueError(f"cannot read {path}: {exc.strerror}") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not a JSON object: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError("must be a JSON object (or a file holding one)")
    return data


class SimWorkerConfig(BaseModel):
    """Settings of one simulated SGLang worker (one process, one DP rank)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    # -- network -------------------------------------------------------------------------------
    host: str = Field("127.0.0.1", description="HTTP bind address.")
    port: int = Field(30001, ge=0, le=65535, description="HTTP port (SGLang's --port).")
    grpc_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description=(
            "Also serve SGLang's gRPC scheduler API (SglangScheduler, as --smg-grpc-mode does) on this port, on the "
            "same scheduler and radix cache as the HTTP API; None = HTTP only."
        ),
    )
    kv_events: bool = Field(True, description="Publish KV events over ZMQ (SGLang --kv-events-config publisher=zmq).")
    kv_events_host: str = Field(
        "*", description="Bind host of the ZMQ sockets ('*' = all interfaces, as SGLang's tcp://*:PORT)."
    )
    kv_events_port: int = Field(5557, ge=1, le=65535, description="ZMQ PUB port (endpoint port base; DP rank 0).")
    kv_replay_port: int | None = Field(
        None, ge=1, le=65535, description="ZMQ ROUTER replay port (rank 0's); default kv_events_port + dp_size."
    )
    kv_topic: str = Field("", description="Topic frame of every published batch (SGLang default: empty).")
    kv_buffer_steps: int = Field(10_000, ge=1, description="Batches kept for replay (SGLang buffer_steps).")
    event_format: Literal["tagged", "positional"] = Field(
        "tagged", description="Event encoding: tagged maps (SGLang >= 0.5.20) or positional arrays (<= 0.5.15)."
    )
    replay_format: Literal[3, 2] = Field(
        3, description="Replay reply frames: 3 = (topic, seq, payload) as 0.5.23; 2 = (seq, payload) as <= 0.5.20."
    )
    dp_rank: int = Field(0, ge=0, description="attn_dp_rank written into every event batch.")
    dp_size: int = Field(
        1,
        ge=1,
        le=64,
        description=(
            "Data-parallel ranks (SGLang --dp-size): each has its own scheduler, radix cache and KV-event "
            "publisher on kv_events_port + rank (replay on kv_replay_port + rank)."
        ),
    )

    # -- model ---------------------------------------------------------------------------------
    model: str = Field("meta-llama/Llama-3.1-8B-Instruct", description="Served model name (/v1/models, model_path).")
    tokenizer: str | None = Field(None, description="HF tokenizer dir or tokenizer.json; None = built-in default.")
    chat_template: str | None = Field(None, description="Chat template file or literal; None = the tokenizer's own.")
    context_length: int = Field(131_072, ge=16, description="Max prompt + output tokens of one request.")

    # -- cache and scheduler (SGLang server args) ------------------------------------------------
    page_size: int = Field(16, ge=1, description="Tokens per KV page (= block_size of the events).")
    capacity_tokens: int | None = Field(None, ge=1, description="KV pool size in tokens; None = the profile's pool.")
    schedule_policy: Literal["fcfs", "lpm"] = Field("fcfs", description="Waiting-queue order.")
    chunked_prefill_size: int = Field(8192, ge=1, description="Per-step prefill token budget (chunking).")
    max_prefill_tokens: int = Field(16384, ge=1, description="Prefill tokens admitted per batch.")
    max_running_requests: int = Field(1024, ge=1, description="Cap on requests in the running batch.")
    default_max_new_tokens: int = Field(
        128, ge=1, description="max_new_tokens when a request gives none (SGLang: 128)."
    )

    # -- timing --------------------------------------------------------------------------------
    profile: str = Field(
        "llama-3.1-8b-h100",
        description=(
            "Timing profile (see sglang_workers.sim.timing), or a comma-separated list cycled over the DP ranks."
        ),
    )
    speedup: float = Field(1.0, gt=0, description="Divide every simulated duration by this.")
    seed: int = Field(0, description="Seed of the output-token generator (same prompt + seed = same output).")
    load_time: float = Field(
        0.0,
        ge=0,
        description=(
            "Seconds after the HTTP port opens during which the worker answers 503, as SGLang does while it "
            "loads weights and warms up (real seconds, not divided by speedup)."
        ),
    )

    # -- hierarchical cache (SGLang HiCache server args, 0.5.23 defaults) ---------------------------
    enable_hierarchical_cache: bool = Field(
        False, description="A host-memory KV tier behind the GPU pool (SGLang --enable-hierarchical-cache)."
    )
    hicache_ratio: float = Field(
        2.0, gt=0, description="Host pool size as a multiple of the device pool (used when hicache_size is 0)."
    )
    hicache_size: int = Field(
        0, ge=0, description="Host pool size in GB (1e9 bytes) per rank; overrides hicache_ratio when > 0."
    )
    hicache_write_policy: WritePolicy = Field(
        "write_through",
        description=(
            "When pages get a host copy: write_through at insert, write_through_selective on the second insert "
            "through a node, write_back only when the GPU evicts them."
        ),
    )
    hicache_io_backend: Literal["direct", "kernel", "kernel_ascend"] = Field(
        "kernel", description="Reported in /server_info only (the simulator moves no bytes)."
    )
    hicache_mem_layout: Literal[
        "layer_first", "page_first", "page_first_direct", "page_first_kv_split", "page_head"
    ] = Field("page_first", description="Reported in /server_info only.")
    hicache_storage_backend: Literal["file"] | None = Field(
        None, description="L3 storage behind the host pool; the simulator implements SGLang's 'file' backend."
    )
    hicache_storage_prefetch_policy: PrefetchPolicy = Field(
        "timeout", description="How long admission waits for a storage prefetch (best_effort, wait_complete, timeout)."
    )
    hicache_storage_backend_extra_config: str | None = Field(
        None, description="JSON object or @file with prefetch_threshold, prefetch_timeout_*, file_storage_path, sim_*."
    )
    file_storage_path: str | None = Field(None, description="Directory of the file backend (seeds the extra config).")

    # -- prefill/decode disaggregation (SGLang --disaggregation-*, 0.5.23 defaults) ----------------------
    disaggregation_mode: DisaggregationMode = Field(
        "null",
        description=(
            "'null' = an aggregated worker; 'prefill' runs a request's prefill, sends its KV to the decode worker "
            "named by bootstrap_host/bootstrap_port/bootstrap_room and answers after the transfer; 'decode' has no "
            "radix cache (no KV events), waits for that KV and then decodes. PD workers refuse requests without a room."
        ),
    )
    disaggregation_bootstrap_port: int = Field(
        8998, ge=1, le=65535, description="Prefill only: the bootstrap server's port, where decode workers hand-shake."
    )
    disaggregation_transfer_gbps: float = Field(
        25.0,
        gt=0,
        description=(
            "Prefill only: KV transfer bandwidth to a decode worker per GPU (GB/s, 1e9; simulated time): a transfer "
            "takes the profile's KV bytes per token x prompt tokens / this."
        ),
    )
    disaggregation_bootstrap_timeout: float = Field(
        300.0,
        gt=0,
        description=(
            "Prefill only: seconds a request waits for its decode worker's handshake before it fails (SGLang's "
            "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT; real seconds, not divided by speedup)."
        ),
    )
    disaggregation_waiting_timeout: float = Field(
        300.0,
        gt=0,
        description=(
            "Decode only: seconds a request waits for its KV after the handshake before it fails (SGLang's "
            "SGLANG_DISAGGREGATION_WAITING_TIMEOUT; real seconds, not divided by speedup)."
        ),
    )

    @model_validator(mode="after")
    def _check_ports(self) -> SimWorkerConfig:
        events = set(range(self.kv_events_port, self.kv_events_port + self.dp_size))
        replay = set(range(self.replay_port, self.replay_port + self.dp_size))
        if self.kv_events and events & replay:
            raise ValueError(
                f"the replay ports {min(replay)}-{max(replay)} overlap the event ports {min(events)}-{max(events)}"
            )
        if self.kv_events and max(events | replay) > 65535:
            raise ValueError("kv_events_port / kv_replay_port + dp_size go past port 65535")
        if self.grpc_port and self.grpc_port == self.port:
            raise ValueError("grpc_port must differ from port")
        if self.disaggregation_mode != "null":
            if self.dp_size != 1 or self.grpc_port is not None or self.enable_hierarchical_cache:
                raise ValueError("a disaggregated (prefill/decode) sim worker has one DP rank, HTTP only, no HiCache")
            if self.disaggregation_mode == "prefill" and self.disaggregation_bootstrap_port == self.port:
                raise ValueError("disaggregation_bootstrap_port must differ from port")
        if self.hicache_storage_backend is not None and not self.enable_hierarchical_cache:
            raise ValueError(
                "hicache_storage_backend needs enable_hierarchical_cache (the L3 tier sits behind host memory)"
            )
        try:
            extra = parse_storage_extra_config(self.hicache_storage_backend_extra_config)
            StorageSettings.model_validate(extra)
        except ValueError as exc:
            raise ValueError(f"hicache_storage_backend_extra_config: {exc}") from None
        return self

    def storage_settings(self) -> StorageSettings:
        """The parsed extra config (``--file-storage-path`` seeds ``file_storage_path``, as in SGLang)."""
        extra = parse_storage_extra_config(self.hicache_storage_backend_extra_config)
        if self.file_storage_path:
            extra.setdefault("file_storage_path", self.file_storage_path)
        return StorageSettings.model_validate(extra)

    def storage_dir(self) -> Path:
        """The file backend's directory, first match wins: SGLang's env override, the config, /tmp/hicache."""
        return Path(os.environ.get(FILE_STORAGE_DIR_ENV) or self.storage_settings().file_storage_path or "/tmp/hicache")

    @property
    def replay_port(self) -> int:
        return self.kv_replay_port if self.kv_replay_port is not None else self.kv_events_port + self.dp_size

    def rank(self, rank: int) -> SimWorkerConfig:
        """The settings of one data-parallel rank: its ``dp_rank`` and its publisher's ports."""
        if self.dp_size == 1:
            return self
        return self.model_copy(
            update={
                "dp_rank": rank,
                "kv_events_port": self.kv_events_port + rank,
                "kv_replay_port": self.replay_port + rank,
            }
        )

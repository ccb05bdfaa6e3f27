"""The simulated worker's configuration: one typed model, filled from the command line.

Every tunable of the simulator lives here with the default SGLang uses (or, where SGLang derives a
value from the GPU, the default of the chosen timing profile), so the scheduler, the cache, the
publisher and the HTTP server each take this one object instead of reading flags or globals.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["SimWorkerConfig"]


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
    profile: str = Field("llama-3.1-8b-h100", description="Timing profile name (see sglang_workers.timing).")
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
        return self

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

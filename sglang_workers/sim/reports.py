"""What a simulated worker reports about itself, shared by its two front doors (HTTP and gRPC).

``/server_info`` (the gRPC ``GetServerInfo.server_args``), ``/model_info`` (``GetModelInfo``) and ``/v1/loads``
(``GetLoads`` is built from it, so the two always agree), under SGLang 0.5.23's names and types: the differential
conformance tests compare them with a real worker's.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

from .config import SimWorkerConfig
from .metrics import GRAPH_PHASES
from .responses import model_info
from .worker import SimWorker

__all__ = [
    "LOAD_SECTIONS",
    "SGLANG_VERSION",
    "disaggregation_info",
    "hicache_info",
    "kv_events_info",
    "load_sections",
    "loads_prometheus",
    "loads_report",
    "model_info_report",
    "server_info_report",
]

SGLANG_VERSION = "0.5.23"  # the SGLang release whose wire behaviour this simulator reproduces
LOAD_SECTIONS = {  # ``/v1/loads?include=`` names -> the sections of a LoadSnapshot
    "memory": "memory",
    "spec": "speculative",
    "lora": "lora",
    "disagg": "disaggregation",
    "queues": "queues",
}


def kv_events_info(cfg: SimWorkerConfig) -> dict[str, Any] | None:
    """The ``kv_events`` block of ``/server_info``: where a router subscribes (None with events off)."""
    if not cfg.kv_events:
        return None
    return {
        "publisher": "zmq",
        "endpoint_host": cfg.kv_events_host,
        "endpoint_port_base": cfg.kv_events_port,
        "topic": cfg.kv_topic,
        "block_size": cfg.page_size,
        "dp_size": cfg.dp_size,
        "replay_endpoint_port_base": cfg.replay_port,
    }


def disaggregation_info(cfg: SimWorkerConfig) -> dict[str, Any]:
    """The ``disaggregation_*`` server arguments, as a real 0.5.23 PD worker on ``mooncake_tcp`` reports them
    (``mooncake_tcp`` is reported as ``mooncake``; a decode worker reports the default bootstrap port)."""
    decode = cfg.disaggregation_mode == "decode"
    return {
        "disaggregation_mode": cfg.disaggregation_mode,
        "disaggregation_transfer_backend": "mooncake",
        "disaggregation_bootstrap_port": cfg.disaggregation_bootstrap_port,
        "disaggregation_ib_device": None,
        "disaggregation_decode_enable_radix_cache": False,
        "disaggregation_decode_enable_offload_kvcache": False,
        "disaggregation_decode_retraction_backup": "cpu_tensor" if decode else None,
        "disaggregation_decode_extra_slots": 0 if decode else None,
        "disaggregation_decode_polling_interval": 1,
        "disaggregation_enable_kv_checksum": False,
        "disaggregation_decode_host_receive_threshold": 1.0,
        "disaggregation_decode_allocation_policy": "early",
    }


def server_info_report(worker: SimWorker) -> dict[str, Any]:
    """The body of ``/server_info`` (also the gRPC ``GetServerInfo.server_args``).

    The server arguments a router, sgl-router, smg or a dashboard reads, under SGLang's names and types
    (the differential conformance test compares them with a real worker's), plus a ``simulator`` block.
    """
    cfg = worker.config
    scheduler = worker.scheduler
    kv_cfg = None
    if cfg.kv_events:
        kv_cfg = json.dumps(
            {
                "publisher": "zmq",
                "endpoint": f"tcp://{cfg.kv_events_host}:{cfg.kv_events_port}",
                "topic": cfg.kv_topic,
                "replay_endpoint": f"tcp://{cfg.kv_events_host}:{cfg.replay_port}",
                "buffer_steps": cfg.kv_buffer_steps,
            }
        )
    load = scheduler.load() if scheduler else {}
    capacity = scheduler.capacity if scheduler else 0
    profile = worker.profile
    graphs = dict.fromkeys(GRAPH_PHASES, 0.0)
    return {
        "model_path": cfg.model,
        "tokenizer_path": worker.tokenizer_path,
        "served_model_name": cfg.model,
        "host": cfg.host,
        "port": worker.bound_port or cfg.port,
        "skip_tokenizer_init": False,
        "is_embedding": False,
        "dtype": "bfloat16",
        "kv_cache_dtype": "auto",
        "device": "cuda",
        "context_length": cfg.context_length,
        "page_size": cfg.page_size,
        "chunked_prefill_size": cfg.chunked_prefill_size,
        "max_prefill_tokens": cfg.max_prefill_tokens,
        "max_running_requests": cfg.max_running_requests,
        "max_total_tokens": cfg.capacity_tokens,
        "schedule_policy": cfg.schedule_policy,
        "random_seed": cfg.seed,
        "tp_size": profile.num_gpus,
        "pp_size": 1,
        "dp_size": cfg.dp_size,
        "load_balance_method": "round_robin",
        "enable_dp_attention": False,
        "disable_radix_cache": cfg.disaggregation_mode == "decode",
        "speculative_algorithm": None,
        **disaggregation_info(cfg),
        "enable_metrics": True,
        "enable_cache_report": True,
        "kv_events_config": kv_cfg,
        "max_total_num_tokens": capacity,
        "status": "ready" if worker.ready else "starting",
        **hicache_info(cfg),
        "internal_states": [
            {
                "effective_max_running_requests_per_dp": cfg.max_running_requests,
                "last_gen_throughput": load.get("gen_throughput", 0.0),
                "memory_usage": {
                    "weight": profile.weight_gb,
                    "kvcache": load.get("memory", {}).get("kv_cache_gb", 0.0),
                    "startup_available": 0.0,
                    "token_capacity": capacity,
                    "token_capacity_swa": None,
                    "graph": {**graphs, "decode": profile.graph_gb},
                },
            }
        ],
        "version": SGLANG_VERSION,
        "kv_events": kv_events_info(cfg),
        "simulator": {
            "profile": cfg.profile,
            "speedup": cfg.speedup,
            "seed": cfg.seed,
            "event_format": cfg.event_format,
            "replay_format": cfg.replay_format,
            # Simulated GPU seconds spent so far, all ranks (what a fleet's compute costs; no SGLang field).
            "busy_seconds": {
                "prefill": sum(s.stats.busy_prefill_s for s in worker.schedulers),
                "decode": sum(s.stats.busy_decode_s for s in worker.schedulers),
            },
            "host_pool_tokens": worker.host_tokens,
        },
    }


def hicache_info(cfg: SimWorkerConfig) -> dict[str, Any]:
    """The HiCache server args as SGLang 0.5.23 reports them, and its L3 layout block."""
    reason = (
        "Hierarchical cache is disabled" if not cfg.enable_hierarchical_cache else "Mooncake storage is not attached"
    )
    return {
        "enable_hierarchical_cache": cfg.enable_hierarchical_cache,
        "hicache_host_memory_mode": "cache",
        "hicache_ratio": cfg.hicache_ratio,
        "hicache_size": cfg.hicache_size,
        "hicache_write_policy": cfg.hicache_write_policy,
        "hicache_io_backend": cfg.hicache_io_backend,
        "hicache_mem_layout": cfg.hicache_mem_layout,
        "hicache_storage_backend": cfg.hicache_storage_backend,
        "hicache_storage_prefetch_policy": cfg.hicache_storage_prefetch_policy,
        "hicache_storage_backend_extra_config": cfg.hicache_storage_backend_extra_config,
        "hicache_storage_prefetch_retry_poll_interval": 8,
        "hicache_storage_prefetch_retry_max_attempts": 8,
        "hicache_host_memory_fraction": 0.8 if cfg.hicache_size == 0 else None,
        "file_storage_path": cfg.file_storage_path,
        "hicache_object_layout": {
            "enabled": False,
            "backend": cfg.hicache_storage_backend if cfg.enable_hierarchical_cache else None,
            "page_size": cfg.page_size,
            "hicache_object_layout": {"pools": []},
            "reason": reason,
        },
    }


def model_info_report(worker: SimWorker) -> dict[str, Any]:
    """The body of ``/model_info`` (the gRPC ``GetModelInfo`` carries the same fields)."""
    return model_info(worker.config.model, worker.tokenizer_path) | {
        "disaggregation_mode": worker.config.disaggregation_mode
    }


def loads_report(worker: SimWorker, sections: set[str] | None = None, dp_rank: int | None = None) -> dict[str, Any]:
    """The body of ``/v1/loads``; the gRPC ``GetLoads`` is built from it, so the two always agree."""
    worker.require_ready()
    loads = [load for load in (s.load() for s in worker.schedulers) if dp_rank is None or load["dp_rank"] == dp_rank]
    return {
        "timestamp": datetime.now(timezone.utc).isoformat(),
        "version": SGLANG_VERSION,
        "accelerator": worker.profile.gpu_name,
        "num_accelerators": worker.profile.num_gpus,
        "loads": [load_sections(load, sections) for load in loads],
    }


def load_sections(load: dict[str, Any], sections: set[str] | None) -> dict[str, Any]:
    """``LoadSnapshot.to_dict``: the flat keys always, the sections asked for (all by default)."""
    if sections is None or "all" in sections:
        return load
    keep = {LOAD_SECTIONS[s] for s in sections if s in LOAD_SECTIONS}
    return {k: v for k, v in load.items() if not isinstance(v, dict) or k in keep}


def loads_prometheus(loads: list[dict[str, Any]]) -> str:
    """``format=prometheus``: one gauge per number, ``sglang_<key>`` or ``sglang_<section>_<key>``."""
    prefixes = {"speculative": "spec", "disaggregation": "disagg"}
    samples: dict[str, list[tuple[int, float]]] = {}
    for load in loads:
        rank = load["dp_rank"]
        for key, value in load.items():
            if key == "dp_rank":
                continue
            if isinstance(value, dict):
                for sub, sub_value in value.items():
                    if isinstance(sub_value, (int, float)) and not isinstance(sub_value, bool):
                        samples.setdefault(f"sglang_{prefixes.get(key, key)}_{sub}", []).append((rank, sub_value))
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                samples.setdefault(f"sglang_{key}", []).append((rank, value))
    lines = []
    for name, values in samples.items():
        lines.append(f"# TYPE {name} gauge")
        lines.extend(f'{name}{{dp_rank="{rank}"}} {value}' for rank, value in values)
    return "\n".join(lines) + "\n"

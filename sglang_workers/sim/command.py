"""``prefix-router sim-worker``: run one SGLang-faithful simulated worker.

Flag names follow SGLang's ``launch_server`` where SGLang has the same knob (``--page-size``,
``--schedule-policy``, ``--chunked-prefill-size``, ...), so a command line reads like the real one.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from pydantic import ValidationError

from prefix_common.logs import add_log_flags, configure_logging

from .config import SimWorkerConfig
from .timing import PROFILES, profile_list

__all__ = ["build_config", "configure", "main"]

log = logging.getLogger("sglang_workers.sim")


def _profiles(text: str) -> str:
    try:
        return ",".join(profile_list(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Run a simulated SGLang worker: SGLang's HTTP API, radix cache, continuous-batching scheduler "
        "and KV-event publisher (ZMQ, byte-identical to SGLang 0.5.23), on CPU, with time taken from a "
        "timing profile of a real GPU. `prefix-router sim-worker --port 30001` alone works."
    )
    d = SimWorkerConfig.model_fields
    net = parser.add_argument_group("network")
    net.add_argument("--host", default=d["host"].default, help="HTTP bind address.")
    net.add_argument("--port", type=int, default=d["port"].default, help="HTTP port.")
    net.add_argument(
        "--grpc-port",
        type=int,
        default=None,
        help="Also serve SGLang's gRPC scheduler API (SglangScheduler from smg-grpc-proto, what SGLang's "
        "--smg-grpc-mode serves and smg's grpc:// workers speak) on this port: the same worker behind both ports. "
        "Default: HTTP only.",
    )
    net.add_argument(
        "--kv-events-port",
        type=int,
        default=d["kv_events_port"].default,
        help="ZMQ PUB port of the KV-event publisher (SGLang endpoint tcp://*:PORT).",
    )
    net.add_argument(
        "--kv-replay-port",
        type=int,
        default=None,
        help="ZMQ ROUTER port for replaying missed batches (default: --kv-events-port + --dp-size).",
    )
    net.add_argument(
        "--kv-events-host",
        default=d["kv_events_host"].default,
        help="Bind host of the ZMQ sockets ('*' = all interfaces, like SGLang).",
    )
    net.add_argument("--kv-topic", default=d["kv_topic"].default, help="Topic frame of published batches.")
    net.add_argument(
        "--kv-buffer-steps",
        type=int,
        default=d["kv_buffer_steps"].default,
        help="Batches kept for replay (ZMQ replay socket and gRPC SubscribeKvEvents resume), as SGLang's buffer_steps.",
    )
    net.add_argument("--no-kv-events", action="store_true", help="Do not publish KV events at all.")
    net.add_argument(
        "--event-format",
        choices=["tagged", "positional"],
        default=d["event_format"].default,
        help="Event encoding: tagged maps (SGLang >= 0.5.20) or positional arrays (<= 0.5.15).",
    )
    net.add_argument(
        "--replay-format",
        type=int,
        choices=[3, 2],
        default=d["replay_format"].default,
        help="Replay reply frames: 3 = (topic, seq, payload) as 0.5.23, 2 = (seq, payload) as <= 0.5.20.",
    )

    model = parser.add_argument_group("model")
    model.add_argument("--model", default=d["model"].default, help="Model name served in /v1/models and /model_info.")
    model.add_argument(
        "--tokenizer",
        default=None,
        help="HF tokenizer directory or tokenizer.json (default: the built-in Llama-3-style tokenizer).",
    )
    model.add_argument(
        "--chat-template", default=None, help="Chat template file or literal (default: the tokenizer's)."
    )
    model.add_argument(
        "--context-length",
        type=int,
        default=d["context_length"].default,
        help="Longest prompt + output a request may ask for (longer: HTTP 400, as SGLang answers).",
    )

    sched = parser.add_argument_group("cache and scheduler (SGLang server args)")
    sched.add_argument(
        "--dp-size",
        type=int,
        default=d["dp_size"].default,
        help=(
            "Data-parallel ranks, as SGLang's --dp-size: each its own scheduler, radix cache and KV-event "
            "publisher (rank r on --kv-events-port + r, dp_rank r in its batches, one /v1/loads entry). A "
            "request names its rank with routed_dp_rank, X-Data-Parallel-Rank or (with "
            "SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES=1) x-override-routed-dp-rank; others go round robin."
        ),
    )
    sched.add_argument(
        "--page-size",
        type=int,
        default=d["page_size"].default,
        help="Tokens per KV page; the block_size of KV events. Must equal the router's block size.",
    )
    sched.add_argument(
        "--capacity-tokens",
        type=int,
        default=None,
        help="KV pool size in tokens (default: the profile's pool at SGLang's memory defaults).",
    )
    sched.add_argument(
        "--schedule-policy",
        choices=["fcfs", "lpm"],
        default=d["schedule_policy"].default,
        help="Waiting-queue order: first come first served, or longest cached prefix first.",
    )
    sched.add_argument(
        "--chunked-prefill-size",
        type=int,
        default=d["chunked_prefill_size"].default,
        help="Prefill tokens per step; longer prompts are chunked.",
    )
    sched.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=d["max_prefill_tokens"].default,
        help="Prefill tokens admitted into one batch.",
    )
    sched.add_argument(
        "--max-running-requests",
        type=int,
        default=d["max_running_requests"].default,
        help="Cap on concurrently running requests.",
    )
    sched.add_argument(
        "--default-max-new-tokens",
        type=int,
        default=d["default_max_new_tokens"].default,
        help="Output length when a /generate or chat request sets none.",
    )

    hi = parser.add_argument_group(
        "hierarchical cache (SGLang HiCache: a host-memory tier, optionally an L3 storage tier shared by workers)"
    )
    hi.add_argument(
        "--enable-hierarchical-cache",
        "--enable-hicache",
        action="store_true",
        help="Keep pages evicted from the GPU in a host-memory pool and load them back on a hit; KV events then "
        "carry medium CPU_PINNED for the host tier.",
    )
    hi.add_argument(
        "--hicache-ratio",
        type=float,
        default=d["hicache_ratio"].default,
        help="Host pool size as a multiple of the GPU pool (SGLang default 2.0).",
    )
    hi.add_argument(
        "--hicache-size",
        type=int,
        default=d["hicache_size"].default,
        help="Host pool size in GB (1e9 bytes, with the profile's KV bytes per token); overrides --hicache-ratio.",
    )
    hi.add_argument(
        "--hicache-write-policy",
        choices=["write_through", "write_through_selective", "write_back"],
        default=d["hicache_write_policy"].default,
        help="write_through: back every new page up at once; write_through_selective: on its second insert; "
        "write_back: only when the GPU evicts it (a synchronous copy inside the eviction).",
    )
    hi.add_argument(
        "--hicache-io-backend",
        choices=["direct", "kernel", "kernel_ascend"],
        default=d["hicache_io_backend"].default,
        help="Accepted for SGLang compatibility and reported in /server_info.",
    )
    hi.add_argument(
        "--hicache-mem-layout",
        choices=["layer_first", "page_first", "page_first_direct", "page_first_kv_split", "page_head"],
        default=d["hicache_mem_layout"].default,
        help="Accepted for SGLang compatibility and reported in /server_info.",
    )
    hi.add_argument(
        "--hicache-storage-backend",
        choices=["file"],
        default=None,
        help="L3 storage behind the host pool: 'file' = one file per page in a directory that several workers "
        "may share (pages one worker wrote are prefetched by any other).",
    )
    hi.add_argument(
        "--hicache-storage-prefetch-policy",
        choices=["best_effort", "wait_complete", "timeout"],
        default=d["hicache_storage_prefetch_policy"].default,
        help="How long admission waits for a storage prefetch: not at all, until it completes, or at most "
        "prefetch_timeout_base + prefetch_timeout_per_ki_token per 1024 tokens (1 s + 0.25 s).",
    )
    hi.add_argument(
        "--hicache-storage-backend-extra-config",
        default=None,
        help="JSON object (or @file.json/.toml/.yaml): prefetch_threshold (256), prefetch_timeout_base (1), "
        "prefetch_timeout_per_ki_token (0.25), file_storage_path, and the simulated I/O cost sim_read_gbps (5), "
        "sim_write_gbps, sim_op_latency_us (100).",
    )
    hi.add_argument(
        "--file-storage-path",
        default=None,
        help="Directory of the file backend (default /tmp/hicache; the env SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR "
        "wins over it, as in SGLang).",
    )

    pd = parser.add_argument_group(
        "prefill/decode disaggregation (SGLang --disaggregation-*): a request goes to one prefill and one decode "
        "worker with bootstrap_host / bootstrap_port / bootstrap_room"
    )
    pd.add_argument(
        "--disaggregation-mode",
        choices=["null", "prefill", "decode"],
        default=d["disaggregation_mode"].default,
        help="null: an aggregated worker. prefill: runs the prefill (radix cache, KV events), sends the KV to the "
        "decode worker that hand-shook for the room, answers after the transfer. decode: no radix cache, no KV "
        "events; waits for the prefill's KV, then decodes. Both answer 400 without bootstrap_room.",
    )
    pd.add_argument(
        "--disaggregation-bootstrap-port",
        type=int,
        default=d["disaggregation_bootstrap_port"].default,
        help="Prefill: the port of its bootstrap server, where decode workers hand-shake (a request's "
        "bootstrap_port; SGLang's default 8998). Decode: the port used when a request's bootstrap_port is null.",
    )
    pd.add_argument(
        "--disaggregation-transfer-gbps",
        type=float,
        default=d["disaggregation_transfer_gbps"].default,
        help="Prefill: KV transfer bandwidth per GPU in GB/s (simulated time): a transfer takes the profile's KV "
        "bytes per token x prompt tokens / this.",
    )
    pd.add_argument(
        "--disaggregation-bootstrap-timeout",
        type=float,
        default=d["disaggregation_bootstrap_timeout"].default,
        help="Prefill: seconds a request waits for its decode worker's handshake, then fails "
        "(SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT; real seconds).",
    )
    pd.add_argument(
        "--disaggregation-waiting-timeout",
        type=float,
        default=d["disaggregation_waiting_timeout"].default,
        help="Decode: seconds a request waits for its KV after the handshake, then fails with a 500 "
        "(SGLANG_DISAGGREGATION_WAITING_TIMEOUT; real seconds).",
    )

    timing = parser.add_argument_group("timing")
    timing.add_argument(
        "--profile",
        type=_profiles,
        default=d["profile"].default,
        help=f"GPU timing profile, one of {', '.join(sorted(PROFILES))} ('instant' takes no simulated time), or a "
        "comma-separated list cycled over the DP ranks (--dp-size), e.g. llama-3.1-8b-h100,llama-3.1-8b-a100.",
    )
    timing.add_argument(
        "--speedup",
        type=float,
        default=d["speedup"].default,
        help="Run simulated time this many times faster than real time.",
    )
    timing.add_argument(
        "--seed",
        type=int,
        default=d["seed"].default,
        help="Seed of generated tokens (same prompt + seed = same output).",
    )
    timing.add_argument(
        "--load-time",
        type=float,
        default=d["load_time"].default,
        help="Seconds to answer 503 after start, like SGLang loading a model (real time).",
    )
    add_log_flags(parser)


def build_config(args: argparse.Namespace) -> SimWorkerConfig:
    return SimWorkerConfig(
        host=args.host,
        port=args.port,
        grpc_port=args.grpc_port,
        kv_events=not args.no_kv_events,
        kv_events_host=args.kv_events_host,
        kv_events_port=args.kv_events_port,
        kv_replay_port=args.kv_replay_port,
        kv_topic=args.kv_topic,
        kv_buffer_steps=args.kv_buffer_steps,
        event_format=args.event_format,
        replay_format=args.replay_format,
        model=args.model,
        tokenizer=args.tokenizer,
        chat_template=args.chat_template,
        context_length=args.context_length,
        page_size=args.page_size,
        dp_size=args.dp_size,
        capacity_tokens=args.capacity_tokens,
        schedule_policy=args.schedule_policy,
        chunked_prefill_size=args.chunked_prefill_size,
        max_prefill_tokens=args.max_prefill_tokens,
        max_running_requests=args.max_running_requests,
        default_max_new_tokens=args.default_max_new_tokens,
        profile=args.profile,
        speedup=args.speedup,
        seed=args.seed,
        load_time=args.load_time,
        enable_hierarchical_cache=args.enable_hierarchical_cache,
        hicache_ratio=args.hicache_ratio,
        hicache_size=args.hicache_size,
        hicache_write_policy=args.hicache_write_policy,
        hicache_io_backend=args.hicache_io_backend,
        hicache_mem_layout=args.hicache_mem_layout,
        hicache_storage_backend=args.hicache_storage_backend,
        hicache_storage_prefetch_policy=args.hicache_storage_prefetch_policy,
        hicache_storage_backend_extra_config=args.hicache_storage_backend_extra_config,
        file_storage_path=args.file_storage_path,
        disaggregation_mode=args.disaggregation_mode,
        disaggregation_bootstrap_port=args.disaggregation_bootstrap_port,
        disaggregation_transfer_gbps=args.disaggregation_transfer_gbps,
        disaggregation_bootstrap_timeout=args.disaggregation_bootstrap_timeout,
        disaggregation_waiting_timeout=args.disaggregation_waiting_timeout,
    )


async def serve(config: SimWorkerConfig) -> None:
    """Run until SIGINT/SIGTERM."""
    from .http_api import HttpServer  # heavy imports (tokenizers, aiohttp) only when serving
    from .worker import SimWorker

    worker = SimWorker(config)
    await worker.start()
    http = HttpServer(worker)
    try:
        await http.start(config.host, config.port)
    except OSError:
        await worker.stop()
        raise
    ranks = f", {config.dp_size} DP ranks from" if config.dp_size > 1 else ""
    grpc_door = None
    if config.grpc_port is not None:
        from .grpc_server import SchedulerGrpcServer  # grpc and the generated protos only when asked for

        grpc_door = SchedulerGrpcServer(worker)
        try:
            await grpc_door.start(config.host, config.grpc_port)
        except OSError:
            await http.stop()
            await worker.stop()
            raise
    events = (
        f"KV events{ranks} on tcp://{config.kv_events_host}:{config.kv_events_port} (replay {config.replay_port})"
        if config.kv_events
        else "KV events off"
    )
    grpc_note = f" and grpc://{config.host}:{grpc_door.bound_port}" if grpc_door is not None else ""
    if config.disaggregation_mode == "prefill":
        grpc_note += f" (prefill, bootstrap port {config.disaggregation_bootstrap_port})"
    elif config.disaggregation_mode == "decode":
        grpc_note += " (decode)"
    capacity = worker.scheduler.capacity if worker.scheduler else 0
    tiers = ""
    if config.enable_hierarchical_cache:
        tiers = f", host tier {worker.host_tokens} tokens ({config.hicache_write_policy})"
        if config.hicache_storage_backend == "file":
            tiers += f", file storage {config.storage_dir()}"
    log.info(
        "sim-worker ready on http://%s:%d%s (%s, page %d, %d KV tokens%s; %s)",
        config.host,
        worker.bound_port,
        grpc_note,
        config.profile,
        config.page_size,
        capacity,
        tiers,
        events,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        if grpc_door is not None:
            await grpc_door.stop()
        await http.stop()
        await worker.stop()


def main(args: argparse.Namespace) -> int:
    configure_logging(args.log_level, args.log_format)
    try:
        config = build_config(args)
    except ValidationError as exc:
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"]) or "config"
            print(f"prefix-router sim-worker: {where}: {err['msg']}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(config))
    except ValueError as exc:  # unknown profile, unreadable tokenizer
        print(f"prefix-router sim-worker: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # port in use
        print(f"prefix-router sim-worker: cannot listen: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # zmq.ZMQError (address in use) and friends, without a traceback
        if type(exc).__module__.startswith("zmq"):
            print(f"prefix-router sim-worker: cannot bind KV-event sockets: {exc}", file=sys.stderr)
            return 1
        raise
    return 0

"""The simulated worker's second front door: SGLang's gRPC scheduler API (``SglangScheduler``).

SGLang serves this API with ``--smg-grpc-mode`` (formerly ``--grpc-mode``; the ``smg-grpc-servicer``
package); smg's ``grpc://`` workers speak it, and only over it does smg's ``cache_aware`` run its
event-driven block index. The service definition comes from PyPI ``smg-grpc-proto``
(``sglang_scheduler.proto``, ``common.proto``).

Both doors lead to the same :class:`~sglang_workers.sim.worker.SimWorker`: one scheduler, one radix cache,
one KV-event publisher, so a request sent over gRPC warms the cache for one sent over HTTP and both
show up in ``/metrics`` and ``/v1/loads``. All of it runs on the worker's one asyncio loop
(``grpc.aio``), so nothing needs a lock.

Where smg depends on how SGLang's own servicer behaves, this one behaves the same (docs/sim-worker.md
lists each point): token ids in and out (the gateway tokenizes); a stream of chunks then one
``complete`` for ``stream=true``, a single ``complete`` otherwise; errors as gRPC statuses, never a
``complete`` with an error in it; ``SubscribeKvEvents`` sends its response headers at once (smg gives
up on a subscription that has not answered within 2 s); ``HealthCheck`` probes the scheduler with a
one-token request only when it is idle; ``GetTokenizer`` streams the tokenizer files as a zip with the
SHA-256 on the last chunk.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import logging
import time
import uuid
import zipfile
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.struct_pb2 import Struct
from smg_grpc_proto.generated import common_pb2, sglang_scheduler_pb2, sglang_scheduler_pb2_grpc

from .grpc_events import KvEventRelay, StreamError, engine_load
from .reports import LOAD_SECTIONS, SGLANG_VERSION, loads_report, model_info_report, server_info_report
from .request import HEALTH_CHECK_RID_PREFIX, Request
from .responses import ApiError
from .worker import HEALTH_CHECK_TIMEOUT_S, SimWorker

__all__ = ["INCLUDE_SECTIONS", "SchedulerGrpcServer", "SchedulerServicer", "scheduler_load"]

logger = logging.getLogger(__name__)

TOKENIZER_CHUNK_BYTES = 64 * 1024
MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # long prompts as token ids; the HTTP door takes 64 MiB bodies too
HEALTH_POLL_S = 0.01  # the gRPC probe answers on the scheduler's first output after it (no 1 s sleep as HTTP)
INCLUDE_SECTIONS = frozenset({"core", "all", *LOAD_SECTIONS})  # what GetLoads' include may name
# Files of a tokenizer directory that make up a tokenizer bundle (never model weights).
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "config.json",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.json",
)
_TOKENIZER_GLOBS = ("*.jinja", "*.tiktoken")

# HTTP statuses of the shared admission checks -> gRPC codes.
_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.INVALID_ARGUMENT,
    503: grpc.StatusCode.UNAVAILABLE,
}


def _set_fields(message: Any, values: Mapping[str, Any]) -> None:
    """Copy ``values`` into ``message`` by field name (scalars and one level of sub-messages).

    By name, so every figure the HTTP report gains shows up here too, without a second list to keep.
    """
    for f in message.DESCRIPTOR.fields:
        value = values.get(f.name)
        if value is None:
            continue
        current = getattr(message, f.name)
        if hasattr(current, "extend"):  # a repeated field
            if isinstance(value, list) and f.message_type is None:
                del current[:]
                current.extend(value)
        elif f.message_type is not None:
            if isinstance(value, Mapping):
                sub = getattr(message, f.name)
                sub.SetInParent()
                _set_fields(sub, value)
        elif f.type == f.TYPE_STRING:
            setattr(message, f.name, str(value))
        elif f.type in (f.TYPE_DOUBLE, f.TYPE_FLOAT):
            setattr(message, f.name, float(value))
        elif f.type == f.TYPE_BOOL:
            setattr(message, f.name, bool(value))
        elif isinstance(value, (int, float)):
            setattr(message, f.name, int(value))


def scheduler_load(load: Mapping[str, Any], max_running_requests: int) -> Any:
    """One DP rank of ``/v1/loads`` as a ``SchedulerLoad`` (SGLang fills the total and the running cap too)."""
    message = sglang_scheduler_pb2.SchedulerLoad()
    _set_fields(message, load)
    disaggregation = load.get("disaggregation")
    if isinstance(disaggregation, Mapping) and "prefill_bootstrap_queue_reqs" in disaggregation:
        # SGLang renamed this queue; the proto kept the old name (SGLang's servicer maps it the same way).
        message.disaggregation.prefill_prealloc_queue_reqs = int(disaggregation["prefill_bootstrap_queue_reqs"])
    if "num_total_reqs" not in load:
        message.num_total_reqs = message.num_running_reqs + message.num_waiting_reqs
    if "max_running_requests" not in load:
        message.max_running_requests = max_running_requests
    return message


def build_tokenizer_zip(tokenizer_path: Path, chat_template: str | None) -> bytes:
    """The tokenizer files beside ``tokenizer.json`` as a zip; the worker's chat template as ``chat_template.jinja``."""
    folder = tokenizer_path if tokenizer_path.is_dir() else tokenizer_path.parent
    files = {folder / name for name in _TOKENIZER_FILES if (folder / name).is_file()}
    for pattern in _TOKENIZER_GLOBS:
        files.update(p for p in folder.glob(pattern) if p.is_file())
    if tokenizer_path.is_file():
        files.add(tokenizer_path)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for path in sorted(files):
            name = "tokenizer.json" if path == tokenizer_path else path.name
            if name == "chat_template.jinja" and chat_template is not None:
                continue  # written below: the template the worker actually applies
            archive.write(path, name)
        if chat_template is not None:
            archive.writestr("chat_template.jinja", chat_template)
    return buffer.getvalue()


class SchedulerServicer(sglang_scheduler_pb2_grpc.SglangSchedulerServicer):
    """``SglangScheduler`` over one :class:`SimWorker`."""

    def __init__(self, worker: SimWorker) -> None:
        self.worker = worker
        self.relay = KvEventRelay(worker.publisher, worker.config.kv_buffer_steps) if worker.publisher else None
        self.started_at = time.time()
        self._requests: dict[str, Request] = {}  # in-flight Generate calls by request id
        self._aborted: set[str] = set()
        self._tokenizer_zip: tuple[bytes, str] | None = None

    # -- helpers -----------------------------------------------------------------------------------
    @staticmethod
    async def _fail(context: grpc.aio.ServicerContext, exc: ApiError) -> None:
        await context.abort(_CODES.get(exc.status, grpc.StatusCode.INTERNAL), exc.message)

    def _load_record(self) -> Any:
        if not self.worker.ready:
            return None
        load = loads_report(self.worker)["loads"][0]
        message = scheduler_load(load, self.worker.config.max_running_requests)
        return engine_load(message, queued_work_known="num_waiting_uncached_tokens" in load)

    def _special_id(self, name: str) -> int | None:
        token = self.worker.tokenizer.special_tokens.get(name)
        return None if token is None else self.worker.tokenizer.tokenizer.token_to_id(token)

    @property
    def _max_req_input_len(self) -> int:
        capacity = self.worker.scheduler.capacity if self.worker.scheduler else self.worker.config.context_length
        return min(self.worker.config.context_length, capacity) - 1

    # -- generation --------------------------------------------------------------------------------
    def _validate(self, request: Any) -> tuple[list[int], int, str]:
        """Token ids, max_new_tokens and request id of a GenerateRequest; ``ValueError`` says what is wrong."""
        if not request.HasField("tokenized") or not request.tokenized.input_ids:
            raise ValueError("tokenized.input_ids is required: the scheduler API takes token ids (tokenize first)")
        if request.HasField("mm_inputs") and request.mm_inputs.ByteSize():
            raise ValueError("multimodal inputs are not supported: the simulated model is text-only")
        if request.input_embeds:
            raise ValueError("input_embeds are not supported by the simulated model")
        if request.lora_id:
            raise ValueError(f"LoRA adapter {request.lora_id!r} is not loaded (the simulator serves none)")
        if request.HasField("data_parallel_rank") and request.data_parallel_rank != 0:
            raise ValueError(f"data_parallel_rank {request.data_parallel_rank} does not exist (dp_size is 1)")
        params = request.sampling_params
        if params.n > 1:
            raise ValueError("n > 1 is not supported by the simulator; send n requests")
        rid = request.request_id or uuid.uuid4().hex
        if rid in self._requests:
            raise ValueError(f"duplicate request id {rid!r}: a request with this id is in flight")
        default = self.worker.config.default_max_new_tokens
        max_new = params.max_new_tokens if params.HasField("max_new_tokens") else default
        return list(request.tokenized.input_ids), max_new, rid

    @staticmethod
    def _complete(rid: str, req: Request, output_ids: list[int]) -> Any:
        return sglang_scheduler_pb2.GenerateResponse(
            request_id=rid,
            complete=sglang_scheduler_pb2.GenerateComplete(
                output_ids=output_ids,
                finish_reason="length",  # the simulator generates exactly max_new_tokens
                prompt_tokens=len(req.input_ids),
                completion_tokens=len(req.output_ids),
                cached_tokens=max(req.cached_tokens, 0),
            ),
        )

    async def Generate(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:  # noqa: N802
        try:
            input_ids, max_new, rid = self._validate(request)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            return
        try:
            req = self.worker.submit(input_ids, max_new, None, rid)
        except ApiError as exc:
            await self._fail(context, exc)
            return
        self._requests[rid] = req
        try:
            last: list[int] = []
            emitted = 0  # counts as of this chunk (the scheduler may be steps ahead of a slow reader)
            while True:
                tokens = await req.updates.get()
                if tokens is None or rid in self._aborted:
                    break
                last = tokens
                emitted += len(tokens)
                if request.stream:
                    yield sglang_scheduler_pb2.GenerateResponse(
                        request_id=rid,
                        chunk=sglang_scheduler_pb2.GenerateStreamChunk(
                            token_ids=tokens,
                            prompt_tokens=len(req.input_ids),
                            completion_tokens=emitted,
                            cached_tokens=max(req.cached_tokens, 0),
                        ),
                    )
            if rid in self._aborted:
                await context.abort(grpc.StatusCode.CANCELLED, f"request {rid} was aborted")
            if req.error is not None:
                await context.abort(grpc.StatusCode.INTERNAL, req.error)
            # As SGLang's servicer: after a stream, the complete repeats the last chunk's tokens; without
            # streaming it carries all of them.
            yield self._complete(rid, req, last if request.stream else list(req.output_ids))
        finally:  # the client went away (smg drops the stream), the call failed, or it completed
            self._requests.pop(rid, None)
            self._aborted.discard(rid)
            if not req.finished and self.worker.scheduler is not None:
                self.worker.scheduler.abort(req)

    async def Abort(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        rid = request.request_id
        req = self._requests.get(rid)
        if req is None or rid.startswith(HEALTH_CHECK_RID_PREFIX) or req.finished:
            return sglang_scheduler_pb2.AbortResponse(success=False, message=f"Request {rid} not found")
        self._aborted.add(rid)
        if self.worker.scheduler is not None:
            self.worker.scheduler.abort(req)
        req.updates.put_nowait(None)  # wake its Generate stream, which ends with CANCELLED
        return sglang_scheduler_pb2.AbortResponse(success=True, message=f"Request {rid} aborted")

    async def Embed(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this worker serves a generation model, not embeddings")

    # -- health, model and server info ---------------------------------------------------------------
    async def HealthCheck(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        """As SGLang's servicer: healthy on the scheduler's first output after the probe started.

        The probe is the HTTP ``/health`` one (``Scheduler.probe_health``): an idle scheduler runs a
        one-token generation, a busy one signals after its current batch.
        """
        worker = self.worker
        if not worker.ready or worker.scheduler is None:
            return sglang_scheduler_pb2.HealthCheckResponse(healthy=False, message="The server is not ready yet.")
        scheduler = worker.scheduler
        tic = time.monotonic()
        scheduler.probe_health()
        while time.monotonic() < tic + HEALTH_CHECK_TIMEOUT_S:
            if scheduler.last_output_at > tic:
                return sglang_scheduler_pb2.HealthCheckResponse(healthy=True, message="Health check passed")
            await asyncio.sleep(HEALTH_POLL_S)
        message = f"Health check timeout after {HEALTH_CHECK_TIMEOUT_S:.0f}s"
        return sglang_scheduler_pb2.HealthCheckResponse(healthy=False, message=message)

    async def GetModelInfo(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        info = model_info_report(self.worker)
        response = sglang_scheduler_pb2.GetModelInfoResponse(
            max_context_length=self.worker.config.context_length,
            vocab_size=self.worker.tokenizer.tokenizer.get_vocab_size(with_added_tokens=True),
            served_model_name=self.worker.config.model,
            supports_vision=False,
            max_req_input_len=self._max_req_input_len,
        )
        _set_fields(response, {k: v for k, v in info.items() if k != "preferred_sampling_params"})
        eos = self._special_id("eos_token")
        if eos is not None:
            response.eos_token_ids.append(eos)
        for field, name in (("bos_token_id", "bos_token"), ("pad_token_id", "pad_token")):
            token_id = self._special_id(name)
            if token_id is not None:
                setattr(response, field, token_id)
        return response

    async def GetServerInfo(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        worker = self.worker
        args = Struct()
        args.update(server_info_report(worker))
        capacity = worker.scheduler.capacity if worker.scheduler else 0
        scheduler_info = Struct()
        scheduler_info.update(
            {"max_total_num_tokens": capacity, "max_req_input_len": self._max_req_input_len, "is_generation": True}
        )
        load = worker.scheduler.load() if worker.scheduler else {}
        active = load.get("num_running_reqs", 0) + load.get("num_waiting_reqs", 0)
        response = sglang_scheduler_pb2.GetServerInfoResponse(
            server_args=args,
            scheduler_info=scheduler_info,
            active_requests=active,
            is_paused=False,
            last_receive_timestamp=self.relay.last_batch_at if self.relay else 0.0,
            uptime_seconds=time.time() - self.started_at,
            sglang_version=SGLANG_VERSION,
            server_type="grpc",
            max_total_num_tokens=capacity,
        )
        response.start_time.FromSeconds(int(worker.started_at))
        return response

    async def GetLoads(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        sections = set(request.include) or None
        unknown = sorted((sections or set()) - INCLUDE_SECTIONS)
        if unknown:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"Invalid include sections: {unknown}. Valid options: {sorted(INCLUDE_SECTIONS)}",
            )
        dp_rank = request.dp_rank if request.HasField("dp_rank") else None
        try:
            report = loads_report(self.worker, sections, dp_rank)
        except ApiError as exc:
            await self._fail(context, exc)
            return None
        if not report["loads"]:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"dp_rank {dp_rank} does not exist")
        cap = self.worker.config.max_running_requests
        messages = [scheduler_load(load, cap) for load in report["loads"]]
        response = sglang_scheduler_pb2.GetLoadsResponse(
            timestamp=str(report["timestamp"]),
            version=str(report["version"]),
            dp_rank_count=len(messages),
            loads=messages,
        )
        # The aggregate over the ranks answered, as SGLang's servicer computes it.
        response.aggregate.total_running_reqs = sum(m.num_running_reqs for m in messages)
        response.aggregate.total_waiting_reqs = sum(m.num_waiting_reqs for m in messages)
        response.aggregate.total_reqs = sum(m.num_total_reqs for m in messages)
        response.aggregate.avg_token_usage = sum(m.token_usage for m in messages) / len(messages)
        response.aggregate.avg_throughput = sum(m.gen_throughput for m in messages) / len(messages)
        response.aggregate.avg_utilization = sum(m.utilization for m in messages) / len(messages)
        return response

    # -- cache and events --------------------------------------------------------------------------
    async def FlushCache(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        scheduler = self.worker.scheduler
        if not self.worker.ready or scheduler is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "The server is not ready yet.")
            return None
        deadline = time.monotonic() + max(request.timeout_s, 0.0)
        while not scheduler.idle and time.monotonic() < deadline:  # timeout_s > 0: wait for the queue to drain
            await asyncio.sleep(0.01)
        if scheduler.flush_cache():
            return common_pb2.FlushCacheResponse(success=True, message="Cache flushed successfully")
        return common_pb2.FlushCacheResponse(
            success=False, message="Cache not flushed because there are pending requests."
        )

    async def SubscribeKvEvents(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:  # noqa: N802
        if self.relay is None:
            await context.abort(
                grpc.StatusCode.UNIMPLEMENTED,
                "KV cache events are off on this worker (started with --no-kv-events)",
            )
        assert self.relay is not None
        start = request.start_sequence_number
        try:
            self.relay.check_cursor(start)
        except StreamError as exc:  # refused before the headers, as SGLang's servicer refuses a cursor
            logger.info("SubscribeKvEvents from %s refused: %s", context.peer(), exc.message)
            await context.abort(exc.code, exc.message)
        # Headers now: smg treats a subscription that has not answered within 2 s as failed.
        await context.send_initial_metadata(())
        cursor = "the current state" if start == 0 else f"after batch {start}"
        logger.info("SubscribeKvEvents from %s: %s (last batch %d)", context.peer(), cursor, self.relay.last_seq)
        try:
            async for batch in self.relay.stream(start, self._load_record):
                yield batch
        except StreamError as exc:
            logger.warning("SubscribeKvEvents from %s ended: %s", context.peer(), exc.message)
            await context.abort(exc.code, exc.message)

    async def GetTokenizer(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:  # noqa: N802
        if self._tokenizer_zip is None:
            path = Path(self.worker.tokenizer_path)
            try:
                data = await asyncio.to_thread(build_tokenizer_zip, path, self.worker.tokenizer.chat_template)
            except OSError as exc:
                await context.abort(grpc.StatusCode.INTERNAL, f"cannot read the tokenizer at {path}: {exc}")
            self._tokenizer_zip = (data, hashlib.sha256(data).hexdigest())
        data, digest = self._tokenizer_zip
        for offset in range(0, len(data), TOKENIZER_CHUNK_BYTES):
            last = offset + TOKENIZER_CHUNK_BYTES >= len(data)
            yield common_pb2.GetTokenizerChunk(
                data=data[offset : offset + TOKENIZER_CHUNK_BYTES], sha256=digest if last else ""
            )

    # -- not simulated ----------------------------------------------------------------------------
    async def _unsupported(self, context: grpc.aio.ServicerContext, what: str) -> None:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{what} is not simulated")

    async def StartProfile(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        await self._unsupported(context, "profiling")

    async def StopProfile(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        await self._unsupported(context, "profiling")

    async def LoadLoRAAdapter(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        await self._unsupported(context, "LoRA")

    async def UnloadLoRAAdapter(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        await self._unsupported(context, "LoRA")

    async def ListLoadedLoRAAdapters(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        await self._unsupported(context, "LoRA")


class SchedulerGrpcServer:
    """A ``grpc.aio`` server for one started :class:`SimWorker`, on the worker's event loop."""

    def __init__(self, worker: SimWorker) -> None:
        self.servicer = SchedulerServicer(worker)
        self._server: grpc.aio.Server | None = None
        self.bound_port: int | None = None

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0: any free port); returns the port. ``OSError`` if it cannot bind."""
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.so_reuseport", 0),  # a second worker on a taken port must fail, not share it
            ]
        )
        sglang_scheduler_pb2_grpc.add_SglangSchedulerServicer_to_server(self.servicer, server)
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            self.bound_port = server.add_insecure_port(address)
        except RuntimeError as exc:  # grpc reports a taken port as "Failed to bind"
            raise OSError(f"gRPC port {address} is in use or cannot be bound ({exc})") from None
        await server.start()
        self._server = server
        return self.bound_port

    async def stop(self, grace: float = 1.0) -> None:
        server, self._server = self._server, None
        if server is not None:
            await server.stop(grace)

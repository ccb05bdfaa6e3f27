"""The sim-worker's gRPC scheduler API (SglangScheduler) over real gRPC, in-process with its HTTP API.

Each test starts one worker (instant timing unless it needs a slow step) with both front doors on free
loopback ports, and talks to it with a real ``grpc.aio`` client and, where the test compares the two
doors, a real HTTP client.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import re
import zipfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from google.protobuf.json_format import MessageToDict
from smg_grpc_proto.generated import common_pb2, sglang_scheduler_pb2, sglang_scheduler_pb2_grpc

from prefix_common.addresses import free_ports
from prefix_common.tokenization import DEFAULT_TOKENIZER_DIR, load_tokenizer
from sglang_workers.sim.config import SimWorkerConfig
from sglang_workers.sim.grpc_events import KvEventRelay, StreamError
from sglang_workers.sim.grpc_server import SchedulerGrpcServer
from sglang_workers.sim.http_api import HttpServer
from sglang_workers.sim.kv_events import BlockStored, KVEventPublisher
from sglang_workers.sim.worker import SimWorker
from tests.support.sim_fixtures import sha256_chain

PAGE = 4
pb = sglang_scheduler_pb2


class Door:
    """One started worker with its two front doors and a gRPC stub."""

    def __init__(self, worker: SimWorker, server: SchedulerGrpcServer, channel: grpc.aio.Channel) -> None:
        self.worker = worker
        self.server = server
        self.channel = channel
        self.stub = sglang_scheduler_pb2_grpc.SglangSchedulerStub(channel)
        self.http = f"http://127.0.0.1:{worker.bound_port}"

    async def get_json(self, path: str) -> Any:
        async with aiohttp.ClientSession() as session, session.get(self.http + path) as resp:
            assert resp.status == 200, await resp.text()
            return await resp.json()

    async def generate(self, ids: list[int], max_new: int = 3, stream: bool = False, rid: str = "") -> list[Any]:
        request = pb.GenerateRequest(
            request_id=rid,
            tokenized=pb.TokenizedInput(input_ids=ids),
            sampling_params=pb.SamplingParams(max_new_tokens=max_new),
            stream=stream,
        )
        return [r async for r in self.stub.Generate(request)]


@contextlib.asynccontextmanager
async def serving(grpc_port: int | None = None, **overrides: Any) -> AsyncIterator[Door]:
    http_port, kv_port, replay_port, free_grpc = free_ports(4)
    port = grpc_port or free_grpc
    options: dict[str, Any] = {"profile": "instant", "page_size": PAGE, **overrides}
    config = SimWorkerConfig(
        host="127.0.0.1",
        port=http_port,
        grpc_port=port,
        kv_events_host="127.0.0.1",
        kv_events_port=kv_port,
        kv_replay_port=replay_port,
        **options,
    )
    worker = SimWorker(config)
    await worker.start()
    http = HttpServer(worker)
    await http.start("127.0.0.1", http_port)
    server = SchedulerGrpcServer(worker)
    await server.start("127.0.0.1", port)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield Door(worker, server, channel)
    finally:
        await channel.close()
        await server.stop(0)
        await http.stop()
        await worker.stop()


async def status_of(coro: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await coro
    return info.value


async def all_of(call: Any) -> list[Any]:
    return [item async for item in call]


async def wait_for_load(door: Door, key: str, value: int) -> None:
    for _ in range(250):
        if (await door.get_json("/v1/loads"))["loads"][0][key] == value:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"/v1/loads never showed {key} = {value}")


# -- generation -------------------------------------------------------------------------------------


async def test_generate_streams_chunks_then_complete_and_shares_the_cache_with_http() -> None:
    shared = list(range(100, 123))  # 23 tokens: 5 whole pages + 3
    async with serving() as door:
        streamed = await door.generate(shared + [1, 2], max_new=4, stream=True, rid="first")
        kinds = [r.WhichOneof("response") for r in streamed]
        assert kinds == ["chunk"] * 4 + ["complete"]
        chunks = [list(r.chunk.token_ids) for r in streamed[:4]]
        assert all(len(c) == 1 for c in chunks)
        assert [r.chunk.completion_tokens for r in streamed[:4]] == [1, 2, 3, 4]
        done = streamed[-1].complete
        assert (done.prompt_tokens, done.completion_tokens, done.cached_tokens) == (25, 4, 0)
        assert done.finish_reason == "length"
        assert list(done.output_ids) == chunks[-1]  # as SGLang's servicer: the last chunk's tokens again
        assert streamed[-1].request_id == "first"

        # Not streamed: one complete with every token; the same prompt gives the same tokens.
        (single,) = await door.generate(shared + [1, 2], max_new=4)
        assert list(single.complete.output_ids) == [t for c in chunks for t in c]
        assert single.complete.cached_tokens == 24 // PAGE * PAGE  # everything but the last token, in pages

        # The HTTP door sees the cache the gRPC door filled, and the same outputs.
        async with aiohttp.ClientSession() as session:
            body = {"input_ids": shared + [7, 7], "sampling_params": {"max_new_tokens": 2}}
            async with session.post(door.http + "/generate", json=body) as resp:
                meta = (await resp.json())["meta_info"]
        assert meta["cached_tokens"] == 20  # the 23 shared tokens rounded down to pages
        (over_grpc,) = await door.generate(shared + [7, 7], max_new=2)
        assert over_grpc.complete.cached_tokens == 24


async def test_errors_are_grpc_statuses_with_messages() -> None:
    async with serving(context_length=64) as door:
        err = await status_of(all_of(door.stub.Generate(pb.GenerateRequest(request_id="x"))))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "input_ids" in (err.details() or "")

        err = await status_of(door.generate(list(range(60)), max_new=10))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "maximum context length" in (err.details() or "")

        request = pb.GenerateRequest(
            tokenized=pb.TokenizedInput(input_ids=[1, 2, 3]), sampling_params=pb.SamplingParams(n=2)
        )
        err = await status_of(all_of(door.stub.Generate(request)))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "n > 1" in (err.details() or "")

        err = await status_of(door.stub.GetLoads(pb.GetLoadsRequest(include=["core", "bogus"])))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "bogus" in (err.details() or "")
        err = await status_of(door.stub.GetLoads(pb.GetLoadsRequest(dp_rank=3)))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT

        err = await status_of(door.stub.Embed(pb.EmbedRequest()))
        assert err.code() == grpc.StatusCode.UNIMPLEMENTED
        err = await status_of(
            all_of(door.stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(start_sequence_number=99)))
        )
        assert err.code() == grpc.StatusCode.OUT_OF_RANGE and "subscribe again from 0" in (err.details() or "")

    async with serving(load_time=30) as loading:
        err = await status_of(loading.generate([1, 2, 3]))
        assert err.code() == grpc.StatusCode.UNAVAILABLE
        health = await loading.stub.HealthCheck(pb.HealthCheckRequest())
        assert not health.healthy

    async with serving(kv_events=False) as quiet:
        err = await status_of(all_of(quiet.stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest())))
        assert err.code() == grpc.StatusCode.UNIMPLEMENTED and "--no-kv-events" in (err.details() or "")


async def test_abort_ends_the_stream_and_frees_the_scheduler() -> None:
    # A slow step (speedup 0.001: a prefill takes ~15 s) keeps the request in flight while we abort it.
    async with serving(profile="llama-3.1-8b-h100", speedup=0.001) as door:
        request = pb.GenerateRequest(
            request_id="victim",
            tokenized=pb.TokenizedInput(input_ids=list(range(10, 50))),
            sampling_params=pb.SamplingParams(max_new_tokens=50),
            stream=True,
        )
        call = door.stub.Generate(request)
        await wait_for_load(door, "num_running_reqs", 1)
        queued_task = asyncio.ensure_future(door.generate(list(range(60, 90)), rid="queued"))
        await wait_for_load(door, "num_waiting_reqs", 1)  # behind the first one's prefill
        missing = await door.stub.Abort(pb.AbortRequest(request_id="nobody"))
        assert not missing.success and "not found" in missing.message
        aborted = await door.stub.Abort(pb.AbortRequest(request_id="queued", reason="test"))
        assert aborted.success
        err = await status_of(queued_task)
        assert err.code() == grpc.StatusCode.CANCELLED and "aborted" in (err.details() or "")
        load = (await door.get_json("/v1/loads"))["loads"][0]
        assert load["num_waiting_reqs"] == 0  # taken out of the queue, not left to run

        call.cancel()  # a client that goes away is aborted too (smg drops the stream)
        scheduler = door.worker.scheduler
        assert scheduler is not None and scheduler.prefilling[0].rid == "victim"
        for _ in range(100):
            if scheduler.prefilling[0].max_new_tokens <= 1:  # cut short: no decode steps after the prefill
                break
            await asyncio.sleep(0.02)
        assert scheduler.prefilling[0].max_new_tokens <= 1


# -- info, health, loads, cache, tokenizer -----------------------------------------------------------


async def test_model_server_info_and_health() -> None:
    async with serving(model="sim-llama") as door:
        info = await door.stub.GetModelInfo(pb.GetModelInfoRequest())
        tokenizer = door.worker.tokenizer
        assert info.served_model_name == info.model_path == "sim-llama"
        assert info.is_generation and info.max_context_length == door.worker.config.context_length
        assert info.tokenizer_path == door.worker.tokenizer_path == str(DEFAULT_TOKENIZER_DIR)
        assert info.vocab_size == tokenizer.tokenizer.get_vocab_size(with_added_tokens=True)
        assert list(info.eos_token_ids) == [tokenizer.tokenizer.token_to_id(tokenizer.special_tokens["eos_token"])]
        assert list(info.architectures) == ["LlamaForCausalLM"]

        server = await door.stub.GetServerInfo(pb.GetServerInfoRequest())
        http_info = await door.get_json("/server_info")
        assert server.server_type == "grpc" and server.sglang_version == http_info["version"]
        assert server.server_args["page_size"] == PAGE == http_info["page_size"]
        assert server.server_args["kv_events"]["block_size"] == PAGE
        assert server.max_total_num_tokens == http_info["max_total_num_tokens"]

        health = await door.stub.HealthCheck(pb.HealthCheckRequest())
        assert health.healthy
        async with aiohttp.ClientSession() as session, session.get(door.http + "/metrics") as resp:
            metrics = await resp.text()
        # The probe ran through the scheduler but, as in SGLang, is no request of the metrics.
        assert re.search(r"^sglang:num_requests_total\{[^}]*\} 0(\.0)?$", metrics, re.MULTILINE), metrics


async def test_get_loads_equals_v1_loads() -> None:
    # max_running_requests 1 and a ~15 s prefill step: one request prefilling, one waiting, nothing moving.
    async with serving(profile="llama-3.1-8b-h100", speedup=0.001, max_running_requests=1) as door:
        tasks = [asyncio.ensure_future(door.generate(list(range(s, s + 40)), rid=f"r{s}")) for s in (10, 60)]
        await wait_for_load(door, "num_waiting_reqs", 1)
        http = await door.get_json("/v1/loads")
        reply = await door.stub.GetLoads(pb.GetLoadsRequest(include=["core", "disagg", "queues", "memory"]))
        assert reply.dp_rank_count == len(http["loads"]) == 1
        assert reply.version == http["version"]
        (load,) = reply.loads
        (figures,) = http["loads"]
        compared = 0
        for field in pb.SchedulerLoad.DESCRIPTOR.fields:
            value = figures.get(field.name)
            if field.message_type is None and value is not None:
                assert getattr(load, field.name) == pytest.approx(value), field.name
                compared += 1
            elif isinstance(value, dict):  # memory, queues, disaggregation: field by field
                section = getattr(load, field.name)
                for sub in section.DESCRIPTOR.fields:
                    if sub.name in value:
                        assert getattr(section, sub.name) == pytest.approx(value[sub.name]), f"{field.name}.{sub.name}"
                        compared += 1
        assert compared >= 20
        assert (
            load.disaggregation.prefill_prealloc_queue_reqs == figures["disaggregation"]["prefill_bootstrap_queue_reqs"]
        )
        assert (load.num_running_reqs, load.num_waiting_reqs) == (1, 1)
        assert load.num_total_reqs == 2 and load.max_running_requests == 1
        assert load.num_waiting_uncached_tokens == figures["num_waiting_uncached_tokens"] > 0
        assert (reply.aggregate.total_running_reqs, reply.aggregate.total_reqs) == (1, 2)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_flush_cache_and_get_tokenizer(tmp_path: Path) -> None:
    async with serving() as door:
        await door.generate(list(range(100, 120)))
        flushed = await door.stub.FlushCache(common_pb2.FlushCacheRequest())
        assert flushed.success
        assert door.worker.scheduler is not None and door.worker.scheduler.cache.total_size == 0

        chunks = [c async for c in door.stub.GetTokenizer(common_pb2.GetTokenizerRequest())]
        data = b"".join(c.data for c in chunks)
        assert [bool(c.sha256) for c in chunks] == [False] * (len(chunks) - 1) + [True]
        assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= set(archive.namelist())
            archive.extractall(tmp_path)
        unpacked = load_tokenizer(str(tmp_path))
        messages = [{"role": "user", "content": "hello there"}]
        assert unpacked.encode_chat(messages) == door.worker.tokenizer.encode_chat(messages)


async def test_flush_cache_refused_while_busy() -> None:
    async with serving(profile="llama-3.1-8b-h100", speedup=0.001) as door:
        task = asyncio.ensure_future(door.generate(list(range(10, 50))))
        await asyncio.sleep(0.1)
        refused = await door.stub.FlushCache(common_pb2.FlushCacheRequest(timeout_s=0))
        assert not refused.success and "pending requests" in refused.message
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


# -- SubscribeKvEvents --------------------------------------------------------------------------------


async def next_batch(stream: Any, skip_load_only: bool = True, timeout: float = 5.0) -> Any:
    while True:
        batch = await asyncio.wait_for(stream.read(), timeout)
        assert batch is not grpc.aio.EOF
        if not (skip_load_only and batch.load.load_only):
            return batch


def subscribe(door: Door, start: int = 0) -> Any:
    return door.stub.SubscribeKvEvents(
        common_pb2.SubscribeKvEventsRequest(start_sequence_number=start, load_records_before_first_batch=True)
    )


async def test_events_match_the_zmq_publisher_and_resume_after_a_cursor() -> None:
    async with serving() as door:
        stream = subscribe(door)
        first = await next_batch(stream)
        assert first.sequence_number == 0 and first.events[0].WhichOneof("data") == "cleared"
        assert first.load.HasField("cache_hit_rate")  # the first record carries the telemetry
        assert first.load.HasField("waiting_uncached_tokens")  # the worker reports its queued prefill work

        prompt = list(range(200, 213))  # 13 tokens: 3 pages go into the tree after prefill
        await door.generate(prompt, max_new=1)
        stored = await next_batch(stream)
        assert stored.sequence_number == 1 and stored.dp_rank == 0
        (event,) = stored.events
        blocks = event.stored.blocks
        assert [b.block_hash for b in blocks] == sha256_chain(prompt, PAGE)[:3]
        assert [list(b.token_ids) for b in blocks] == [prompt[i : i + PAGE] for i in range(0, 12, PAGE)]
        assert all(b.block_size == PAGE for b in blocks)
        assert not event.stored.HasField("parent_block_hash")
        assert event.stored.tier == common_pb2.KV_CACHE_TIER_DEVICE and event.stored.medium == "GPU"
        assert stored.load.running_requests in (0, 1) and not stored.load.HasField("cache_hit_rate")
        stream.cancel()

        # The same batches, byte for byte, as the ZMQ publisher sent them.
        assert door.worker.publisher is not None
        zmq_batches = door.worker.publisher.buffered()
        assert [seq for seq, _ in zmq_batches] == [0, 1]

        await door.generate(list(range(300, 309)), max_new=1)  # seq 2
        await door.generate(list(range(400, 409)), max_new=1)  # seq 3
        resumed = subscribe(door, start=1)
        assert [(await next_batch(resumed)).sequence_number for _ in range(2)] == [2, 3]
        await door.generate(list(range(500, 509)), max_new=1)
        assert (await next_batch(resumed)).sequence_number == 4  # live after the replay: no gap, no duplicate
        resumed.cancel()

        caught_up = subscribe(door, start=4)
        await door.generate(list(range(600, 609)), max_new=1)
        assert (await next_batch(caught_up)).sequence_number == 5
        caught_up.cancel()


async def test_load_only_heartbeat_repeats_the_last_sequence() -> None:
    async with serving() as door:
        stream = subscribe(door)
        assert (await next_batch(stream)).sequence_number == 0
        beat = await next_batch(stream, skip_load_only=False, timeout=3.0)
        assert beat.load.load_only and not beat.events
        assert beat.sequence_number == 0 and beat.load.sample == 2
        assert door.worker.scheduler is not None
        assert beat.load.max_total_num_tokens == door.worker.scheduler.capacity  # heartbeats carry the telemetry
        stream.cancel()


async def test_snapshot_once_the_history_no_longer_reaches_seq_0() -> None:
    async with serving(kv_buffer_steps=2) as door:
        prompts = [list(range(s, s + 9)) for s in (100, 200, 300, 400)]  # 2 pages each, +1 output page-free
        for p in prompts:
            await door.generate(p, max_new=1)
        assert door.worker.publisher is not None
        last = door.worker.publisher.next_seq - 1
        stream = subscribe(door)
        chunk = await next_batch(stream)
        assert chunk.HasField("snapshot") and chunk.snapshot.index == 0
        count = chunk.snapshot.count
        chunks = [chunk] + [await next_batch(stream) for _ in range(count - 1)]
        assert chunks[-1].sequence_number == last  # live events continue right after it
        assert chunks[0].events[0].WhichOneof("data") == "cleared"
        stored = [e.stored for c in chunks for e in c.events if e.WhichOneof("data") == "stored"]
        assert chunk.snapshot.blocks == len(stored) == 8 and chunk.snapshot.unknown_before == 0
        by_prompt = {tuple(p[:PAGE]): p for p in prompts}
        for s in stored:  # each prompt's two pages, parent before child
            (block,) = s.blocks
            if not s.HasField("parent_block_hash"):
                assert tuple(block.token_ids) in by_prompt
        await door.generate(list(range(500, 509)), max_new=1)
        assert (await next_batch(stream)).sequence_number == last + 1
        stream.cancel()

        err = await status_of(all_of(subscribe(door, start=1)))  # batch 2 is gone from the history
        assert err.code() == grpc.StatusCode.OUT_OF_RANGE and "no longer kept" in (err.details() or "")


async def test_a_restarted_worker_refuses_the_old_cursor_and_starts_again_at_0() -> None:
    _, port = free_ports(2)
    async with serving(grpc_port=port) as door:
        for s in (100, 200, 300):
            await door.generate(list(range(s, s + 9)), max_new=1)
        assert door.worker.publisher is not None
        cursor = door.worker.publisher.next_seq - 1
    async with serving(grpc_port=port) as restarted:  # same address, new process state
        err = await status_of(all_of(subscribe(restarted, start=cursor)))
        assert err.code() == grpc.StatusCode.OUT_OF_RANGE and "restarted" in (err.details() or "")
        stream = subscribe(restarted)
        first = await next_batch(stream)
        assert first.sequence_number == 0 and first.events[0].WhichOneof("data") == "cleared"
        stream.cancel()


async def test_a_subscriber_that_falls_behind_gets_data_loss() -> None:
    publisher = KVEventPublisher(host="127.0.0.1", port=1, replay_port=None, buffer_steps=3)  # never bound
    publisher.publish([BlockStored([1], None, [1, 2, 3, 4], 4)])
    relay = KvEventRelay(publisher, history=3)
    stream = relay.stream(0, lambda: None)
    assert (await stream.__anext__()).sequence_number == 0
    for i in range(2, 7):
        publisher.publish([BlockStored([i], None, [i] * 4, 4)])
    with pytest.raises(StreamError) as info:
        await stream.__anext__()
    assert info.value.code == grpc.StatusCode.DATA_LOSS and "fell behind" in info.value.message
    await stream.aclose()


def test_sim_worker_cli_serves_grpc() -> None:
    """``prefix-router sim-worker --grpc-port`` as a process (both doors, the ready line names both)."""
    from prefix_router.fleet import start_fleet

    with start_fleet("sim", 1, grpc=True, profile="instant")[0] as worker:
        assert worker.grpc_url.startswith("grpc://127.0.0.1:")
        with grpc.insecure_channel(worker.grpc_url.removeprefix("grpc://")) as channel:
            stub = sglang_scheduler_pb2_grpc.SglangSchedulerStub(channel)
            assert stub.HealthCheck(pb.HealthCheckRequest(), timeout=10).healthy
            info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
            assert MessageToDict(info.server_args)["port"] == worker.port
        assert "grpc://" in worker.log()

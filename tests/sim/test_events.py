"""KV events of real sim-worker processes over real ZMQ sockets: hashes, eviction, replay, encodings."""

from __future__ import annotations

from collections.abc import Iterator

import msgpack
import pytest
import zmq

from prefix_router.fleet import start_fleet
from sglang_workers.process import WorkerProcess
from sglang_workers.sim.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, decode_payload
from tests.support.sim_fixtures import EventSubscriber, post_json, sha256_chain

PAGE = 4


@pytest.fixture(scope="module")
def workers() -> Iterator[list[WorkerProcess]]:
    # [0] default worker, [1] tiny KV pool (64 tokens) for eviction, [2] positional events + 2-frame replay.
    ws = start_fleet("sim", 1, profile="instant", page_size=PAGE)
    ws += start_fleet("sim", 1, profile="instant", page_size=PAGE, capacity_tokens=64)
    ws += start_fleet("sim", 1, profile="instant", page_size=PAGE, event_format="positional", replay_format=2)
    yield ws
    for w in ws:
        w.stop()


@pytest.fixture
def sub(request: pytest.FixtureRequest, workers: list[WorkerProcess]) -> Iterator[EventSubscriber]:
    s = EventSubscriber(workers[getattr(request, "param", 0)])
    s.sync()
    yield s
    s.close()


def _generate(worker: WorkerProcess, ids: list[int], n: int, **extra: object) -> dict:
    status, body = post_json(worker, "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": n}, **extra})
    assert status == 200, body
    return body


def _events(batches: list[tuple[int, list[KVEvent], bytes]]) -> list[KVEvent]:
    return [e for _, events, _ in batches for e in events]


def test_stored_hashes_equal_an_independent_sha256_chain(workers: list[WorkerProcess], sub: EventSubscriber) -> None:
    prompt = list(range(500, 518))  # 18 tokens: 4 whole pages after prefill
    body = _generate(workers[0], prompt, 3)
    stored = [e for e in _events(sub.drain()) if isinstance(e, BlockStored)]
    # Prefill caches the prompt's whole pages; finishing caches prompt + output minus the last token.
    full = (prompt + body["output_ids"])[:20]
    assert [h for e in stored for h in e.block_hashes] == sha256_chain(full, PAGE)
    assert [t for e in stored for t in e.token_ids] == full
    assert stored[0].parent_block_hash is None
    assert stored[1].parent_block_hash == stored[0].block_hashes[-1]
    assert all(e.block_size == PAGE and e.medium == "GPU" for e in stored)


def test_cache_salt_namespaces_hashes(workers: list[WorkerProcess], sub: EventSubscriber) -> None:
    prompt = list(range(700, 709))
    _generate(workers[0], prompt, 1, cache_salt="tenant-A")
    (stored,) = [e for e in _events(sub.drain()) if isinstance(e, BlockStored)]
    assert stored.cache_salt == "tenant-A"
    assert stored.block_hashes == sha256_chain(prompt, PAGE, salt="tenant-A")
    body = _generate(workers[0], prompt, 1)  # same tokens, no salt: nothing cached for it
    assert body["meta_info"]["cached_tokens"] == 0


@pytest.mark.parametrize("sub", [1], indirect=True)
def test_eviction_removes_exactly_the_lru_pages(workers: list[WorkerProcess], sub: EventSubscriber) -> None:
    small = workers[1]  # 64-token pool
    a, b, c = list(range(1000, 1017)), list(range(2000, 2017)), list(range(3000, 3041))
    _generate(small, a, 1)  # caches 16 tokens (4 pages)
    _generate(small, b, 1)  # caches 16 more
    assert _generate(small, a, 1)["meta_info"]["cached_tokens"] == 16  # touch a: b is now least recent
    sub.drain()
    _generate(small, c, 1)  # needs 41 tokens of 64 with 32 cached: must evict b, and only b
    events = _events(sub.drain())
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert removed == sha256_chain(b, PAGE)
    stored = [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]
    assert stored == sha256_chain(c, PAGE)
    assert _generate(small, a, 1)["meta_info"]["cached_tokens"] == 16


def test_replay_returns_missed_batches(workers: list[WorkerProcess], sub: EventSubscriber) -> None:
    worker = workers[0]
    for i in range(3):
        _generate(worker, list(range(4000 + 100 * i, 4010 + 100 * i)), 2)
    live = sub.drain()
    assert len(live) >= 3
    start = live[1][0]
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(worker.replay_endpoint)
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        replies = []
        while True:
            assert dealer.poll(5000), "no replay reply"
            frames = dealer.recv_multipart()
            assert frames[0] == b"" and len(frames) == 4  # delimiter, topic, seq, payload
            seq = int.from_bytes(frames[2], "big", signed=True)
            if seq == -1:
                assert frames[3] == b""
                break
            replies.append((seq, frames[3]))
    finally:
        dealer.close(0)
        ctx.term()
    assert replies[: len(live) - 1] == [(seq, payload) for seq, _, payload in live[1:]]
    assert replies[0][0] == start


@pytest.mark.parametrize("sub", [2], indirect=True)
def test_positional_encoding_and_two_frame_replay(workers: list[WorkerProcess], sub: EventSubscriber) -> None:
    worker = workers[2]
    prompt = list(range(60, 69))
    _generate(worker, prompt, 1)
    batches = sub.drain()
    raw = msgpack.unpackb(batches[0][2])
    assert isinstance(raw[1][0], list) and raw[1][0][0] == "BlockStored"  # positional arrays, not maps
    (stored,) = [e for e in _events(batches) if isinstance(e, BlockStored)]
    assert stored.block_hashes == sha256_chain(prompt, PAGE)
    ctx = zmq.Context()
    req = ctx.socket(zmq.REQ)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(worker.replay_endpoint)
    try:
        req.send(batches[0][0].to_bytes(8, "big"))  # REQ adds the empty delimiter itself
        assert req.poll(5000)
        seq, payload = req.recv_multipart()  # 2-frame reply: (seq, payload)
        assert int.from_bytes(seq, "big") == batches[0][0] and payload == batches[0][2]
    finally:
        req.close(0)
        ctx.term()


def test_fresh_process_starts_at_seq_zero_with_all_blocks_cleared() -> None:
    with start_fleet("sim", 1, profile="instant", page_size=PAGE)[0] as worker:
        ctx = zmq.Context()
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(worker.replay_endpoint)
        try:
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            assert dealer.poll(5000)
            _, _topic, seq, payload = dealer.recv_multipart()
            assert int.from_bytes(seq, "big") == 0
            assert decode_payload(payload)[1] == [AllBlocksCleared()]
            assert decode_payload(payload)[2] == 0
        finally:
            dealer.close(0)
            ctx.term()

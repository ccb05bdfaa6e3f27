"""The ZMQ transport of KV events, over real sockets: a PUB publisher and a replay ROUTER in the test.

``EventSubscriber`` applies batches from its socket's reader callback and hands gaps to its task;
these check what that must keep: order across a replay (batches arriving while it is under way wait
and follow it), and a stream that goes on after a batch whose applying fails.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest
import zmq
import zmq.asyncio

from extproc.config import EventsConfig
from extproc.fleet.blocks import block_keys, chain_seed
from extproc.fleet.index import BlockIndex
from extproc.sync.cache_view import WorkerCacheView
from extproc.sync.subscriber import EventSubscriber
from prefix_common.addresses import free_ports
from tests.support.kv_batches import CLEARED, PAGE, stored
from tests.support.waiting import until

pytestmark = pytest.mark.timeout(60)


@dataclass
class Publisher:
    """A worker's two event sockets: live batches on PUB, the buffered ones on a replay ROUTER."""

    pub: zmq.asyncio.Socket
    router: zmq.asyncio.Socket
    buffer: list[tuple[int, bytes]] = field(default_factory=list)
    replay_delay_s: dict[int, float] = field(default_factory=dict)  # start seq -> how long to wait before answering
    asked: list[int] = field(default_factory=list)

    async def publish(self, seq: int, payload: bytes, *, lost: bool = False) -> None:
        """Buffer the batch; send it live unless it is ``lost`` on the way."""
        self.buffer.append((seq, payload))
        if not lost:
            await self.pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])

    async def serve_replays(self) -> None:
        while True:
            identity, _empty, start_frame = await self.router.recv_multipart()
            start = int.from_bytes(start_frame, "big")
            self.asked.append(start)
            await asyncio.sleep(self.replay_delay_s.get(start, 0.0))
            for seq, payload in self.buffer:
                if seq >= start:
                    await self.router.send_multipart([identity, b"", b"", seq.to_bytes(8, "big"), payload])
            await self.router.send_multipart([identity, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])


@dataclass
class Stream:
    publisher: Publisher
    view: WorkerCacheView
    index: BlockIndex
    subscriber: EventSubscriber


@pytest.fixture
async def stream() -> AsyncIterator[Stream]:
    ctx = zmq.asyncio.Context()
    live, replay = free_ports(2)
    pub, router = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    pub.bind(f"tcp://127.0.0.1:{live}")
    router.bind(f"tcp://127.0.0.1:{replay}")
    publisher = Publisher(pub, router)
    index = BlockIndex()
    view = WorkerCacheView("w", index)
    subscriber = EventSubscriber(
        view, f"tcp://127.0.0.1:{live}", f"tcp://127.0.0.1:{replay}", EventsConfig(replay_timeout_s=2.0), ctx
    )
    tasks = [asyncio.create_task(publisher.serve_replays()), asyncio.create_task(subscriber.run())]
    try:
        await asyncio.wait_for(subscriber.connected.wait(), 10)
        await asyncio.sleep(0.3)  # the subscription reaches the publisher (ZMQ's slow joiner)
        yield Stream(publisher, view, index, subscriber)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        ctx.destroy(linger=0)


def _keys(tokens: list[int], parent: int | None = None) -> list[int]:
    return block_keys(tokens, PAGE, chain_seed(""), parent=parent)


A, B, C, D, E = [1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16], [17, 18, 19, 20], [21, 22, 23, 24]


async def test_batches_sent_during_a_replay_are_applied_after_it_in_order(stream: Stream) -> None:
    pub = stream.publisher
    await pub.publish(0, CLEARED)
    await pub.publish(1, stored(A, [11, 12], None))
    await until(lambda: stream.view.last_seq == 1, "the first two batches")
    pub.replay_delay_s[2] = 0.5  # the replay of the gap answers late
    await pub.publish(2, stored(B, [13], 12), lost=True)
    # 3 and 4 back to back: read in one drain, which must stop at the gap 3 shows and leave 4 queued.
    await pub.publish(3, stored(C, [14], 13))
    await pub.publish(4, stored(D, [15], 14))
    await asyncio.sleep(0.1)
    await pub.publish(5, stored(E, [16], 15))  # while the replay is under way: it waits in the socket
    await until(lambda: stream.view.last_seq == 5, "the replay and the batches after it")

    assert 2 in pub.asked
    assert stream.view.stats.gaps == 1 and stream.view.stats.gaps_repaired == 1
    assert stream.view.stats.orphans == 0  # D's parent (C, from the replay) was known when D applied
    a = _keys(A)
    b = _keys(B, a[-1])
    c = _keys(C, b[-1])
    d = _keys(D, c[-1])
    assert stream.index.blocks("w") == {*a, *b, *c, *d, *_keys(E, d[-1])}
    assert stream.view.state == "synced"


async def test_a_batch_that_fails_to_apply_resyncs_and_the_stream_goes_on(
    stream: Stream, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    pub = stream.publisher
    await pub.publish(0, CLEARED)
    await until(lambda: stream.view.last_seq == 0, "the first batch")
    apply: Callable[..., Awaitable[None] | None] = stream.view.apply_batch
    failures = [RuntimeError("a bug in applying")]

    def fail_once(batch: object) -> None:
        if failures:
            raise failures.pop()
        apply(batch)

    monkeypatch.setattr(stream.view, "apply_batch", fail_once)
    with caplog.at_level(logging.ERROR, logger="extproc.sync.subscriber"):
        await pub.publish(1, stored(A, [11, 12], None))
        await until(lambda: stream.view.stats.restarts == 1, "the resync after the failure")
    assert "applying a KV-event batch failed" in caplog.text
    await pub.publish(2, stored(B, [13], 12))
    # After the resync the view asks for the replay from 0, which brings batch 1 back: nothing is lost.
    await until(lambda: stream.view.last_seq == 2, "the stream after the failure")
    a = _keys(A)
    assert stream.index.blocks("w") == {*a, *_keys(B, a[-1])}
    assert 0 in pub.asked[1:]  # the replay after the resync, besides the first catch-up's

"""The ZMQ transport of KV events: one SUB socket per publisher, plus replay on demand.

``EventSubscriber`` receives ``[topic, seq, payload]`` batches and hands them to its
``WorkerCacheView`` in arrival order; when the view reports a gap (or on first connect and every
reconnect) it asks the publisher's replay ROUTER socket for the buffered batches. Both replay reply
shapes are read: ``[seq, payload]`` ending with ``(-1, b"")`` up to 0.5.20, and
``[topic, seq, payload]`` ending with ``(b"", -1, b"")`` in 0.5.23.
"""

from __future__ import annotations

import asyncio
import logging

import zmq
import zmq.asyncio

from extproc.config import EventsConfig
from extproc.sync.cache_view import WorkerCacheView
from extproc.sync.event_wire import END_OF_REPLAY, decode_seq

__all__ = ["EventSubscriber", "replay"]

log = logging.getLogger(__name__)

DRAIN_BATCHES = 256  # batches applied from one socket before the event loop gets a turn


async def replay(
    ctx: zmq.asyncio.Context,
    endpoint: str,
    start_seq: int,
    timeout_s: float,
) -> list[tuple[int, bytes]] | None:
    """Ask a replay (ROUTER) socket for every buffered batch from ``start_seq``; None on timeout."""
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(endpoint)
    try:
        await sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
        out: list[tuple[int, bytes]] = []
        while True:
            if not await sock.poll(timeout_s * 1000):
                return None
            frames = await sock.recv_multipart()
            if frames and frames[0] == b"":
                frames = frames[1:]  # the ROUTER envelope delimiter
            if len(frames) == 3:  # 0.5.23: topic, seq, payload
                seq_frame, payload = frames[1], frames[2]
            elif len(frames) == 2:  # older: seq, payload
                seq_frame, payload = frames
            else:
                continue
            seq = decode_seq(seq_frame)
            if seq == END_OF_REPLAY:
                return out
            out.append((seq, payload))
    finally:
        sock.close()


class EventSubscriber:
    """One SUB socket (plus replay on demand) feeding one ``WorkerCacheView``."""

    def __init__(
        self,
        view: WorkerCacheView,
        endpoint: str,
        replay_endpoint: str | None,
        config: EventsConfig,
        ctx: zmq.asyncio.Context,
    ) -> None:
        self.view = view
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.config = config
        self.ctx = ctx
        self.connected = asyncio.Event()

    async def run(self) -> None:
        sub = self.ctx.socket(zmq.SUB)
        sub.linger = 0
        sub.rcvhwm = 0  # never drop on our side; the publisher's HWM is the only loss point
        sub.setsockopt(zmq.SUBSCRIBE, self.config.topic.encode())
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED)
        sub.connect(self.endpoint)
        plain: zmq.Socket[bytes] = zmq.Socket.shadow(sub.underlying)  # see ``_drain``
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            while True:
                # Until the first batch is in, keep asking the replay socket: a worker that just
                # (re)started may not have bound it, or published anything, when we connected.
                catching_up = self.view.last_seq is None and self.replay_endpoint is not None
                ready = dict(await poller.poll(self.config.replay_timeout_s * 1000 if catching_up else None))
                if not ready and catching_up and self.connected.is_set():
                    await self._repair(0)
                if sub in ready:
                    # Everything queued from the old connection first, then the reconnect (below).
                    await self._drain(plain)
                if monitor in ready:
                    await monitor.recv_multipart()
                    # (Re)connected: the publisher may have restarted or batches were lost while we
                    # were away. Start over from what its replay buffer holds.
                    if self.view.last_seq is not None:
                        self.view.resync()
                    if self.replay_endpoint:
                        await self._repair(0)
                    self.connected.set()
        finally:
            sub.disable_monitor()
            monitor.close(0)
            sub.close()

    async def _drain(self, plain: zmq.Socket[bytes]) -> None:
        """Apply every batch queued on the SUB socket, through ``plain``, a blocking-API view of it.

        The asyncio socket wraps each receive in a future (~tens of us): at thousands of batches a
        second that was most of the ingestion cost. The poller has said the socket is readable, so
        non-blocking receives on the plain socket read what is queued; every ``DRAIN_BATCHES`` the
        loop is given a turn, so a flood from one worker never stalls decisions or other streams.
        """
        applied = 0
        while True:
            try:
                frames = plain.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) < 2:
                continue
            seq, payload = decode_seq(frames[-2]), frames[-1]
            start = self.view.ingest(seq, payload)
            if start is not None:
                await self._repair(start)
            applied += 1
            if applied % DRAIN_BATCHES == 0:
                await asyncio.sleep(0)

    async def _repair(self, start: int) -> None:
        entries = None
        if self.replay_endpoint:
            try:
                entries = await replay(self.ctx, self.replay_endpoint, start, self.config.replay_timeout_s)
            except zmq.ZMQError as exc:
                log.warning("worker %s: replay from %s failed: %s", self.view.worker_id, self.replay_endpoint, exc)
        if entries is None and not self.view.awaiting_replay and self.view.last_seq is None:
            return  # initial catch-up without an answer: just wait for live batches
        self.view.replayed(entries)

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
    """One SUB socket (plus replay on demand) feeding one ``WorkerCacheView``.

    Batches are applied in the event loop's reader callback of the socket's file descriptor, as they
    come: no task switch, future or poller registration per batch (``zmq.asyncio``'s poller adds and
    removes its descriptors on every call, which at a busy fleet's thousands of small batches a second
    cost more than applying them). The ``run`` task does only what waits: replays, reconnects, the
    first catch-up. While a replay is under way the socket is not read; what arrives waits in it.
    """

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
        # For ``run``: a seq to replay from (a gap), or None (the socket (re)connected).
        self._work: asyncio.Queue[int | None] = asyncio.Queue()
        self._plain: zmq.Socket[bytes] | None = None  # a blocking-API view of the SUB socket
        self._reading = False  # the reader callback is registered (not while a replay is under way)

    async def run(self) -> None:
        sub = self.ctx.socket(zmq.SUB)
        sub.linger = 0
        sub.rcvhwm = 0  # never drop on our side; the publisher's HWM is the only loss point
        sub.setsockopt(zmq.SUBSCRIBE, self.config.topic.encode())
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED)
        sub.connect(self.endpoint)
        self._plain = zmq.Socket.shadow(sub.underlying)
        plain_monitor: zmq.Socket[bytes] = zmq.Socket.shadow(monitor.underlying)
        loop = asyncio.get_running_loop()
        monitor_fd = plain_monitor.fileno()
        loop.add_reader(monitor_fd, self._on_monitor, plain_monitor)
        self._resume()
        loop.call_soon(self._on_monitor, plain_monitor)  # the descriptors signal edges: read what came before
        try:
            while True:
                # Until the first batch is in, keep asking the replay socket: a worker that just
                # (re)started may not have bound it, or published anything, when we connected.
                catching_up = self.view.last_seq is None and self.replay_endpoint is not None
                try:
                    if catching_up:
                        start = await asyncio.wait_for(self._work.get(), self.config.replay_timeout_s)
                    else:
                        start = await self._work.get()
                except TimeoutError:
                    if self.connected.is_set():
                        await self._repair_paused(0)
                    continue
                if start is not None:
                    await self._repair_paused(start)
                    continue
                # (Re)connected: the publisher may have restarted or batches were lost while we
                # were away. Start over from what its replay buffer holds.
                if self.view.last_seq is not None:
                    self.view.resync()
                if self.replay_endpoint:
                    await self._repair_paused(0)
                self.connected.set()
        finally:
            self._pause()
            loop.remove_reader(monitor_fd)
            self._plain = None
            sub.disable_monitor()
            monitor.close(0)
            sub.close()

    def _pause(self) -> None:
        if self._reading and self._plain is not None:
            asyncio.get_running_loop().remove_reader(self._plain.fileno())
            self._reading = False

    def _resume(self) -> None:
        if not self._reading and self._plain is not None:
            loop = asyncio.get_running_loop()
            loop.add_reader(self._plain.fileno(), self._drain)
            self._reading = True
            loop.call_soon(self._drain)  # batches that arrived while paused signalled no new edge

    async def _repair_paused(self, start: int) -> None:
        """A replay from ``start`` with the live stream held back, then reading resumes."""
        self._pause()
        try:
            await self._repair(start)
        finally:
            self._resume()

    def _on_monitor(self, plain_monitor: zmq.Socket[bytes]) -> None:
        """The monitor socket is readable: each connect event goes to ``run``."""
        while True:
            try:
                plain_monitor.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.ZMQError:  # zmq.Again: nothing more queued (or the socket closed under us on shutdown)
                return
            self._drain()  # everything queued from the old connection first, then the reconnect
            self._work.put_nowait(None)

    def _drain(self) -> None:
        """Apply every batch queued on the SUB socket (the reader callback; non-blocking receives).

        Every ``DRAIN_BATCHES`` the loop is given a turn, so a flood from one worker never stalls
        decisions or other streams. A gap pauses reading and hands the replay to ``run``.
        """
        plain = self._plain
        if not self._reading or plain is None:
            return
        for _ in range(DRAIN_BATCHES):
            try:
                frames = plain.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.ZMQError:  # zmq.Again: the socket is empty (or it closed under us on shutdown)
                return
            if len(frames) < 2:
                continue
            try:
                start = self.view.ingest(decode_seq(frames[-2]), frames[-1])
            except Exception:  # a bug, not bad input (that is a decode error, handled by the view)
                log.exception("worker %s: applying a KV-event batch failed; resyncing", self.view.worker_id)
                self.view.resync()
                continue
            if start is not None:
                self._pause()
                self._work.put_nowait(start)
                return
        asyncio.get_running_loop().call_soon(self._drain)

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

"""Decision latency of the router and KV-event ingestion rate (prints figures; not a test).

    python -m benchmarks.decision_latency [--samples 40] [--workers 8] [--event-blocks 200000]

Decision latency is ``Router.route()`` (the serving app's router, in process) end to end (render the
chat template, tokenize, hash the blocks, look them up, choose, trace), for chat prompts of about 1k /
8k / 32k tokens over a fleet of ``--workers`` workers:

- cold: a prompt never seen before (nothing in the piece cache, no block in the index);
- warm: a later turn of a conversation seen before (its document and earlier turns tokenized
  already, their blocks held by one worker in the index, as its KV events would have reported);
  the ``--samples`` conversations' turns arrive interleaved, as many users' do.

Event ingestion sends real msgpack ``BlockStored`` batches (16 pages of 16 tokens each) from
``--workers`` ZMQ PUB sockets in a separate process to the router's subscribers and times how fast
the index absorbs them. With ``--full-cache`` every batch after a worker's first ``FULL_AFTER``
also carries a ``BlockRemoved`` of the batch stored ``FULL_AFTER`` batches before (a worker whose
cache is full evicts a page for every page it stores: what a busy fleet sends). The router's CPU
seconds over the run (this process: the subscribers and the index; the publisher is another) give
blocks per CPU-second, a figure that holds on a shared machine where wall-clock rates do not.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import random
import statistics
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from extproc.config import EventsConfig, IndexConfig, PolicyConfig, RouterConfig
from extproc.decision.request import ParsedRequest
from extproc.fleet.index import BlockIndex
from extproc.fleet.workers import Worker, WorkerRegistry
from extproc.serving.app import RouterApp
from extproc.sync.http import WorkerHttp
from extproc.sync.hub import EventHub
from prefix_common.tokenization import load_tokenizer

PAGE = 16
FULL_AFTER = 8  # batches a worker stores before its cache is full (with ``full_cache``)
SIZES = (1024, 8192, 32768)


def _vocabulary(rng: random.Random) -> list[str]:
    letters = "abcdefghijklmnopqrstuvwxyz"
    return ["".join(rng.choice(letters) for _ in range(rng.randint(2, 10))) for _ in range(3000)]


def _document(rng: random.Random, vocab: list[str], tokens: int) -> str:
    """Paragraphs of pseudo-words, about ``tokens`` tokens long under the default tokenizer."""
    tok = load_tokenizer()
    paragraphs: list[str] = []
    count = 0
    while count < tokens:
        para = " ".join(rng.choice(vocab) for _ in range(rng.randint(20, 60))) + "."
        paragraphs.append(para)
        count += len(tok.encode_whole(para, False)) + 1
    return "\n\n".join(paragraphs)


def _nearest_rank(ordered: Sequence[float], quantile: float) -> float:
    """The nearest-rank quantile of sorted values (the figure every table of this module reports)."""
    return ordered[min(len(ordered) - 1, round(quantile * (len(ordered) - 1)))]


def _percentiles(values: list[float]) -> tuple[float, float]:
    ordered = sorted(values)
    return statistics.median(ordered) * 1000, _nearest_rank(ordered, 0.99) * 1000


def decision_latency(
    samples: int, workers: int, max_candidates: int | None = None
) -> list[tuple[int, int, tuple[float, float], tuple[float, float]]]:
    """Per prompt size: (size, tokens, cold p50/p99, warm p50/p99); ``max_candidates`` overrides the shortlist."""
    rng = random.Random(42)
    vocab = _vocabulary(rng)
    fleet = [
        Worker(id=f"w{i}", url=f"http://127.0.0.1:{41000 + i}", ip="127.0.0.1", port=41000 + i) for i in range(workers)
    ]
    policy = PolicyConfig() if max_candidates is None else PolicyConfig(max_candidates=max_candidates)
    config = RouterConfig(events=EventsConfig(enabled=False), index=IndexConfig(default_block_size=PAGE), policy=policy)
    app = RouterApp(config, WorkerRegistry(fleet))
    router, index = app.router, app.index
    # One throw-away decision: the tokenizer's first call initialises lazily (~10 ms), once per process.
    router.finish(router.route(ParsedRequest(path="/generate", kind="generate", model="m", prompt_text="warm up")))
    results = []
    for size in SIZES:
        cold: list[float] = []
        warm: list[float] = []
        tokens = 0
        sessions: list[list[dict[str, str]]] = []
        for _ in range(samples):
            doc = _document(rng, vocab, size)
            history = [
                {"role": "system", "content": "You answer questions about the document."},
                {"role": "user", "content": doc + "\n\nSummarise it."},
            ]
            parsed = ParsedRequest(path="/v1/chat/completions", kind="chat", model="m", messages=history)
            start = time.perf_counter()
            outcome = router.route(parsed)
            cold.append(time.perf_counter() - start)
            router.finish(outcome)
            tokens = len(outcome.request.token_ids or [])
            # The worker prefilled it and reported its blocks (what its KV events would have said).
            index.store(outcome.worker.id, outcome.request.block_keys)
            sessions.append([*history, {"role": "assistant", "content": "A summary."}])
        # Later turns interleaved across the sessions, as many users' conversations arrive.
        for turn in range(3):
            for i, history in enumerate(sessions):
                history += [{"role": "user", "content": f"Question {turn} about paragraph {i}?"}]
                parsed = ParsedRequest(path="/v1/chat/completions", kind="chat", model="m", messages=list(history))
                start = time.perf_counter()
                outcome = router.route(parsed)
                warm.append(time.perf_counter() - start)
                router.finish(outcome)
                assert outcome.matched_blocks > 0
                history += [{"role": "assistant", "content": "An answer."}]
        results.append((size, tokens, _percentiles(cold), _percentiles(warm)))
    return results


def _stamped(payload: bytes, ts: float) -> bytes:
    """``payload`` with its batch timestamp set to ``ts``: the time a paced publisher sends it.

    The batches are packed before the run (packing costs the publisher more than sending), as
    ``[float64 ts, events, rank]``: a fixarray header, the float's marker, its 8 bytes; those 8 are replaced.
    """
    return payload[:2] + _TS.pack(ts) + payload[10:]


_TS = struct.Struct(">d")


def _publisher(
    ports: list[int], batches: int, pages: int, full_cache: bool, rate: float | None, ready: Any, go: Any, span: Any
) -> None:
    import msgpack
    import zmq

    rng = random.Random(7)
    ctx = zmq.Context()
    socks = []
    for port in ports:
        sock = ctx.socket(zmq.PUB)
        sock.sndhwm = 0
        sock.bind(f"tcp://127.0.0.1:{port}")
        socks.append(sock)
    payloads: list[list[bytes]] = []
    sizes: list[list[int]] = []  # blocks (stored + removed) per batch
    for _ in ports:
        out = [msgpack.packb([time.time(), [{"type": "AllBlocksCleared"}], 0])]
        blocks = [0]
        parent = None
        stored: list[list[int]] = []
        for b in range(batches):
            tokens = [rng.randrange(128_000) for _ in range(pages * PAGE)]
            hashes = [rng.getrandbits(63) for _ in range(pages)]
            event = {
                "type": "BlockStored",
                "block_hashes": hashes,
                "parent_block_hash": parent,
                "token_ids": tokens,
                "block_size": PAGE,
                "lora_id": None,
                "medium": "GPU",
            }
            events: list[dict[str, Any]] = [event]
            if full_cache and b >= FULL_AFTER:
                events.append({"type": "BlockRemoved", "block_hashes": stored[b - FULL_AFTER], "medium": "GPU"})
            stored.append(hashes)
            # A float ts always: ``_stamped`` overwrites it in place.
            out.append(msgpack.packb([float(time.time()), events, 0], use_single_float=False))
            blocks.append(pages * len(events))
            parent = hashes[-1] if b % 8 else None  # chains of 8 batches, then a new root
        payloads.append(out)
        sizes.append(blocks)
    ready.set()
    go.wait()
    start = time.time()
    sent = 0
    for seq in range(batches + 1):
        for w, sock in enumerate(socks):
            payload = payloads[w][seq]
            if rate is not None:
                # On schedule: the batch leaves once the blocks before it have had their time at ``rate``
                # (sleeping only for gaps above a millisecond: a paced stream is a steady one, not a precise one).
                due = start + sent / rate
                now = time.time()
                if due - now > 0.001:
                    time.sleep(due - now)
                payload = _stamped(payload, time.time())
            sent += sizes[w][seq]
            sock.send_multipart([b"", seq.to_bytes(8, "big"), payload])
    span.value = time.time() - start
    time.sleep(2.0)
    ctx.destroy(linger=0)


@dataclass(frozen=True)
class Ingestion:
    """One ingestion run: blocks stored and removed by the streams, how long, the router's CPU, the index after.

    A paced run (``rate`` set) also has the publishers' own sending time and the lag of the batches the
    router applied (``lags_s``: publish to applied, one sample per stream per poll of the views).
    """

    stored: int
    removed: int
    expected_held: int  # what the index must hold: every stored block not removed since
    seconds: float
    cpu_s: float  # this process's CPU seconds over the run (subscribers, decoding, index; every thread)
    held: int  # entries the index holds at the end
    rate: float | None = None  # offered blocks/s (stored + removed), all publishers together; None: flat out
    sent_s: float = 0.0  # how long the publishers took to send everything
    lags_s: tuple[float, ...] = ()

    @property
    def blocks(self) -> int:
        return self.stored + self.removed

    @property
    def exact(self) -> bool:
        return self.held == self.expected_held

    @property
    def cores(self) -> float:
        """The router's CPU seconds per wall second over the run: its share of a core the stream costs."""
        return self.cpu_s / self.seconds if self.seconds else 0.0

    def lag_ms(self, quantile: float) -> float:
        """A quantile of the applied batches' publish-to-apply lag, in ms (0 without samples)."""
        if not self.lags_s:
            return 0.0
        return _nearest_rank(sorted(self.lags_s), quantile) * 1000


async def event_ingestion(
    workers: int, total_blocks: int, full_cache: bool = False, rate: float | None = None
) -> Ingestion:
    """Publish ``total_blocks`` stored blocks from ``workers`` publishers (and as many removals, less the
    first ``FULL_AFTER`` batches', with ``full_cache``) and time how fast the index absorbs them.

    Flat out by default (the router's ceiling); with ``rate`` the publishers send on a schedule of
    ``rate`` blocks per second (stored and removed, all together), as a busy fleet does, and the run
    reports whether the router keeps up: how far behind the publishers its index is, and its CPU share.
    """
    from prefix_common.addresses import free_ports

    if rate is not None and rate <= 0:
        raise ValueError("rate must be positive blocks per second")
    pages = 16
    batches = max(1, total_blocks // (workers * pages))
    ports = free_ports(workers)
    fleet = [
        Worker(
            id=f"w{i}",
            url=f"http://127.0.0.1:{ports[i]}",
            ip="127.0.0.1",
            port=ports[i],
            kv_events_endpoint=f"tcp://127.0.0.1:{ports[i]}",
        )
        for i in range(workers)
    ]
    index = BlockIndex(max_blocks=10_000_000)
    http = WorkerHttp()  # unused: every worker names its publisher, so nothing is discovered over HTTP
    hub = EventHub(EventsConfig(discovery_interval_s=3600), WorkerRegistry(fleet), index, http)
    ctx = mp.get_context("spawn")
    ready, go, span = ctx.Event(), ctx.Event(), ctx.Value("d", 0.0)
    proc = ctx.Process(target=_publisher, args=(ports, batches, pages, full_cache, rate, ready, go, span), daemon=True)
    proc.start()
    await asyncio.get_running_loop().run_in_executor(None, ready.wait)
    await hub.start()
    await asyncio.sleep(1.0)  # subscriptions established (ZMQ slow joiner)
    expected_stored = workers * batches * pages
    expected_removed = workers * max(0, batches - FULL_AFTER) * pages if full_cache else 0
    views = [v for per_worker in hub.views.values() for v in per_worker]
    seen = [v.stats.batches for v in views]
    lags: list[float] = []
    go.set()
    start, cpu_start = time.perf_counter(), time.process_time()

    def counted() -> tuple[int, int]:
        return sum(v.stats.blocks_stored for v in views), sum(v.stats.blocks_removed for v in views)

    def done() -> bool:
        stored, removed = counted()
        return stored >= expected_stored and removed >= expected_removed

    deadline = start + 120 + (expected_stored + expected_removed) / (rate or float("inf"))
    while not done() and time.perf_counter() < deadline:
        await asyncio.sleep(0.005)
        if rate is not None:  # the lag of each stream's latest batch, if it applied one since the last look
            for i, view in enumerate(views):
                if view.stats.batches != seen[i]:
                    seen[i] = view.stats.batches
                    lags.append(view.stats.lag_s)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    stored, removed = counted()
    held = index.blocks_total
    await hub.stop()
    proc.join(5)
    return Ingestion(
        stored, removed, expected_stored - expected_removed, elapsed, cpu, held, rate, span.value, tuple(lags)
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.decision_latency",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--samples", type=int, default=30, help="Conversations per prompt size (3 warm turns each).")
    parser.add_argument("--workers", type=int, default=8, help="Workers in the fleet / event publishers.")
    parser.add_argument("--event-blocks", type=int, default=200_000, help="Blocks to publish for the ingestion run.")
    parser.add_argument(
        "--full-cache", action="store_true", help="Every batch also removes an older one (a full cache's events)."
    )
    args = parser.parse_args(argv)

    print(f"decision latency, prefix-aware policy, {args.workers} workers, page {PAGE} (ms)")
    print(f"{'prompt':>8} {'tokens':>7} {'cold p50':>9} {'cold p99':>9} {'warm p50':>9} {'warm p99':>9}")
    for size, tokens, (c50, c99), (w50, w99) in decision_latency(args.samples, args.workers):
        print(f"{size // 1024:>7}k {tokens:>7} {c50:>9.2f} {c99:>9.2f} {w50:>9.2f} {w99:>9.2f}")
    run = asyncio.run(event_ingestion(args.workers, args.event_blocks, args.full_cache))
    print(
        f"event ingestion: {run.stored} blocks stored + {run.removed} removed from {args.workers} workers in "
        f"{run.seconds:.2f} s = {run.blocks / run.seconds:,.0f} blocks/s, {run.blocks / max(run.cpu_s, 1e-9):,.0f} "
        f"per router CPU-second (batches of 16 pages x {PAGE} tokens, real ZMQ), index exact: {run.exact}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

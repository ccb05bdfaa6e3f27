"""``prefix-router bench --suite decision-latency``: the router's decision latency and KV-event ingestion rate,
measured in this process (prints figures; not a test).

Decision latency is ``Router.route()`` end to end (render the chat template, tokenize, hash the
blocks, look them up, choose, trace), for chat prompts of about 1k / 8k / 32k tokens over a fleet of
``--workers`` workers:

- cold: a prompt never seen before (nothing in the piece cache, no block in the index);
- warm: a later turn of a conversation seen before (its document and earlier turns tokenized
  already, their blocks held by one worker in the index, as its KV events would have reported);
  the ``--samples`` conversations' turns arrive interleaved, as many users' do.

Event ingestion sends real msgpack ``BlockStored`` batches (16 pages of 16 tokens each) from
``--workers`` ZMQ PUB sockets in a separate process to the router's subscribers and times how fast
the index absorbs them. With ``--full-cache`` every batch after a worker's first 8 also carries a
``BlockRemoved`` of the batch stored 8 batches before (a worker whose cache is full evicts a page for
every page it stores: what a busy fleet sends). The router's CPU seconds over the run (this process:
the subscribers and the index; the publisher is another) give blocks per CPU-second, a figure that
holds on a shared machine where wall-clock rates do not. ``--suite scale`` runs both at 16 to 256 workers.
"""

from __future__ import annotations

import argparse
import asyncio

from benchmarks.argtypes import positive
from benchmarks.probes.decisions import PAGE, decision_latency
from benchmarks.probes.ingestion import event_ingestion

__all__ = ["configure", "main"]


def configure(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("decisions and ingestion")
    g.add_argument(
        "--samples", type=positive(int), default=30, help="Conversations per prompt size (3 warm turns each)."
    )
    g.add_argument("--workers", type=positive(int), default=8, help="Workers in the fleet / event publishers.")
    g.add_argument(
        "--event-blocks", type=positive(int), default=200_000, help="Blocks to publish for the ingestion run."
    )
    g.add_argument(
        "--full-cache", action="store_true", help="Every batch also removes an older one (a full cache's events)."
    )


def main(args: argparse.Namespace) -> int:
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

"""Continuous batching as SGLang's scheduler does it, on a simulated clock.

One asyncio task runs the loop of ``sglang.srt.managers.scheduler.Scheduler.event_loop_normal``:
each iteration first tries to form a prefill batch from the waiting queue (``PrefillAdder``), and
only when none can be formed runs one decode step of the running batch, so long prefills stall
decodes exactly as they do in SGLang without ``--enable-mixed-chunk``. A step's duration comes from
the timing profile and is slept (divided by ``--speedup``); its KV events are published at its end.

Admission (``admission``) follows ``PrefillAdder``: queue order, the running-requests cap and the KV,
prefill and chunk budgets; a request cut by the chunk budget continues first in the next prefill batch.
A request's prompt enters the radix cache right after its prefill (so others can match it), and prompt +
output when it finishes. Its counters and histograms are kept in ``metrics``.
When decode runs out of KV, the requests with the fewest output tokens are retracted to the queue.
Admission reserves each running request's remaining output times ``new_token_ratio``: 0.7 at start,
after a retraction (re-estimated) and whenever the scheduler is idle with nothing queued (SGLang's
``on_idle``), then lowered by one 600th of the way to 0.098 per decode step.

The memory pool is counted in tokens and handed out in whole pages: tree pages (evictable or locked)
plus each request's private pages (computed but not yet in the tree: its partial last page and, until
it finishes, its output).

With HiCache (``HiRadixCache``) the loop also does what SGLang's ``check_hicache_events`` and
``PrefillAdder`` do for the host tier: at the start of each iteration it acknowledges finished
device-to-host copies (publishing their ``CPU_PINNED`` stores, and writing them to L3 storage when a
storage backend is on); admission counts a request's host hit as cached and loads it back (a host span
of at least 10 tokens, if its pages fit), the copy overlapping the prefill layer by layer; a request
whose storage prefetch is still running is skipped this pass (``StoragePrefetcher``); at the end of
the iteration the step's write-through backups go out as one copy. Asynchronous work (copies, storage
I/O) runs on the scheduler's clock: simulated seconds since start, wall time x ``--speedup``.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import random
import time
import uuid
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from prefix_common.tasks import cancel_and_wait

from .admission import LPM_FALLBACK_QUEUE, next_prefill_batch
from .config import SimWorkerConfig
from .hicache_storage import FileStorage, StoragePrefetcher
from .hiradix_cache import Backup, HiRadixCache
from .kv_events import KVEventPublisher
from .load_report import NULL_DISAGGREGATION, LoadCounters
from .metrics import Histogram, SchedulerStats, record_finished
from .radix_cache import RadixCache
from .request import HEALTH_CHECK_RID_PREFIX, Request
from .timing import TimingProfile

__all__ = ["Scheduler", "Step", "device_pool_tokens"]

logger = logging.getLogger(__name__)

INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = INIT_NEW_TOKEN_RATIO * 0.14
NEW_TOKEN_RATIO_DECAY = (INIT_NEW_TOKEN_RATIO - MIN_NEW_TOKEN_RATIO) / 600
RETRACT_DECODE_STEPS = 20
MAX_PACING_CREDIT = 0.05  # at most this much wall time is made up after a stall (s)


@dataclass(frozen=True)
class Step:
    """One executed batch, kept for inspection (tests, debugging): kind, requests, new tokens, seconds."""

    kind: str  # "prefill" or "decode"
    rids: tuple[str, ...]
    tokens: int
    duration: float


def device_pool_tokens(config: SimWorkerConfig, profile: TimingProfile) -> int:
    """The KV pool in whole pages, as SGLang sizes it."""
    pool = config.capacity_tokens or profile.kv_pool_tokens
    return max(pool // config.page_size, 1) * config.page_size


class Scheduler:
    """Waiting queue, running batch, radix cache and KV pool of one simulated worker."""

    def __init__(
        self,
        config: SimWorkerConfig,
        profile: TimingProfile,
        cache: RadixCache,
        publisher: KVEventPublisher | None,
        vocab: Sequence[int],
    ) -> None:
        if not vocab:
            raise ValueError("empty output vocabulary")
        self.config = config
        self.profile = profile
        self.cache = cache
        self.publisher = publisher
        self.vocab = list(vocab)
        self.capacity = device_pool_tokens(config, profile)
        self._t0 = time.monotonic()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stall = 0.0  # simulated seconds of write_back copies inside eviction, charged to the next step
        self.hicache = cache if isinstance(cache, HiRadixCache) else None
        self.prefetcher: StoragePrefetcher | None = None
        if self.hicache is not None:
            self.hicache.clock = self.clock
            self.hicache.d2h_time = profile.d2h_time
            if config.hicache_storage_backend == "file":
                self.prefetcher = StoragePrefetcher(
                    FileStorage(config.storage_dir(), config.model),
                    self.hicache,
                    config.storage_settings(),
                    config.hicache_storage_prefetch_policy,
                    profile.kv_bytes,
                    self.clock,
                    self._wake_threadsafe,
                )
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.chunked: Request | None = None
        self.prefilling: list[Request] = []  # the prefill batch in flight
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        # What ``sglang:new_token_ratio`` shows: the ratio the last prefill batch was admitted with (0 before one).
        self.reported_new_token_ratio = 0.0
        self.stats = SchedulerStats()
        self.counters = LoadCounters(speedup=config.speedup)
        self.last_output_at = 0.0  # monotonic time of the last output (a token or a health signal), as SGLang's
        self._health_waiters = 0  # /health probes answered by the next step's output instead of a generation
        self.sim_time = 0.0  # simulated GPU seconds elapsed (sum of step durations)
        self.steps: deque[Step] = deque(maxlen=1024)
        self._wakeup = asyncio.Event()
        self._paced_until: float | None = None  # wall clock at the end of the last step (None: was idle)
        self._debt = 0.0  # wall seconds the simulation is behind (+) or ahead (-) of its pace
        self._task: asyncio.Task[None] | None = None
        self._rids = itertools.count()
        # SGLang's decode server runs without a radix cache (nothing inserted, nothing matched, no events).
        self.radix_cache = config.disaggregation_mode != "decode"
        self.disaggregation_report: Callable[[], dict[str, Any]] | None = None  # PD queues for /v1/loads
        self._publish()  # the AllBlocksCleared of cache construction, as SGLang publishes it

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = self._loop.create_task(self._run(), name="sim-scheduler")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        if self.prefetcher is not None:
            self.prefetcher.close()

    def clock(self) -> float:
        """Simulated seconds since start (wall time x speedup): the clock of copies and storage I/O."""
        return (time.monotonic() - self._t0) * self.config.speedup

    def _wake_threadsafe(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._wakeup.set)

    # -- requests ----------------------------------------------------------------------------------
    def submit(
        self,
        input_ids: list[int],
        max_new_tokens: int,
        cache_salt: str | None = None,
        rid: str | None = None,
        stream: bool = False,
    ) -> Request:
        """Queue a request; its tokens arrive on ``request.updates`` (``None`` = finished).

        Like SGLang, ``max_new_tokens`` is clipped so that prompt + output fit the KV pool.
        """
        return self.enqueue(self.new_request(input_ids, max_new_tokens, cache_salt, rid, stream))

    def new_request(
        self,
        input_ids: list[int],
        max_new_tokens: int,
        cache_salt: str | None = None,
        rid: str | None = None,
        stream: bool = False,
    ) -> Request:
        """A request of this scheduler, not queued yet (a PD request waits for its hand-off first)."""
        max_new_tokens = max(0, min(max_new_tokens, self.capacity - 1 - len(input_ids)))
        req = Request(
            rid or f"{next(self._rids):x}",
            list(input_ids),
            max_new_tokens,
            cache_salt,
            sim_arrival=self.sim_time,
            stream=stream,
            dp_rank=self.config.dp_rank,
        )
        seed_material = f"{self.config.seed}:{cache_salt}:".encode() + array("Q", input_ids).tobytes()
        req.rng = random.Random(hashlib.sha256(seed_material).digest())
        return req

    def enqueue(self, req: Request) -> Request:
        """Put a request made by ``new_request`` in the waiting queue."""
        self.waiting.append(req)
        if not req.health_check:
            self.stats.num_requests += 1
        if self.prefetcher is not None:  # SGLang prefetches from storage as the request arrives
            m = self.cache.match(req.input_ids[:-1], req.cache_salt)
            self.prefetcher.start(req, req.input_ids, req.cache_salt, m.node, m.device_len + m.host_len)
        self._wakeup.set()
        return req

    def probe_health(self) -> None:
        """What SGLang's scheduler does with a ``/health`` generation request.

        Idle, it runs the request (one token of ``[0]``, one new token) so that an answer proves the model
        runs; busy, it skips it ("ongoing requests already carry health info") and signals after the next
        batch instead. Either way ``last_output_at`` moves, which is what the HTTP handler waits for.
        """
        if self.idle:
            self.submit([0], 1, None, f"{HEALTH_CHECK_RID_PREFIX}_{uuid.uuid4().hex}")
        else:
            self._health_waiters += 1

    def abort(self, req: Request) -> None:
        """Drop a request whose client went away (SGLang aborts it the same way)."""
        if req in self.waiting:
            self.waiting.remove(req)
            req.finished_at = time.monotonic()
            if self.prefetcher is not None:
                self.prefetcher.cancel(req)
        elif not req.finished:
            req.max_new_tokens = min(req.max_new_tokens, max(len(req.output_ids), 1))

    def abort_request(self, req: Request, message: str = "Aborted by AbortReq.") -> bool:
        """SGLang's ``/abort_request`` for one request: it ends with finish_reason abort ``message``.

        Waiting, it leaves the queue and its response ends now; running, it ends after this step. Returns
        False when the request is not in this scheduler (not queued yet, or already finished)."""
        if req.finished or req.abort_message is not None:
            return False
        if req in self.waiting:
            self.waiting.remove(req)
            if self.prefetcher is not None:
                self.prefetcher.cancel(req)
            req.abort_message = message
            req.finished_at = time.monotonic()
            req.updates.put_nowait(None)
            return True
        if req in self.running or req in self.prefilling or req is self.chunked:
            req.abort_message = message
            req.max_new_tokens = min(req.max_new_tokens, max(len(req.output_ids), 1))
            return True
        return False

    def abort_matching(self, rid: str, abort_all: bool) -> int:
        """``/abort_request``: every request whose rid starts with ``rid`` (SGLang matches prefixes)."""
        reqs = [*self.waiting, *self.prefilling, *self.running, *([self.chunked] if self.chunked else [])]
        hits = [r for r in dict.fromkeys(reqs) if not r.health_check and (abort_all or r.rid.startswith(rid))]
        return sum(self.abort_request(r) for r in hits)

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.running or self.prefilling or self.chunked)

    def flush_cache(self) -> bool:
        """SGLang's /flush_cache: only when no request is queued or running."""
        if not self.idle:
            return False
        self.cache.reset()
        self._publish()
        return True

    # -- pool accounting ---------------------------------------------------------------------------
    @property
    def private_tokens(self) -> int:
        total = sum(self._private(r) for r in self.running) + sum(self._private(r) for r in self.prefilling)
        if self.chunked is not None and self.chunked not in self.prefilling:
            total += self._private(self.chunked)
        return total

    def page_ceil(self, tokens: int) -> int:
        page = self.config.page_size
        return -(-tokens // page) * page

    def _private(self, req: Request) -> int:
        """Pool tokens a request holds outside the tree: whole pages, as SGLang's paged allocator hands out."""
        return self.page_ceil(req.kv_len) - req.tree_len

    def _decode_need(self) -> int:
        """Tokens the next decode step allocates: a new page for each request whose last page is full."""
        return self.config.page_size * sum(1 for r in self.running if r.kv_len % self.config.page_size == 0)

    @property
    def free_tokens(self) -> int:
        return self.capacity - self.cache.total_size - self.private_tokens

    @property
    def used_tokens(self) -> int:
        """SGLang's num_used: the pool minus free and evictable tokens."""
        return self.capacity - self.free_tokens - self.cache.evictable_size

    def ensure_free(self, tokens: int) -> bool:
        shortfall = tokens - self.free_tokens
        if shortfall > 0:
            start = time.perf_counter()
            freed = self.cache.evict(shortfall)
            if freed:
                self.stats.evicted_tokens += freed
                self.stats.evictions.observe(time.perf_counter() - start)
        return self.free_tokens >= tokens

    # -- the loop ----------------------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            try:
                await self._step()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug must not hang every client: fail in-flight requests, start clean
                logger.exception("scheduler step failed; failing in-flight requests and flushing the cache")
                self._fail_all("internal scheduler error")

    def _fail_all(self, message: str) -> None:
        reqs = self.waiting + self.prefilling + self.running + ([self.chunked] if self.chunked else [])
        for req in dict.fromkeys(reqs):
            req.error = message
            req.finished_at = time.monotonic()
            req.updates.put_nowait(None)
        self.waiting, self.prefilling, self.running, self.chunked = [], [], [], None
        if self.prefetcher is not None:
            for key in list(self.prefetcher.ops):
                self.prefetcher.cancel(key)
        self.cache.reset()
        self._publish()

    async def _step(self) -> None:
        """One iteration of SGLang's event loop: a prefill batch if one forms, else a decode step."""
        self._hicache_events()
        if self.idle:
            self._publish()  # acknowledged host copies go out even when idle (SGLang's idle check)
            self.new_token_ratio = INIT_NEW_TOKEN_RATIO  # SGLang's on_idle resets it once nothing is queued or running
            await self._idle_wait(self._next_timer())
            return
        batch = next_prefill_batch(self)
        if batch:
            self.reported_new_token_ratio = self.new_token_ratio
            # A decode worker's prebuilt requests got their KV from the prefill worker: no compute.
            compute = self.profile.prefill_time((r.chunk_len, r.chunk_prefix) for r in batch if not r.prebuilt)
            loaded = sum(r.load_tokens for r in batch)
            h2d = self.profile.h2d_time(loaded)
            duration = self.profile.overlapped_prefill(compute, h2d) + self._take_stall()
            if loaded:
                self.stats.load_back_tokens += loaded
                self.stats.load_back_bytes += self.profile.kv_bytes(loaded)
                self.stats.load_back_seconds.observe(h2d / self.config.speedup)  # reported in wall seconds
            self.stats.busy_prefill_s += duration
            self.steps.append(Step("prefill", tuple(r.rid for r in batch), sum(r.chunk_len for r in batch), duration))
            launch = self.sim_time
            await self._sleep(duration)
            self._finish_prefill(batch, launch, duration)
        elif self.running:
            context = sum(r.kv_len for r in self.running) + len(self.running)
            duration = self.profile.decode_time(len(self.running), context) + self._take_stall()
            self.stats.busy_decode_s += duration
            self.steps.append(Step("decode", tuple(r.rid for r in self.running), len(self.running), duration))
            launch = self.sim_time
            await self._sleep(duration)
            self.counters.on_decode(launch, len(self.running), all(r.health_check for r in self.running))
            self._decode_step()
        else:
            # Nothing fits right now (KV budget, storage prefetches in flight); wait for a change.
            self._publish()
            await self._idle_wait(self._next_timer())
            return
        if self._health_waiters:  # SGLang's maybe_send_health_check_signal after each batch
            self._health_waiters = 0
            self.last_output_at = time.monotonic()
        if self.hicache is not None:
            self.hicache.flush_backups()  # SGLang start_writing: this step's backups, one copy
        self._publish()

    async def _idle_wait(self, until: float | None = None) -> None:
        """No batch to run: SGLang's on_idle (the next batch starts after an idle gap), then wait for work,
        or until ``until`` on the scheduler's clock (a copy acknowledgement or a storage prefetch is due)."""
        self.counters.on_idle()
        if self._health_waiters:  # nothing ran, but the loop is alive: answer waiting probes
            self._health_waiters = 0
            self.last_output_at = time.monotonic()
        self._wakeup.clear()
        start = time.monotonic()
        if until is None:
            await self._wakeup.wait()
        else:
            delay = max(0.0, until - self.clock()) / self.config.speedup
            try:
                await asyncio.wait_for(self._wakeup.wait(), delay)
            except asyncio.TimeoutError:
                pass
        self.stats.idle_s += time.monotonic() - start
        self._paced_until = None

    def _next_timer(self) -> float | None:
        """When a copy acknowledgement or a storage prefetch next needs the loop (None: nothing pending)."""
        times = []
        if self.hicache is not None and self.hicache.next_ack_at is not None:
            times.append(self.hicache.next_ack_at)
        if self.prefetcher is not None:
            if any(op.hits is None and op.query.done() for op in self.prefetcher.ops.values()):
                return self.clock()  # a storage lookup answered while the step ran
            wake = self.prefetcher.next_wake()
            if wake is not None:
                times.append(wake)
        return min(times) if times else None

    def _hicache_events(self) -> None:
        """SGLang ``check_hicache_events``: acknowledge finished host copies (their events, L3 writes)."""
        if self.hicache is None:
            return
        for op in self.hicache.poll_backups():
            self._backed_up(op)

    def _backed_up(self, op: Backup) -> None:
        self.stats.backup_bytes += self.profile.kv_bytes(op.tokens)
        self.stats.backup_seconds.observe(op.seconds / self.config.speedup)
        if self.prefetcher is not None:
            self.prefetcher.write_nodes(op.nodes)

    def _take_stall(self) -> float:
        """Seconds of synchronous write_back copies done inside evictions since the last step."""
        if self.hicache is not None:
            for op in self.hicache.take_sync_backups():
                self._stall += op.seconds
                self._backed_up(op)
        stall, self._stall = self._stall, 0.0
        return stall

    async def _sleep(self, simulated: float) -> None:
        """Let a step take ``simulated / speedup`` seconds of wall time, without drift.

        The wall time the loop spent since the previous step (its own CPU work) counts towards the step,
        and what a sleep overshoots is paid back by the next ones, so many sub-millisecond steps (high
        ``--speedup``) keep the right average pace instead of each rounding up to the timer resolution.
        """
        loop = asyncio.get_running_loop()
        self.sim_time += simulated
        now = loop.time()
        self.stats.busy_s += simulated / self.config.speedup
        if self._paced_until is None:
            self._paced_until, self._debt = now, 0.0
        self._debt += simulated / self.config.speedup - (now - self._paced_until)
        # sleep(0) still yields, so HTTP handlers run between steps even with the instant profile.
        await asyncio.sleep(self._debt if self._debt > 0 else 0)
        after = loop.time()
        self._debt = max(self._debt - (after - now), -MAX_PACING_CREDIT)
        self._paced_until = after

    def _publish(self) -> None:
        events = self.cache.take_events()
        if events and self.publisher is not None:
            self.publisher.publish(events)

    def _finish_prefill(self, batch: list[Request], launch: float, duration: float) -> None:
        self.prefilling = []
        self.stats.prefill_batches += 1
        # SGLang's effective prefill tokens: health checks and re-prefilled retractions are not cache statistics,
        # nor a decode worker's prompts whose KV came from the prefill worker (it computed nothing).
        counted = [r for r in batch if not r.health_check and not r.retracted and not r.prebuilt]
        self.stats.prefill_compute_tokens += sum(r.chunk_len for r in counted)
        self.stats.prefill_cache_tokens += sum(r.chunk_prefix for r in counted)
        self.counters.on_prefill(
            launch,
            duration,
            new_tokens=sum(r.chunk_len for r in batch if not r.prebuilt),
            effective_new=sum(r.chunk_len for r in counted),
            effective_hit=sum(r.chunk_prefix for r in counted),
            health_only=all(r.health_check for r in batch),
        )
        now = time.monotonic()
        for req in batch:
            if req is self.chunked:  # chunk done, more to come: cache what exists so far
                self._cache_unfinished(req)
                continue
            if req.max_new_tokens > 0:
                self._emit(req, now)
            if len(req.output_ids) >= req.max_new_tokens:
                self._cache_finished(req, now)
            else:
                self._cache_unfinished(req)
                self.running.append(req)

    # -- decode ------------------------------------------------------------------------------------
    def _decode_step(self) -> None:
        if not self.ensure_free(self._decode_need()):
            self._retract()
            if not self.running:
                return
        self.stats.decode_steps += 1
        self.new_token_ratio = max(self.new_token_ratio - NEW_TOKEN_RATIO_DECAY, MIN_NEW_TOKEN_RATIO)
        now = time.monotonic()
        still: list[Request] = []
        for req in self.running:
            req.kv_len += 1
            self._emit(req, now)
            if len(req.output_ids) >= req.max_new_tokens:
                self._cache_finished(req, now)
            else:
                still.append(req)
        self.running = still

    def _retract(self) -> None:
        """Out of KV for the next decode step: requeue the requests that lose least (SGLang order)."""
        self.running.sort(key=lambda r: (len(r.output_ids), -len(r.input_ids)), reverse=True)
        while self.running and not self.ensure_free(self._decode_need()):
            req = self.running.pop()
            if req.last_node is not None:
                self.cache.unlock(req.last_node)
            req.last_node, req.kv_len, req.tree_len = None, 0, 0
            req.retracted = True
            req.num_retractions += 1
            self.waiting.insert(0, req)
            self.stats.num_retractions += 1
            self.counters.on_retract(1)
        total_max_new = sum(r.max_new_tokens for r in self.running)
        decoded = sum(len(r.output_ids) for r in self.running)
        self.new_token_ratio = min(1.0, (decoded + RETRACT_DECODE_STEPS * len(self.running)) / (total_max_new + 1))

    # -- radix cache hand-off ----------------------------------------------------------------------
    def _cache_unfinished(self, req: Request) -> None:
        """Insert what the request has computed so far and move its lock to the new path."""
        if not self.radix_cache:  # its KV stays private until it finishes
            return
        tokens = req.fill_ids[: req.kv_len]
        aligned = self.cache.page_align(len(tokens))
        self.cache.insert(tokens[:aligned], req.cache_salt, req.inserted_len)
        req.inserted_len = max(req.inserted_len, aligned)
        _, node = self.cache.match_prefix(tokens[:aligned], req.cache_salt)
        self.cache.lock(node)
        if req.last_node is not None:
            self.cache.unlock(req.last_node)
        req.last_node, req.tree_len = node, aligned

    def _cache_finished(self, req: Request, now: float) -> None:
        tokens = req.fill_ids[: req.kv_len]
        if self.radix_cache:
            self.cache.insert(tokens[: self.cache.page_align(len(tokens))], req.cache_salt, req.inserted_len)
        if req.last_node is not None:
            self.cache.unlock(req.last_node)
        req.last_node, req.kv_len, req.tree_len = None, 0, 0
        req.finished_at = now
        req.sim_finished = self.sim_time
        if not req.health_check:
            record_finished(self.stats, req, now)
        if req.on_computed is not None and req.abort_message is None:
            req.on_computed(req)  # a prefill worker's request: its response ends after the KV transfer
        else:
            req.updates.put_nowait(None)
        self._wakeup.set()

    def _emit(self, req: Request, now: float) -> None:
        """Sample the next token (seeded, so the same prompt always gets the same output)."""
        assert req.rng is not None
        token = self.vocab[req.rng.randrange(len(self.vocab))]
        if req.first_token is not None and not req.output_ids:
            token = req.first_token  # sampled by the prefill worker (the draw above keeps the sequence aligned)
        req.output_ids.append(token)
        self.last_output_at = now
        if req.health_check:
            req.first_token_at = req.first_token_at or now
            req.last_token_at = now
            req.updates.put_nowait([token])
            return
        if req.first_token_at is None:
            req.first_token_at = now
            req.sim_first_token = self.sim_time
            self.stats.ttft.observe(now - req.arrival)
        elif req.last_token_at is not None:
            self.stats.itl.observe(now - req.last_token_at)
        req.last_token_at = now
        self.stats.generation_tokens += 1
        req.updates.put_nowait([token])

    # -- load reports ------------------------------------------------------------------------------
    def storage_histograms(self) -> tuple[Histogram, Histogram]:
        """Pages and GB/s of each storage read operation so far (SGLang's prefetch_pgs, prefetch_bandwidth)."""
        if self.prefetcher is not None:
            ops, self.prefetcher.stats.prefetch_ops = self.prefetcher.stats.prefetch_ops, []
            for pages, gbps in ops:
                self.stats.prefetch_pages.observe(pages)
                self.stats.prefetch_gbps.observe(gbps * self.config.speedup)  # per wall second, as measured
        return self.stats.prefetch_pages, self.stats.prefetch_gbps

    def num_running_reqs(self) -> int:
        """Requests in the running batch: decoding, or in the prefill batch in flight (not the chunked one)."""
        return len(self.running) + sum(1 for r in self.prefilling if r is not self.chunked)

    def num_waiting_uncached_tokens(self) -> int:
        """SGLang's estimate of the prefill work queued, in tokens (``get_num_waiting_uncached_tokens``).

        With ``lpm`` (a policy that matches every waiting request's prefix, up to 128 of them) each request
        counts its unmatched tokens; otherwise its length times the recent miss rate. The chunked request
        adds what it has left to prefill.
        """
        matched = self.config.schedule_policy == "lpm" and len(self.waiting) <= LPM_FALLBACK_QUEUE
        miss_rate = 1.0 - self.counters.recent_cache_hit_rate()
        total = 0
        for req in self.waiting:
            seqlen = len(req.input_ids) + len(req.output_ids)
            if matched:  # host hits count as matched (num_matched_prefix_tokens)
                m = self.cache.match(req.fill_ids[:-1], req.cache_salt)
                total += max(0, seqlen - m.device_len - m.host_len)
            else:
                total += int(seqlen * miss_rate)
        if self.chunked is not None:
            total += max(0, len(self.chunked.fill_ids) - self.chunked.kv_len)
        return total

    def load(self) -> dict[str, Any]:
        """One DP rank's ``LoadSnapshot`` as SGLang 0.5.23 reports it: every key, in its order."""
        used = self.used_tokens
        waiting_tokens = sum(len(r.input_ids) + len(r.output_ids) for r in self.waiting)
        counters = self.counters
        profile = self.profile
        return {
            "timestamp": time.time(),
            "dp_rank": self.config.dp_rank,
            "num_running_reqs": self.num_running_reqs(),
            "num_waiting_reqs": len(self.waiting),
            "num_waiting_uncached_tokens": self.num_waiting_uncached_tokens(),
            "num_used_tokens": used,
            "num_total_tokens": used + waiting_tokens,
            "num_active_tokens": used + waiting_tokens,  # = num_total_tokens outside disaggregated decode
            "num_prealloc_ready_tokens": 0,
            "max_total_num_tokens": self.capacity,
            "max_running_requests": self.config.max_running_requests,
            "token_usage": round(used / self.capacity, 4),
            "gen_throughput": round(counters.gen_throughput, 2),
            "cache_hit_rate": round(counters.cache_hit_rate, 4),
            "utilization": 0.0,  # see sglang_workers.sim.load_report: 0.5.23 never sets its input
            "total_prefill_uncached_tokens": counters.total_prefill_uncached_tokens,
            "total_prefill_busy_us": counters.total_prefill_busy_us,
            "decode_moments": counters.moments(),
            "memory": {
                "weight_gb": profile.weight_gb,
                "kv_cache_gb": round(self.capacity * profile.kv_bytes_per_token / 2**30, 3),
                "graph_gb": profile.graph_gb,
                "token_capacity": self.capacity,
            },
            "disaggregation": self.disaggregation_report() if self.disaggregation_report else dict(NULL_DISAGGREGATION),
            "queues": {
                "waiting": len(self.waiting),
                "grammar": 0,
                "paused": 0,
                "retracted": counters.num_retracted_reqs,
                "prealloc_ready": 0,
            },
        }

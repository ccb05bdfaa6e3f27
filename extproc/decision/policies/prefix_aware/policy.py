"""``prefix-aware`` (the default): each request goes where it costs the fleet least, now and later.

For every healthy worker the policy predicts time-to-first-token as

    queued prefill + wait for KV room + prefill of the uncached tokens + the wait for the decode step under way

with prefill ``c0 + a*L + b*(L^2 + 2*P*L)`` for ``L`` uncached tokens after ``P`` cached ones, the
constants of that worker learned online from what it reports (``cost_model``; the configured constants
are only priors; ``c0`` is paid once per prefill batch where the worker counts its batches, so a
request that joins the batch forming behind the running prefill adds none of its own). Reports reach
the model through ``on_load``; ranking only reads it. The queued prefill is the worker's own report
(``num_waiting_uncached_tokens``) plus what the router sent since, drained in real time (the router's
own account stands while a reported batch runs: a prefill under way counts as running, never as
waiting). The wait for KV room comes from the router's own open requests on the worker against its
reported pool (``in_flight``): below saturation a full pool, not the prefill queue, is what makes a
request wait.

The ranking adds the price of the GPU time the decision spends: ``score = TTFT + price * prefill``
(plus, on a worker whose KV pool is full, the pool room its new tokens hold, priced by the requests
queued there: below).
Recomputing a prefix that another worker holds delays every request that later queues behind it on
the worker that recomputes; in a queue at utilisation ``rho`` that is about ``rho / (1 - rho)``
requests (the mean number waiting in an M/G/1 queue). So the price of a second of prefill on a
worker is ``clamp(rho / (1 - rho), min_work_price, max_work_price)``, with ``rho`` the worker's
measured prefill utilisation, or the time-averaged number of requests in the worker (running +
waiting, from its load reports) when that is less: a worker kept busy by one client that sends its
next request only after the last one finished is busy all the time but delays nobody, and its
prefix must not be moved away from it (measured on real SGLang: the second turn of a chat left its
holder before this). Lightly loaded workers spend cheap seconds: a hot prefix whose holder
is busy spills to an idle worker (replication, as Preble does). As the fleet nears saturation every
second becomes expensive, requests stay with the workers that hold their prefixes, and total work
stays as low as the cache allows: the "death spiral on misses" cannot start, because moving a
prefix off its holder only pays when the holder's queue is longer than the recomputation times its
price. ``min_work_price`` (1) keeps back-to-back requests of one prefix together on a busy fleet.
On a lightly loaded fleet (fewer than ``idle_fleet_busy_share`` of the candidates have anything of the
router's queued), on a worker that is idle now and whose cache has room for the new tokens (nothing
evicted), the least price is instead the fleet's own mean price when that is lower
(``idle_fleet_price``; before any worker has measured itself, what the share of candidates with a queue
implies): such a worker's second delays no queue and pushes out no prefix, so a request
whose holder is busy spills to it when that is sooner, as the perfect-information floor would. Where the
fleet's workers are mostly busy or the worker's cache is full the least price stays ``min_work_price``:
a momentarily idle worker of a loaded fleet is not free, and recomputing into a full cache evicts.
A fleet whose pools are full with requests waiting is saturated whatever its prefill utilisation says: there,
until the fleet is judged past its knee, the least price is ``max_work_price`` (``memory_bound``).
Where a new prefix is placed (no worker holds any of the prompt), evictions are priced too
(``eviction_weight``): the new tokens a full cache must push out, times the fleet's mean reuse of a cached
token, at the fleet's mean pace of a token, beyond the least any candidate would push out; priced as GPU time
and once more as the wait of the request that finds its prefix gone. Without that a new prefix lands
wherever its first prefill is shortest, and on a fleet of fast and slow GPUs every new system prompt went to
the fast workers until their caches thrashed.

Where the request would wait for KV room (the pool, not prefill time, bounds the worker: long prompts past
the knee), or wherever the fleet is not lightly loaded (``idle_fleet_busy_share`` of the candidates have a
queue, which fills a pool within one request's hold), the score adds ``memory_price * new * hold / capacity``:
the new tokens hold that share of the
pool for ``hold`` (its prefill, and its decode at the pace the worker's prefills leave its decode steps),
and every request waiting there waits for it, so ``memory_price`` is the number the worker reports waiting
(at least ``price``, at most ``max_work_price``); only the new tokens beyond the least any candidate brings
count (those are held wherever it goes). Requests sharing a prefix hold it once; a spill that copies a held prefix into
another full pool takes room from that pool's queue, and on agent sessions past the knee spills had put
every tenant's prompt on two workers where the peers' strict affinity kept one.

Near-ties (within ``tie_abs_s`` or ``tie_rel``) go to the worker that received the least traffic
recently (prompt tokens, exponentially decayed over ``balance_window_s``): a new prefix is placed where
it will least unbalance the fleet, since it attracts its followers there, instead of every tie
herding onto one argmax. Tokens, not requests: where prompts are alike in length the two agree, and
where they are not, a count of requests sent long prompts to the worker that got the fewest of them
because each was long. Exact ties fall to rendezvous hashing of the first block not every tied
worker holds, so placement is deterministic per prefix. Router replicas that share decisions place a
new prefix by that hash alone (``replica_cold_tie_rel``): recent traffic is each replica's own, and two
replicas taking one burst's first requests at once must choose alike.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import xxhash
from pydantic import Field

from extproc.config import MemoryConfig
from extproc.decision.policies.base import Candidate, Decision, Policy, PolicyOptions, RoutingRequest
from extproc.decision.policies.prefix_aware.cost_model import (
    DecodeModel,
    FleetMean,
    Learning,
    PrefillModel,
    WorkerCostModel,
)
from extproc.decision.policies.prefix_aware.in_flight import FLOOR_RESERVE_RATIO, InFlightBook
from extproc.decision.policies.prefix_aware.recency import RecencyLedger
from extproc.decision.policies.prefix_aware.tier_cost import costs_from_report, kv_bytes_per_token, tier_extra
from extproc.fleet.reports import WorkerLoad
from extproc.fleet.workers import Worker
from extproc.memory import LEDGER_BYTES, MemoryPlan

__all__ = ["PrefixAwareOptions", "PrefixAwarePolicy"]

# What the workers' orders of use may hold before ``use_memory`` says (the default budget's ``policy`` share).
_DEFAULT_LEDGER_BYTES = MemoryPlan.from_budget(MemoryConfig().budget_bytes).policy_bytes

# SGLang (0.5.23) estimates a request's output as at most this many tokens when it reserves KV room for it
# (SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION).
_OUTPUT_CLIP = 4096
# The fewest keys a sampled order-of-use ledger keeps: about half of them fall within the cached share, and
# the count of blocks used after a key is then estimated to ~10 % (one over the root of the count).
_MIN_SAMPLED_KEYS = 256
# Each eviction a worker reports moves its learned eviction horizon this share of the way to what it measured.
_HORIZON_BLEND = 0.1
# Time constant of the share of candidates with a queue averaged over decisions (``busy_average``): about a
# second, so that a fleet past its knee (every candidate queued within a second of its start) is told from one
# whose workers are all busy only for a moment.
_BUSY_AVERAGE_S = 1.0
# KV usage from which a worker with requests waiting counts as memory-bound (SGLang admits a request only when
# its new tokens and clipped output fit beside the running ones' reservations: near full, the queue waits for room).
_MEMORY_BOUND_USAGE = 0.9


def _output_of(request: RoutingRequest) -> int:
    """The output a request may write, as SGLang estimates it when it reserves KV room (0: none named)."""
    limit = request.max_new_tokens
    return min(limit, _OUTPUT_CLIP) if limit is not None else 0


def _waits_for_room(load: WorkerLoad | None) -> bool:
    """The worker's last report found requests waiting with its KV pool full: a queue for memory, not prefill."""
    return load is not None and load.num_waiting_reqs > 0 and load.token_usage >= _MEMORY_BOUND_USAGE


def _rendezvous(key: int, candidates: list[Candidate]) -> Candidate:
    """The candidate whose id hashes highest with ``key`` (a block key): the same on every router that asks."""
    data = key.to_bytes(8, "little")
    return max(candidates, key=lambda c: xxhash.xxh3_64_intdigest(data + c.worker.id.encode()))


class PrefixAwareOptions(PolicyOptions):
    """Constants of the ``prefix-aware`` policy.

    The time constants are priors: each worker's own are learned from its reports within seconds
    of traffic, and a worker that reports nothing keeps these. They describe an 8B-class model on
    one current datacenter GPU to an order of magnitude, not any measured setup.
    """

    prefill_floor_s: float = Field(
        0.02,
        ge=0,
        description=(
            "Prior c0: fixed cost of one prefill batch (one request's, on a worker whose /metrics does not count "
            "its prefill batches)."
        ),
    )
    prefill_per_token_s: float = Field(4e-5, gt=0, description="Prior a: seconds per uncached prompt token.")
    attention_per_token2_s: float = Field(1e-9, ge=0, description="Prior b: attention seconds per token^2 of context.")
    decode_step_s: float = Field(0.01, ge=0, description="Prior d0: one decode step of a small batch.")
    decode_per_request_s: float = Field(1e-4, ge=0, description="Prior d1: added per request in the decode batch.")
    prior_weight: float = Field(
        1.0, gt=0, description="Confidence in the priors (an inverse variance of their scale): higher learns slower."
    )
    memory_s: float = Field(
        10.0, gt=0, description="Time constant of the learned constants' memory (how fast a changed worker is tracked)."
    )
    utilization_window_s: float = Field(
        5.0, gt=0, description="Time constant of the measured prefill utilisation that prices GPU time."
    )
    min_attributed_share: float = Field(
        0.5,
        ge=0,
        le=1,
        description="A worker's load window is fitted only if at least this share of its prefilled tokens are "
        "requests this router sent (with several replicas, the rest are the others' and can only be guessed).",
    )
    work_price: Literal["lesser", "concurrency", "utilization"] = Field(
        "lesser",
        description="What prices a second of prefill: rho / (1 - rho) of the worker's measured prefill "
        "utilisation ('utilization'), its time-averaged requests in flight, running + waiting ('concurrency'), "
        "or the lesser of the two ('lesser': a worker kept busy by one client at a time is not congested).",
    )
    min_work_price: float = Field(
        1.0, ge=0, description="Least price of a second of prefill, in seconds of TTFT (0: rank by TTFT alone)."
    )
    max_work_price: float = Field(30.0, ge=0, description="Highest price of a second of prefill (a saturated worker).")
    idle_fleet_price: bool = Field(
        True,
        description="On a lightly loaded fleet, on a worker with nothing queued and cache room for the new tokens, "
        "the least price is the fleet's mean price of a second of prefill when that is below min_work_price "
        "(False: min_work_price everywhere).",
    )
    idle_fleet_busy_share: float = Field(
        0.5,
        ge=0,
        le=1,
        description="The fleet counts as lightly loaded while fewer than this share of the candidates have anything "
        "of the router's queued: idle workers' least price may fall (idle_fleet_price); past it a spill pays for "
        "the KV room its copy of a held prefix takes even before a pool is full. Where this share report requests "
        "waiting with full KV pools, the fleet is memory-bound and a second of prefill costs max_work_price until "
        "it is past its knee.",
    )
    eviction_lag_busy_share: float = Field(
        0.8,
        ge=0,
        le=1,
        description="The fleet is past its knee where at least this share of the candidates have anything of the "
        "router's queued now and idle_fleet_busy_share have had on average over the last second. Below it a matched "
        "prefix the worker will have evicted by the request's admission (its order of use past its eviction "
        "horizon) counts as uncached (0: never), and a request that joins a forming batch pays for the wait it adds "
        "to each request in it. Past it every holder has a queue: spilling on the prediction moves the "
        "recomputation to a worker where it evicts in turn, and the price counts the batch already.",
    )
    eviction_weight: float = Field(
        1.0,
        ge=0,
        description="Weight of the future recomputation a full cache's avoidable evictions cause (beyond the "
        "least any candidate causes) where a new prefix is placed, priced at the fleet's mean reuse of cached "
        "tokens and mean pace of a token, as GPU time and as the wait of the request that recomputes them (0: "
        "ignore evictions; a new prefix then lands wherever its first prefill is shortest, which on "
        "a mixed fleet fills the fast workers' caches and evicts).",
    )
    cache_full_fraction: float = Field(
        0.8,
        gt=0,
        le=1,
        description="Share of a worker's KV pool its cached prefixes fill before new ones evict them (prices the "
        "evictions a new prefix causes, and sizes the order-of-use ledgers; where a prefix will have been evicted "
        "by admission the worker's own evictions say).",
    )
    tie_abs_s: float = Field(0.003, ge=0, description="Scores within this many seconds of the best count as a tie.")
    tie_rel: float = Field(0.05, ge=0, description="... or within this fraction of the best.")
    cold_tie_rel: float = Field(
        0.15,
        ge=0,
        description="A request no candidate holds any block of: candidates within this fraction of the best score "
        "and with no more queue than the best's (plus tie_abs_s) are a near-tie too (0: the tie_rel band only).",
    )
    balance_window_s: float = Field(
        10.0, gt=0, description="Near-ties go to the worker sent the fewest prompt tokens over about this window."
    )
    replica_cold_tie_rel: float = Field(
        1.0,
        ge=0,
        description="With router replicas sharing decisions (shared_state): a request no candidate holds any block "
        "of goes by rendezvous hash of its first block among the candidates within this fraction of the best score "
        "that wait no longer than the best (plus tie_abs_s), so replicas placing one new prefix at once choose "
        "alike (0: each replica places it as a lone router would).",
    )


class PrefixAwarePolicy(Policy[PrefixAwareOptions]):
    name = "prefix-aware"
    needs_tokens = True

    def setup(self) -> None:
        o = self.opts
        self._prior = PrefillModel(o.prefill_floor_s, o.prefill_per_token_s, o.attention_per_token2_s)
        self._decode_prior = DecodeModel(o.decode_step_s, o.decode_per_request_s)
        self._learning = Learning(
            memory_s=o.memory_s,
            prior_weight=o.prior_weight,
            min_attributed_share=o.min_attributed_share,
            utilization_window_s=o.utilization_window_s,
        )
        self.costs: dict[str, WorkerCostModel] = {}  # worker id -> its learned cost model
        self.fleet = FleetMean()  # the measured workers' mean constants (judge the unmeasured ones)
        self._unseen = self._new_model()  # how a worker nothing is known of yet is judged (never fed)
        self._traffic: dict[str, tuple[float, float]] = {}  # worker id -> (decayed k prompt tokens sent, as of)
        self._recency: dict[str, RecencyLedger] = {}  # worker id -> its blocks in the order our sends used them
        # worker id -> blocks its ledger counts used after a block when the worker evicts it (learned, averaged)
        self._horizon: dict[str, float] = {}
        self._ledger_bytes = _DEFAULT_LEDGER_BYTES  # what the ledgers may hold together (``use_memory``)
        self._capacity: dict[str, int] = {}  # worker id -> its KV pool in tokens, as last reported
        self.book = InFlightBook()  # what the router sent each worker and has not seen finish
        # Each measured worker's mean requests delayed per second of prefill (its price before the bounds),
        # and their sum: the fleet's mean price, kept as a running sum so a report costs O(1).
        self._queued: dict[str, float] = {}
        self._queued_sum = 0.0
        self._reuse_sum = 0.0  # the sum of the cost models' reuse (the fleet's mean prices an eviction)
        self._turn = 0
        # The share of candidates with a queue, averaged over decisions (``_BUSY_AVERAGE_S``), and as of when.
        self.busy_average = 0.0
        self._busy_at: float | None = None
        self._replicated = False  # set by share_decisions: new prefixes are placed alike on every replica

    def share_decisions(self) -> None:
        self._replicated = True

    def _new_model(self) -> WorkerCostModel:
        return WorkerCostModel(self._prior, self._decode_prior, self._learning, self.fleet)

    def cost_model(self, worker: Worker) -> WorkerCostModel:
        """The worker's learned cost model, created from the priors on first report or send."""
        model = self.costs.get(worker.id)
        if model is None:
            model = self.costs[worker.id] = self._new_model()
            self._reuse_sum += model.reuse
        return model

    def on_load(self, worker: Worker, load: WorkerLoad) -> None:
        """Learn from a report (a refit also moves the fleet's mean, which judges unmeasured workers).

        Why the fleet's mean and not the priors: against the priors a fresh worker would look faster or
        slower than measured ones for no reason but ignorance (on real SGLang CPU workers the holder of a
        chat's history, the only worker measured so far, looked slower than the prior said the idle one
        was, and the second turn left it). Workers behind one router usually run one model on one kind of
        GPU; a fleet that mixes them is told apart after each worker's first measured window.
        """
        model = self.cost_model(worker)
        model.observe(load)
        if load.max_total_num_tokens:
            self._capacity[worker.id] = load.max_total_num_tokens
        if model.windows:
            queued = self._queued_of(model)
            self._queued_sum += queued - self._queued.get(worker.id, 0.0)
            self._queued[worker.id] = queued

    def _queued_of(self, cost: WorkerCostModel) -> float:
        """How many requests a second of prefill on this worker delays (``work_price``), before the bounds."""
        rho = min(cost.utilization, 0.999)
        if self.opts.work_price == "concurrency":
            return cost.concurrency
        if self.opts.work_price == "lesser":
            return min(rho / (1.0 - rho), cost.concurrency)
        return rho / (1.0 - rho)

    def fleet_reuse(self) -> float:
        """The mean over the workers' cost models of the share of prompt tokens sent there cached (a prior of 0.5)."""
        return self._reuse_sum / len(self.costs) if self.costs else 0.5

    def fleet_price(self, busy_share: float = 0.0) -> float:
        """The measured workers' mean of ``_queued_of``; before any has measured itself, ``rho / (1 - rho)`` with
        ``rho`` the share of candidates that have something of the router's queued (``busy_share``; infinite
        where none has).

        It bounds the price only where a second delays nothing anyway: an idle worker with cache room in a
        fleet whose workers mostly have nothing queued. Before the first measured window the router's own
        account of who is busy is the only utilisation there is; the least price instead (what this
        returned before) had a fleet's first half second price a spill to an idle worker at twice its
        prefill on the priors, and a hot prefix's bursts queued behind the worker still computing it
        (virtual fleet, 64 workers, hot-burst: TTFT p99 90 against the floor's 68 ms; docs/benchmarks-log.md,
        2026-12-05, "start-up, the first half second").
        """
        if self._queued:
            return self._queued_sum / len(self._queued)
        if busy_share <= 0.0:
            # Nobody has a queue, so no spill can be sooner than an idle holder: the least price stands and
            # keeps a short prompt's hit apart from a near-tie with the idle workers that hold nothing.
            return math.inf
        rho = min(busy_share, 0.999)
        return rho / (1.0 - rho)

    def remove_worker(self, worker_id: str) -> None:
        model = self.costs.pop(worker_id, None)
        if model is not None:
            self.fleet.remove(model)
            self._reuse_sum -= model.reuse
        self._traffic.pop(worker_id, None)
        self._recency.pop(worker_id, None)
        self._horizon.pop(worker_id, None)
        self._capacity.pop(worker_id, None)
        self._queued_sum -= self._queued.pop(worker_id, 0.0)
        self.book.forget(worker_id)

    def predict(
        self,
        request: RoutingRequest,
        c: Candidate,
        now: float,
        light: bool = False,
        new_prefix: bool = True,
        busy_share: float = 0.0,
        past_knee: bool = False,
        memory_bound: bool = False,
    ) -> dict[str, float]:
        """The figures behind one candidate's predicted TTFT and score (also reported on the decision span).

        ``light``: the fleet counts as lightly loaded; ``busy_share``: the share of its candidates with
        something queued (``busy_share``); ``new_prefix``: no candidate holds any of the prompt (only then
        are evictions priced); ``past_knee``: the fleet is past its knee (``past_knee``); ``memory_bound``: not
        past it, but its pools are full with requests waiting (``memory_bound``). Reads the learned state and
        changes nothing.
        """
        opts = self.opts
        cost = self.costs.get(c.worker.id) or self._unseen
        model = cost.prefill
        total = request.prompt_tokens
        limit = max(total - 1, 0)  # SGLang always computes at least the last prompt token
        gpu = min(c.matched_blocks * c.block_size, limit)
        host = max(min(c.host_matched_blocks * c.block_size, limit) - gpu, 0)
        shared = max(min(c.shared_matched_blocks * c.block_size, limit) - gpu - host, 0)
        # Host hits load back overlapping the prefill; shared-storage hits are read first (tier_cost.py).
        # The transfer costs are the worker's own reports, documented priors until it has made one.
        compute = model.seconds(total - gpu - host - shared, gpu + host + shared)
        tier_costs = costs_from_report(c.tier_report, kv_bytes_per_token(c.load))
        tiers = tier_extra(host, shared, tier_costs, compute, c.block_size)
        new = total - gpu - tiers.host_tokens - tiers.shared_tokens
        # Unless the fleet is past its knee, what the worker will have evicted of the matched prefix by this
        # request's admission is computed again, not reused. (Past it every holder has a queue, and spilling on
        # that prediction moves the recomputation elsewhere, where it evicts in turn: virtual fleet, multi-turn
        # past the knee, docs/benchmarks-log.md, 2026-12-06 (afternoon).)
        lost = 0
        if gpu > 0 and not past_knee and opts.eviction_lag_busy_share > 0:
            lost = self._lost_before_admission(request, c, gpu)
        new += lost
        prefill = model.seconds(new, total - new) + tiers.load_back_s
        queue = cost.queued_seconds(now)
        if prefill > 0 and cost.joins_forming_batch(now):
            prefill = max(0.0, prefill - model.c0)  # it joins the batch waiting there: that batch pays the floor
        load = c.load
        running = load.num_running_reqs if load else c.in_flight
        # A request that arrives during a decode step waits for its end: half a step on average.
        step_wait = cost.decode.step_seconds(running) / 2
        rho = min(cost.utilization, 0.999)
        # Storing the new tokens in a full cache evicts as many cached ones (least recently used). A
        # cached token is reused about reuse / (1 - reuse) times (hits per miss), so an evicted one costs
        # that many recomputations later. The reuse is the fleet's mean, not this worker's: a worker that
        # drew cold prompts would otherwise look cheap to evict on and draw more of them. So is the pace of a
        # token: the evicted prefix is recomputed wherever its next request goes, and priced at a fast GPU's
        # own pace, new prefixes evicted on the fast workers of a mixed fleet while slow ones had room (virtual
        # fleet, 4 x H100 + 4 x A100 at 7.31x, gsp past the knee: 39 prefixes recomputed on seed 0, 22 with this).
        capacity = load.max_total_num_tokens if load and load.max_total_num_tokens else None
        evicted = 0.0
        if capacity:
            # Past ``cache_full_fraction`` of the pool the rest is running requests' working room
            # (SGLang reserves for their decodes): new tokens there push cached ones out.
            room = opts.cache_full_fraction * capacity - c.cached_blocks * c.block_size
            evicted = min(float(new), max(0.0, new - room))
        # An idle worker with cache room in a lightly loaded fleet: its seconds delay no queue and push out
        # no prefix, so they cost what the fleet's average delays (below saturation, less than the least price).
        least = opts.min_work_price
        if light and queue <= 0 and evicted <= 0:
            least = min(least, self.fleet_price(busy_share))
        if memory_bound:
            # The queue waits for KV room with its prefill done, so the prefill utilisation that prices a second
            # understates the load: the fleet is saturated, and every second of recomputation holds pool room the
            # queue needs (``memory_bound``).
            least = opts.max_work_price
        price = min(max(self._queued_of(cost), least), opts.max_work_price)
        if not past_knee and c.matched_blocks == 0 and cost.joins_forming_batch(now):
            # The requests in the batch it joins get their first tokens when the whole batch is done: each waits
            # for this one's prefill too, beside the requests to come that the price counts. Charged only at the
            # price, a cold prompt joined a hit's batch on a busy worker and took the hit from 72 to 122 ms while
            # an idle worker was 4 ms further off (virtual fleet, gsp, 4 workers, 0.5 x knee). Past the knee the
            # price (the mean number waiting) counts the batch's requests already; charged again there, it sent
            # session turns off their holders (16 workers, multi-turn: TTFT p99 +112 ms over ten seeds;
            # docs/benchmarks-log.md, 2026-12-06 (late night)). Only a prompt this worker holds none of is
            # charged: a hit on its holder adds little to the batch, and charging it pushed sessions off their
            # holders while the pools filled (agent sessions past the knee, 4 workers: mean TTFT +89 ms over 30
            # seeds charged everywhere, +28 charged cold only; docs/benchmarks-log.md, 2026-12-06 (memory-bound
            # knee)).
            price = min(price + cost.forming_requests, opts.max_work_price)
        reuse = min(self.fleet_reuse(), 0.95)
        pace = self.fleet.model.a if self.fleet.model is not None else model.a  # the measured workers' mean
        eviction = opts.eviction_weight * reuse / (1.0 - reuse) * pace * evicted if new_prefix else 0.0
        output = _output_of(request)
        # The share of running requests' remaining outputs the worker reserves (its last report; the floor without one).
        ratio = load.new_token_ratio if load and load.new_token_ratio is not None else FLOOR_RESERVE_RATIO
        token_s = cost.token_seconds(running)
        memory_wait = self.book.memory_wait_s(c.worker.id, new, total - new, capacity, output, now, ratio, token_s)
        ttft = queue + memory_wait + prefill + step_wait + tiers.prefetch_s
        # On a worker whose pool is full (this request would wait for room) the queue is admitted only as
        # running requests free room: the new tokens this one brings hold pool room through its prefill and
        # decode, a share new / capacity of the pool for that long, and every request queued there waits for
        # it. Requests that share a prefix hold it once, so this is what a spill that copies a held prefix
        # costs a memory-bound fleet (docs/routing.md, "The price of KV room"). Past the knee (at least
        # idle_fleet_busy_share of the candidates have a queue) it is charged before the pool is full too: the
        # queue fills the pool within the hold, and a copy made now holds room the queued requests will need
        # (virtual fleet, agent sessions and multi-turn past the knee: docs/benchmarks-log.md, 2026-12-06 (night)).
        memory_work = 0.0
        if capacity and (memory_wait > 0 or busy_share >= opts.idle_fleet_busy_share):
            hold = prefill + output * token_s
            memory_work = new * hold / capacity
        waiting = float(load.num_waiting_reqs) if load else 0.0
        # Past the knee a copy's room is held while the queue only grows: every request admitted during the hold
        # waits for it, not only those waiting now, so it costs what a saturated worker's second does.
        memory_price = opts.max_work_price if past_knee else min(max(waiting, price), opts.max_work_price)
        return {
            "matched_blocks": c.matched_blocks,
            "cached_tokens": total - new,
            "host_tokens": tiers.host_tokens,
            "shared_tokens": tiers.shared_tokens,
            "tier_s": tiers.seconds,
            "new_tokens": new,
            "lost_tokens": lost,
            "queue_s": queue,
            "memory_wait_s": memory_wait,
            "prefill_s": prefill,
            "in_flight": c.in_flight,
            "utilization": rho,
            "work_price": price,
            "ttft_s": ttft,
            "eviction_s": eviction,
            "memory_work_s": memory_work,
            "memory_price": memory_price,
            "score": ttft + price * (prefill + eviction) + eviction + memory_price * memory_work,
        }

    def select(self, request: RoutingRequest, candidates: list[Candidate]) -> Decision:
        now = self.clock()
        share = self.busy_share(candidates, now)
        self._average_busy_share(share, now)
        light = self.opts.idle_fleet_price and share < self.opts.idle_fleet_busy_share
        past_knee = self.past_knee(share)
        memory_bound = not past_knee and self.memory_bound(candidates)
        # Evictions are priced only where a new prefix is placed (no candidate holds any of it): that choice
        # decides where its followers go. For a prompt some worker holds, the choice is its holder or a spill,
        # which the price of GPU time already governs; charging the spill's evictions too kept hits waiting
        # behind cold prefills on their holders (virtual fleet: 4 workers docqa, 16 workers multi-turn).
        new_prefix = not any(c.matched_blocks for c in candidates)
        figures = {
            c.worker.id: self.predict(request, c, now, light, new_prefix, share, past_knee, memory_bound)
            for c in candidates
        }
        # Only the evictions a choice could avoid are its cost: where every candidate's cache is full, one
        # prompt evicts about as much anywhere, and pricing that moves nothing but the ties.
        unavoidable = min(f["eviction_s"] for f in figures.values())
        if unavoidable > 0:
            for f in figures.values():
                f["eviction_s"] -= unavoidable
                f["score"] -= (f["work_price"] + 1.0) * unavoidable
        # Likewise the room new tokens hold: what the candidate that needs the fewest would hold is held wherever
        # the request goes; only the copy of a prefix another candidate already holds is the choice's cost.
        least_new = min(f["new_tokens"] for f in figures.values())
        for f in figures.values():
            if f["memory_work_s"] > 0:
                held_anyway = f["memory_work_s"] * least_new / f["new_tokens"]
                f["memory_work_s"] -= held_anyway
                f["score"] -= f["memory_price"] * held_anyway
        score = {wid: f["score"] for wid, f in figures.items()}
        best = min(score.values())
        band = best + max(self.opts.tie_abs_s, self.opts.tie_rel * best)
        top = max(c.matched_blocks for c in candidates)
        tied = [c for c in candidates if score[c.worker.id] <= band]
        held = any(c.matched_blocks or c.host_matched_blocks or c.shared_matched_blocks for c in candidates)
        if not held and self._replicated and self.opts.replica_cold_tie_rel > 0 and request.block_keys:
            winner = self._place_alike(request, candidates, figures)
        else:
            if not held and self.opts.cold_tie_rel > self.opts.tie_rel:
                tied = self._cold_ties(candidates, figures, tied, self.opts.cold_tie_rel)
            winner = self._break_tie(request, tied) if len(tied) > 1 else tied[0]
        rest = sorted((c for c in candidates if c is not winner), key=lambda c: score[c.worker.id])
        ranked = [winner, *rest]
        if winner.matched_blocks and winner.matched_blocks == top:
            reason = "prefix-hit"
        elif top:
            reason = "prefix-spill"  # a holder exists but recomputing here costs the fleet less
        else:
            reason = "cold"
        if winner.index_state != "synced" and winner.matched_blocks:
            reason += "-own-record"
        return Decision(ranked=[c.worker for c in ranked], reason=reason, scores=figures)

    def explain(self, request: RoutingRequest, candidates: list[Candidate]) -> Decision:
        """``select`` with the rotation among untokenized ties put back (the only state ``select`` moves)."""
        turn = self._turn
        try:
            return self.select(request, candidates)
        finally:
            self._turn = turn

    def learned(self, worker_id: str) -> dict[str, float]:
        """The worker's cost model as ranking reads it now: prefill and decode constants, utilisation, the share
        of time its prefills leave to decode, queue; and its order-of-use ledger (keys kept, and every how
        many blocks one is kept: 0 without a ledger, when evictions before admission are not predicted)."""
        cost = self.costs.get(worker_id)
        if cost is None:
            return {}
        prefill, decode = cost.prefill, cost.decode
        ledger = self._recency.get(worker_id)
        return {
            "windows": cost.windows,
            "prefill_floor_s": prefill.c0,
            "prefill_per_token_s": prefill.a,
            "attention_per_token2_s": prefill.b,
            "decode_step_s": decode.d0,
            "decode_per_request_s": decode.d1,
            "utilization": cost.utilization,
            "decode_share": cost.decode_share,
            "concurrency": cost.concurrency,
            "reuse": cost.reuse,
            "queued_s": cost.queued_seconds(self.clock()),
            "work_price": min(max(self._queued_of(cost), self.opts.min_work_price), self.opts.max_work_price),
            "ledger_keys": len(ledger) if ledger is not None else 0,
            "ledger_sample_every": ledger.sample_every if ledger is not None else 0,
            "eviction_horizon_blocks": self._horizon.get(worker_id, 0.0),
        }

    def _cold_ties(
        self, candidates: list[Candidate], figures: dict[str, dict[str, float]], tied: list[Candidate], rel: float
    ) -> list[Candidate]:
        """A request nobody holds any of: ``tied`` and those within ``rel`` of the best score that wait no longer.

        Such a request places a new prefix, and its followers go where it goes. What sets its candidates
        apart is then their learned prefill speed, and like workers' learned constants differ by their
        measurement noise (~10% between two identical simulated prefill workers under cache pressure,
        2026-12-02): outside the ``tie_rel`` band the same worker took 40 of 66 cold requests, held more
        prefixes than its cache and thrashed (docs/benchmarks.md, issue 19). The queue is measured, not
        learned, so a candidate that would wait longer than the best stays out of the wider band.
        """
        o = self.opts
        best = min(candidates, key=lambda c: figures[c.worker.id]["score"])
        top = figures[best.worker.id]

        def wait(f: dict[str, float]) -> float:
            return f["queue_s"] + f["memory_wait_s"]

        limit, band = wait(top) + o.tie_abs_s, top["score"] * (1.0 + rel)
        inside = {c.worker.id for c in tied}
        wider = [
            c
            for c in candidates
            if c.worker.id not in inside
            and figures[c.worker.id]["score"] <= band
            and wait(figures[c.worker.id]) <= limit
        ]
        return tied + wider

    def _place_alike(
        self, request: RoutingRequest, candidates: list[Candidate], figures: dict[str, dict[str, float]]
    ) -> Candidate:
        """A new prefix, placed as every replica sharing decisions places it: by rendezvous hash of its first
        block among the candidates within ``replica_cold_tie_rel`` of the best score that wait no longer.

        Replicas share decisions, but a decision reaches the others a few milliseconds late, and requests of a
        burst on one new prefix arrive closer together than that, spread over the replicas. Each replica learns
        a worker's speed from its own share of the traffic: in the compose stack (two replicas, two like
        simulated workers) their predicted prefill of one 1,076-token prompt on one worker differed by up to
        70%, each preferred the worker it had measured faster, and a burst's first two requests, taken by
        different replicas 5 ms apart, computed the prefix on both workers (first-holder share 0.42 to 0.75 on
        6 of 28 runs). The hash of the prompt's first block is the same on every replica, and so, while no
        replica's sends have queued anything, is the set of candidates it chooses among; a worker with a
        queue, or one scoring more than ``replica_cold_tie_rel`` worse (a much slower GPU, a full cache), stays
        out, as the ``cold_tie_rel`` band keeps it out for a lone router. Recent traffic, the lone router's
        tie-break, is each replica's own, so it is not used: hashing spreads new prefixes over the workers
        evenly by itself.
        """
        alike = self._cold_ties(candidates, figures, [], self.opts.replica_cold_tie_rel)  # the best among them
        return _rendezvous(request.block_keys[0], alike)

    def busy_share(self, candidates: list[Candidate], now: float) -> float:
        """The share of the candidates with a queue (0 without candidates): prefill of the router's own queued
        there, or, on a worker whose KV pool is full, requests its last report found waiting.

        Below ``idle_fleet_busy_share`` the fleet counts as lightly loaded, and idle workers' least price may
        fall (``idle_fleet_price``). The router's own account of each worker's queue, not its utilisation: on
        a fleet past the knee the measured utilisation and the fleet's mean price can be as low as below it
        (hits are cheap), but most workers have something waiting, and a request spilled onto the one that
        is momentarily idle costs the holder's followers their cache (16 workers, multi-turn, 1.3 x knee:
        mean 147 vs 121 ms). On a memory-bound worker the queue waits for KV room with its prefill done, and
        the router's prefill account is empty: there the report's waiting requests count. Agent sessions deep
        past the knee (virtual fleet, 4 workers, 1.72 x knee, seed 0) were judged neither light nor past the knee
        in 216 of 600 decisions, and copied their prefixes. Counted on
        any worker, reported waiting moved multi-turn turns off their holders past the knee (+62 ms mean at 4
        workers, ten seeds), where queues wait for prefill and a report is up to a poll stale.
        """
        if not candidates:
            return 0.0
        unseen = self._unseen
        busy = sum(
            1
            for c in candidates
            if (self.costs.get(c.worker.id) or unseen).queued_seconds(now) > 0 or _waits_for_room(c.load)
        )
        return busy / len(candidates)

    def memory_bound(self, candidates: list[Candidate]) -> bool:
        """Whether at least ``idle_fleet_busy_share`` of the candidates report requests waiting with their KV pools
        full: the fleet waits for memory, not prefill. ``select`` prices every second of prefill there at
        ``max_work_price`` until the fleet is past its knee (``past_knee``).

        On such a fleet the measured prefill utilisation, which prices a second, stays low (hits are cheap) while
        the queue grows, and the router's own prefill account, which judges the knee, is empty where the queue
        waits for room: agent sessions past the knee copied their tenants' prompts there (virtual fleet, 4
        workers, 1.3 x knee, 30 seeds: TTFT mean -49 ms, 95 % interval -89 to -9, p50 -45, -86 to -4, with it;
        docs/benchmarks-log.md, 2026-12-07 (morning)). Past the knee a copy's room is priced at
        ``max_work_price`` already; pricing every second there too kept multi-turn turns on holders with long
        queues (16 workers: TTFT p99 +268 ms over ten seeds).
        """
        if not candidates:
            return False
        waiting = sum(1 for c in candidates if _waits_for_room(c.load))
        return waiting / len(candidates) >= self.opts.idle_fleet_busy_share

    def _average_busy_share(self, share: float, now: float) -> None:
        """Fold one decision's busy share into ``busy_average`` (exponentially, over ``_BUSY_AVERAGE_S``)."""
        if self._busy_at is None:
            self.busy_average = share
        else:
            weight = 1.0 - math.exp(-max(0.0, now - self._busy_at) / _BUSY_AVERAGE_S)
            self.busy_average += weight * (share - self.busy_average)
        self._busy_at = now

    def past_knee(self, busy_share: float) -> bool:
        """Whether the fleet is past its knee: at least ``eviction_lag_busy_share`` of the candidates have a queue
        now, and at least ``idle_fleet_busy_share`` have had one on average over the last second.

        There the eviction lag is not predicted (every holder has a queue, and spilling on the prediction moves
        the recomputation to a worker where it evicts in turn: virtual fleet, multi-turn past the knee at 16
        workers, TTFT p99 +826 ms over three seeds where it was predicted at any load), and a request that joins
        a forming batch pays the price alone (the price counts the batch already). Judged by the share now
        alone, a light fleet of four workers, all of them busy for a moment, went without the prediction: hits
        went to a holder whose step under way had evicted their prefix, and a cold prompt after them into the
        same batch (gsp at half the knee; docs/benchmarks-log.md, 2026-12-06 (late night)).
        """
        opts = self.opts
        return busy_share >= opts.eviction_lag_busy_share and self.busy_average >= opts.idle_fleet_busy_share

    def _break_tie(self, request: RoutingRequest, tied: list[Candidate]) -> Candidate:
        keys = request.block_keys
        if not keys:
            # Nothing to hash (untokenized request): least in-flight, rotating among equals.
            self._turn += 1
            fewest = min(c.in_flight for c in tied)
            idle = [c for c in tied if c.in_flight == fewest]
            return idle[self._turn % len(idle)]
        depth = min(*(c.matched_blocks for c in tied), len(keys) - 1)
        now = self.clock()
        least = min(round(self._recent_traffic(c.worker.id, now), 3) for c in tied)
        return _rendezvous(keys[depth], [c for c in tied if round(self._recent_traffic(c.worker.id, now), 3) == least])

    def _lost_before_admission(self, request: RoutingRequest, c: Candidate, gpu: int) -> int:
        """Matched tokens gone from the worker's cache by the time ``request`` is admitted, though the index has them.

        SGLang evicts the least recently used pages when new ones need room, and publishes a step's removals
        when the step ends: the batch being prefilled may already have evicted the prefix, and the sends
        queued ahead will evict more before this request is admitted. The worker's order of use, as the
        router's own sends made it (``RecencyLedger``), says how many blocks were used there after the
        prefix's deepest block; beyond the worker's eviction horizon (``on_evicted``) the block is gone, and so is
        the run of blocks the same send used last (``RecencyLedger.kept_depth``). A worker that has evicted
        nothing yet has lost nothing but what its step under way may be evicting, and has no horizon to judge
        that by: nothing is predicted there (the pool's cached share, ``cache_full_fraction``, stood in before,
        and with runs leaving whole it took 2k-token prefixes from holders that still had them: virtual fleet,
        gsp, 16 workers, half the knee, TTFT mean +0.6 ms over ten seeds). Virtual fleet, multi-turn, 16
        workers, 0.5 x knee: turns predicted to find their session's history computed it again (the history
        evicted during the step under way), TTFT p99 183 against the floor's 75 ms before this, 77 after.
        """
        capacity = c.load.max_total_num_tokens if c.load else None
        ledger = self._recency.get(c.worker.id)
        if not capacity or ledger is None or c.block_size <= 0:
            return 0
        depth = gpu // c.block_size
        limit = self._horizon.get(c.worker.id)
        if limit is None:  # no eviction seen there yet
            return 0
        kept = ledger.kept_depth(request.block_keys, depth, limit)
        return gpu - kept * c.block_size if kept < depth else 0

    def on_routed(self, request: RoutingRequest, decision: Decision) -> None:
        worker = decision.ranked[0]
        figures = decision.scores.get(worker.id)
        if figures is None:
            return
        now = self.clock()
        new, cached = int(figures["new_tokens"]), int(figures["cached_tokens"])
        model = self.cost_model(worker)
        before = model.reuse
        model.sent(new, cached, now)
        self._reuse_sum += model.reuse - before
        output = _output_of(request)
        self.book.booked(worker.id, id(request), new, cached, now, request.block_keys, request.block_size, output)
        # Prompt tokens, not requests: a request holds its prompt's KV while it runs, and on a trace of mixed
        # lengths past the knee, ties broken by the fewest requests sent the longest prompts to one worker, whose
        # backlog then drained 23 s after another's (virtual fleet, Mooncake trace, 4 workers, 1.3 x knee).
        self._traffic[worker.id] = (self._recent_traffic(worker.id, now) + (new + cached) / 1000.0, now)
        # The worker's order of use: this send uses every block of its prompt there.
        ledger = self._ledger_of(worker.id, request.block_size)
        if ledger is not None:
            ledger.touch(request.block_keys)

    def on_evicted(self, worker_id: str, keys: Sequence[int]) -> None:
        """The worker evicted ``keys``: what its ledger counts used after the newest of them is what its pool held.

        That count, averaged over the worker's evictions, is where its ledger's blocks fall out of the pool: the
        share of the pool its cached prefixes fill, less what the ledger does not see (running requests' decode
        tokens, outputs stored when a request ends, other routers' sends). Nothing stands in for it before the
        first eviction: the pool's cached share (``cache_full_fraction``, 80 %) was too low (on multi-turn chat a
        pool's prefixes filled 96 % of it, virtual fleet, 4 workers), and predicting a prefix gone past it sent
        turns away from holders that still had it.
        """
        ledger = self._recency.get(worker_id)
        if ledger is None:
            return
        used = ledger.used_after_newest(keys)
        if used is None:
            return
        horizon = self._horizon.get(worker_id)
        self._horizon[worker_id] = used if horizon is None else horizon + _HORIZON_BLEND * (used - horizon)

    def use_memory(self, budget_bytes: int) -> None:
        self._ledger_bytes = max(0, budget_bytes)
        self._recency.clear()
        self._horizon.clear()

    def memory_bytes(self) -> int:
        return sum(ledger.memory_bytes() for ledger in self._recency.values())

    def _ledger_of(self, worker_id: str, block_size: int) -> RecencyLedger | None:
        """The worker's order of use, made or resized to its share of the memory (None: the share is too small).

        A ledger keeps twice the pool's cached share, so that a block is judged gone long before it is forgotten
        (a key it does not keep predicts nothing); every worker whose pool is known gets an equal share of the
        ledgers' memory. A share no larger than the cached share would judge nothing gone, so such a worker's
        ledger keeps a sample of the keys instead (every n-th, n the least that fits twice the cached share in
        the worker's part); a sample under ``_MIN_SAMPLED_KEYS`` keys estimates too coarsely, and gets none.
        """
        capacity = self._capacity.get(worker_id)
        if not capacity or block_size <= 0:
            return None
        reach = math.ceil(self.opts.cache_full_fraction * capacity / block_size) + 1
        share = self._ledger_bytes // LEDGER_BYTES // max(len(self._capacity), 1)
        every, size = 1, min(2 * reach, share)
        if size <= reach and share > 0:
            every = math.ceil(2 * reach / share)
            size = min(share, math.ceil(2 * reach / every))
        ledger = self._recency.get(worker_id)
        if size <= reach // every or (every > 1 and size < _MIN_SAMPLED_KEYS):
            self._recency.pop(worker_id, None)
            return None
        if ledger is None or (ledger.max_blocks, ledger.sample_every) != (size, every):  # the fleet or pool changed
            ledger = self._recency[worker_id] = RecencyLedger(size, every)
        return ledger

    def _recent_traffic(self, worker_id: str, now: float) -> float:
        tokens, stamp = self._traffic.get(worker_id, (0.0, now))
        return tokens * math.exp(-(now - stamp) / self.opts.balance_window_s)

    def on_complete(self, request: RoutingRequest, worker: Worker) -> None:
        self.book.released(worker.id, id(request), self.clock())
        model = self.costs.get(worker.id)
        if worker.in_flight == 0 and model is not None:
            model.idle()  # nothing outstanding from this router: no queue of its own either

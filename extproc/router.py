"""The routing pipeline, wired in order: request -> tokens -> block keys -> index + load -> policy.

The ext_proc servicer awaits ``aroute()`` once per generation request (after the buffered body is
parsed) and calls ``finish()`` when that request's ext_proc stream ends, which Envoy only does once
the response has been completely sent: that brackets the router's in-flight count per worker.

A decision has two halves. Rendering, tokenizing and hashing the prompt is CPU work that reads no
shared state; ``aroute()`` runs it in a small thread pool (``server.tokenize_threads``) so a cold
32k-token prompt never stalls the other streams on the event loop (tokenizers releases the GIL).
The index lookup, the policy and the in-flight counts then run on the loop, so the index and the
policies stay single-threaded. ``route()`` does the same on the calling thread (tests, benchmarks).

The sync path runs in the background (``start()``): ``extproc.sync.hub`` keeps the block index in
step with the workers' KV events, ``extproc.sync.load`` polls their reported load.

A worker running ``--dp-size N`` has N radix caches, indexed apart (``index.rank_key``). The policy
ranks workers by their best rank's match; the router then pins the rank that holds the most of the
prompt (ties: the fewest of its own requests in flight there, then the least reported load) with
SGLang's ``x-override-routed-dp-rank`` / ``x-data-parallel-rank`` headers, and lists as fallbacks only
workers that have that rank too. Routing does no I/O
and never raises for a bad prompt: a request that cannot be tokenized is still routed (by load
alone) rather than lost.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from extproc.clock import MONOTONIC, Clock
from extproc.config import RouterConfig
from extproc.fleet_layout import FleetLayout, WorkerLayout
from extproc.flow_control import Admission, FlowController
from extproc.index import BlockIndex, rank_key
from extproc.key_cache import KeyCache
from extproc.memory import SHARED_KEY_BYTES, MemoryPlan, SharedBound
from extproc.pd import split_roles
from extproc.policies import Candidate, Decision, Policy, RoutingRequest, create_policy, policy_from_config
from extproc.prefill_leg import PrefillClient
from extproc.prompt import Chain, PreparedPrompt, PromptPreparer
from extproc.pruning import CandidatePruner, Depth, load_of
from extproc.request import ParsedRequest, RequestError
from extproc.response import DP_RANK_HEADERS
from extproc.sync.discovery import dp_size
from extproc.sync.http import WorkerHttp
from extproc.sync.hub import EventHub
from extproc.sync.load import LoadTracker
from extproc.sync.shared_state import SharedDecisions
from extproc.sync.tier_stats import TierStatsTracker
from extproc.sync.workers import Worker, WorkerRegistry
from extproc.telemetry import Telemetry
from extproc.tokenization import ModelTokenizer

__all__ = ["NoWorkerError", "RouteOutcome", "Router"]

log = logging.getLogger(__name__)


class NoWorkerError(Exception):
    """No healthy worker can take the request (answered with 503)."""


_ADMIT_ALL = Admission()


@dataclass
class RouteOutcome:
    """A decision in flight: what was chosen for which request."""

    request: RoutingRequest
    decision: Decision
    worker: Worker
    finished: bool = False
    # Headers the server must set on the upstream request (e.g. W3C ``traceparent`` of the decision span).
    upstream_headers: dict[str, str] = field(default_factory=dict)
    candidates: list[Candidate] = field(default_factory=list)
    dp_rank: int | None = None  # the data-parallel rank pinned on the chosen worker (None: it has one rank)
    recorded_keys: list[int] = field(default_factory=list)  # the router's record of what it sent there
    queue_wait_s: float = 0.0  # time the request waited in flow control before being routed
    # The policy that chose ``worker`` and hears ``on_complete`` (None: the router's main policy).
    policy: Policy | None = None
    # On a disaggregated fleet this outcome is the decode side (Envoy's destination) and ``prefill``
    # the prefill worker chosen with it; the router sends that leg itself (``extproc.pd_launch``).
    prefill: RouteOutcome | None = None

    def endpoints(self, fallbacks: int) -> list[str]:
        """Primary ``ip:port`` first, then up to ``fallbacks`` others (Endpoint Picker convention).

        With a pinned rank, a fallback must have that rank too (the retry carries the same header).
        """
        rank = self.dp_rank or 0
        others = [w for w in self.decision.ranked[1:] if dp_size(w) > rank]
        return [w.endpoint for w in [self.worker, *others[:fallbacks]]]

    @property
    def matched_blocks(self) -> int:
        """Leading blocks the chosen worker was believed to hold."""
        return next((c.matched_blocks for c in self.candidates if c.worker is self.worker), 0)


def _chains(workers: list[Worker], sizes: list[int]) -> set[Chain]:
    """The (block size, model) key chains the candidates need (workers sharing both share one)."""
    return {(size, w.model or "") for w, size in zip(workers, sizes)}


class Router:
    """Owns the policy, the block index and the per-worker in-flight counts; knows nothing of gRPC."""

    def __init__(
        self,
        config: RouterConfig,
        registry: WorkerRegistry,
        metrics: CollectorRegistry | None = None,
        http: WorkerHttp | None = None,
        clock: Clock = MONOTONIC,
    ) -> None:
        """``http``: the sync path's client, shared with the caller's health checks (one is made if not given)."""
        self.config = config
        self.registry = registry
        self._owns_http = http is None
        self.http = http or WorkerHttp()
        self.clock = clock  # the index, the load reports and the policy read it (a harness passes a virtual one)
        self.policy = policy_from_config(config.policy, clock)
        self.pruner = CandidatePruner(config.policy.max_candidates)
        self.memory = MemoryPlan.from_budget(config.memory.budget_bytes)
        self.index = BlockIndex(
            config.index, clock=clock, max_blocks=self.memory.index_blocks, max_recent=self.memory.recent_keys
        )
        self.events = EventHub(config.events, registry, self.index, self.http, SharedBound(self.memory.engine_hashes))
        self.loads = LoadTracker(config.load, registry, self.http, clock)
        self.loads.listeners.append(self.policy.on_load)
        # Prefill/decode fleets: the decode worker of a pair is chosen by a policy of its own.
        sections, decode_name = config.policy.sections(), config.pd.decode_policy
        self.decode_policy = create_policy(decode_name, sections.get(decode_name), sections, clock)
        self.loads.listeners.append(self.decode_policy.on_load)
        self.prefill_client = PrefillClient(config.pd)
        self._members = {w.id: w for w in registry.workers}
        registry.listeners.append(self._forget_departed)
        self.tier_stats = TierStatsTracker(config.load, registry, self.http)
        self.telemetry = Telemetry(config.observability, config.policy.name, metrics)
        self.telemetry.watch_fleet(registry, self.index, self.events)
        self.shared: SharedDecisions | None = None
        if config.shared_state.backend != "none":
            self.shared = SharedDecisions(
                config.shared_state, self.index, metrics=self.telemetry.metrics, max_keys=self.memory.shared_keys
            )
        self.prompts = PromptPreparer(
            config.models,
            KeyCache(self.memory.key_cache_bytes),
            config.index.max_lookup_blocks,
            self.policy.needs_tokens,
            self.policy.needs_text,
        )
        # The piece caches of the tokenizers this router uses share one part of the budget.
        self._tokenizers = [self.prompts.tokenizer_for(m.name) for m in config.models] or [
            self.prompts.tokenizer_for(None)
        ]
        if self.prompts.tokenizer_for(None) not in self._tokenizers:
            self._tokenizers.append(self.prompts.tokenizer_for(None))
        for tokenizer in self._tokenizers:
            tokenizer.set_cache_bytes(self.memory.piece_cache_bytes // len(self._tokenizers))
        self.layout = FleetLayout(self.prompts.model_config, self.events.block_size, config.index.default_block_size)
        self.telemetry.watch_memory(self.memory_usage, self.memory.limits())
        self._pool = ThreadPoolExecutor(config.server.tokenize_threads, thread_name_prefix="tokenize")
        self.flow = FlowController(config.flow_control, self.telemetry.metrics) if config.flow_control.enabled else None

    def _forget_departed(self) -> None:
        """The worker set changed: the policy forgets workers that left or moved to another address."""
        current = {w.id: w for w in self.registry.workers}
        for worker_id, worker in self._members.items():
            if current.get(worker_id) is not worker:
                self.policy.remove_worker(worker_id)
                self.decode_policy.remove_worker(worker_id)
        self._members = current
        self.layout.retain(self.registry.workers)

    def memory_usage(self) -> dict[str, int]:
        """Estimated bytes each part of the memory budget holds now (``/metrics`` reads it at scrape time)."""
        usage = self.index.memory()
        usage["engine_hashes"] = self.events.memory()
        usage["key_cache"] = self.prompts.key_cache_bytes
        usage["piece_cache"] = sum(t.cache_stats["bytes"] for t in self._tokenizers)
        usage["shared_state"] = self.shared.queued_keys * SHARED_KEY_BYTES if self.shared is not None else 0
        return usage

    async def start(self) -> None:
        """Start background work (event subscriptions, load polling)."""
        await self.events.start()
        await self.loads.start()
        await self.tier_stats.start()
        if self.shared is not None:
            await self.shared.start()

    async def stop(self) -> None:
        """Stop background work and flush spans."""
        if self.shared is not None:
            await self.shared.stop()
        await self.tier_stats.stop()
        await self.loads.stop()
        await self.events.stop()
        await self.prefill_client.close()
        if self._owns_http:
            await self.http.close()
        if self.flow is not None:
            self.flow.stop()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.telemetry.shutdown()

    # -- request -> tokens ------------------------------------------------------------------------
    def tokenizer_for(self, model: str | None) -> ModelTokenizer:
        """The model's configured tokenizer; models without a config use the built-in default."""
        return self.prompts.tokenizer_for(model)

    def block_size_for(self, worker: Worker) -> int:
        """Tokens per block for this worker: model config, then /server_info, then its events."""
        return self.layout.block_size(worker)

    # -- the decision -----------------------------------------------------------------------------
    def route(self, parsed: ParsedRequest) -> RouteOutcome:
        """Choose a worker for ``parsed`` on the calling thread; raises NoWorkerError when none is healthy.

        For tests and benchmarks; the server uses ``aroute`` so that tokenizing never blocks its loop.
        """
        start_ns, wall_ns = time.perf_counter_ns(), time.time_ns()
        workers, decode, aggregated = self._split_roles(self._workers(parsed))
        layout = self.layout.read(workers)
        prompt = self.prompts.prepare(parsed, _chains(workers, layout[1]))
        assert prompt is not None  # no budget, so never refused
        return self._decide(parsed, workers, layout, prompt, start_ns, wall_ns, decode=decode, aggregated=aggregated)

    async def aroute(
        self,
        parsed: ParsedRequest,
        subset: frozenset[str] | None = None,
        admission: Admission | None = None,
        on_queued: Callable[[float], Awaitable[None]] | None = None,
    ) -> RouteOutcome:
        """``route`` for the event loop: a prompt that is mostly new is tokenized in the thread pool.

        ``subset`` (the gateway's subset hint): only workers at these ``ip:port``s may be chosen; an
        empty or ineligible subset raises NoWorkerError (503). With flow control on, the request
        waits here while every eligible worker is saturated (``admission``: its band and fairness
        id), or raises ``ShedError`` (429); ``on_queued`` is awaited when it starts waiting.

        A warm prompt (at most ``server.inline_tokenize_chars`` characters missing the piece cache)
        costs less than a thread hop and is done in place. Everything that reads or changes shared
        state (registry, index, in-flight counts, policy) runs on the loop after the await, in one
        synchronous step, so it stays single-threaded. If the caller is cancelled while the pool
        works, no slot has been taken yet: nothing leaks.
        """
        start_ns, wall_ns = time.perf_counter_ns(), time.time_ns()
        workers, decode, aggregated = self._split_roles(self._workers(parsed, subset))
        layout = self.layout.read(workers)
        chains = _chains(workers, layout[1])
        prompt = self.prompts.prepare(parsed, chains, self.config.server.inline_tokenize_chars)
        if prompt is None:
            loop = asyncio.get_running_loop()
            prompt = await loop.run_in_executor(self._pool, self.prompts.prepare, parsed, chains)
            assert prompt is not None  # no budget, so never refused
            # Health may have changed meanwhile.
            workers, decode, aggregated = self._split_roles(self._workers(parsed, subset))
            layout = self.layout.read(workers)
        waited = 0.0
        if self.flow is not None:
            admission = admission or _ADMIT_ALL
            priority = admission.priority
            has_room = lambda: self._has_room(parsed, subset, priority)  # noqa: E731 (read at every check)
            waited = await self.flow.admit(admission, has_room, on_queued)
            if waited:  # the fleet changed while it waited (a new page size is hashed in ``_match``)
                workers, decode, aggregated = self._split_roles(self._workers(parsed, subset))
            # Admitted because some worker has room: the policy chooses among those only.
            workers = [w for w in workers if self._room_at(w, priority)] or workers
            layout = self.layout.read(workers)
        outcome = self._decide(parsed, workers, layout, prompt, start_ns, wall_ns, waited, decode, aggregated)
        if waited and self.flow is not None:
            self.flow.wake()  # this one took its slot: the next waiter may fit too
        return outcome

    def pass_through_endpoints(self, subset: frozenset[str] | None, fallbacks: int) -> list[str]:
        """Endpoints for a request the router does not route by prompt (``/v1/models``, health, ...).

        Our own Envoy config never sends those here; a GIE gateway sends every request of the pool's
        routes, and without a destination its ORIGINAL_DST cluster has no upstream. Fewest in
        flight first; nothing is counted (such requests are cheap and not tracked).
        """
        workers = self.registry.candidates(None)
        if subset is not None:
            workers = [w for w in workers if w.endpoint in subset]
        ranked = sorted(workers, key=lambda w: w.in_flight)
        return [w.endpoint for w in ranked[: fallbacks + 1]]

    def _has_room(self, parsed: ParsedRequest, subset: frozenset[str] | None, priority: int = 0) -> bool:
        """Whether some worker this request may go to is below the saturation bounds of flow control."""
        try:
            workers = self._workers(parsed, subset)
        except (NoWorkerError, RequestError):
            return True  # routing will answer it (503 / 400) at once: no reason to hold it
        return any(self._room_at(w, priority) for w in workers)

    def _room_at(self, worker: Worker, priority: int = 0) -> bool:
        """Below both saturation bounds: the router's in-flight count there, and its reported queue.

        A sheddable request (negative priority) gets only ``sheddable_share`` of the in-flight bound.
        """
        bounds = self.config.flow_control
        limit = bounds.max_in_flight_per_worker
        if priority < 0:
            limit = max(1, int(limit * bounds.sheddable_share))
        if worker.in_flight >= limit:
            return False
        if bounds.max_waiting_per_worker is not None:
            load = self.loads.get(worker)
            if load is not None and load.num_waiting_reqs >= bounds.max_waiting_per_worker:
                return False
        return True

    def _workers(self, parsed: ParsedRequest, subset: frozenset[str] | None = None) -> list[Worker]:
        self._check_vocabulary(parsed)
        model = parsed.model or ""
        workers = self.registry.candidates(parsed.model)
        if not workers and self.config.health.keep_last_healthy_s > 0:
            workers = self.registry.recently_healthy(parsed.model, self.config.health.keep_last_healthy_s)
        if subset is not None:
            if not subset:
                raise NoWorkerError("the gateway's endpoint subset for this request is empty")
            workers = [w for w in workers if w.endpoint in subset]
            if not workers:
                raise NoWorkerError(f"no healthy worker in the gateway's endpoint subset {sorted(subset)}")
        if not workers:
            raise NoWorkerError(f"no healthy worker for model {model!r}" if model else "no healthy worker")
        return workers

    def _split_roles(self, workers: list[Worker]) -> tuple[list[Worker], list[Worker] | None, list[Worker]]:
        """The workers the main policy ranks, the decode workers of a disaggregated fleet (None: aggregated),
        and the aggregated workers a short-uncached request may go to instead (``pd.aggregate_below_tokens``).

        A fleet with prefill and decode workers pairs them (the policy ranks the prefill workers: they
        hold the radix cache); aggregated workers beside them take only the requests the decider sends
        them. A fleet of aggregated workers only is routed exactly as before.
        """
        roles = split_roles(workers)
        if not roles.prefill and not roles.decode:
            return workers, None, []
        if roles.disaggregated:
            aggregated = roles.aggregated if self.config.pd.aggregate_below_tokens > 0 else []
            return roles.prefill, roles.decode, aggregated
        if roles.aggregated:
            return roles.aggregated, None, []
        missing = "decode" if roles.prefill else "prefill"
        raise NoWorkerError(f"no healthy {missing} worker to pair with the {len(workers)} healthy ones")

    def _check_vocabulary(self, parsed: ParsedRequest) -> None:
        """Refuse token ids outside the model's vocabulary (400): a worker must never see them."""
        cfg = self.prompts.model_config(parsed.model)
        if cfg is None or cfg.vocab_size is None or parsed.max_token_id is None:
            return
        if parsed.max_token_id >= cfg.vocab_size:
            raise RequestError(
                400,
                f"token id {parsed.max_token_id} is outside the vocabulary of model {cfg.name!r} "
                f"(size {cfg.vocab_size})",
                param="input_ids" if parsed.kind == "generate" else "prompt",
            )

    def _decide(
        self,
        parsed: ParsedRequest,
        workers: list[Worker],
        layout: tuple[list[WorkerLayout], list[int]],
        prompt: PreparedPrompt,
        start_ns: int,
        wall_ns: int,
        queue_wait_s: float = 0.0,
        decode: list[Worker] | None = None,
        aggregated: list[Worker] | None = None,
    ) -> RouteOutcome:
        """Rank ``workers`` with the policy; given ``decode`` (a disaggregated fleet), pair the winner with one."""
        model = parsed.model or ""
        policy = self.policy
        shapes, sizes = layout  # read once per decision (``FleetLayout.read``): the lookups below use them
        if prompt.error is not None:
            log.info("routing %s without tokens: %s", parsed.path, prompt.error)
            self.telemetry.tokenize_failed(model)
        tokens = prompt.tokens
        loads, events, tiers = self.loads, self.events, self.tier_stats
        shared = self.config.index.shared_tier
        # The index lookup and the pruning read every worker; candidates are built for the shortlist only.
        keys_of: dict[Chain, list[int]] = {}
        rank_matches: dict[str, list[int]] = {}
        first_keys: list[int] = []
        depths: list[Depth] | None = None
        kept: range | list[int] = range(len(workers))
        if tokens is not None and policy.needs_tokens:
            depths, first_keys = self._match(parsed, tokens, prompt.keys, workers, shapes, sizes, keys_of, rank_matches)
            if decode is not None and aggregated:
                # llm-d's prefix-based PD decider: little left to prefill is cheaper without the KV transfer.
                cached = max(depth[2] * size for depth, size in zip(depths, sizes))
                if len(tokens) - cached < self.config.pd.aggregate_below_tokens:
                    self.telemetry.pd_skipped()
                    layout = self.layout.read(aggregated)
                    return self._decide(parsed, aggregated, layout, prompt, start_ns, wall_ns, queue_wait_s)
            kept = self.pruner.shortlist(depths, lambda: [load_of(w.in_flight, loads.peek(w)) for w in workers])
        candidates: list[Candidate] = []
        index_size = self.index.size
        for i in kept:
            w = workers[i]
            c = Candidate(
                worker=w,
                in_flight=w.in_flight,
                load=loads.get(w),
                index_state=events.state(w),
                block_size=sizes[i],
                cached_blocks=index_size(w.id),
                storage_group=shapes[i].storage_group if shared else None,
                tier_report=tiers.get(w),
            )
            if depths is not None:
                c.shared_matched_blocks, c.host_matched_blocks, c.matched_blocks = depths[i]
            candidates.append(c)
        chosen_keys: dict[str, list[int]] = {}
        if depths is not None:
            for c in candidates:
                chosen_keys[c.worker.id] = keys_of[(c.block_size, c.worker.model or "")]
        request = RoutingRequest(
            model=model,
            path=parsed.path,
            prompt_text=prompt.text if policy.needs_text else "",
            token_ids=tokens,
            block_keys=first_keys,
            block_size=candidates[0].block_size,
            headers=parsed.headers,
            lora=parsed.lora,
            cache_salt=parsed.cache_salt,
            max_new_tokens=parsed.max_new_tokens,
        )
        decision = policy.select(request, candidates)
        chosen = decision.ranked[0]
        chosen.in_flight += 1
        rank = self._pin_rank(chosen, rank_matches.get(chosen.id))
        slot = chosen.id if rank is None else rank_key(chosen.id, rank)
        if chosen_keys.get(chosen.id):
            self.index.record_routed(slot, chosen_keys[chosen.id])
            if self.shared is not None:
                self.shared.publish(slot, chosen_keys[chosen.id])
        policy.on_routed(request, decision)
        if log.isEnabledFor(logging.DEBUG):  # why each candidate ranked where it did (--log-level debug)
            log.debug("routed %s to %s (%s): %s", parsed.path, chosen.id, decision.reason, decision.scores)
        pair: tuple[Decision, list[Candidate]] | None = None
        if decode is not None:
            pair = self._pick_decode(request, decode)
        end_ns = time.perf_counter_ns()
        headers = self.telemetry.decision(
            model=model,
            path=parsed.path,
            headers=parsed.headers,
            request=request,
            candidates=candidates,
            decision=decision,
            start_ns=wall_ns,
            end_ns=wall_ns + (end_ns - start_ns),
            blocks=len(chosen_keys.get(chosen.id, first_keys)),
            tokenized=tokens is not None,
            queue_wait_s=queue_wait_s,
            decode=pair[0] if pair is not None else None,
        )
        trace_headers = headers
        if rank is not None:
            headers = {**headers, **dict.fromkeys(DP_RANK_HEADERS, str(rank))}
        outcome = RouteOutcome(
            request=request,
            decision=decision,
            worker=chosen,
            upstream_headers=headers,
            candidates=candidates,
            dp_rank=rank,
            recorded_keys=chosen_keys.get(chosen.id, []),
            queue_wait_s=queue_wait_s,
        )
        if pair is None:
            return outcome
        decode_decision, decode_candidates = pair
        return RouteOutcome(
            request=request,
            decision=decode_decision,
            worker=decode_decision.ranked[0],
            upstream_headers=dict(trace_headers),  # the prefill rank's pin goes on the prefill leg only
            candidates=decode_candidates,
            queue_wait_s=queue_wait_s,
            policy=self.decode_policy,
            prefill=outcome,
        )

    def _pick_decode(self, request: RoutingRequest, workers: list[Worker]) -> tuple[Decision, list[Candidate]]:
        """The decode side of a pair, by ``pd.decode_policy`` (load and KV room); its in-flight slot taken."""
        loads = self.loads
        candidates = [Candidate(worker=w, in_flight=w.in_flight, load=loads.get(w)) for w in workers]
        decision = self.decode_policy.select(request, candidates)
        decision.ranked[0].in_flight += 1
        self.decode_policy.on_routed(request, decision)
        return decision, candidates

    def _pin_rank(self, worker: Worker, matches: list[int] | None) -> int | None:
        """The DP rank to pin on ``worker`` (None for a single-rank worker), its in-flight count taken.

        Most matched blocks first; then the fewest requests this router has in flight there; then
        the least load the worker reports for the rank; then the lowest rank.
        """
        ranks = dp_size(worker)
        if ranks <= 1:
            return None
        load = self.loads.get(worker)
        reported = load.rank_requests if load is not None else {}
        in_flight = worker.rank_in_flight
        matched = matches or []
        rank = min(
            range(ranks),
            key=lambda r: (
                -(matched[r] if r < len(matched) else 0),
                in_flight.get(r, 0),
                reported.get(r, 0),
                r,
            ),
        )
        in_flight[rank] = in_flight.get(rank, 0) + 1
        return rank

    def _match(
        self,
        parsed: ParsedRequest,
        tokens: Sequence[int],
        chains: dict[Chain, list[int]],
        workers: list[Worker],
        shapes: list[WorkerLayout],
        sizes: list[int],
        keys_of: dict[Chain, list[int]],
        rank_matches: dict[str, list[int]],
    ) -> tuple[list[Depth], list[int]]:
        """Each worker's match depth, in fleet order, and the first chain's keys.

        Workers sharing page size and model share one key chain (filled into ``keys_of``). A
        multi-rank worker's match is its best rank's; each rank's is kept in ``rank_matches``.
        """
        chain_of = [(size, w.model or "") for w, size in zip(workers, sizes)]
        groups: dict[Chain, Sequence[int]]
        if chain_of.count(chain_of[0]) == len(chain_of):  # the usual fleet: one page size, one model
            groups = {chain_of[0]: range(len(workers))}
        else:
            mixed: dict[Chain, list[int]] = {}
            for i, chain in enumerate(chain_of):
                mixed.setdefault(chain, []).append(i)
            groups = dict(mixed)
        depths: list[Depth] = [(0, 0, 0)] * len(workers)
        first: list[int] | None = None
        index = self.index
        lower = index.has_tier("host") or index.has_tier("shared")
        shared = self.config.index.shared_tier
        for chain, members in groups.items():
            keys = chains.get(chain)
            if keys is None:  # a worker's page size became known while the pool hashed
                keys = self.prompts.chain(parsed, tokens, chain)
            if first is None:
                first = keys
            keys_of[chain] = keys
            ids = [slot for i in members for slot in shapes[i].slots]
            if lower:  # GPU, then host memory, then the storage tier each shares (every rank shares it)
                groups_of = {s: shapes[i].storage_group if shared else None for i in members for s in shapes[i].slots}
                tiers = index.match_tiers(keys, ids, groups_of)
                for i in members:
                    mine = [tiers[s] for s in shapes[i].slots]
                    gpu = max(d.gpu for d in mine)
                    host = max(gpu, *(d.local for d in mine))
                    depths[i] = (max(host, *(d.shared for d in mine)), host, gpu)
                    if len(mine) > 1:
                        rank_matches[workers[i].id] = [d.local for d in mine]
                continue
            matched = index.match(keys, ids, "gpu")
            if len(ids) == len(members):  # one rank each: the answers come in the members' order
                for i, depth in zip(members, matched.values()):
                    if depth:
                        depths[i] = (depth, depth, depth)
                continue
            for i in members:
                slots = shapes[i].slots
                depth = max(matched[s] for s in slots)
                if len(slots) > 1:
                    rank_matches[workers[i].id] = [matched[s] for s in slots]
                if depth:
                    depths[i] = (depth, depth, depth)
        return depths, first or []

    def served(self, outcome: RouteOutcome, endpoint: str) -> bool:
        """Envoy says ``endpoint`` served the request: move the accounting there if it fell back.

        The in-flight slot, the policy's booking and the router's record of the prompt's blocks
        follow the request to the worker that really has it. Returns whether anything moved (an
        endpoint that is the chosen one, or no worker of ours, moves nothing).
        """
        old = outcome.worker
        if outcome.finished or endpoint == old.endpoint:
            return False
        new = next((w for w in self.registry.workers if w.endpoint == endpoint), None)
        if new is None:
            log.warning("served endpoint %s is none of the router's workers", endpoint)
            return False
        self._release(outcome)
        new.in_flight += 1
        rank = outcome.dp_rank if outcome.dp_rank is not None and dp_size(new) > outcome.dp_rank else None
        if rank is not None:
            new.rank_in_flight[rank] = new.rank_in_flight.get(rank, 0) + 1
        keys = outcome.recorded_keys
        if keys:
            self.index.unrecord_routed(old.id if outcome.dp_rank is None else rank_key(old.id, outcome.dp_rank), keys)
            self.index.record_routed(new.id if rank is None else rank_key(new.id, rank), keys)
        outcome.worker, outcome.dp_rank = new, rank
        ranked = [new, *(w for w in outcome.decision.ranked if w is not new)]
        outcome.decision = Decision(ranked=ranked, reason=outcome.decision.reason, scores=outcome.decision.scores)
        (outcome.policy or self.policy).on_routed(outcome.request, outcome.decision)
        self.telemetry.fell_back()
        return True

    def finish(self, outcome: RouteOutcome) -> None:
        """The request's stream ended: release its in-flight slot, and its prefill worker's (idempotent)."""
        if outcome.prefill is not None:
            self.finish(outcome.prefill)
        if outcome.finished:
            return
        self._release(outcome)
        outcome.finished = True
        if self.flow is not None:
            self.flow.wake()

    def _release(self, outcome: RouteOutcome) -> None:
        outcome.worker.in_flight = max(0, outcome.worker.in_flight - 1)
        if outcome.dp_rank is not None:
            by_rank = outcome.worker.rank_in_flight
            by_rank[outcome.dp_rank] = max(0, by_rank.get(outcome.dp_rank, 0) - 1)
        (outcome.policy or self.policy).on_complete(outcome.request, outcome.worker)

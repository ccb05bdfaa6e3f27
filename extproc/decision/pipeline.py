"""The decision, read in order: fleet -> prompt's block keys -> match -> prune -> policy -> pin.

``DecisionPipeline.decide`` takes a parsed request, its prepared prompt (``extproc.decision.prompt``:
rendered, tokenized, hashed) and the fleet as read once for it (``read_fleet``), and returns the
decision: the worker (and, on a prefill/decode fleet, the decode worker paired with it), the DP rank
pinned there, the candidates and the policy's figures. It does no I/O and never waits: what it reads
of the sync path (reported loads, each worker's index state, tier reports) comes through three small
read-only interfaces, and what it changes is the decision's own state: the chosen worker's in-flight
count and DP-rank slot, the policy's book, and the index's record of what was sent where. The router
(``extproc.routing.router``) runs it on the event loop, so that state stays single-threaded; the
benchmarks and the virtual fleet build the same pipeline (``DecisionPipeline.build``) over sources of
their own.

A worker running ``--dp-size N`` has N radix caches, indexed apart (``rank_key``). The policy ranks
workers by their best rank's match; the pipeline then pins the rank that holds the most of the
prompt (ties: the fewest of its own requests in flight there, then the least reported load) and lists
as fallbacks only workers that have that rank too. A request that cannot be tokenized is still routed
(by load alone) rather than lost.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from extproc.clock import MONOTONIC, Clock
from extproc.config import RouterConfig
from extproc.decision.key_cache import KeyCache
from extproc.decision.match import Match, match_fleet
from extproc.decision.policies import Candidate, Decision, Policy, RoutingRequest, create_policy, policy_from_config
from extproc.decision.prompt import Chain, PreparedPrompt, PromptPreparer
from extproc.decision.pruning import CandidatePruner, load_of
from extproc.decision.request import ParsedRequest, RequestError
from extproc.fleet.index import BlockIndex, rank_key
from extproc.fleet.info import dp_size
from extproc.fleet.layout import FleetLayout, WorkerLayout
from extproc.fleet.reports import TierReport, WorkerLoad
from extproc.fleet.roles import split_roles
from extproc.fleet.workers import Worker, WorkerRegistry
from extproc.memory import MemoryPlan

__all__ = [
    "Decided",
    "DecisionPipeline",
    "Explained",
    "FleetView",
    "IndexStates",
    "LoadSource",
    "NoWorkerError",
    "RouteOutcome",
    "TierSource",
]


class NoWorkerError(Exception):
    """No healthy worker can take the request (answered with 503)."""


class LoadSource(Protocol):
    """Each worker's last reported load (``extproc.sync.load.LoadTracker``)."""

    def get(self, worker: Worker) -> WorkerLoad | None:
        """The report as the policy reads it (aged)."""

    def peek(self, worker: Worker) -> WorkerLoad | None:
        """The report as it arrived (for pruning, which only compares workers)."""


class IndexStates(Protocol):
    """Whether the index follows each worker's KV events (``extproc.sync.hub.EventHub``)."""

    def state(self, worker: Worker) -> str:
        """``synced`` or ``unknown``."""

    def block_size(self, worker: Worker) -> int | None:
        """The page size the worker's events showed, if any."""


class TierSource(Protocol):
    """HiCache workers' tier-transfer figures (``extproc.sync.tier_stats.TierStatsTracker``)."""

    def get(self, worker: Worker) -> TierReport | None:
        """The worker's latest report, if any."""


@dataclass
class RouteOutcome:
    """A decision in flight: what was chosen for which request."""

    request: RoutingRequest
    decision: Decision
    worker: Worker
    finished: bool = False
    # Headers the server must set on the upstream request (W3C ``traceparent`` of the decision span, the DP rank).
    upstream_headers: dict[str, str] = field(default_factory=dict)
    candidates: list[Candidate] = field(default_factory=list)
    dp_rank: int | None = None  # the data-parallel rank pinned on the chosen worker (None: it has one rank)
    recorded_keys: list[int] = field(default_factory=list)  # the router's record of what it sent there
    queue_wait_s: float = 0.0  # time the request waited in flow control before being routed
    # The policy that chose ``worker`` and hears ``on_complete`` (None: the pipeline's main policy).
    policy: Policy | None = None
    # On a disaggregated fleet this outcome is the decode side (Envoy's destination) and ``prefill``
    # the prefill worker chosen with it; ``extproc.pd`` sends that leg.
    prefill: RouteOutcome | None = None
    request_id: str = ""  # the request's ``x-request-id`` (Envoy sets one), or one the router made up

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


@dataclass
class FleetView:
    """The fleet as one decision reads it, once: the workers the policy ranks and their layout."""

    workers: list[Worker]
    shapes: list[WorkerLayout]
    sizes: list[int]  # each worker's page size
    decode: list[Worker] | None = None  # a disaggregated fleet's decode workers (None: aggregated)
    aggregated: list[Worker] = field(default_factory=list)  # where a short-uncached request of a PD fleet may go

    @property
    def chains(self) -> set[Chain]:
        """The (page size, model) key chains the candidates need (workers sharing both share one)."""
        return {(size, w.model or "") for w, size in zip(self.workers, self.sizes)}


@dataclass
class Explained:
    """What the policy would rank for a prompt now, decided nowhere (``DecisionPipeline.explain``)."""

    request: RoutingRequest
    candidates: list[Candidate]
    decision: Decision
    decode: Decision | None = None  # a disaggregated fleet: the decode side the winner would be paired with
    decode_candidates: list[Candidate] = field(default_factory=list)
    pd_skipped: bool = False  # a PD fleet's prompt an aggregated worker would take whole


@dataclass
class Decided:
    """A decision and what its record needs: ``outcome`` is Envoy's destination (a pair's decode side)."""

    outcome: RouteOutcome
    chosen: RouteOutcome  # the main policy's pick (``outcome`` itself unless the request is paired)
    slot: str  # the index slot the prompt's keys were recorded on
    blocks: int  # the prompt's full blocks in the chosen worker's chain
    tokenized: bool
    tokenize_error: str | None = None
    pd_skipped: bool = False  # a PD fleet's request sent to an aggregated worker: little was left to prefill


class DecisionPipeline:
    """Owns the policies and the decision's state; ``decide`` is the request's path through it."""

    def __init__(
        self,
        config: RouterConfig,
        registry: WorkerRegistry,
        index: BlockIndex,
        prompts: PromptPreparer,
        layout: FleetLayout,
        policy: Policy,
        decode_policy: Policy,
        loads: LoadSource,
        states: IndexStates,
        tiers: TierSource,
    ) -> None:
        self.config = config
        self.registry = registry
        self.index = index
        self.prompts = prompts
        self.layout = layout
        self.policy = policy
        self.decode_policy = decode_policy  # the decode side of a pair (``pd.decode_policy``: load and KV room)
        self.loads = loads
        self.states = states
        self.tiers = tiers
        self.pruner = CandidatePruner(config.policy.max_candidates)
        self._members = {w.id: w for w in registry.workers}

    @classmethod
    def build(
        cls,
        config: RouterConfig,
        registry: WorkerRegistry,
        index: BlockIndex,
        memory: MemoryPlan,
        loads: LoadSource,
        states: IndexStates,
        tiers: TierSource,
        clock: Clock = MONOTONIC,
    ) -> DecisionPipeline:
        """The pipeline as configured: policies by name, prompt preparation within its share of ``memory``."""
        policy = policy_from_config(config.policy, clock)
        if config.shared_state.backend != "none":
            policy.share_decisions()
        sections, decode_name = config.policy.sections(), config.pd.decode_policy
        decode_policy = create_policy(decode_name, sections.get(decode_name), sections, clock)
        policy.use_memory(memory.policy_bytes)  # the decode policy keeps no per-worker state of its own
        decode_policy.use_memory(0)
        prompts = PromptPreparer(
            config.models,
            KeyCache(memory.key_cache_bytes),
            config.index.max_lookup_blocks,
            policy.needs_tokens,
            policy.needs_text,
        )
        prompts.share_piece_cache(memory.piece_cache_bytes)
        layout = FleetLayout(prompts.model_config, states.block_size, config.index.default_block_size)
        return cls(config, registry, index, prompts, layout, policy, decode_policy, loads, states, tiers)

    # -- what the sync path tells the decision ------------------------------------------------------
    def on_load(self, worker: Worker, load: WorkerLoad) -> None:
        """A load report arrived: both policies learn from it."""
        self.policy.on_load(worker, load)
        self.decode_policy.on_load(worker, load)

    def on_evicted(self, worker_id: str, keys: Sequence[int]) -> None:
        """A worker's KV events removed these blocks from its GPU pool: both policies learn from it."""
        self.policy.on_evicted(worker_id, keys)
        self.decode_policy.on_evicted(worker_id, keys)

    def forget_departed(self) -> None:
        """The worker set changed: the policies forget workers that left or moved to another address."""
        current = {w.id: w for w in self.registry.workers}
        for worker_id, worker in self._members.items():
            if current.get(worker_id) is not worker:
                self.policy.remove_worker(worker_id)
                self.decode_policy.remove_worker(worker_id)
        self._members = current
        self.layout.retain(self.registry.workers)

    # -- the fleet, read once per decision ----------------------------------------------------------
    def eligible(self, parsed: ParsedRequest, subset: frozenset[str] | None = None) -> list[Worker]:
        """The healthy workers that may take ``parsed`` (the gateway's ``subset`` of them, if given).

        Raises ``RequestError`` (400) for token ids outside the model's vocabulary and ``NoWorkerError``
        (503) when none is left.
        """
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

    def read_fleet(self, workers: list[Worker]) -> FleetView:
        """The view of ``workers`` (from ``eligible``) a decision reads: roles, layouts and page sizes.

        A fleet with prefill and decode workers pairs them (the policy ranks the prefill workers: they
        hold the radix cache); aggregated workers beside them take only the requests the PD decider sends
        them. A fleet of aggregated workers only is routed exactly as before.
        """
        roles = split_roles(workers)
        decode: list[Worker] | None = None
        aggregated: list[Worker] = []
        if roles.prefill or roles.decode:
            if roles.disaggregated:
                workers, decode = roles.prefill, roles.decode
                aggregated = roles.aggregated if self.config.pd.aggregate_below_tokens > 0 else []
            elif roles.aggregated:
                workers = roles.aggregated
            else:
                missing = "decode" if roles.prefill else "prefill"
                raise NoWorkerError(f"no healthy {missing} worker to pair with the {len(workers)} healthy ones")
        shapes, sizes = self.layout.read(workers)
        return FleetView(workers, shapes, sizes, decode, aggregated)

    # -- the decision -------------------------------------------------------------------------------
    def decide(self, parsed: ParsedRequest, prompt: PreparedPrompt, fleet: FleetView) -> Decided:
        """Match, prune, rank with the policy, pin; on a disaggregated fleet pair the winner with a decode worker."""
        policy = self.policy
        ranking = self._rank(parsed, prompt, fleet, policy.select)
        if isinstance(ranking, FleetView):  # a PD fleet's request with little to prefill: an aggregated worker
            skipped = self.decide(parsed, prompt, ranking)
            skipped.pd_skipped = True
            return skipped
        request, candidates, decision, match = ranking
        chosen = decision.ranked[0]
        chosen.in_flight += 1
        rank = self._pin_rank(chosen, match.rank_matches.get(chosen.id) if match is not None else None)
        slot = chosen.id if rank is None else rank_key(chosen.id, rank)
        keys: list[int] = []
        if match is not None:
            size = next(c.block_size for c in candidates if c.worker is chosen)
            keys = match.keys_of[(size, chosen.model or "")]
            if keys:
                self.index.record_routed(slot, keys)
        policy.on_routed(request, decision)
        outcome = RouteOutcome(
            request=request, decision=decision, worker=chosen, candidates=candidates, dp_rank=rank, recorded_keys=keys
        )
        decided = Decided(
            outcome=outcome,
            chosen=outcome,
            slot=slot,
            blocks=len(keys),
            tokenized=prompt.tokens is not None,
            tokenize_error=prompt.error,
        )
        if fleet.decode is not None:
            decided.outcome = self._pair(outcome, fleet.decode)
        return decided

    def explain(self, parsed: ParsedRequest, prompt: PreparedPrompt, fleet: FleetView) -> Explained:
        """What ``decide`` would rank now, with every policy's ``explain``: nothing is pinned, booked or recorded.

        The in-flight counts, the DP-rank slots, the index's record of sends and the policies' books stay
        as they were, so the next real decision is the one it would have been without this call.
        """
        ranking = self._rank(parsed, prompt, fleet, self.policy.explain)
        if isinstance(ranking, FleetView):
            skipped = self.explain(parsed, prompt, ranking)
            skipped.pd_skipped = True
            return skipped
        request, candidates, decision, _ = ranking
        explained = Explained(request=request, candidates=candidates, decision=decision)
        if fleet.decode is not None:
            explained.decode_candidates = self._decode_candidates(fleet.decode)
            explained.decode = self.decode_policy.explain(request, explained.decode_candidates)
        return explained

    def _rank(
        self,
        parsed: ParsedRequest,
        prompt: PreparedPrompt,
        fleet: FleetView,
        rank: Callable[[RoutingRequest, list[Candidate]], Decision],
    ) -> tuple[RoutingRequest, list[Candidate], Decision, Match | None] | FleetView:
        """Match, prune and ``rank`` (the policy's ``select`` or ``explain``); a fleet view to rank instead."""
        policy = self.policy
        tokens = prompt.tokens
        workers, sizes = fleet.workers, fleet.sizes
        match: Match | None = None
        kept: range | list[int] = range(len(workers))
        if tokens is not None and policy.needs_tokens:
            match = match_fleet(
                self.index, workers, fleet.shapes, sizes, self._keys_for(parsed, prompt), self.config.index.shared_tier
            )
            if fleet.decode is not None and fleet.aggregated:
                # llm-d's prefix-based PD decider: little left to prefill is cheaper without the KV transfer.
                cached = max(depth[2] * size for depth, size in zip(match.depths, sizes))
                if len(tokens) - cached < self.config.pd.aggregate_below_tokens:
                    return self.read_fleet_of(fleet.aggregated)
            loads = self.loads
            kept = self.pruner.shortlist(match.depths, lambda: [load_of(w.in_flight, loads.peek(w)) for w in workers])
        candidates = self._candidates(fleet, kept, match)
        request = RoutingRequest(
            model=parsed.model or "",
            path=parsed.path,
            prompt_text=prompt.text if policy.needs_text else "",
            token_ids=tokens,
            block_keys=match.first_keys if match is not None else [],
            block_size=candidates[0].block_size,
            headers=parsed.headers,
            lora=parsed.lora,
            cache_salt=parsed.cache_salt,
            max_new_tokens=parsed.max_new_tokens,
        )
        return request, candidates, rank(request, candidates), match

    def narrow(self, fleet: FleetView, keep: Callable[[Worker], bool]) -> FleetView:
        """``fleet`` with only the workers the policy ranks that ``keep`` accepts (all of them if it accepts none)."""
        kept = [w for w in fleet.workers if keep(w)]
        if not kept or len(kept) == len(fleet.workers):
            return fleet
        shapes, sizes = self.layout.read(kept)
        return FleetView(kept, shapes, sizes, fleet.decode, fleet.aggregated)

    def read_fleet_of(self, workers: list[Worker]) -> FleetView:
        """A view of workers of one role (a PD fleet's aggregated workers): no pairing."""
        shapes, sizes = self.layout.read(workers)
        return FleetView(workers, shapes, sizes)

    def _keys_for(self, parsed: ParsedRequest, prompt: PreparedPrompt) -> Callable[[Chain], list[int]]:
        def keys_for(chain: Chain) -> list[int]:
            keys = prompt.keys.get(chain)
            if keys is None:  # a worker's page size became known while the pool hashed
                assert prompt.tokens is not None
                keys = self.prompts.chain(parsed, prompt.tokens, chain)
            return keys

        return keys_for

    def _candidates(self, fleet: FleetView, kept: Sequence[int], match: Match | None) -> list[Candidate]:
        """One ``Candidate`` per shortlisted worker, with everything the policy may weigh."""
        loads, states, tiers = self.loads, self.states, self.tiers
        shared = self.config.index.shared_tier
        index_size = self.index.size
        candidates: list[Candidate] = []
        for i in kept:
            w = fleet.workers[i]
            c = Candidate(
                worker=w,
                in_flight=w.in_flight,
                load=loads.get(w),
                index_state=states.state(w),
                block_size=fleet.sizes[i],
                cached_blocks=index_size(w.id),
                storage_group=fleet.shapes[i].storage_group if shared else None,
                tier_report=tiers.get(w),
            )
            if match is not None:
                c.shared_matched_blocks, c.host_matched_blocks, c.matched_blocks = match.depths[i]
            candidates.append(c)
        return candidates

    def _decode_candidates(self, workers: list[Worker]) -> list[Candidate]:
        loads = self.loads
        return [Candidate(worker=w, in_flight=w.in_flight, load=loads.get(w)) for w in workers]

    def _pair(self, prefill: RouteOutcome, workers: list[Worker]) -> RouteOutcome:
        """The decode side of a pair, by ``pd.decode_policy`` (load and KV room); its in-flight slot taken."""
        candidates = self._decode_candidates(workers)
        decision = self.decode_policy.select(prefill.request, candidates)
        decision.ranked[0].in_flight += 1
        self.decode_policy.on_routed(prefill.request, decision)
        return RouteOutcome(
            request=prefill.request,
            decision=decision,
            worker=decision.ranked[0],
            candidates=candidates,
            policy=self.decode_policy,
            prefill=prefill,
        )

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

    # -- the request's later life -------------------------------------------------------------------
    def move(self, outcome: RouteOutcome, new: Worker) -> None:
        """Envoy served the request from ``new`` (a fallback): its slot, booking and record of keys follow it."""
        old = outcome.worker
        self.release(outcome)
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

    def release(self, outcome: RouteOutcome) -> None:
        """The request left ``outcome.worker``: its in-flight slot is free and its policy hears of it."""
        outcome.worker.in_flight = max(0, outcome.worker.in_flight - 1)
        if outcome.dp_rank is not None:
            by_rank = outcome.worker.rank_in_flight
            by_rank[outcome.dp_rank] = max(0, by_rank.get(outcome.dp_rank, 0) - 1)
        (outcome.policy or self.policy).on_complete(outcome.request, outcome.worker)

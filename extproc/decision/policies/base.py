"""The one small interface every routing policy implements.

Like sgl-router's policies: a policy gets the request and the candidate workers (healthy, with
their in-flight counts, reported load and, for policies that need tokens, how many leading blocks
of the prompt each one holds) in one context, and returns a ranking. Optional hooks default to
nothing. Policies never do I/O: the router gathers inputs, the policy decides.

Each policy owns its options: a ``PolicyOptions`` model (unknown keys refused, every field
described) named once, as the type argument of its base (``class P(Policy[POptions])``: ``P.Options``
is ``POptions`` and ``self.opts`` one of them), validated once here, in the base class.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar, cast, get_args, get_origin

from pydantic import Field, ValidationError

from extproc.clock import MONOTONIC, Clock
from extproc.config import Section
from extproc.fleet.reports import TierReport, WorkerLoad
from extproc.fleet.workers import Worker

__all__ = [
    "Candidate",
    "Decision",
    "Policy",
    "PolicyError",
    "PolicyOptions",
    "RandomTieBreakOptions",
    "RandomTieBreakPolicy",
    "RoutingRequest",
    "WorkerLoad",
]


class PolicyError(ValueError):
    """Bad policy name or options (reported at start-up, not per request)."""


class PolicyOptions(Section):
    """Base of each policy's options model (a policy without constants keeps this empty one)."""


@dataclass
class RoutingRequest:
    """One request as policies see it."""

    model: str
    path: str
    prompt_text: str = ""  # rendered prompt; character-based peer policies match on it
    token_ids: Sequence[int] | None = None
    block_keys: list[int] = field(default_factory=list)  # full pages only (of the first candidate group)
    block_size: int = 16
    headers: Mapping[str, str] = field(default_factory=dict)
    lora: str | None = None
    cache_salt: str | None = None
    max_new_tokens: int | None = None  # the body's output limit (None: not given)

    @property
    def prompt_tokens(self) -> int:
        return len(self.token_ids) if self.token_ids is not None else len(self.prompt_text) // 4


@dataclass
class Candidate:
    """One healthy worker with everything a policy may weigh."""

    worker: Worker
    in_flight: int = 0
    load: WorkerLoad | None = None
    matched_blocks: int = 0  # leading blocks of the prompt this worker holds in GPU memory (index + speculative)
    host_matched_blocks: int = 0  # ... counting its host-memory tier too (>= matched_blocks when reported)
    shared_matched_blocks: int = 0  # ... counting the storage tier it shares with others too (>= host_matched)
    index_state: str = "synced"  # synced | unknown (events lost or absent; matched_blocks from own record)
    block_size: int = 16  # this worker's page size (tokens per block)
    cached_blocks: int = 0  # blocks the worker's GPU cache holds as far as the index knows (its fill)
    storage_group: str | None = None  # the shared storage tier it reads (HiCache L3), if any
    tier_report: TierReport | None = None  # its reported load-back / storage-prefetch figures (HiCache workers)

    def predicted_cached_tokens(self, prompt_tokens: int) -> int:
        """The prompt tokens this worker's engine should report cached if the index is right.

        Its longest match over every tier (host and shared hits are loaded back and count as cached), in
        whole pages of the first ``prompt_tokens - 1`` tokens: SGLang always computes the last prompt
        token and matches its radix cache a page at a time.
        """
        size = max(self.block_size, 1)
        blocks = max(self.matched_blocks, self.host_matched_blocks, self.shared_matched_blocks)
        return min(blocks, max(prompt_tokens - 1, 0) // size) * size

    @property
    def tier_blocks(self) -> dict[str, int]:
        """Leading blocks by tier: on its GPU, then in its host memory, then in the shared storage tier."""
        host = max(self.host_matched_blocks, self.matched_blocks)
        shared = max(self.shared_matched_blocks, host)
        return {"gpu": self.matched_blocks, "host": host - self.matched_blocks, "shared": shared - host}


@dataclass
class Decision:
    """Workers best first (primary, then fallbacks), why, and per-worker figures for the span."""

    ranked: list[Worker]
    reason: str
    scores: dict[str, dict[str, float]] = field(default_factory=dict)


def _problems(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in err['loc']) or 'options'}: {err['msg']}" for err in exc.errors())


OptionsT = TypeVar("OptionsT", bound=PolicyOptions)


class Policy(ABC, Generic[OptionsT]):
    """Base class: set ``name`` (and the options model as the type argument if the policy has constants);
    override ``select``.

    ``sections`` holds every policy's configured section by policy name, for policies composed of
    others (``session`` places new sessions with its fallback policy, configured in its own section).
    ``clock`` is the router's: a policy that ages or stamps state reads it, never ``time`` directly.
    """

    name: ClassVar[str]
    Options: ClassVar[type[PolicyOptions]] = PolicyOptions
    opts: OptionsT
    needs_tokens: bool = False  # True: the router tokenizes and fills matched_blocks
    needs_text: bool = False  # True: the router renders the prompt text (character-based peers)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for base in cls.__dict__.get("__orig_bases__", ()):
            origin, args = get_origin(base), get_args(base)
            # ``class P(Policy[POptions])`` (or of a generic policy base): POptions validates P's options.
            if isinstance(origin, type) and issubclass(origin, Policy) and args and isinstance(args[0], type):
                cls.Options = args[0]

    def __init__(
        self,
        options: Mapping[str, Any] | None = None,
        sections: Mapping[str, Mapping[str, Any]] | None = None,
        clock: Clock = MONOTONIC,
    ) -> None:
        self.clock = clock
        try:
            self.opts = cast(OptionsT, self.Options.model_validate(dict(options or {})))
        except ValidationError as exc:
            raise PolicyError(f"invalid {self.name} options: {_problems(exc)}") from exc
        self.sections = dict(sections or {})
        self.setup()

    def setup(self) -> None:
        """Build the policy's own state; ``opts``, ``sections`` and ``clock`` are set (one constructor for all)."""

    def compose(self, create: Callable[[str], Policy]) -> None:
        """Called once after construction with the registry's factory: a policy made of others creates them here."""

    def share_decisions(self) -> None:
        """Called once when this router's replicas share their decisions (``shared_state``).

        Two replicas can take requests of one new prefix at the same moment, before either has heard of
        the other's decision. A policy whose choice there rests on what only one replica knows (its own
        traffic, its own learned constants) then makes them disagree; one that can choose from what every
        replica sees alike does so from now on. Nothing changes by default.
        """

    def use_memory(self, budget_bytes: int) -> None:
        """Called once with the bytes of ``memory.budget_bytes`` the policy's own per-worker state may hold.

        That is the ``policy`` share of the budget (``extproc/memory.py``) for the routing policy, none for
        the decode policy of prefill/decode pairs. Nothing is kept by default.
        """

    def memory_bytes(self) -> int:
        """Estimated bytes the policy's own per-worker state holds now (``/metrics``, part ``policy``)."""
        return 0

    @abstractmethod
    def select(self, request: RoutingRequest, candidates: list[Candidate]) -> Decision:
        """Rank ``candidates`` (never empty) for ``request``."""

    def explain(self, request: RoutingRequest, candidates: list[Candidate]) -> Decision:
        """What ``select`` would answer now, with nothing changed (the debug port's "explain this prompt").

        The default is ``select`` itself, right for a policy whose ``select`` only reads its state. A
        policy whose ``select`` moves anything (a turn counter, a random generator, an LRU order)
        overrides this, so that an explained prompt never changes the next real decision.
        """
        return self.select(request, candidates)

    def learned(self, worker_id: str) -> dict[str, float]:
        """What the policy has learned of one worker (its cost constants, say), for the debug view; none here."""
        return {}

    def on_routed(self, request: RoutingRequest, decision: Decision) -> None:
        """Called after a decision is sent to Envoy (update own state)."""

    def on_complete(self, request: RoutingRequest, worker: Worker) -> None:
        """Called when the request's ext_proc stream ends (response fully sent)."""

    def on_load(self, worker: Worker, load: WorkerLoad) -> None:
        """Called with each load report as it arrives (learn from it here; ``select`` only reads)."""

    def on_evicted(self, worker_id: str, keys: Sequence[int]) -> None:
        """Called when the worker's KV events say it evicted these blocks from its GPU pool (router block keys)."""

    def remove_worker(self, worker_id: str) -> None:
        """Called when a worker left the fleet (or moved to another address): forget what was kept on it."""


class RandomTieBreakOptions(PolicyOptions):
    """Options every policy with a random tie-break has."""

    seed: int | None = Field(
        None,
        description="Seed of the tie-break's random generator (none: a new one each start, as the peer does; "
        "benchmarks set it so that a run repeats).",
    )


RandomOptionsT = TypeVar("RandomOptionsT", bound=RandomTieBreakOptions)


class RandomTieBreakPolicy(Policy[RandomOptionsT]):
    """A policy that breaks ties with its own random generator (``_rng``, seeded by its ``seed`` option).

    ``explain`` runs ``select`` and puts the generator back, so an explained prompt draws nothing the next
    real decision would have drawn.
    """

    _rng: random.Random

    def setup(self) -> None:
        self._rng = random.Random(self.opts.seed)

    def explain(self, request: RoutingRequest, candidates: list[Candidate]) -> Decision:
        state = self._rng.getstate()
        try:
            return self.select(request, candidates)
        finally:
            self._rng.setstate(state)

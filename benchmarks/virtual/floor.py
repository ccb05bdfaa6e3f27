"""The perfect-information floor of the virtual fleet: routing that sees every worker's true state.

Peers only tell us who routes better than whom; this reference says how much is left. For each request
it reads each simulated worker's actual state, which no router can see:

- its radix cache's exact match for the prompt (a read-only walk of the tree, no LRU touch), and the
  prompts ahead of it in that worker (waiting, being prefilled, running): they are in the tree by the
  time the request is admitted, so the longest prefix shared with any of them counts as cached too;
- the step under way (how long until it ends) and the prefill work queued before the request, each
  waiting request priced with its true uncached tokens by the worker's own timing profile;

and sends the request where its time to first token would be lowest now (ties: the fewest requests in
the worker, then the worker's position). It is greedy: it does not plan for later requests, so a policy
that places prefixes with the future in mind can beat it; it is the best any router can do one request
at a time with nothing hidden, which is what "closing the gap" is measured against. It lives here, in
the benchmarks, and reads simulator objects: nothing in ``extproc/`` can do this.

``sees_step_phase=False`` makes a second reference, the same floor blind to one thing: where the decode
step under way is. A request that arrives during a decode step waits for its end, anywhere from nothing to a
whole step (7-8 ms for one to eight requests on an 8B H100 profile); no router can see that phase (the worker
reports nothing of it, and it drifts with every step), so the blind floor charges half a step, the expected
wait. Between the two floors lies what only the step's phase buys: on a light fleet, where every cold request
waits for some decode step, that is most of round robin's excess at p99.

The phase-blind floor still reads the true end of a prefill under way, and that end carries the phase: a
prompt that arrived during a decode step started its prefill when that step ended. Sending a cold prompt to a
worker whose prefill ends in a millisecond (it is prefilled next, with no decode step between) is how that
floor placed half its cold prompts at 64 workers (gsp, half the knee, 2026-12-07). ``sees_prefill_start=False``
makes a third reference, the router's view: blind to the phase, and placing each prefill batch's end where a
router would, from when its requests were sent, with half the decode step under way as their expected wait
(``ObservedScheduler.seen_prefill_end``); until that end it counts the prefill as under way, after it the
worker as decoding whatever runs there. Everything else it reads as the other floors do.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from typing import Any

from sglang_workers.sim.radix_cache import RadixCache, TreeNode
from sglang_workers.sim.request import Request
from sglang_workers.sim.scheduler import Scheduler
from sglang_workers.sim.timing import TimingProfile

__all__ = ["ObservedRadixCache", "ObservedScheduler", "PerfectInformationFloor", "cached_prefix"]


class ObservedRadixCache(RadixCache):
    """The simulator's radix cache, also counting the changes to what it holds (the floor's memo key)."""

    mutations: int = 0

    def reset(self) -> None:
        self.mutations += 1
        super().reset()

    def insert(self, key: Sequence[int], salt: str | None = None, inserted_len: int = 0) -> int:
        self.mutations += 1
        return super().insert(key, salt, inserted_len)

    def _delete_leaf(self, leaf: TreeNode) -> None:
        self.mutations += 1
        super()._delete_leaf(leaf)


class ObservedScheduler(Scheduler):
    """The simulator's scheduler, also noting when the step under way ends (what the floors read).

    Beside the true end of the step under way it keeps the end of the last prefill batch as a router would
    place it (``seen_prefill_end``): a batch whose first request arrived during a decode step started when that
    step ended, which no router sees, so it is placed half that step after the request arrived; a batch run
    right behind a prefill starts where the previous one's end was placed.
    """

    busy_until: float = 0.0  # loop time at which the current step ends
    seen_prefill_end: float = 0.0  # loop time at which a router would place the last prefill batch's end

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._arrived: dict[str, float] = {}  # rid -> loop time it was queued, until its prefill starts
        self._last_kind = ""  # the step before the one starting: "prefill", "decode" or "" (none yet)
        self._last_start = 0.0
        self._last_seconds = 0.0

    def enqueue(self, req: Request) -> Request:
        self._arrived[req.rid] = asyncio.get_running_loop().time()
        return super().enqueue(req)

    async def _sleep(self, simulated: float) -> None:
        now = asyncio.get_running_loop().time()
        seconds = simulated / self.config.speedup
        self.busy_until = now + seconds
        step = self.steps[-1] if self.steps else None
        if step is not None and step.kind == "prefill":
            arrived = [self._arrived.pop(rid) for rid in step.rids if rid in self._arrived]
            first = min(arrived, default=-math.inf)  # none: the next chunk of a chunked prompt
            start = now
            if self._last_kind == "decode" and self._last_start <= first < now:
                start = first + self._last_seconds / 2  # it waited for the decode step under way: half, expected
            elif self._last_kind == "prefill":
                start = max(first, self.seen_prefill_end)  # behind the last prefill: where its end was placed
            self.seen_prefill_end = start + seconds
        if step is not None:
            self._last_kind, self._last_start, self._last_seconds = step.kind, now, seconds
        await super()._sleep(simulated)


def cached_prefix(cache: RadixCache, tokens: Sequence[int], salt: str | None = None) -> int:
    """Tokens of ``tokens`` the radix cache holds as a whole-page prefix, without changing the tree."""
    page = cache.page_size
    key = list(tokens[: len(tokens) // page * page])
    node, matched = cache.root, 0
    while key:
        plain = key[0] if page == 1 else tuple(key[:page])
        child = node.children.get(plain if salt is None else (salt, plain))
        if child is None:
            break
        n = min(len(child.key), len(key))
        same = 0
        while same < n and child.key[same : same + page] == key[same : same + page]:
            same += page
        same = min(same, n)
        matched += same
        if same < len(child.key):
            break
        node, key = child, key[same:]
    return matched


def _page_chain(tokens: Sequence[int], page: int) -> list[int]:
    """One hash per whole page of ``tokens``, each over the page and every page before it.

    Two prompts share their first ``k`` pages exactly when their ``k``-th chain hashes are equal (up to
    a 64-bit collision), so the longest prefix a prompt shares with any of a set of prompts is a walk
    down its own chain through the set of theirs, not a comparison with each.
    """
    chain, h = [], 0
    for start in range(0, len(tokens) // page * page, page):
        h = hash((h, tuple(tokens[start : start + page])))
        chain.append(h)
    return chain


def _shared_with(chain: Sequence[int], seen: set[int], page: int) -> int:
    """Tokens of the prompt whose page chain is ``chain`` that some prompt of ``seen`` shares from the start."""
    depth = 0
    for h in chain:
        if h not in seen:
            break
        depth += 1
    return depth * page


class PerfectInformationFloor:
    """Greedy lowest-TTFT-now placement over the simulated workers' true state."""

    name = "floor"

    def __init__(
        self,
        schedulers: dict[str, ObservedScheduler],
        *,
        sees_step_phase: bool = True,
        sees_prefill_start: bool = True,
    ) -> None:
        self.schedulers = schedulers
        self.sees_step_phase = sees_step_phase
        self.sees_prefill_start = sees_prefill_start or sees_step_phase  # the phase shows when a prefill started
        if sees_step_phase:
            self.name = "floor"
        else:
            self.name = "floor-phase-blind" if self.sees_prefill_start else "floor-router-view"
        # Per scheduler: the queue's state when last priced, its prefill seconds and the page chains of the
        # prompts in it. A worker's queue changes less often than requests arrive: pricing it again for
        # every decision made a deep queue quadratic (minutes a run past the knee).
        self._queues: dict[int, tuple[Any, float, set[int]]] = {}

    def choose(self, tokens: Sequence[int]) -> str:
        """The worker where ``tokens`` would see its first token soonest."""
        now = asyncio.get_running_loop().time()
        best: tuple[float, int, int] | None = None
        chosen = ""
        for position, (worker_id, scheduler) in enumerate(self.schedulers.items()):
            ttft = self.ttft(scheduler, tokens, now)
            crowd = len(scheduler.waiting) + scheduler.num_running_reqs()
            key = (round(ttft, 6), crowd, position)
            if best is None or key < best:
                best, chosen = key, worker_id
        return chosen

    def ttft(self, scheduler: ObservedScheduler, tokens: Sequence[int], now: float) -> float:
        """Seconds until ``tokens`` would get its first token on ``scheduler`` if sent there now."""
        profile, speedup = scheduler.profile, scheduler.config.speedup
        page = scheduler.cache.page_size
        budget = scheduler.config.chunked_prefill_size
        wait = 0.0
        if not self.sees_prefill_start:
            # A prefill under way until where a router would place its end; after it, decode steps of an unseen
            # phase wherever anything runs (the batch just prefilled too, if its prefill has in fact not ended).
            decoding = [*scheduler.running, *scheduler.prefilling]
            if now < scheduler.seen_prefill_end:
                wait = (scheduler.seen_prefill_end - now) * speedup
            elif decoding:
                context = sum(r.kv_len for r in decoding) + len(decoding)
                wait = profile.decode_time(len(decoding), context) / 2
        elif scheduler.prefilling or (scheduler.running and self.sees_step_phase):
            wait = max(0.0, scheduler.busy_until - now) * speedup
        elif scheduler.running:  # a decode step under way, its phase unseen: half a step on average
            context = sum(r.kv_len for r in scheduler.running) + len(scheduler.running)
            wait = profile.decode_time(len(scheduler.running), context) / 2
        queued, seen = self._queue(scheduler)
        prompt = list(tokens)
        cached = max(
            cached_prefix(scheduler.cache, prompt[:-1]), _shared_with(_page_chain(prompt[:-1], page), seen, page)
        )
        new = len(prompt) - cached
        own = _batched_prefill(profile, [(new, cached)], budget)
        return (wait + queued + own) / speedup

    def _queue(self, scheduler: ObservedScheduler) -> tuple[float, set[int]]:
        """GPU seconds of the prefill queued on ``scheduler``, and the page chains of every prompt in it.

        Prefill queued before a new request: the chunked request's rest, then every waiting request (first
        come, first served), each with its true uncached tokens (what the tree holds, or what a prompt
        ahead of it will have put there), packed into batches of the chunk budget.
        """
        cache = scheduler.cache
        chunked = scheduler.chunked
        state = (
            cache.mutations if isinstance(cache, ObservedRadixCache) else None,
            chunked.rid if chunked is not None else None,
            chunked.kv_len if chunked is not None else 0,
            tuple(r.rid for r in scheduler.prefilling),
            tuple(r.rid for r in scheduler.running),
            tuple(r.rid for r in scheduler.waiting),
        )
        memo = self._queues.get(id(scheduler))
        if memo is not None and state[0] is not None and memo[0] == state:
            return memo[1], memo[2]
        page = cache.page_size
        chunks: list[tuple[int, int]] = []
        if chunked is not None:
            rest = len(chunked.fill_ids) - chunked.kv_len
            if rest > 0:
                chunks.append((rest, chunked.kv_len))
        seen: set[int] = set()
        for r in (*scheduler.prefilling, *scheduler.running):
            seen.update(_page_chain(r.input_ids, page))
        for req in scheduler.waiting:
            prompt = req.fill_ids
            cached = max(
                cached_prefix(cache, prompt[:-1], req.cache_salt),
                _shared_with(_page_chain(prompt[:-1], page), seen, page),
            )
            chunks.append((len(prompt) - cached, cached))
            seen.update(_page_chain(prompt, page))
        queued = _batched_prefill(scheduler.profile, chunks, scheduler.config.chunked_prefill_size)
        self._queues[id(scheduler)] = (state, queued, seen)
        return queued, seen


def _batched_prefill(profile: TimingProfile, chunks: list[tuple[int, int]], budget: int) -> float:
    """GPU seconds of prefill batches of at most ``budget`` new tokens each (a request may span batches)."""
    total, room = 0.0, budget
    batch: list[tuple[int, int]] = []
    prefill_time = profile.prefill_time
    for uncached, context in chunks:
        new, cached = uncached, context
        while new > 0:
            take = min(new, room)
            batch.append((take, cached))
            new, cached, room = new - take, cached + take, room - take
            if room <= 0:
                total += prefill_time(batch)
                batch, room = [], budget
    if batch:
        total += prefill_time(batch)
    return float(total)

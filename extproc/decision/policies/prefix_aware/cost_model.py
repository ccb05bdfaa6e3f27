"""Each worker's cost model, learned online from what the worker reports and what the router sent it.

A prefill of ``L`` uncached tokens after ``P`` cached ones costs ``c0 + a*L + b*(L^2 + 2*P*L)``
seconds on a worker (a per-request floor, the weights, attention over the context). The constants
differ by model, GPU, TP degree and quantization, and drift with the software, so nothing here is
configured per fleet: the configured values are priors, and each worker's constants are estimated
from two sources every time its load report changes:

- SGLang (0.5.23) reports cumulative counters in ``/v1/loads``: ``total_prefill_busy_us`` (time spent
  in prefill steps) and ``total_prefill_uncached_tokens``. Between two reports their deltas say how
  long the worker spent prefilling how many tokens.
- The router knows the requests it sent the worker, in order, with the uncached and cached tokens
  it predicted for each. Attributing the reported tokens to those requests first in, first out
  (SGLang's default schedule) gives each window's request count and attention work.

A least-squares fit of ``busy = c0*batches + a*tokens + b*attention`` over those windows, in
relative errors, forgotten over ``memory_s`` (a worker that gets slower or faster is tracked within
tens of seconds), regularized toward the worker's common scale (a direction the traffic does not
excite follows how fast the worker is overall) and kept non-negative, gives the constants. It works
in units of the prior (each constant is the prior times a learned scale), so the three features are
of one magnitude.

Why the common scale and not the priors: a worker that mostly sees hits (128 new tokens after 2,048
cached) measures its floor well and its per-token and attention constants hardly at all. Ridged toward
the priors those kept the priors' values, and on a GPU seven times slower than the priors a cold
2k-token prompt was priced at half its 1.36 s all run long: cold prompts queued on the slow workers of a
mixed fleet and made its TTFT p99 (virtual fleet, 4 x H100 + 4 x A100 at 7.31x, gsp at half the knee:
p99 1,651 ms, 1,440 with the common scale; docs/benchmarks-log.md, 2026-12-08).

The floor ``c0`` is paid once per prefill batch (one forward pass, however many requests it holds:
eight 64-token requests in one batch take 18 ms on an H200, one alone 7 ms; docs/sim-worker.md). A
worker whose ``/metrics`` counts its prefill batches (``sglang:cuda_graph_passes_total``, read beside
``/v1/loads``) is fitted on that count; then a request sent while a batch is forming behind the
running one joins it and is priced without a floor of its own, from the first report that carries
the count (the priors' ``c0`` is already a batch's floor), not only once a window has been fitted:
in a fleet's first half second every sent request paid the prior's 20 ms floor, a hot prefix's holder
looked hundreds of ms behind while it had 20 ms of work, and bursts piled onto workers still
computing the prefix (virtual fleet, 64 workers, hot-burst). Without the count, each request is
counted as a batch of its own: a burst prefilled in fewer batches than requests then fits a floor
that leaves too little per token (a 2k-token cold prefill predicted at a third of its time).

The same reports give the worker's prefill utilisation (busy time per wall second, averaged over
``utilization_window_s``), its decode step time against batch size (from ``decode_moments``, the
cumulative moments of SGLang's own decode-step regression), the share of the last second or so its
prefills left to decode (SGLang runs a prefill batch whenever one forms: a hot holder's running requests
write a token only between prefills, ``token_seconds``), and its queued prefill work
(``num_waiting_uncached_tokens``), which the router's own sends since the report are added to.
Workers that report none of this (older SGLang, ``/metrics`` fallback) keep the priors and are
judged by the router's own record of what it sent.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from extproc.fleet.reports import WorkerLoad

__all__ = ["DecodeModel", "FleetMean", "Learning", "PrefillModel", "WorkerCostModel"]

_MIN_SCALE = 1e-4  # a learned constant never drops below this fraction of its prior (or below zero)
_MAX_SENT = 4096  # requests remembered per worker for attribution (older ones are dropped)
_SENT_HORIZON_S = 120.0  # a request not attributed after this long was served from cache or elsewhere
_DECODE_SHARE_WINDOW_S = 1.0  # time constant of the share of time prefills leave to decode (two polls)
_MIN_DECODE_SHARE = 0.05  # a worker prefilling back to back still decodes now and then


@dataclass(frozen=True)
class PrefillModel:
    """``c0 + a*L + b*(L^2 + 2*P*L)`` seconds for ``L`` uncached tokens after ``P`` cached ones."""

    c0: float
    a: float
    b: float

    def seconds(self, new_tokens: float, cached_tokens: float) -> float:
        if new_tokens <= 0:
            return 0.0
        n, p = new_tokens, cached_tokens
        return self.c0 + self.a * n + self.b * (n * n + 2.0 * p * n)


@dataclass(frozen=True)
class DecodeModel:
    """One decode step over ``B`` running requests takes ``d0 + d1*B`` seconds."""

    d0: float
    d1: float

    def step_seconds(self, batch: int) -> float:
        return self.d0 + self.d1 * batch if batch > 0 else 0.0


class FleetMean:
    """The mean learned constants of the workers that have measured themselves, kept as running sums.

    A worker that has not measured a window yet is judged by it. Each refit of a worker replaces that
    worker's share of the sums, so a report costs the same whatever the fleet's size (walking every
    worker's model per report made a 256-worker fleet's reports quadratic).
    """

    def __init__(self) -> None:
        self._sums = [0.0, 0.0, 0.0]
        self._members: dict[int, PrefillModel] = {}  # id of a worker's model -> its share of the sums
        self.model: PrefillModel | None = None  # the mean (None: nobody has measured anything)

    def update(self, member: object, learned: PrefillModel) -> None:
        old = self._members.get(id(member))
        self._members[id(member)] = learned
        for i, name in enumerate(("c0", "a", "b")):
            self._sums[i] += getattr(learned, name) - (getattr(old, name) if old is not None else 0.0)
        self._refresh()

    def remove(self, member: object) -> None:
        old = self._members.pop(id(member), None)
        if old is None:
            return
        for i, name in enumerate(("c0", "a", "b")):
            self._sums[i] -= getattr(old, name)
        self._refresh()

    def _refresh(self) -> None:
        n = len(self._members)
        self.model = PrefillModel(*(max(0.0, total / n) for total in self._sums)) if n else None


@dataclass
class _Sent:
    new: float  # uncached tokens predicted, not yet attributed to a report
    cached: float
    at: float  # when it was routed (the router's clock)
    seconds: float  # its predicted prefill under the model of that time


@dataclass(frozen=True)
class Learning:
    """How every worker's model learns (``policy.prefix_aware``'s options say)."""

    memory_s: float = 10.0  # time constant of the fit's memory: older windows weigh exp(-age / memory_s)
    prior_weight: float = 1.0  # the priors' say in the fit (1: a hundredth of one window's)
    min_window_tokens: int = 256  # a window with fewer tokens (and under 50 ms busy) is not fitted
    min_attributed_share: float = 0.5  # ... nor one whose tokens the router's sends explain less of
    utilization_window_s: float = 5.0  # time constant of the utilisation and concurrency averages


class WorkerCostModel:
    """One worker's learned prefill and decode constants, utilisation and queued prefill work."""

    def __init__(
        self,
        prior: PrefillModel,
        decode_prior: DecodeModel,
        learning: Learning = Learning(),
        fleet: FleetMean | None = None,
    ) -> None:
        self.prior = prior
        self.decode_prior = decode_prior
        self.learning = learning
        self._scale = [1.0, 1.0, 1.0]  # learned constants = prior * scale
        # Forgotten sums of the relative-error least squares (normal equations), and the prior's weight
        # in windows: 0.01 means a hundredth of one window's say.
        self._gram = [[0.0] * 3 for _ in range(3)]
        self._fitted_at: float | None = None
        self._rhs = [0.0] * 3
        self._ridge = 0.01 * learning.prior_weight
        self._sent: deque[_Sent] = deque()
        self._last: WorkerLoad | None = None  # the report the current window started at
        self._window_start: WorkerLoad | None = None
        self._rate_report: WorkerLoad | None = None
        self.utilization = 0.0  # how busy the worker is, for pricing its time: the larger of the two below
        self.prefill_utilization = 0.0  # prefill busy time per wall second
        self.waiting_share = 0.0  # share of polls that found requests waiting
        # Share of the last second or so not spent prefilling: what is left to decode. SGLang runs a
        # prefill batch whenever one forms, so a hot holder's running requests advance only this often.
        self.decode_share = 1.0
        # Requests in the worker (running + waiting), time-averaged over ``utilization_window_s``: how
        # many requests a second of prefill there delays (running decodes stall during it, waiting
        # requests start later). In an M/G/1 queue that mean is rho / (1 - rho); measured, it also tells
        # a worker kept busy by one client at a time (1) from one with a queue.
        self.concurrency = 0.0
        self.windows = 0  # windows fitted so far (0: the model is still the prior)
        self._decode = decode_prior
        self._decode_moments: tuple[float, ...] | None = None
        self._mean_new = 512.0  # running mean of uncached tokens per request, for unattributed tokens
        self.reuse = 0.5  # fraction of prompt tokens found cached on this worker, recent requests (a prior)
        self._queue_level = 0.0  # seconds of prefill queued as of _queue_clock
        self._queue_clock = 0.0
        # Until this worker has measured a window it is judged by its fleet's measured mean, for its
        # prefill and its queue alike; once it has, its own constants join that mean.
        self.fleet = fleet
        # Set at the worker's first report that counts its prefill batches: ``c0`` is then a batch's floor
        # (else a request's).
        self.floor_per_batch = False
        # When the batch now forming (requests waiting behind the running prefill) starts: a request sent
        # before then joins it. None: nothing is forming; the next request that finds a queue opens one.
        self._forming_until: float | None = None
        # Requests in that batch: SGLang prefills a batch in one pass and each gets its first token at its end,
        # so a request that joins delays every one of them by its own prefill.
        self.forming_requests = 0

    # -- the learned figures ----------------------------------------------------------------------
    @property
    def learned(self) -> PrefillModel:
        """Its own fitted constants (the priors before its first window)."""
        s = self._scale
        return PrefillModel(self.prior.c0 * s[0], self.prior.a * s[1], self.prior.b * s[2])

    @property
    def prefill(self) -> PrefillModel:
        """The constants that price its prefills and its queue: its own once measured, else the fleet's mean."""
        if self.windows or self.fleet is None or self.fleet.model is None:
            return self.learned
        return self.fleet.model

    @property
    def decode(self) -> DecodeModel:
        return self._decode

    def token_seconds(self, running: int) -> float:
        """Seconds between two output tokens of a request running beside ``running`` others here now."""
        return self._decode.step_seconds(max(running, 1)) / max(self.decode_share, _MIN_DECODE_SHARE)

    def queued_seconds(self, now: float) -> float:
        """Prefill work queued on the worker now: its last report plus what was sent since, drained in real time."""
        return max(0.0, self._queue_level - (now - self._queue_clock))

    def joins_forming_batch(self, now: float) -> bool:
        """A request sent now joins the batch waiting behind the running one, so it adds no floor of its own."""
        return self.floor_per_batch and self._forming_until is not None and now < self._forming_until

    def idle(self) -> None:
        """The router has nothing in flight there: nothing of its own is queued (others' work may be)."""
        if self._last is None or not self._last.num_waiting_reqs:
            self._queue_level = 0.0

    def _restart_queue(self, load: WorkerLoad) -> None:
        """A new report: restart the virtual queue from what was waiting then, and replay the later sends.

        The report says how many requests were waiting. SGLang admits in arrival order, so when the
        router sent them, the waiting ones are its newest sends not yet prefilled (first in, first out),
        and its own prediction of each (it knows what it matched) is better than the worker's own
        token estimate (a miss-rate guess under ``fcfs``). Waiting requests beyond the router's own
        are someone else's: they count with the reported uncached tokens' share.
        """
        model = self.prefill
        waiting = load.num_waiting_reqs
        outstanding = [sent for sent in self._sent if sent.at <= load.polled_at]
        own = outstanding[len(outstanding) - min(waiting, len(outstanding)) :] if waiting else []
        level = sum(model.seconds(sent.new, sent.cached) for sent in own)
        others = waiting - len(own)
        if others > 0:
            tokens = load.num_waiting_uncached_tokens
            share = tokens * others / waiting if tokens is not None else others * self._mean_new
            level += model.c0 * others + model.a * share + model.b * share * share / others
        if self.floor_per_batch and waiting > 1:
            level -= model.c0 * (waiting - 1)  # what waits now is admitted as one batch: one floor
        waiting_work = level
        recent: list[_Sent] = []
        for sent in reversed(self._sent):  # newest first; only the few sent during the poll are newer
            if sent.at <= load.polled_at:
                break
            recent.append(sent)
        if load.num_running_reqs:
            # A prefill batch under way counts as running, not waiting: the report cannot show it. The
            # router's own account of what it sent (drained in real time) can, so it stands when larger.
            # A worker that reports nothing running has no batch under way: the report alone is exact.
            own_account = self.queued_seconds(load.polled_at) - sum(sent.seconds for sent in recent)
            level = max(level, own_account)
        self._queue_level, self._queue_clock = level, load.polled_at
        # The waiting requests start once what runs now is done; until then a new one joins them.
        self._forming_until = load.polled_at + (level - waiting_work) if waiting else None
        self.forming_requests = waiting
        for sent in reversed(recent):
            self._enqueue(sent.seconds, sent.at)

    def _enqueue(self, seconds: float, now: float) -> None:
        self._queue_level = max(0.0, self._queue_level - (now - self._queue_clock)) + seconds
        self._queue_clock = now

    # -- inputs -----------------------------------------------------------------------------------
    def sent(self, new_tokens: int, cached_tokens: int, now: float) -> float:
        """The router sent the worker a request predicted to prefill these tokens; returns its predicted seconds."""
        seconds = self.prefill.seconds(new_tokens, cached_tokens)
        if self.floor_per_batch and seconds > 0:
            if self.joins_forming_batch(now):
                seconds = max(0.0, seconds - self.prefill.c0)
                self.forming_requests += 1
            else:  # it opens the next batch: starting once the queue drains (now, if there is none)
                queued = self.queued_seconds(now)
                self._forming_until = now + queued if queued > 0 else None
                self.forming_requests = 1 if queued > 0 else 0
        self._enqueue(seconds, now)
        if new_tokens + cached_tokens > 0:
            self.reuse += 0.05 * (cached_tokens / (new_tokens + cached_tokens) - self.reuse)
        if new_tokens > 0:
            self._sent.append(_Sent(float(new_tokens), float(cached_tokens), now, seconds))
            self._mean_new += 0.05 * (new_tokens - self._mean_new)
        while len(self._sent) > _MAX_SENT or (self._sent and now - self._sent[0].at > _SENT_HORIZON_S):
            self._sent.popleft()
        return seconds

    def observe(self, load: WorkerLoad | None) -> None:
        """A load report (the same object again is a no-op): learn from what changed since the last one."""
        if load is None or load is self._last or load.polled_at <= (self._last.polled_at if self._last else -1.0):
            return
        previous, self._last = self._last, load
        if load.total_prefill_batches is not None:
            self.floor_per_batch = True  # it counts its batches: it batches what waits (module docstring)
        self._observe_concurrency(previous, load)
        self._observe_decode(load)
        self._observe_prefill(previous, load)
        self._restart_queue(load)  # after attribution: what is left of the router's sends is outstanding

    def _observe_concurrency(self, previous: WorkerLoad | None, load: WorkerLoad) -> None:
        present = float(load.num_running_reqs + load.num_waiting_reqs)
        if previous is None:
            self.concurrency = present
            return
        elapsed = load.polled_at - previous.polled_at
        alpha = 1.0 - math.exp(-elapsed / self.learning.utilization_window_s)
        self.concurrency += alpha * (present - self.concurrency)

    def _observe_prefill(self, previous: WorkerLoad | None, load: WorkerLoad) -> None:
        if load.total_prefill_busy_us is None or load.total_prefill_uncached_tokens is None:
            return
        if previous is None or previous.total_prefill_busy_us is None or previous.total_prefill_uncached_tokens is None:
            self._window_start = self._rate_report = load
            self._align(load)
            return
        if (
            load.total_prefill_busy_us < previous.total_prefill_busy_us
            or load.total_prefill_uncached_tokens < previous.total_prefill_uncached_tokens
        ):
            # The worker restarted (its counters went back): start over from this report, keep what was learned.
            self._window_start = self._rate_report = load
            self._align(load)
            return
        self._observe_utilization(load)
        self._observe_window(load)

    def _align(self, load: WorkerLoad) -> None:
        """At a first report: its counters already count the sends it no longer reports waiting.

        The waiting ones are the newest (first in, first out), plus perhaps one being prefilled.
        """
        before = [sent for sent in self._sent if sent.at <= load.polled_at]
        keep = min(len(before), load.num_waiting_reqs + (1 if load.num_running_reqs else 0))
        self._sent = deque([*before[len(before) - keep :], *(sent for sent in self._sent if sent.at > load.polled_at)])

    def _observe_utilization(self, load: WorkerLoad) -> None:
        start = self._rate_report
        assert start is not None and start.total_prefill_busy_us is not None and load.total_prefill_busy_us is not None
        elapsed = load.polled_at - start.polled_at
        if elapsed < 0.2:  # two polls that close together measure mostly jitter
            return
        busy = (load.total_prefill_busy_us - start.total_prefill_busy_us) / 1e6 / max(load.ranks, 1)
        alpha = 1.0 - math.exp(-elapsed / self.learning.utilization_window_s)
        self.prefill_utilization += alpha * (min(busy / elapsed, 1.0) - self.prefill_utilization)
        fast = 1.0 - math.exp(-elapsed / _DECODE_SHARE_WINDOW_S)
        self.decode_share += fast * (1.0 - min(busy / elapsed, 1.0) - self.decode_share)
        # How often a request arriving here has to wait (in M/G/1 that is the utilisation itself). It
        # also sees a worker whose queue waits for KV memory, not for prefill time.
        waited = 1.0 if (load.num_waiting_reqs or start.num_waiting_reqs) else 0.0
        self.waiting_share += alpha * (waited - self.waiting_share)
        self.utilization = max(self.prefill_utilization, self.waiting_share)
        self._rate_report = load

    def _observe_window(self, load: WorkerLoad) -> None:
        start = self._window_start
        assert start is not None and start.total_prefill_uncached_tokens is not None
        assert load.total_prefill_uncached_tokens is not None and load.total_prefill_busy_us is not None
        assert start.total_prefill_busy_us is not None
        tokens = load.total_prefill_uncached_tokens - start.total_prefill_uncached_tokens
        busy = (load.total_prefill_busy_us - start.total_prefill_busy_us) / 1e6
        if tokens < self.learning.min_window_tokens and busy < 0.05:
            if tokens == 0 and busy == 0:
                self._window_start = load  # idle: nothing to learn, nothing to carry over
                self._drop_admitted(load)
            return  # too little work to measure yet: widen the window
        self._window_start = load
        requests, attention, unattributed = self._attribute(tokens)
        self._drop_admitted(load)
        if unattributed > (1.0 - self.learning.min_attributed_share) * tokens:
            # Most of the window is work this router did not send (another replica's requests, or a
            # misprediction): their count and attention are guessed from this router's own mean, and a
            # fit on the guess drifts apart between replicas (each learns a worker it rarely uses as
            # slow, and keeps avoiding it). The window is not fitted.
            return
        batches = _delta(start.total_prefill_batches, load.total_prefill_batches)
        if batches is not None:
            self.floor_per_batch = True
            floors = float(batches)
        elif self.floor_per_batch:
            return  # the count is missing at one end: this window's requests are not its batches
        else:
            floors = requests
        self._fit(floors, float(tokens), attention, busy, load.polled_at)

    def _attribute(self, tokens: float) -> tuple[float, float, float]:
        """The requests (fractional) and attention work (L^2 + 2PL) behind ``tokens`` reported prefilled.

        The third figure is the tokens that no request this router sent accounts for.
        """
        requests = attention = 0.0
        remaining = tokens
        while remaining > 0 and self._sent:
            head = self._sent[0]
            take = min(head.new, remaining)
            requests += take / head.new if head.new else 0.0
            attention += take * take + 2.0 * head.cached * take
            remaining -= take
            if take < head.new:  # chunked: the rest continues after the part just counted
                head.new -= take
                head.cached += take
            else:
                self._sent.popleft()
        if remaining > 0:  # tokens of requests the router did not send (another router) or mispredicted
            mean = max(self._mean_new, 1.0)
            requests += remaining / mean
            attention += remaining * mean
        return requests, attention, max(remaining, 0.0)

    def _drop_admitted(self, load: WorkerLoad) -> None:
        """With nothing waiting at the report, every earlier send has been admitted: forget the rest."""
        if load.num_waiting_reqs == 0 and not load.num_waiting_uncached_tokens and load.num_running_reqs == 0:
            while self._sent and self._sent[0].at < load.polled_at:
                self._sent.popleft()

    def _fit(self, floors: float, tokens: float, attention: float, busy: float, now: float) -> None:
        """Refit ``busy = scale . (c0*floors, a*tokens, b*attention)`` with this window added.

        ``floors``: the window's prefill batches where the worker counts them, else its requests.

        Least squares of relative errors (a window of 5 ms counts as much as one of 5 s, so a fast
        worker is fitted as well as a slow one), forgotten with time constant ``memory_s`` (whatever
        the traffic, the fit reflects the last tens of seconds), with a ridge pulling the
        scales toward the worker's common scale (1, the priors, before any window) so directions the
        traffic never excites follow the worker's overall pace, and non-negative (a constant never goes
        below zero).
        """
        if busy <= 0:
            return
        x = [self.prior.c0 * floors / busy, self.prior.a * tokens / busy, self.prior.b * attention / busy]
        lam = math.exp(-(now - self._fitted_at) / self.learning.memory_s) if self._fitted_at is not None else 1.0
        self._fitted_at = now
        for i in range(3):
            self._rhs[i] = lam * self._rhs[i] + x[i]
            for j in range(3):
                self._gram[i][j] = lam * self._gram[i][j] + x[i] * x[j]
        self._scale = _ridge_nonnegative(self._gram, self._rhs, self._ridge)
        self.windows += 1
        if self.fleet is not None:
            self.fleet.update(self, self.learned)

    def _observe_decode(self, load: WorkerLoad) -> None:
        moments = load.decode_moments
        previous, self._decode_moments = self._decode_moments, moments
        if moments is None or previous is None or moments[0] < previous[0]:
            return
        n, sb, st, sbb, sbt = (moments[i] - previous[i] for i in range(5))
        if n < 8:
            self._decode_moments = previous  # keep accumulating until enough steps for a regression
            return
        spread = n * sbb - sb * sb
        mean_t = st / n / 1e6
        if spread > 1e-9:
            d1 = max(0.0, (n * sbt - sb * st) / spread / 1e6)
            d0 = max(0.0, mean_t - d1 * sb / n)
        else:  # one batch size only: the slope is unknown, keep the prior's
            d1 = self._decode.d1
            d0 = max(0.0, mean_t - d1 * sb / n)
        blend = 0.3  # exponential smoothing over windows
        self._decode = DecodeModel(
            self._decode.d0 + blend * (d0 - self._decode.d0), self._decode.d1 + blend * (d1 - self._decode.d1)
        )


def _delta(before: int | None, after: int | None) -> int | None:
    """How much a cumulative counter grew between two reports (None: missing, or it went back)."""
    if before is None or after is None or after < before:
        return None
    return after - before


def _solve3(m: list[list[float]], v: list[float], free: list[int]) -> dict[int, float] | None:
    """Solve the ``free`` rows and columns of ``m x = v`` (Gaussian elimination; None if singular)."""
    n = len(free)
    rows = [[m[i][j] for j in free] + [v[i]] for i in free]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(rows[r][col]))
        if abs(rows[pivot][col]) < 1e-12:
            return None
        rows[col], rows[pivot] = rows[pivot], rows[col]
        for r in range(n):
            if r != col:
                f = rows[r][col] / rows[col][col]
                rows[r] = [a - f * b for a, b in zip(rows[r], rows[col])]
    return {free[i]: rows[i][n] / rows[i][i] for i in range(n)}


def _ridge_nonnegative(gram: list[list[float]], rhs: list[float], ridge: float) -> list[float]:
    """``argmin |Xs - 1|^2 + ridge |s - t|^2`` over ``s >= _MIN_SCALE`` (active set on three variables).

    ``t`` is the common scale: the one factor ``k`` that fits ``|X(k, k, k) - 1|^2`` best, with the ridge's
    own pull toward 1 (so it is 1 before any window).
    """
    target = (sum(rhs) + ridge) / (sum(sum(row) for row in gram) + ridge)
    m = [[gram[i][j] + (ridge if i == j else 0.0) for j in range(3)] for i in range(3)]
    v = [rhs[i] + ridge * target for i in range(3)]
    fixed: dict[int, float] = {}
    for _ in range(3):
        free = [i for i in range(3) if i not in fixed]
        # Move the fixed variables' contribution to the right-hand side.
        v_free = [v[i] - sum(m[i][j] * x for j, x in fixed.items()) for i in range(3)]
        solution = _solve3(m, v_free, free)
        if solution is None:
            break
        negative = [i for i, x in solution.items() if x < _MIN_SCALE]
        if not negative:
            return [fixed.get(i, solution.get(i, 1.0)) for i in range(3)]
        for i in negative:
            fixed[i] = _MIN_SCALE
    return [fixed.get(i, 1.0) for i in range(3)]

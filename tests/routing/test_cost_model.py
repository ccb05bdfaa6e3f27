"""The learned cost model against a worker whose true constants are known.

``FifoWorker`` serves requests one at a time in arrival order, each taking ``c0 + a*L + b*(L^2 +
2*P*L)`` seconds of prefill, and reports what SGLang 0.5.23's ``/v1/loads`` reports (cumulative
prefill busy time and tokens, the waiting queue) every poll. The model sees only those reports and
the requests the router sent: the tests check that the constants it learns converge to the true
ones, track a worker that slows down, and that its queue estimate follows the real queue.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from extproc.decision.policies.prefix_aware.cost_model import DecodeModel, Learning, PrefillModel, WorkerCostModel
from extproc.fleet.reports import WorkerLoad

PRIOR = PrefillModel(0.02, 4e-5, 1e-9)
DECODE_PRIOR = DecodeModel(0.01, 1e-4)


@dataclass
class FifoWorker:
    truth: PrefillModel
    clock: float = 0.0
    busy_until: float = 0.0
    busy_s: float = 0.0
    tokens: int = 0
    queue: list[tuple[float, int, int]] = field(default_factory=list)  # (start, new, cached) not yet begun

    def submit(self, now: float, new: int, cached: int) -> None:
        self.advance(now)
        start = max(now, self.busy_until)
        self.busy_until = start + self.truth.seconds(new, cached)
        self.queue.append((start, new, cached))

    def advance(self, now: float) -> None:
        """Account every prefill that has finished by ``now`` (counters move when a step ends, as in SGLang)."""
        self.clock = now
        done = []
        for item in self.queue:
            start, new, cached = item
            end = start + self.truth.seconds(new, cached)
            if end <= now:
                self.busy_s += end - start
                self.tokens += new
                done.append(item)
        for item in done:
            self.queue.remove(item)

    def report(self, now: float) -> WorkerLoad:
        self.advance(now)
        waiting = [(new, cached) for start, new, cached in self.queue if start > now]
        return WorkerLoad(
            num_running_reqs=len(self.queue) - len(waiting),
            num_waiting_reqs=len(waiting),
            num_waiting_uncached_tokens=sum(new for new, _ in waiting),
            total_prefill_uncached_tokens=self.tokens,
            total_prefill_busy_us=int(self.busy_s * 1e6),
            polled_at=now,
        )


def _drive(
    model: WorkerCostModel,
    worker: FifoWorker,
    seconds: float,
    rate: float,
    rng: random.Random,
    start: float = 0.0,
    poll_s: float = 0.5,
    prompt: Callable[[random.Random], tuple[int, int]] | None = None,
) -> float:
    """Poisson arrivals of varied prompts for ``seconds``; the model gets every send and every poll.

    ``prompt`` draws a request's (new, cached) tokens; by default a wide mix of both."""
    now, next_poll = start, start + poll_s
    end = start + seconds
    while now < end:
        now += rng.expovariate(rate)
        while next_poll <= now:
            model.observe(worker.report(next_poll))
            next_poll += poll_s
        if prompt is None:
            new = rng.choice([64, 256, 1024, 2048, 4096])
            cached = rng.choice([0, 0, 1024, 4096, 8192])
        else:
            new, cached = prompt(rng)
        model.sent(new, cached, now)
        worker.submit(now, new, cached)
    return now


@pytest.mark.parametrize(
    "truth",
    [
        PrefillModel(0.015, 23e-6, 0.52e-9),  # the 8B-on-H100 shape
        PrefillModel(0.030, 64e-6, 0.64e-9),  # 70B TP4 on H200
        PrefillModel(0.060, 92e-6, 2.1e-9),  # the 8B profile on a GPU four times slower
    ],
)
def test_learned_constants_converge_to_the_workers_own(truth: PrefillModel) -> None:
    model = WorkerCostModel(PRIOR, DECODE_PRIOR)
    worker = FifoWorker(truth)
    rng = random.Random(1)
    rate = 0.4 / truth.seconds(1500, 2500)  # ~40% utilisation
    _drive(model, worker, 120.0, rate, rng)
    learned = model.prefill
    assert model.windows > 50
    assert learned.c0 == pytest.approx(truth.c0, rel=0.15)
    assert learned.a == pytest.approx(truth.a, rel=0.10)
    assert learned.b == pytest.approx(truth.b, rel=0.20)
    # what routing uses: the predicted prefill of typical requests
    for new, cached in ((128, 4096), (2048, 0), (4096, 8192)):
        assert learned.seconds(new, cached) == pytest.approx(truth.seconds(new, cached), rel=0.05)
    assert model.utilization == pytest.approx(0.4, abs=0.2)  # a 5 s average of Poisson traffic at 40%


def test_a_worker_that_slows_down_is_tracked_within_seconds() -> None:
    fast = PrefillModel(0.015, 23e-6, 0.52e-9)
    model = WorkerCostModel(PRIOR, DECODE_PRIOR)
    worker = FifoWorker(fast)
    rng = random.Random(2)
    rate = 0.3 / fast.seconds(1500, 2500)
    now = _drive(model, worker, 60.0, rate, rng)
    assert model.prefill.seconds(2048, 0) == pytest.approx(fast.seconds(2048, 0), rel=0.05)
    worker.truth = slow = PrefillModel(0.030, 46e-6, 1.04e-9)  # twice as slow (e.g. a throttled GPU)
    _drive(model, worker, 30.0, rate / 2, rng, start=now + 5)
    assert model.prefill.seconds(2048, 0) == pytest.approx(slow.seconds(2048, 0), rel=0.10)


def test_a_slow_worker_that_mostly_sees_hits_learns_its_cold_prefill_from_its_pace() -> None:
    """Hits (128 new tokens after 2,048 cached) pin the floor and say little of the per-token constants: those
    follow the worker's overall pace, not the priors, so a GPU seven times slower than the priors prices its
    rare cold prompt near what it takes. Ridged toward the priors, a cold 2k-token prompt was learned at about
    four fifths of its time here, and at half on the virtual clock (an A100 in a mixed fleet,
    docs/benchmarks-log.md, 2026-12-07 late night)."""
    truth = PrefillModel(0.015 * 7, 23e-6 * 7, 0.52e-9 * 7)
    model = WorkerCostModel(PRIOR, DECODE_PRIOR)
    worker = FifoWorker(truth)

    def mostly_hits(rng: random.Random) -> tuple[int, int]:
        return (2048, 0) if rng.random() < 0.1 else (128, 2048)

    _drive(model, worker, 90.0, 0.3 / truth.seconds(400, 1800), random.Random(5), prompt=mostly_hits)
    assert model.windows > 20
    assert model.prefill.seconds(2048, 0) == pytest.approx(truth.seconds(2048, 0), rel=0.15)
    assert model.prefill.seconds(128, 2048) == pytest.approx(truth.seconds(128, 2048), rel=0.15)


def test_queued_work_follows_the_reported_queue_and_own_sends() -> None:
    truth = PrefillModel(0.015, 23e-6, 0.52e-9)
    model = WorkerCostModel(truth, DECODE_PRIOR)  # exact priors: only the queue is under test
    worker = FifoWorker(truth)
    for i in range(10):  # a burst: ten 2k-token prompts at once
        model.sent(2048, 0, 0.01 * i)
        worker.submit(0.01 * i, 2048, 0)
    expected = worker.busy_until - 0.1
    assert model.queued_seconds(0.1) == pytest.approx(expected, rel=0.05)
    model.observe(worker.report(0.3))
    assert model.queued_seconds(0.3) == pytest.approx(worker.busy_until - 0.3, rel=0.15)
    assert model.queued_seconds(worker.busy_until + 1) == 0.0


def test_reports_without_counters_keep_the_priors_and_a_restart_is_survived() -> None:
    model = WorkerCostModel(PRIOR, DECODE_PRIOR)
    model.observe(WorkerLoad(num_waiting_reqs=4, polled_at=1.0))  # older SGLang: no counters
    assert model.prefill == PRIOR and model.windows == 0
    assert model.queued_seconds(1.0) == pytest.approx(4 * PRIOR.seconds(512, 0), rel=0.01)
    truth = PrefillModel(0.015, 23e-6, 0.52e-9)
    worker = FifoWorker(truth)
    now = _drive(model, worker, 40.0, 5.0, random.Random(3), start=2.0)
    learned = model.prefill
    restarted = FifoWorker(truth)  # counters back to zero
    model.observe(restarted.report(now + 1))
    assert model.prefill == learned  # nothing lost, nothing learned from the negative delta
    _drive(model, restarted, 20.0, 5.0, random.Random(4), start=now + 1)
    assert model.prefill.seconds(2048, 0) == pytest.approx(truth.seconds(2048, 0), rel=0.05)


def test_decode_step_regression_from_decode_moments() -> None:
    model = WorkerCostModel(PRIOR, DECODE_PRIOR)
    d0, d1 = 0.007e6, 0.06e3  # microseconds: 7 ms + 0.06 ms per running request
    moments = [0.0] * 5
    rng = random.Random(5)
    for poll in range(1, 30):
        for _ in range(50):
            b = rng.randint(1, 64)
            t = d0 + d1 * b
            for i, v in enumerate((1.0, b, t, b * b, b * t)):
                moments[i] += v
        model.observe(WorkerLoad(decode_moments=tuple(moments), polled_at=poll * 0.5))
    assert model.decode.d0 == pytest.approx(0.007, rel=0.02)
    assert model.decode.d1 == pytest.approx(0.06e-3, rel=0.02)


def test_a_worker_that_prefills_most_of_the_time_writes_its_outputs_that_much_slower() -> None:
    """SGLang runs a prefill batch whenever one forms: a worker whose last second was three quarters prefill
    advances its running requests a quarter as often, and ``token_seconds`` says so within a few polls."""
    model = WorkerCostModel(PRIOR, DECODE_PRIOR)
    step = DECODE_PRIOR.step_seconds(100)
    assert model.token_seconds(100) == pytest.approx(step)  # nothing measured: decodes run back to back
    busy_us = 0
    for poll in range(10):
        model.observe(WorkerLoad(total_prefill_busy_us=busy_us, total_prefill_uncached_tokens=0, polled_at=poll * 0.5))
        busy_us += int(0.75 * 0.5e6)  # three quarters of each half second spent prefilling
    assert model.decode_share == pytest.approx(0.25, abs=0.02)
    assert model.token_seconds(100) == pytest.approx(step / 0.25, rel=0.1)
    for poll in range(10, 20):  # the prefills stop: the decodes get the worker back
        model.observe(WorkerLoad(total_prefill_busy_us=busy_us, total_prefill_uncached_tokens=0, polled_at=poll * 0.5))
    assert model.token_seconds(100) == pytest.approx(step, rel=0.05)


def _drive_two_routers(
    mine: WorkerCostModel, theirs: WorkerCostModel, worker: FifoWorker, seconds: float, rng: random.Random
) -> None:
    """One worker behind two router replicas: each sees every load report but only its own sends.

    The other replica places cold prompts here; this one sends the short hits that follow them
    (half the requests, a few percent of the tokens): a replica's own mix says nothing of the other's.
    """
    now, next_poll = 0.0, 0.5
    rate = 0.4 / worker.truth.seconds(1000, 2000)
    while now < seconds:
        now += rng.expovariate(rate)
        while next_poll <= now:
            report = worker.report(next_poll)
            mine.observe(report)
            theirs.observe(report)
            next_poll += 0.5
        new, cached, model = (64, 4096, mine) if rng.random() < 0.5 else (2048, 0, theirs)
        model.sent(new, cached, now)
        worker.submit(now, new, cached)


def test_a_replica_does_not_fit_windows_of_work_another_replica_sent() -> None:
    """Guessing the other replica's requests from one's own mix fits a wrong floor; such windows are skipped."""
    truth = PrefillModel(0.015, 23e-6, 0.52e-9)
    prior = PrefillModel(0.018, 27e-6, 0.6e-9)  # 15-20% off, as a prior for the right GPU class is
    hit, cold = (64, 4096), (2048, 0)

    def run(min_attributed_share: float) -> tuple[WorkerCostModel, WorkerCostModel]:
        learning = Learning(min_attributed_share=min_attributed_share)
        mine = WorkerCostModel(prior, DECODE_PRIOR, learning)
        theirs = WorkerCostModel(prior, DECODE_PRIOR, learning)
        _drive_two_routers(mine, theirs, FifoWorker(truth), 120.0, random.Random(3))
        return mine, theirs

    # Every window fitted: the other's 2048-token prompts were counted as this replica's 64-token
    # requests, ~32 requests each, and the floor learned from them is far off (here too low; with the
    # mixes the other way round, too high: a replica then avoids the worker the other one fills).
    guessed, _ = run(0.0)
    assert abs(guessed.prefill.seconds(*hit) / truth.seconds(*hit) - 1.0) > 0.5
    mine, theirs = run(0.5)
    assert mine.windows < guessed.windows / 2  # windows mostly the other's work are not fitted
    assert mine.prefill.seconds(*hit) == pytest.approx(truth.seconds(*hit), rel=0.25)
    assert theirs.windows > 50  # the replica that sent most of the work still learns (its windows hold a few
    # of the other's hits, guessed: within 30%)
    assert theirs.prefill.seconds(*cold) == pytest.approx(truth.seconds(*cold), rel=0.30)


@dataclass
class BatchingWorker:
    """SGLang's continuous batching: what waits when a prefill batch ends is admitted as the next batch.

    A batch takes ``c0 + sum(a*L + b*(L^2 + 2*P*L))``: the floor once per batch, as the GPU pays it
    (docs/sim-worker.md: eight 64-token requests in one forward take 18 ms on an H200, one takes 7).
    ``counts``: the report carries the worker's prefill-batch count (SGLang's /metrics), or not.
    """

    truth: PrefillModel
    counts: bool = True
    running: list[tuple[int, int]] = field(default_factory=list)
    waiting: list[tuple[int, int]] = field(default_factory=list)
    batch_end: float = 0.0
    busy_s: float = 0.0
    tokens: int = 0
    batches: int = 0

    def _duration(self, batch: list[tuple[int, int]]) -> float:
        t = self.truth
        return t.c0 + sum(t.a * n + t.b * (n * n + 2 * p * n) for n, p in batch)

    def advance(self, now: float) -> None:
        while self.running and self.batch_end <= now:
            self.busy_s += self._duration(self.running)
            self.tokens += sum(n for n, _ in self.running)
            self.batches += 1
            start, self.running, self.waiting = self.batch_end, self.waiting, []
            self.batch_end = start + self._duration(self.running)

    def submit(self, now: float, new: int, cached: int) -> None:
        self.advance(now)
        if self.running:
            self.waiting.append((new, cached))
        else:
            self.running, self.batch_end = [(new, cached)], now + self._duration([(new, cached)])

    def report(self, now: float) -> WorkerLoad:
        self.advance(now)
        return WorkerLoad(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            num_waiting_uncached_tokens=sum(n for n, _ in self.waiting),
            total_prefill_uncached_tokens=self.tokens,
            total_prefill_busy_us=int(self.busy_s * 1e6),
            total_prefill_batches=self.batches if self.counts else None,
            polled_at=now,
        )


def _drive_bursts(model: WorkerCostModel, worker: BatchingWorker, seconds: float, rng: random.Random) -> None:
    """Bursts of a few siblings (one cold prompt's followers, hits) between single cold prompts."""
    now, next_poll = 0.0, 0.5
    while now < seconds:
        now += rng.expovariate(6.0)
        while next_poll <= now:
            model.observe(worker.report(next_poll))
            next_poll += 0.5
        burst = [(2048, 0)] if rng.random() < 0.3 else [(84, 2048)] * rng.randint(2, 8)
        for i, (new, cached) in enumerate(burst):
            at = now + 0.002 * i
            model.sent(new, cached, at)
            worker.submit(at, new, cached)


def test_the_floor_is_learned_per_batch_where_the_worker_counts_its_batches() -> None:
    """Counted per request, bursts batched together fit a floor that leaves too little per token."""
    truth = PrefillModel(0.015, 23e-6, 0.52e-9)
    prior = PrefillModel(0.02, 30e-6, 0.6e-9)
    per_batch = WorkerCostModel(prior, DECODE_PRIOR)
    _drive_bursts(per_batch, BatchingWorker(truth), 120.0, random.Random(7))
    per_request = WorkerCostModel(prior, DECODE_PRIOR)
    _drive_bursts(per_request, BatchingWorker(truth, counts=False), 120.0, random.Random(7))
    assert per_batch.floor_per_batch and not per_request.floor_per_batch
    assert per_batch.windows > 50 and per_request.windows > 50
    cold, hit = (2048, 0), (84, 2048)
    for prompt in (cold, hit):
        assert per_batch.prefill.seconds(*prompt) == pytest.approx(truth.seconds(*prompt), rel=0.05)
    assert per_batch.prefill.c0 == pytest.approx(truth.c0, rel=0.15)
    # Per request, the same reports fit a floor of a few ms: a hit alone is predicted at half its time.
    assert per_request.prefill.c0 < 0.5 * truth.c0
    assert per_request.prefill.seconds(*hit) < 0.6 * truth.seconds(*hit)


def test_a_request_sent_while_a_batch_forms_joins_it_without_a_floor_of_its_own() -> None:
    truth = PrefillModel(0.015, 23e-6, 0.52e-9)
    model = WorkerCostModel(truth, DECODE_PRIOR)
    worker = BatchingWorker(truth)
    for poll in range(1, 4):  # two windows with the batch count: the floor is now a batch's
        model.sent(2048, 0, poll - 0.9)
        worker.submit(poll - 0.9, 2048, 0)
        model.observe(worker.report(float(poll)))
    assert model.floor_per_batch
    model.sent(2048, 0, 4.0)  # runs at once
    assert not model.joins_forming_batch(4.0) and model.forming_requests == 0
    first = model.sent(2048, 0, 4.001)  # waits behind it: opens the next batch, pays its floor
    assert first == pytest.approx(truth.seconds(2048, 0))
    assert model.joins_forming_batch(4.002) and model.forming_requests == 1
    joined = model.sent(84, 2048, 4.002)  # joins that batch: no floor of its own
    assert joined == pytest.approx(truth.seconds(84, 2048) - truth.c0)
    assert model.forming_requests == 2  # a third that joins delays both: they get their first tokens with it
    assert model.queued_seconds(4.002) == pytest.approx(2 * truth.seconds(2048, 0) + joined - 0.002, rel=0.01)
    assert not model.joins_forming_batch(4.0 + truth.seconds(2048, 0) + 0.001)  # that batch has started


def test_a_first_report_that_counts_batches_makes_the_priors_floor_a_batchs() -> None:
    """Before any window is fitted: a burst behind a running prefill is queued as one batch, not one floor each.

    Per request, a fleet's first half second put every sibling of a hot prefix 20 ms (the prior's floor) behind
    the last, and bursts piled onto workers still computing the prefix (virtual fleet, 64 workers, hot-burst).
    """
    prior = PrefillModel(0.02, 40e-6, 1e-9)
    counting = WorkerCostModel(prior, DECODE_PRIOR)
    counting.observe(BatchingWorker(prior).report(0.0))
    silent = WorkerCostModel(prior, DECODE_PRIOR)
    silent.observe(BatchingWorker(prior, counts=False).report(0.0))
    assert counting.floor_per_batch and counting.windows == 0
    assert not silent.floor_per_batch
    hit = (84, 2048)
    for model in (counting, silent):
        model.sent(2048, 0, 0.001)  # a cold prefill runs
        model.sent(*hit, 0.002)  # a sibling waits behind it: it opens the next batch and pays its floor
    assert counting.sent(*hit, 0.003) == pytest.approx(prior.seconds(*hit) - prior.c0)  # joins that batch
    assert silent.sent(*hit, 0.003) == pytest.approx(prior.seconds(*hit))  # a batch of its own
    assert silent.queued_seconds(0.003) - counting.queued_seconds(0.003) == pytest.approx(prior.c0)

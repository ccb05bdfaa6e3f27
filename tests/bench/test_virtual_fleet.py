"""The virtual-clock fleet: the real router and simulated workers in one process, deterministic."""

from __future__ import annotations

import math
import time

import pytest

from benchmarks.fleet.shapes import FLEETS
from benchmarks.virtual.fleet import FLOOR as FLOOR_NAME
from benchmarks.virtual.fleet import run_virtual, virtual_fleet_of
from benchmarks.workloads.cells import WORKLOADS, CellSize


def test_runs_repeat_exactly_and_faster_than_real_time() -> None:
    fleet = virtual_fleet_of(FLEETS["4x8b-h100"])
    workload = WORKLOADS["gsp"](20.0, CellSize(requests=64))
    started = time.monotonic()
    first = run_virtual("prefix-aware", workload, fleet)
    wall = time.monotonic() - started
    again = run_virtual("prefix-aware", workload, fleet)
    assert first.ttft_s == again.ttft_s and first.per_worker == again.per_worker  # same seed, same run
    assert len(first.ttft_s) == 64 and first.errors == 0
    assert first.duration_s > 2.0  # seconds of GPU time were simulated ...
    assert wall < first.duration_s * 5  # ... in less than five times as many seconds on a loaded 2-core machine


def test_a_slowed_fleet_stretches_time_alike_for_round_robin() -> None:
    """GPUs 4x slower and arrivals 4x sparser: a router that reads no clock-time constant (round robin) sees the
    same run, four times as long; the prefix-aware router, whose poll interval and TTLs are clock time, may not."""
    fast = virtual_fleet_of(FLEETS["4x8b-h100"])
    slow = virtual_fleet_of(FLEETS["4x8b-h100"], gpu_slowdown=4.0)
    assert slow.speedup == 0.25 and "GPUs 4x slower" in slow.name and fast.speedup == 1.0
    quick = run_virtual("round-robin", WORKLOADS["gsp"](20.0, CellSize(requests=64)), fast)
    stretched = run_virtual("round-robin", WORKLOADS["gsp"](5.0, CellSize(requests=64, gpu_slowdown=4.0)), slow)
    assert stretched.duration_s == pytest.approx(4 * quick.duration_s, rel=0.02)
    assert sum(stretched.ttft_s) == pytest.approx(4 * sum(quick.ttft_s), rel=0.05)


def test_the_index_is_fed_by_the_workers_events() -> None:
    """A prefix-aware router on the virtual fleet finds the shared system prompts that round robin scatters."""
    fleet = virtual_fleet_of(FLEETS["4x8b-h100"])
    workload = WORKLOADS["gsp"](10.0, CellSize(requests=64))
    ours = run_virtual("prefix-aware", workload, fleet).summary(fleet.workers)
    rr = run_virtual("round-robin", workload, fleet).summary(fleet.workers)
    assert ours["hit_rate"] > rr["hit_rate"] + 0.2
    assert ours["prefill_busy_s"] < rr["prefill_busy_s"]


def test_the_floor_reads_true_state_and_gap_closed_is_measured_against_it() -> None:
    """The perfect-information floor finds shared prefixes from the workers' real caches, with no router."""
    from benchmarks.virtual.cells import gap_closed
    from benchmarks.virtual.fleet import FLOOR

    fleet = virtual_fleet_of(FLEETS["4x8b-h100"], 8)
    assert fleet.workers == 8
    workload = WORKLOADS["gsp"](20.0, CellSize(requests=64))
    floor = run_virtual(FLOOR, workload, fleet).summary(fleet.workers)
    rr = run_virtual("round-robin", workload, fleet).summary(fleet.workers)
    assert floor["errors"] == 0 and floor["hit_rate"] > rr["hit_rate"] + 0.2
    assert floor["ttft_s"]["mean"] < rr["ttft_s"]["mean"]
    assert gap_closed(100.0, 55.0, 50.0) == 0.9 and gap_closed(100.0, 40.0, 50.0) > 1.0
    assert gap_closed(50.0, 40.0, 60.0) != gap_closed(50.0, 40.0, 60.0)  # no gap: NaN, never a fake 100 %


def test_cached_prefix_reads_the_tree_without_touching_it() -> None:
    from benchmarks.virtual.floor import cached_prefix
    from sglang_workers.sim.radix_cache import RadixCache

    cache = RadixCache(4, enable_events=False)
    cache.insert(list(range(12)))
    before = [(n.last_access, len(n.key)) for n in cache.root.children.values()]
    assert cached_prefix(cache, [*range(8), 99, 99, 99, 99]) == 8
    assert cached_prefix(cache, [5, 6, 7, 8]) == 0
    assert [(n.last_access, len(n.key)) for n in cache.root.children.values()] == before  # no split, no LRU touch


def test_the_phase_blind_floor_charges_half_a_decode_step_where_the_floor_sees_its_end() -> None:
    """The one thing the phase-blind floor does not see: where the decode step under way is."""
    import asyncio

    from benchmarks.virtual.floor import ObservedScheduler, PerfectInformationFloor
    from sglang_workers.sim.config import SimWorkerConfig
    from sglang_workers.sim.radix_cache import RadixCache
    from sglang_workers.sim.request import Request
    from sglang_workers.sim.timing import get_profile

    async def estimates() -> tuple[float, float, float, float]:
        profile = get_profile("llama-3.1-8b-h100")
        config = SimWorkerConfig(page_size=16, capacity_tokens=24576, profile=profile.name, speedup=1.0)
        scheduler = ObservedScheduler(config, profile, RadixCache(16, enable_events=False), None, [1])
        decoding = Request("r", list(range(100, 612)), 32)
        decoding.kv_len = 512
        scheduler.running = [decoding]
        now = asyncio.get_running_loop().time()
        scheduler.busy_until = now + 0.001  # the step under way ends in 1 ms
        prompt = list(range(5000, 7048))
        seeing = PerfectInformationFloor({"w0": scheduler}).ttft(scheduler, prompt, now)
        blind_floor = PerfectInformationFloor({"w0": scheduler}, sees_step_phase=False)
        blind = blind_floor.ttft(scheduler, prompt, now)
        scheduler.running = []
        idle = blind_floor.ttft(scheduler, prompt, now)
        return seeing, blind, idle, profile.decode_time(1, 513)

    seeing, blind, idle, step = asyncio.run(estimates())
    assert idle > 0.03  # a cold 2k-token prefill
    assert abs(seeing - (idle + 0.001)) < 1e-9  # the true end of the step under way
    assert abs(blind - (idle + step / 2)) < 1e-9  # half a step: the expected wait, phase unseen
    assert step / 2 > 0.001  # so here the blind floor expects the longer wait


def test_the_router_view_floor_places_a_prefill_end_where_a_router_would() -> None:
    """A cold prompt sent during a decode step starts its prefill when that step ends: the phase-blind floor reads
    that true end, the router-view floor expects half the step instead, as a router must."""
    import asyncio

    from benchmarks.virtual.clock import VirtualClockLoop, simulator_clock
    from benchmarks.virtual.floor import ObservedRadixCache, ObservedScheduler, PerfectInformationFloor
    from sglang_workers.sim.config import SimWorkerConfig
    from sglang_workers.sim.timing import get_profile

    async def scenario() -> dict[str, float]:
        loop = asyncio.get_running_loop()
        profile = get_profile("llama-3.1-8b-h100")
        config = SimWorkerConfig(page_size=16, capacity_tokens=24576, profile=profile.name, speedup=1.0)
        scheduler = ObservedScheduler(config, profile, ObservedRadixCache(16, enable_events=False), None, [1])
        scheduler.start()
        try:
            decoding = scheduler.submit(list(range(100, 612)), 400)
            await decoding.updates.get()  # prefilled: it decodes from now on
            await asyncio.sleep(0.0123)  # somewhere inside a decode step
            sent = loop.time()
            step = scheduler.steps[-1]
            residual = scheduler.busy_until - sent
            cold = scheduler.submit(list(range(5000, 7048)), 8)
            await asyncio.sleep(residual + 0.01)  # the decode step has ended; the cold prompt's prefill is under way
            now = loop.time()
            prefill, before = scheduler.steps[-1], scheduler.steps[-2]
            assert before is step and before.kind == "decode" and prefill.kind == "prefill"
            prompt = list(range(9000, 11048))
            figures = {
                "sent": sent,
                "residual": residual,
                "step": step.duration,
                "prefill": prefill.duration,
                "seen_end": scheduler.seen_prefill_end,
                "true_end": scheduler.busy_until,
                "now": now,
                "blind": PerfectInformationFloor({"w": scheduler}, sees_step_phase=False).ttft(scheduler, prompt, now),
                "view": PerfectInformationFloor({"w": scheduler}, sees_step_phase=False, sees_prefill_start=False).ttft(
                    scheduler, prompt, now
                ),
            }
            await cold.updates.get()
            figures["first_token"] = loop.time()
            return figures
        finally:
            await scheduler.stop()

    loop = VirtualClockLoop()
    try:
        with simulator_clock(loop):
            f = loop.run_until_complete(scenario())
    finally:
        loop.close()
    assert 0 < f["residual"] < f["step"] and abs(f["residual"] - f["step"] / 2) > 1e-4
    assert f["true_end"] == pytest.approx(f["sent"] + f["residual"] + f["prefill"], abs=1e-9)
    assert f["first_token"] == pytest.approx(f["true_end"], abs=1e-6)
    assert f["seen_end"] == pytest.approx(f["sent"] + f["step"] / 2 + f["prefill"], abs=1e-9)  # the expected wait
    # Each floor waits for the prefill under way to end where it places that end, then prefills the new prompt.
    assert f["view"] - f["blind"] == pytest.approx(f["seen_end"] - f["true_end"], abs=1e-9)


@pytest.mark.parametrize("reference", ["floor", "floor-phase-blind"])
def test_a_figure_without_a_gap_is_judged_by_the_same_inequality_as_a_bound(reference: str) -> None:
    from benchmarks.virtual.cells import meets_targets
    from benchmarks.virtual.fleet import FLOOR, FLOOR_PHASE_BLIND

    prefix = {FLOOR: "", FLOOR_PHASE_BLIND: "blind_"}[reference]

    def cell(rr: float, ours: float, floor: float, rr99: float, ours99: float, floor99: float) -> dict[str, object]:
        runs = {
            "round-robin": [{"mean": rr, "p99": rr99}],
            "prefix-aware": [{"mean": ours, "p99": ours99}],
            reference: [{"mean": floor, "p99": floor99}],
        }
        gap = {
            m: [(a - b) / (a - c) if a > c else float("nan")]
            for m, a, b, c in (("mean", rr, ours, floor), ("p99", rr99, ours99, floor99))
        }
        return {"runs": runs, f"{prefix}gap_closed_mean": gap["mean"], f"{prefix}gap_closed_p99": gap["p99"]}

    assert meets_targets(cell(100, 55, 50, 100, 60, 50), reference)  # 90 % / 80 %
    assert not meets_targets(cell(100, 56, 50, 100, 60, 50), reference)  # 88 % of the mean gap
    # The floor's p99 above round robin's (no gap): ours must be under 0.2 x rr + 0.8 x floor.
    assert meets_targets(cell(100, 55, 50, 800, 700, 1000), reference)
    assert meets_targets(cell(100, 55, 50, 800, 960, 1000), reference)
    assert not meets_targets(cell(100, 55, 50, 800, 961, 1000), reference)
    # A cell judged against a floor it did not run does not meet the target.
    other = FLOOR_PHASE_BLIND if reference == FLOOR else FLOOR
    assert not meets_targets(cell(100, 55, 50, 100, 60, 50), other)


def test_the_suite_counts_the_cells_that_meet_the_target_against_each_floor_run(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The suite's last lines judge issue 41's target (the phase-blind floor) and the full floor's."""
    from prefix_router.cli import main as cli_main

    argv = ["bench", "--suite", "virtual-fleet", "--workloads", "gsp", "--sizes", "4", "--loads", "0.5"]
    argv += ["--requests", "40", "--seeds", "0", "--policies", "round-robin,prefix-aware,floor,floor-phase-blind"]
    assert cli_main(argv) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("Cells where")]
    assert [line.split(" to ", 1)[1].split(":")[0] for line in lines] == [
        "the phase-blind floor (the target)",
        "the full floor (the physical limit)",
    ]
    assert all(line.endswith(" of 1.") for line in lines)


def test_a_recorded_run_keeps_each_request_and_decides_the_same() -> None:
    """Per-request records (the policy's prediction beside the floor's view) change no decision."""
    fleet = virtual_fleet_of(FLEETS["4x8b-h100"])
    workload = WORKLOADS["gsp"](20.0, CellSize(requests=48))
    plain = run_virtual("prefix-aware", workload, fleet)
    recorded = run_virtual("prefix-aware", workload, fleet, record=True)
    assert recorded.ttft_s == plain.ttft_s and recorded.per_worker == plain.per_worker and not plain.records
    records = recorded.records
    assert len(records) == 48 and sorted(r["ttft_s"] for r in records) == sorted(plain.ttft_s)
    first = records[0]
    assert first["reason"] == "cold" and first["cached_tokens"] == 0 and first["true_cached_tokens_now"] == 0
    assert first["predicted_ttft_s"] > 0 and first["floor_estimate_here_s"] > 0
    assert all(r["floor_estimate_best_s"] <= r["floor_estimate_here_s"] for r in records)
    hits = [r for r in records if r["reason"] == "prefix-hit" and r["cached_tokens"] > 0]
    assert hits and all(r["predicted_new_tokens"] < r["prompt_tokens"] for r in hits)
    # What every worker holds of the prompt: the chosen one's share is at most the best's, and a hit's holder counts.
    assert first["true_holders"] == 0 and first["true_cached_tokens_best"] == 0
    assert all(r["true_cached_tokens_now"] <= r["true_cached_tokens_best"] for r in records)
    assert all(r["true_holders"] >= 1 for r in records if r["true_cached_tokens_now"] > 0)
    assert max(r["true_holders"] for r in records) <= 4
    # The chosen worker's state: the first request finds every worker idle; one decoding has requests running.
    assert first["worker_state"] == "idle" and first["idle_workers"] == 4 and first["worker_running"] == 0
    states = {r["worker_state"] for r in records}
    assert states <= {"idle", "prefilling", "decoding", "waiting"} and len(states) > 1
    assert all(r["worker_running"] > 0 for r in records if r["worker_state"] == "decoding")
    assert all(r["idle_workers"] >= 1 for r in records if r["worker_state"] == "idle")
    # Every candidate the policy scored, the chosen one among them with the figures recorded for the choice.
    for r in records:
        chosen = r["candidates"][r["worker"]]
        assert chosen["ttft_s"] == r["predicted_ttft_s"] and chosen["new_tokens"] == r["predicted_new_tokens"]
        assert chosen["floor_estimate_s"] == r["floor_estimate_here_s"]
        assert chosen["true_cached_tokens"] == r["true_cached_tokens_now"] and chosen["state"] == r["worker_state"]
    assert all(len(r["candidates"]) == 4 for r in records)  # a fleet this small is scored in full
    # A cold prompt is one no candidate was predicted to hold any of; a hit went to the deepest predicted match.
    for r in records:
        predicted = {wid: c["cached_tokens"] for wid, c in r["candidates"].items()}
        if r["reason"] == "cold":
            assert not any(predicted.values())
        if r["reason"] == "prefix-hit":
            assert predicted[r["worker"]] == max(predicted.values()) > 0


def test_the_floor_prices_each_queue_once_per_state_and_as_if_anew(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The floor memoizes a worker's queued prefill by the queue's and the tree's state: the same choices."""
    from benchmarks.virtual.floor import PerfectInformationFloor

    fleet = virtual_fleet_of(FLEETS["4x8b-h100"])
    workload = WORKLOADS["gsp"](90.0, CellSize(requests=120))  # past the knee: queues build
    memoized = run_virtual(FLOOR_NAME, workload, fleet)
    original = PerfectInformationFloor._queue
    priced: list[int] = []

    def anew(self: PerfectInformationFloor, scheduler):  # type: ignore[no-untyped-def]
        self._queues.clear()
        priced.append(len(scheduler.waiting))
        return original(self, scheduler)

    monkeypatch.setattr(PerfectInformationFloor, "_queue", anew)
    fresh = run_virtual(FLOOR_NAME, workload, fleet)
    assert max(priced) >= 3  # the queues the memo skips were there
    assert fresh.ttft_s == memoized.ttft_s and fresh.per_worker == memoized.per_worker


def test_page_chains_find_the_longest_shared_prefix_as_a_comparison_does() -> None:
    import random

    from benchmarks.virtual.floor import _page_chain, _shared_with

    rng = random.Random(3)
    page = 4
    stems = [[rng.randrange(50) for _ in range(40)] for _ in range(3)]
    prompts = [s[: rng.randrange(0, 41)] + [rng.randrange(50) for _ in range(rng.randrange(12))] for s in stems * 6]
    for i, prompt in enumerate(prompts):
        others = prompts[:i]
        seen = {h for other in others for h in _page_chain(other, page)}
        by_comparison = 0
        for other in others:
            n, same = min(len(prompt), len(other)) // page * page, 0
            while same < n and prompt[same : same + page] == other[same : same + page]:
                same += page
            by_comparison = max(by_comparison, same)
        assert _shared_with(_page_chain(prompt, page), seen, page) == by_comparison


def test_a_workloads_token_ids_are_computed_once_and_follow_a_cut() -> None:
    workload = WORKLOADS["gsp"](20.0, CellSize(requests=16))
    ids = workload.token_ids()
    assert workload.token_ids() is ids and len(ids) == 16
    workload.requests = workload.requests[:5]
    assert workload.token_ids() == ids[:5]


def test_the_routers_memory_budget_bounds_what_its_policy_keeps() -> None:
    """``memory_budget_bytes`` is the router's ``memory.budget_bytes``: at the default the order-of-use ledgers of
    4 workers fit its ``policy`` share; at 1 MiB (52 KB for the policy) none does, and the policy keeps nothing."""
    fleet = virtual_fleet_of(FLEETS["4x8b-h100"])
    workload = WORKLOADS["multiturn"](20.0, CellSize(requests=64))
    default = run_virtual("prefix-aware", workload, fleet)
    small = run_virtual("prefix-aware", workload, fleet, memory_budget_bytes=2**20)
    assert 0 < default.policy_memory_bytes <= 0.05 * 256 * 2**20
    assert small.policy_memory_bytes == 0 and small.errors == 0 and len(small.ttft_s) == 64


def test_ours_minus_the_phase_blind_floor_is_paired_by_seed_with_its_interval() -> None:
    from benchmarks.virtual.cells import cell_markdown, paired_difference
    from benchmarks.virtual.fleet import FLOOR_PHASE_BLIND

    mean, low, high = paired_difference([1.0, 2.0, 3.0], [0.0, 0.0, 0.0])  # differences 1, 2, 3: sd 1
    assert mean == 2.0 and (low, high) == pytest.approx((2.0 - 4.303 / 3**0.5, 2.0 + 4.303 / 3**0.5))
    # Seeds that move ours and the floor together: a spread of 10 ms between seeds, 1 ms between the two.
    mean, low, high = paired_difference([0.011, 0.021, 0.031, 0.041], [0.010, 0.020, 0.030, 0.040])
    assert mean == pytest.approx(0.001) and high - low == pytest.approx(0.0, abs=1e-12)
    one = paired_difference([0.5], [0.4])
    assert one[0] == pytest.approx(0.1) and math.isnan(one[1]) and math.isnan(one[2])
    runs = {
        "prefix-aware": [
            {"mean": m, "p50": m, "p99": 3 * m, "hit_vs_oracle": 1.0, "max_mean": 1.0} for m in (0.05, 0.06)
        ],
        FLOOR_PHASE_BLIND: [
            {"mean": m, "p50": m, "p99": 3 * m, "hit_vs_oracle": 1.0, "max_mean": 1.0} for m in (0.04, 0.05)
        ],
    }
    cell = {"fleet": "f", "workload": "w", "load": 0.5, "rate": 1.0, "requests": 10, "seeds": [0, 1], "runs": runs}
    cell["blind_difference_mean"] = paired_difference([0.05, 0.06], [0.04, 0.05])
    cell["blind_difference_p99"] = paired_difference([0.15, 0.18], [0.12, 0.15])
    head = cell_markdown(cell)[0]
    assert (
        "prefix-aware minus the phase-blind floor, seed by seed: +10.0 ms (95 % interval +10.0 to +10.0) in mean"
        in head
    )
    assert "+30.0 ms (95 % interval +30.0 to +30.0) in p99" in head
    assert "router-view" not in head
    cell["view_difference_mean"] = paired_difference([0.05, 0.06], [0.045, 0.055])
    cell["view_difference_p99"] = paired_difference([0.15, 0.18], [0.14, 0.17])
    cell["view_gap_closed_mean"], cell["view_gap_closed_p99"] = [0.5, 0.7], [0.8, 1.0]
    head = cell_markdown(cell)[0]
    assert "of the gap to the router-view floor, 60 (50-70) % in mean, 90 (80-100) % in p99" in head
    assert "minus the router-view floor, seed by seed: +5.0 ms (95 % interval +5.0 to +5.0) in mean" in head


def test_a_seeds_figures_do_not_depend_on_the_seeds_run_beside_it() -> None:
    """A cell's knee is measured on one fixed seed's workload, so seed 1 alone and seed 1 after seed 2 are one run.

    Measured on the cell's first seed, the knee (and so the offered rate of "1.72 x the knee") moved with the
    seed list by up to a fifth on agent sessions, and runs of different seed lists could not be paired.
    """
    from benchmarks.virtual.cells import KNEE_SEED, run_cell

    fleet = virtual_fleet_of(FLEETS["4x8b-h100"])
    alone = run_cell("gsp", fleet, 0.8, ["round-robin"], 64, [1])
    beside = run_cell("gsp", fleet, 0.8, ["round-robin"], 64, [2, 1])
    assert KNEE_SEED not in (1, 2)  # neither list holds the seed that measures the knee
    assert alone["knee"] == beside["knee"] > 0
    assert alone["runs"]["round-robin"][0] == beside["runs"]["round-robin"][1]


def test_a_peers_options_reach_that_peer_alone() -> None:
    """``overrides`` are by policy: sgl-router's policy that never follows the cache (a match rate above 1)
    places by tree size alone and hits less, beside a run of its defaults; prefix-aware is not touched."""
    from benchmarks.virtual.cells import run_cell

    fleet = virtual_fleet_of(FLEETS["4x8b-h100"])
    peers = ["sgl-cache-aware", "prefix-aware"]
    plain = run_cell("gsp", fleet, 0.5, peers, 96, [0])["runs"]
    blind = run_cell("gsp", fleet, 0.5, peers, 96, [0], {"sgl-cache-aware": {"cache_threshold": 1.01}})["runs"]
    assert blind["sgl-cache-aware"][0]["hit_vs_oracle"] < plain["sgl-cache-aware"][0]["hit_vs_oracle"]
    assert blind["prefix-aware"][0] == plain["prefix-aware"][0]


@pytest.mark.parametrize("policy", ["round-robin", "least-load", "sgl-cache-aware", "gie-prefix", "dynamo-cost"])
def test_every_peers_run_can_be_recorded(policy: str) -> None:
    """A peer's figures are keyed by the workers it scored, so its records name only workers of the fleet."""
    fleet = virtual_fleet_of(FLEETS["4x8b-h100"])
    workload = WORKLOADS["gsp"](20.0, CellSize(requests=24))
    recorded = run_virtual(policy, workload, fleet, record=True)
    assert len(recorded.records) == 24 and not recorded.errors
    workers = {f"w{i}" for i in range(fleet.workers)}
    for r in recorded.records:
        assert r["worker"] in workers and set(r["candidates"]) <= workers
    if policy == "sgl-cache-aware":  # the matched worker carries its match rate once a prompt repeats a prefix
        matched = [r for r in recorded.records if r["reason"] == "cache-match"]
        assert matched and all(0.5 < r["candidates"][r["worker"]]["match_rate"] <= 1 for r in matched)


def test_the_knee_of_slowed_gpus_scales_with_the_slowdown() -> None:
    """GPUs 16 times slower have a knee 16 times lower. The first probe (8 req/s at 4 workers) is then twice
    past it; read over the whole run, whose queues drained long after the last arrival, it looked half busy, and
    the knee came out 6.2 times lower instead of 16 ("half the knee" overloaded round robin)."""
    from benchmarks.virtual.cells import virtual_knee

    fast = virtual_knee("gsp", virtual_fleet_of(FLEETS["4x8b-h100"]), CellSize(requests=200, seed=0))
    slow_fleet = virtual_fleet_of(FLEETS["4x8b-h100"], None, 16.0)
    slow = virtual_knee("gsp", slow_fleet, CellSize(requests=200, seed=0, gpu_slowdown=16.0))
    assert 14.0 <= fast / slow <= 18.0, (fast, slow)

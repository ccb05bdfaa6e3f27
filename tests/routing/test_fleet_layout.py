"""The per-worker layout a decision reads (page size, DP ranks, storage group) follows what workers report."""

from __future__ import annotations

from extproc.config import EventsConfig, IndexConfig, RouterConfig
from extproc.decision.request import ParsedRequest
from extproc.fleet.blocks import block_keys, chain_seed
from extproc.fleet.workers import Worker, WorkerRegistry
from extproc.serving.app import RouterApp
from tests.support.routing import loopback_workers


def _router(count: int) -> tuple[RouterApp, list[Worker]]:
    workers = loopback_workers(count, 43000)
    config = RouterConfig(events=EventsConfig(enabled=False), index=IndexConfig(default_block_size=16))
    return RouterApp(config, WorkerRegistry(workers)), workers


def _generate(ids: list[int]) -> ParsedRequest:
    return ParsedRequest(path="/generate", kind="generate", model="m", input_ids=ids)


def test_a_new_server_info_changes_the_page_size_the_next_decision_uses() -> None:
    app, (a, b) = _router(2)
    tokens = list(range(1, 129))
    assert app.pipeline.layout.block_size(a) == 16
    a.info = {"page_size": 32}  # discovery replaces the dict on every refresh
    assert app.pipeline.layout.block_size(a) == 32 and app.pipeline.layout.block_size(b) == 16
    app.index.store("w0", block_keys(tokens, 32, chain_seed("")))  # w0 holds the prompt, in 32-token pages
    outcome = app.router.route(_generate(tokens))
    assert outcome.worker is a and outcome.matched_blocks == 4
    assert {c.worker.id: c.block_size for c in outcome.candidates} == {"w0": 32, "w1": 16}
    a.info = {}  # the page size is no longer reported: back to the default
    assert app.pipeline.layout.block_size(a) == 16


def test_a_worker_that_turns_out_to_run_two_ranks_is_looked_up_under_both() -> None:
    app, (a, _b) = _router(2)
    tokens = list(range(1, 65))
    first = app.router.route(_generate(list(range(1000, 1064))))  # a decision before the ranks are known
    app.router.finish(first)
    a.info = {"dp_size": 2}
    app.index.store("w0#dp1", block_keys(tokens, 16, chain_seed("")))  # rank 1 of w0 holds it
    outcome = app.router.route(_generate(tokens))
    assert outcome.worker is a and outcome.dp_rank == 1 and outcome.matched_blocks == 4


def test_departed_workers_leave_the_layout() -> None:
    app, workers = _router(3)
    app.router.route(_generate(list(range(1, 33))))
    assert app.pipeline.layout.known() == set(workers)
    app.registry.reconcile(workers[:2])
    assert app.pipeline.layout.known() == set(workers[:2])

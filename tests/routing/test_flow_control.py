"""Flow control's queue on its own: bands by priority, turns across fairness ids, TTLs, cancels (pure asyncio)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from extproc.config import FlowControlConfig
from extproc.routing.flow_control import Admission, FlowController, ShedError


class Room:
    """Capacity the test hands out: ``has_room`` is true while slots are free."""

    def __init__(self) -> None:
        self.free = 0

    def __call__(self) -> bool:
        return self.free > 0


async def _admitted_in_order(flow: FlowController, room: Room, admissions: list[Admission]) -> list[Admission]:
    order: list[Admission] = []

    async def one(admission: Admission) -> None:
        await flow.admit(admission, room)
        order.append(admission)
        room.free -= 1  # the admitted request takes its slot, as routing does

    tasks = [asyncio.create_task(one(a)) for a in admissions]
    await asyncio.sleep(0.01)
    assert flow.waiting == len(admissions)
    for _ in admissions:  # one slot at a time frees up, as requests end
        room.free += 1
        flow.wake()
        await asyncio.sleep(0.01)
    await asyncio.gather(*tasks)
    return order


async def test_higher_priority_first_then_fairness_ids_take_turns() -> None:
    flow = FlowController(FlowControlConfig(enabled=True, poll_interval_s=10))
    room = Room()
    tenant_a = [Admission(priority=0, fairness_id="a", objective=f"a{i}") for i in range(3)]
    tenant_b = [Admission(priority=0, fairness_id="b", objective=f"b{i}") for i in range(2)]
    urgent = Admission(priority=5, fairness_id="c", objective="urgent")
    order = await _admitted_in_order(flow, room, [*tenant_a, *tenant_b, urgent])
    assert [a.objective for a in order] == ["urgent", "a0", "b0", "a1", "b1", "a2"]
    flow.stop()


async def test_nothing_waits_while_there_is_room() -> None:
    flow = FlowController(FlowControlConfig(enabled=True))
    assert await flow.admit(Admission(priority=-1), lambda: True) == 0.0  # even sheddable: not saturated


async def test_sheddable_ttl_and_queue_bound() -> None:
    flow = FlowController(FlowControlConfig(enabled=True, queue_ttl_s=0.05, max_queued=1, retry_after_s=7))
    with pytest.raises(ShedError) as shed:
        await flow.admit(Admission(priority=-3), lambda: False)
    assert shed.value.reason == "sheddable" and shed.value.retry_after_s == 7
    waiting = asyncio.create_task(flow.admit(Admission(), lambda: False))
    await asyncio.sleep(0.01)
    with pytest.raises(ShedError) as full:
        await flow.admit(Admission(), lambda: False)
    assert full.value.reason == "queue-full"
    with pytest.raises(ShedError) as expired:
        await waiting
    assert expired.value.reason == "queue-ttl" and flow.waiting == 0
    flow.stop()


async def test_a_cancelled_waiter_leaves_its_band() -> None:
    flow = FlowController(FlowControlConfig(enabled=True))
    task = asyncio.create_task(flow.admit(Admission(fairness_id="x"), lambda: False))
    await asyncio.sleep(0.01)
    assert flow.waiting == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert flow.waiting == 0
    flow.stop()


async def test_room_appearing_without_a_request_ending_is_found_by_the_ticker() -> None:
    flow = FlowController(FlowControlConfig(enabled=True, poll_interval_s=0.01))
    room = Room()
    task = asyncio.create_task(flow.admit(Admission(), room))
    await asyncio.sleep(0.03)
    assert not task.done()
    room.free = 1  # e.g. a worker came back: nobody calls wake()
    assert await asyncio.wait_for(task, 1.0) > 0
    flow.stop()


async def test_the_decision_span_records_the_wait() -> None:
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from extproc.config import EventsConfig, RouterConfig
    from extproc.decision.request import ParsedRequest
    from extproc.fleet.workers import Worker, WorkerRegistry
    from extproc.serving.app import RouterApp

    config = RouterConfig(
        events=EventsConfig(enabled=False),
        flow_control=FlowControlConfig(enabled=True, max_in_flight_per_worker=1, poll_interval_s=0.01),
    )
    app = RouterApp(config, WorkerRegistry([Worker(id="w", url="http://127.0.0.1:1", ip="127.0.0.1", port=1)]))
    exporter = InMemorySpanExporter()
    app.telemetry.add_span_processor(SimpleSpanProcessor(exporter))

    def parsed() -> ParsedRequest:
        return ParsedRequest(path="/generate", kind="generate", prompt_text="hello")

    first = await app.router.aroute(parsed())
    second = asyncio.create_task(app.router.aroute(parsed()))
    await asyncio.sleep(0.1)  # the only worker is at its bound: the second waits
    assert not second.done()
    app.router.finish(first)
    outcome = await asyncio.wait_for(second, 2)
    assert outcome.queue_wait_s >= 0.09
    waits: list[Any] = [dict(span.attributes or {})["router.queue_wait_ms"] for span in exporter.get_finished_spans()]
    assert waits[0] == 0 and waits[1] >= 90
    app.router.finish(outcome)
    await app.stop()

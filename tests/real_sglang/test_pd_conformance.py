"""Differential conformance of prefill/decode pairs: a real SGLang 0.5.23 PD pair on this CPU against a simulated one.

One scripted PD session (``run_pd_session``) runs against a real pair (``start_pd_fleet("sglang-cpu", 1, 1)``:
Mooncake over TCP, the CPU adjustment of ``guard/sglang_cpu_pd.py``) and a simulated pair with the same page size
and pool. Both must answer alike: the statuses and body shapes (keys, order, value types) of both halves of
``/generate``, chat and streaming chat, ``cached_tokens`` of a repeated prompt (the prefill side's hit, reported
by decode), decode's output starting with prefill's token, the 400 without a room, a decode waiting for a prefill
that never comes failing (500, the same message) when ``/abort_request`` names it, the ``disaggregation_*``
fields of ``/server_info`` and ``/v1/loads``, and KV events from the prefill worker only.

One real pair for the module (~40-100 s to start, ~7 GB); the whole module stays well under 4 minutes on 2 cores.
"""

from __future__ import annotations

import json
import random
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from prefix_router.fleet import PdFleet, start_pd_fleet
from tests.support.pd import DISAGGREGATION_LOAD_KEYS, pd_body, pd_load, send_pd
from tests.support.sglang_session import shape, shape_differences, timed_only_in_simulator
from tests.support.sim_fixtures import EventSubscriber, get_json, http, sse_events
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.real_sglang, pytest.mark.timeout(600)]

MODEL = "tiny-llama"
PAGE = 16
POOL = 8192
PROMPT = [random.Random(19).randrange(100, 8000) for _ in range(160)]  # 10 pages
CHAT = [{"role": "user", "content": "Tell me how prefill and decode servers share the work of one request."}]
DISAGGREGATION_KEYS = (  # the /server_info server args of a PD worker a router or a dashboard reads
    "disaggregation_mode",
    "disaggregation_transfer_backend",
    "disable_radix_cache",
    "disaggregation_decode_retraction_backup",
)


@dataclass
class PdSession:
    """What one PD session showed: per step, the (status, shape) of each half, and values that must be equal."""

    shapes: dict[str, Any] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)


def _meta_values(body: dict[str, Any]) -> dict[str, Any]:
    meta = body["meta_info"]
    return {k: meta[k] for k in ("prompt_tokens", "completion_tokens", "cached_tokens", "finish_reason")}


def run_pd_session(pd: PdFleet) -> PdSession:
    """The same PD requests, one at a time, against one pair; returns what a client and a router could see."""
    prefill, decode = pd.prefill[0], pd.decode[0]
    out = PdSession()
    events = {"prefill": EventSubscriber(prefill), "decode": EventSubscriber(decode)}
    try:
        time.sleep(0.5)  # past the subscribers' slow-joiner window
        generate = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 16, "ignore_eos": True}}
        for step in ("generate", "generate repeat"):
            (ps, p), (ds, d) = send_pd(prefill, decode, "/generate", pd_body(generate, prefill), timeout=120)
            out.shapes[step] = ((ps, shape(p)), (ds, shape(d)))
            out.values[step] = {
                "prefill": _meta_values(p),
                "decode": _meta_values(d),
                "decode continues prefill": d["output_ids"][:1] == p["output_ids"],
            }
        out.values["events"] = {
            side: sum(len(batch) for _, batch, _ in sub.drain(0.5)) > 0 for side, sub in events.items()
        }
    finally:
        for sub in events.values():
            sub.close()

    chat = {"messages": CHAT, "max_tokens": 6, "ignore_eos": True}
    (ps, p), (ds, d) = send_pd(prefill, decode, "/v1/chat/completions", pd_body(chat, prefill), timeout=120)
    out.shapes["chat"] = ((ps, shape(p)), (ds, shape(d)))
    out.values["chat"] = (p["usage"], d["usage"], p["choices"][0]["finish_reason"], d["choices"][0]["finish_reason"])
    body = pd_body(chat | {"stream": True, "stream_options": {"include_usage": True}}, prefill)
    (ps, p), (ds, d) = send_pd(prefill, decode, "/v1/chat/completions", body, timeout=120)
    chunks = [[json.loads(e) for e in sse_events(raw) if e != "[DONE]"] for raw in (p, d)]
    out.shapes["streaming chat"] = ((ps, shape(chunks[0])), (ds, shape(chunks[1])))
    # The token counts, from each half's closing usage chunk. Not the number of chunks with content: the chat
    # samples at the server's default temperature, and a token whose text is not yet a whole character adds no
    # content, so a real decode stream of 6 tokens carried 5 content chunks in one CI run and 6 in others.
    out.values["streaming chat"] = [
        {k: cs[-1]["usage"][k] for k in ("prompt_tokens", "completion_tokens")} for cs in chunks
    ]
    contents = [sum(1 for c in cs if c["choices"] and c["choices"][0]["delta"].get("content")) for cs in chunks]
    out.values["streaming chat content chunks"] = contents[0] <= 1 and 1 <= contents[1] <= 6  # max_tokens

    for side, worker in (("prefill", prefill), ("decode", decode)):
        status, raw = http("POST", worker.url + "/generate", {"input_ids": PROMPT, "rid": "no-room"})
        out.shapes[f"{side} no room"] = (status, shape(json.loads(raw)))
        out.values[f"{side} no room"] = json.loads(raw)
        status, raw = http("POST", worker.url + "/v1/chat/completions", {"messages": CHAT})
        error = json.loads(raw)
        out.shapes[f"{side} chat no room"] = (status, shape(error))
        out.values[f"{side} chat no room"] = (error["type"], re.sub(r"req\.rid='\w+'", "req.rid=?", error["message"]))
        _, info = get_json(worker, "/server_info")
        out.values[f"{side} server_info"] = {k: info[k] for k in DISAGGREGATION_KEYS}
        out.values[f"{side} bootstrap port"] = info["disaggregation_bootstrap_port"] == (worker.bootstrap_port or 8998)
        _, loads = get_json(worker, "/v1/loads")
        block = loads["loads"][0]["disaggregation"]
        out.values[f"{side} loads"] = (set(block), block["mode"])
        out.values[f"{side} model_info"] = get_json(worker, "/model_info")[1]["disaggregation_mode"]

    # A decode half whose prefill never comes, ended by /abort_request (as a PD router ends a failed pair).
    room = 4242
    lonely = pd_body({"input_ids": PROMPT, "rid": "abandoned", "sampling_params": {"max_new_tokens": 4}}, prefill, room)
    answer: list[tuple[int, bytes]] = []
    thread = threading.Thread(target=lambda: answer.append(http("POST", decode.url + "/generate", lonely, None, 60)))
    thread.start()
    wait_until(lambda: pd_load(decode)["decode_transfer_queue_reqs"] == 1, what="the decode half in its transfer queue")
    out.values["abort answer"] = http("POST", decode.url + "/abort_request", {"rid": "abandoned"})
    thread.join(30)
    status, raw = answer[0]
    out.shapes["aborted decode"] = (status, shape(json.loads(raw)))
    out.values["aborted decode"] = json.loads(raw)
    return out


@pytest.fixture(scope="module")
def sessions() -> tuple[PdSession, PdSession]:
    from sglang_workers.real.installation import find_install, missing_install_reason

    reason = missing_install_reason()
    install = find_install()
    if reason is None and install is not None and install.pd_problems():
        reason = "; ".join(install.pd_problems())
    if reason is not None:
        pytest.skip(reason)
    with start_pd_fleet("sglang-cpu", 1, 1, page_size=PAGE, capacity_tokens=POOL, startup_timeout=400) as real_pair:
        real = run_pd_session(real_pair)
    with start_pd_fleet("sim", 1, 1, page_size=PAGE, capacity_tokens=POOL, model=MODEL, speedup=20) as sim_pair:
        sim = run_pd_session(sim_pair)
    return real, sim


def test_both_halves_answer_with_the_same_statuses_and_shapes(sessions: tuple[PdSession, PdSession]) -> None:
    real, sim = sessions
    assert list(real.shapes) == list(sim.shapes)
    problems = []
    for step, real_shape in real.shapes.items():
        for diff in shape_differences(real_shape, sim.shapes[step]):
            if not timed_only_in_simulator(diff):
                problems.append(f"{step}: {diff}")
    assert problems == []


def test_token_counts_cached_tokens_and_the_first_token_agree(sessions: tuple[PdSession, PdSession]) -> None:
    real, sim = sessions
    for step in ("generate", "generate repeat", "chat", "streaming chat"):
        assert real.values[step] == sim.values[step], step
    assert real.values["streaming chat content chunks"] is sim.values["streaming chat content chunks"] is True
    repeat = real.values["generate repeat"]
    assert repeat["decode"]["cached_tokens"] == repeat["prefill"]["cached_tokens"] == 144  # 9 of 10 pages
    assert repeat["decode continues prefill"] is True


def test_refusals_aborts_and_reports_agree(sessions: tuple[PdSession, PdSession]) -> None:
    real, sim = sessions
    for side in ("prefill", "decode"):
        for what in ("no room", "chat no room", "server_info", "bootstrap port", "loads", "model_info"):
            key = f"{side} {what}"
            assert real.values[key] == sim.values[key], key
        assert real.values[f"{side} loads"] == (set(DISAGGREGATION_LOAD_KEYS), side)
    assert real.values["abort answer"] == sim.values["abort answer"] == (200, b"")
    assert real.values["aborted decode"] == sim.values["aborted decode"]
    assert real.values["aborted decode"]["code"] == 500


def test_kv_events_come_from_the_prefill_worker_only(sessions: tuple[PdSession, PdSession]) -> None:
    real, sim = sessions
    assert real.values["events"] == sim.values["events"] == {"prefill": True, "decode": False}

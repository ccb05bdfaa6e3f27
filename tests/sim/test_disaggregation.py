"""Simulated prefill/decode pairs over real sockets: SGLang 0.5.23's PD requests, hand-off, errors and aborts.

Each worker is a real ``prefix-router sim-worker`` process; the two sides meet through the prefill worker's
bootstrap server exactly as a PD client (smg, sgl-router's mini-lb, our router) makes them meet: the same body,
with the bootstrap fields, sent to both at once.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from prefix_common.addresses import free_ports
from prefix_router.fleet import PdFleet, start_fleet, start_pd_fleet
from tests.support.pd import DISAGGREGATION_LOAD_KEYS, pd_body, pd_load, send_pd
from tests.support.sim_fixtures import EventSubscriber, get_json, http, post_json, sse_events
from tests.support.waiting import wait_until

PAGE = 4
PROMPT = list(range(100, 160))  # 60 tokens: 15 pages


@pytest.fixture(scope="module")
def pair() -> Iterator[PdFleet]:
    with start_pd_fleet("sim", 1, 1, profile="instant", page_size=PAGE, seed=3) as pd:
        yield pd


def test_generate_pair_answers_from_both_and_decode_continues_the_prefill_token(pair: PdFleet) -> None:
    prefill, decode = pair.prefill[0], pair.decode[0]
    body = pd_body({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8}}, prefill)
    (ps, p), (ds, d) = send_pd(prefill, decode, "/generate", body)
    assert (ps, ds) == (200, 200)
    assert p["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert len(p["output_ids"]) == 1 and p["meta_info"]["completion_tokens"] == 1
    assert len(d["output_ids"]) == 8 and d["output_ids"][0] == p["output_ids"][0]
    assert d["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    assert d["meta_info"]["prompt_tokens"] == p["meta_info"]["prompt_tokens"] == len(PROMPT)

    # The same prompt again, new room: the prefill worker's radix cache hits, and decode reports that hit.
    (ps, p2), (ds, d2) = send_pd(prefill, decode, "/generate", pd_body(body, prefill))
    assert (ps, ds) == (200, 200)
    hit = (len(PROMPT) - 1) // PAGE * PAGE
    assert p2["meta_info"]["cached_tokens"] == hit
    assert d2["meta_info"]["cached_tokens"] == hit
    assert d2["output_ids"] == d["output_ids"]  # same prompt and seed: the same tokens


def test_chat_and_streaming_chat_through_the_pair(pair: PdFleet) -> None:
    prefill, decode = pair.prefill[0], pair.decode[0]
    chat = {"messages": [{"role": "user", "content": "Tell me about prefill and decode."}], "max_tokens": 6}
    (ps, p), (ds, d) = send_pd(prefill, decode, "/v1/chat/completions", pd_body(chat, prefill))
    assert (ps, ds) == (200, 200)
    assert p["usage"]["completion_tokens"] == 1 and d["usage"]["completion_tokens"] == 6
    assert d["choices"][0]["finish_reason"] == "length"
    assert d["choices"][0]["message"]["content"].startswith(p["choices"][0]["message"]["content"])

    (ps, _), (ds, raw) = send_pd(prefill, decode, "/v1/chat/completions", pd_body(chat | {"stream": True}, prefill))
    assert (ps, ds) == (200, 200)
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    content = [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"]]
    assert sum(1 for c in content if c) == 6  # one chunk per token, the first of them the prefill's
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_kv_events_come_from_the_prefill_worker_only(pair: PdFleet) -> None:
    prefill, decode = pair.prefill[0], pair.decode[0]
    from_prefill, from_decode = EventSubscriber(prefill), EventSubscriber(decode)
    try:
        from_prefill.sync()
        time.sleep(0.3)  # past the decode subscriber's slow-joiner window too
        from_decode.drain()
        body = pd_body({"input_ids": [7, *PROMPT[::-1]], "sampling_params": {"max_new_tokens": 4}}, prefill)
        (ps, _), (ds, _) = send_pd(prefill, decode, "/generate", body)
        assert (ps, ds) == (200, 200)
        stored = [e for _, batch, _ in from_prefill.drain(0.5) for e in batch if type(e).__name__ == "BlockStored"]
        assert stored, "the prefill worker published no BlockStored"
        assert from_decode.drain(0.3) == []
    finally:
        from_prefill.close()
        from_decode.close()


def test_requests_without_a_room_are_refused_as_sglang_refuses_them(pair: PdFleet) -> None:
    for worker in pair.workers:
        status, body = post_json(worker, "/generate", {"input_ids": PROMPT, "rid": "no-room"})
        assert status == 400
        assert body == {
            "error": {
                "message": "Invalid request: Disaggregated request received without bootstrap room id. "
                "req.rid='no-room'"
            }
        }
        status, body = post_json(worker, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
        assert status == 400
        assert body["object"] == "error" and body["type"] == "BadRequestError" and body["code"] == 400
        assert body["message"].startswith("Invalid request: Disaggregated request received without bootstrap room")


def test_server_info_and_loads_name_the_side(pair: PdFleet) -> None:
    prefill, decode = pair.prefill[0], pair.decode[0]
    _, info = get_json(prefill, "/server_info")
    assert info["disaggregation_mode"] == "prefill"
    assert info["disaggregation_bootstrap_port"] == prefill.bootstrap_port
    _, info = get_json(decode, "/server_info")
    assert info["disaggregation_mode"] == "decode" and info["disable_radix_cache"] is True
    for worker, mode in ((prefill, "prefill"), (decode, "decode")):
        block = pd_load(worker)
        assert block["mode"] == mode
        assert set(block) == set(DISAGGREGATION_LOAD_KEYS)
        assert get_json(worker, "/model_info")[1]["disaggregation_mode"] == mode


def _post_in_thread(url: str, body: dict[str, Any], out: list[tuple[int, bytes]]) -> threading.Thread:
    thread = threading.Thread(target=lambda: out.append(http("POST", url, body, timeout=30)))
    thread.start()
    return thread


@pytest.mark.parametrize("side", ["decode", "prefill"])
def test_abort_request_fails_a_request_waiting_for_its_other_half(pair: PdFleet, side: str) -> None:
    """Real SGLang 0.5.23 answers these with a 500 naming the stage and "Aborted by AbortReq."."""
    prefill, decode = pair.prefill[0], pair.decode[0]
    worker = decode if side == "decode" else prefill
    queue = "decode_transfer_queue_reqs" if side == "decode" else "prefill_bootstrap_queue_reqs"
    rid = f"abort-me-{side}"
    body = pd_body({"input_ids": PROMPT, "rid": rid, "sampling_params": {"max_new_tokens": 4}}, prefill)
    out: list[tuple[int, bytes]] = []
    thread = _post_in_thread(worker.url + "/generate", body, out)  # only one half: it waits for the other
    wait_until(lambda: pd_load(worker)[queue] == 1)
    status, raw = http("POST", worker.url + "/abort_request", {"rid": rid})
    assert (status, raw) == (200, b"")
    thread.join(10)
    status, raw = out[0]
    error = json.loads(raw)
    assert status == 500 and error["type"] == "500" and error["code"] == 500 and error["object"] == "error"
    room = body["bootstrap_room"]
    stage = "Decode transfer" if side == "decode" else "Prefill bootstrap"
    prefix = "decode_req.req" if side == "decode" else "req"
    assert error["message"] == (
        f"{stage} failed for request rank=0 {prefix}.rid={rid!r} {prefix}.bootstrap_room={room} with exception "
        f"KVTransferError(bootstrap_room={room}): Aborted by AbortReq."
    )
    assert pd_load(worker)[queue] == 0


def test_abort_request_ends_a_running_request_with_finish_reason_abort() -> None:
    with start_fleet("sim", 1, profile="llama-3.1-8b-h100", page_size=16)[0] as worker:
        out: list[tuple[int, bytes]] = []
        body = {"input_ids": PROMPT, "rid": "long-one", "sampling_params": {"max_new_tokens": 5000}}
        thread = _post_in_thread(worker.url + "/generate", body, out)
        wait_until(lambda: get_json(worker, "/v1/loads")[1]["loads"][0]["num_running_reqs"] == 1)
        assert http("POST", worker.url + "/abort_request", {"rid": "long"}) == (200, b"")  # rid prefixes match
        thread.join(10)
        status, raw = out[0]
        meta = json.loads(raw)["meta_info"]
        assert status == 200
        assert meta["finish_reason"] == {
            "type": "abort",
            "message": "Aborted by AbortReq.",
            "status_code": None,
            "err_type": None,
        }
        assert meta["completion_tokens"] < 5000


def test_abort_request_with_an_unknown_rid_is_a_no_op(pair: PdFleet) -> None:
    assert http("POST", pair.decode[0].url + "/abort_request", {"rid": "nobody"}) == (200, b"")


def test_decode_whose_prefill_never_comes_fails_after_the_waiting_timeout(pair: PdFleet) -> None:
    prefill = pair.prefill[0]
    with start_fleet(
        "sim", 1, profile="instant", page_size=PAGE, disaggregation_mode="decode", disaggregation_waiting_timeout=1.0
    )[0] as decode:
        body = pd_body({"input_ids": PROMPT, "rid": "lonely"}, prefill, room=12345)
        start = time.monotonic()
        status, raw = http("POST", decode.url + "/generate", body)
        took = time.monotonic() - start
        assert status == 500
        error = json.loads(raw)
        assert error["type"] == "500" and error["code"] == 500
        message = error["message"]
        assert message.startswith("Decode transfer failed for request rank=0 decode_req.req.rid='lonely'")
        assert "Request 12345 timed out after 1.0s in KVPoll.WaitingForInput" in message
        assert 1.0 <= took < 5.0
        chat = pd_body({"messages": [{"role": "user", "content": "x"}]}, prefill)
        status, raw = http("POST", decode.url + "/v1/chat/completions", chat)
        error = json.loads(raw)
        assert status == 500 and error["type"] == "500" and error["code"] == 500


def test_prefill_whose_decode_never_comes_fails_after_the_bootstrap_timeout() -> None:
    with start_fleet(
        "sim", 1, profile="instant", page_size=PAGE, disaggregation_mode="prefill", disaggregation_bootstrap_timeout=1.0
    )[0] as prefill:
        status, raw = http("POST", prefill.url + "/generate", pd_body({"input_ids": PROMPT}, prefill, room=7))
        assert status == 500
        message = json.loads(raw)["message"]
        assert message.startswith("Prefill bootstrap failed for request rank=0 req.rid=")
        assert message.endswith(
            "KVTransferError(bootstrap_room=7): Request 7 timed out after 1.0s in KVPoll.Bootstrapping"
        )


def test_a_failed_prefill_fails_its_decode_at_once(pair: PdFleet) -> None:
    """An aborted prefill fails the room: the decode side does not wait out its 300 s."""
    prefill, decode = pair.prefill[0], pair.decode[0]
    rid = "doomed"
    body = pd_body({"input_ids": PROMPT, "rid": rid}, prefill)
    started = time.monotonic()
    with ThreadPoolExecutor(2) as pool:
        p = pool.submit(http, "POST", prefill.url + "/generate", body | {"rid": rid}, None, 30)
        wait_until(lambda: pd_load(prefill)["prefill_bootstrap_queue_reqs"] == 1)
        # the prefill waits in its bootstrap queue: abort it there, then the decode half arrives and fails fast
        assert http("POST", prefill.url + "/abort_request", {"rid": rid})[0] == 200
        assert p.result()[0] == 500
        status, raw = http("POST", decode.url + "/generate", body | {"rid": "doomed-decode"})
    assert status == 500 and json.loads(raw)["message"].endswith("Aborted by AbortReq.")
    assert time.monotonic() - started < 10


def test_an_unreachable_bootstrap_server_fails_the_handshake(pair: PdFleet) -> None:
    closed = free_ports(1, "127.0.0.1")[0]
    body = {"input_ids": PROMPT, "bootstrap_host": "127.0.0.1", "bootstrap_port": closed, "bootstrap_room": 1}
    status, raw = http("POST", pair.decode[0].url + "/generate", body)
    assert status == 500
    assert json.loads(raw)["message"].startswith("Decode handshake failed for request rank=0")


def test_kv_transfer_takes_bytes_per_token_over_the_bandwidth() -> None:
    """llama-3.1-8b-h100 holds 131072 KV bytes per token per GPU: 2000 tokens at 0.5 GB/s take 0.524 s."""
    with start_pd_fleet("sim", 1, 1, profile="llama-3.1-8b-h100", page_size=16, disaggregation_transfer_gbps=0.5) as pd:
        prefill, decode = pd.prefill[0], pd.decode[0]
        body = pd_body({"input_ids": list(range(1000, 3000)), "sampling_params": {"max_new_tokens": 2}}, prefill)
        (ps, p), (ds, _) = send_pd(prefill, decode, "/generate", body)
        assert (ps, ds) == (200, 200)
        block = pd_load(prefill)
        assert block["kv_transfer_latency_ms"] == pytest.approx(2000 * 131072 / 0.5e9 * 1e3, rel=1e-3)
        assert block["kv_transfer_speed_gb_s"] == 0.5
        assert p["meta_info"]["e2e_latency"] >= 0.5

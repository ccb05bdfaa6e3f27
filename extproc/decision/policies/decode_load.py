"""``decode-load``: the decode worker of a prefill/decode pair, by load and KV room.

A decode worker holds no useful prefix cache (SGLang runs decode without a radix cache), so what
decides is how soon it can take the transferred KV and start emitting tokens: the requests this
router has in flight there, then the requests it reports queued before decoding (waiting, plus
SGLang's disaggregation queues: preallocating KV, receiving the transfer, retracted), then how full
its KV pool is (room for the new request's tokens). Exact ties rotate, as ``least-load`` does.
"""

from __future__ import annotations

from extproc.decision.policies.base import Candidate
from extproc.decision.policies.least_load import LeastLoadPolicy
from extproc.fleet.reports import WorkerLoad

__all__ = ["DecodeLoadPolicy", "decode_queue"]

# The per-rank counters of /v1/loads' ``disaggregation`` block that count requests not yet decoding.
_DECODE_QUEUES = ("decode_prealloc_queue_reqs", "decode_transfer_queue_reqs", "decode_retracted_queue_reqs")


def decode_queue(load: WorkerLoad | None) -> int:
    """Requests a decode worker reports waiting before they decode (0 when it reports nothing)."""
    if load is None:
        return 0
    queued = load.num_waiting_reqs
    for rank in load.disaggregation or []:
        for name in _DECODE_QUEUES:
            value = rank.get(name)
            if isinstance(value, int) and not isinstance(value, bool):
                queued += value
    return queued


class DecodeLoadPolicy(LeastLoadPolicy):
    """``least-load``'s ranking with SGLang's decode queues counted as queued."""

    name = "decode-load"

    def queue(self, load: WorkerLoad | None) -> int:
        return decode_queue(load)

    def scores(self, candidate: Candidate, queued: int) -> dict[str, float]:
        usage = candidate.load.token_usage if candidate.load else 0.0
        return {"in_flight": candidate.in_flight, "decode_queue": queued, "kv_usage": usage}

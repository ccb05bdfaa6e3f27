"""``decode-load``: the decode worker of a prefill/decode pair, by load and KV room.

A decode worker holds no useful prefix cache (SGLang runs decode without a radix cache), so what
decides is how soon it can take the transferred KV and start emitting tokens: the requests this
router has in flight there, then the requests it reports queued before decoding (waiting, plus
SGLang's disaggregation queues: preallocating KV, receiving the transfer, retracted), then how full
its KV pool is (room for the new request's tokens). Exact ties rotate, as ``least-load`` does.
"""

from __future__ import annotations

from extproc.decision.policies.base import Candidate, Decision, Policy, RoutingRequest
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


class DecodeLoadPolicy(Policy):
    name = "decode-load"

    _tiebreak = 0

    def select(self, request: RoutingRequest, candidates: list[Candidate]) -> Decision:
        self._tiebreak += 1
        return self._rank(candidates, self._tiebreak)

    def explain(self, request: RoutingRequest, candidates: list[Candidate]) -> Decision:
        """The next ``select``'s ranking, the rotation left where it is."""
        return self._rank(candidates, self._tiebreak + 1)

    @staticmethod
    def _rank(candidates: list[Candidate], tiebreak: int) -> Decision:
        n = len(candidates)
        queued = {c.worker.id: decode_queue(c.load) for c in candidates}

        def key(item: tuple[int, Candidate]) -> tuple[float, ...]:
            i, c = item
            usage = c.load.token_usage if c.load else 0.0
            return (c.in_flight, queued[c.worker.id], usage, (i - tiebreak) % n)

        ordered = [c for _, c in sorted(enumerate(candidates), key=key)]
        return Decision(
            ranked=[c.worker for c in ordered],
            reason="decode-load",
            scores={
                c.worker.id: {
                    "in_flight": c.in_flight,
                    "decode_queue": queued[c.worker.id],
                    "kv_usage": c.load.token_usage if c.load else 0.0,
                }
                for c in ordered
            },
        )

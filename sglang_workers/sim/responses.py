"""The bodies SGLang 0.5.23 answers with, built from a simulated request: meta_info, usage, errors, model info.

Every key real SGLang sends is here, in its order, with its type, because routers, clients and the
differential conformance test (``tests/real_sglang/test_conformance.py``) read them. Where a value is
the engine's own measurement (timestamps, latencies, throughput) it comes from the simulated request's
clock; where it describes features the simulator has not got (reasoning, LoRA weight versions, host
cache tiers) it has the value a plain SGLang worker reports: 0, ``"default"``, null.

Errors come in the four shapes SGLang uses, depending on where it refuses a request:

* ``validation``: the request does not parse into SGLang's pydantic model (bad JSON, a wrong type, a
  missing field): ``{"object": "error", "message", "type": "Bad Request", "param": null, "code": 400}``;
* ``openai``: the OpenAI layer refuses it (empty messages, too long):
  ``{"object": "error", "message", "type": "BadRequestError", "param": null, "code": 400}``;
* ``generate``: native ``/generate`` refuses it: ``{"error": {"message"}}`` (``plain``: ``{"error": message}``
  when its sampling parameters do not parse);
* ``detail``: the router of the HTTP framework (unknown path, wrong method): ``{"detail": "Not Found"}``.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from .request import Request

__all__ = [
    "ApiError",
    "ErrorKind",
    "error_body",
    "finish_reason_name",
    "meta_info",
    "model_info",
    "usage",
    "weight_versions",
]

ErrorKind = Literal["validation", "openai", "generate", "plain", "detail"]
_TYPES = {400: "BadRequestError", 404: "NotFoundError", 413: "BadRequestError", 500: "InternalServerError"}
_DETAILS = {404: "Not Found", 405: "Method Not Allowed"}


class ApiError(Exception):
    """A client-visible refusal: becomes the body SGLang gives this kind of refusal (``error_body``) on HTTP, and
    the matching status on gRPC."""

    def __init__(self, status: int, message: str, kind: ErrorKind = "openai", err_type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.err_type = err_type  # the OpenAI body's ``type`` where SGLang names it otherwise than by status


def finish_reason_name(req: Request) -> str:
    """The OpenAI ``finish_reason`` of a finished request: ``abort`` after /abort_request, else ``length``."""
    return "abort" if req.abort_message is not None else "length"


# Monotonic -> wall clock, fixed once (SGLang's convert_time_to_realtime does the same).
_WALL_OFFSET = time.time() - time.monotonic()


def _wall(monotonic: float) -> float:
    return monotonic + _WALL_OFFSET


def error_body(kind: ErrorKind, status: int, message: str, err_type: str | None = None) -> dict[str, Any]:
    """The JSON body of one refusal, in the shape SGLang gives that kind of refusal."""
    if kind == "generate":
        return {"error": {"message": message}}
    if kind == "plain":  # sampling params parsed by SGLang's Rust extension: its message, unwrapped
        return {"error": message}
    if kind == "detail":
        return {"detail": _DETAILS.get(status, message)}
    kind_name = err_type or ("Bad Request" if kind == "validation" else _TYPES.get(status, "BadRequestError"))
    return {"object": "error", "message": message, "type": kind_name, "param": None, "code": status}


def _finish_reason(req: Request) -> dict[str, Any]:
    if req.abort_message is not None:  # SGLang's FINISH_ABORT.to_json() of an /abort_request
        return {"type": "abort", "message": req.abort_message, "status_code": None, "err_type": None}
    length = req.finish_length if req.finish_length is not None else req.max_new_tokens
    return {"type": "length", "length": length}


def weight_versions(completion_tokens: int) -> list[dict[str, Any]]:
    return [{"version": "default", "start": 0, "end": completion_tokens}]


def _cached_details(cached: int) -> dict[str, int] | None:
    return {"device": cached, "host": 0} if cached > 0 else None


def meta_info(
    req: Request, finished: bool, first_chunk: bool = False, details: dict[str, Any] | None = None
) -> dict[str, Any]:
    """``meta_info`` of a native ``/generate`` answer (or one streamed chunk of it), keys in 0.5.23's order.

    Streaming: the first chunk carries ``response_sent_to_client_ts`` (the time it was sent), later
    chunks do not, the last carries the finished request's figures. Non-streaming: the finished figures,
    then ``response_sent_to_client_ts``. ``details`` is ``cached_tokens_details`` by tier (the server knows
    the tiers; without it: all on the device).
    """
    now = time.monotonic()
    cached = max(req.cached_tokens, 0)
    completion = len(req.output_ids)
    admitted = req.admitted_at if req.admitted_at is not None else now
    out: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": _finish_reason(req) if finished else None,
        "prompt_tokens": len(req.input_ids),
        "weight_version": "default",
        "num_retractions": req.num_retractions,
    }
    if not req.prebuilt:  # a decode worker's request had no prefill (and no storage prefetch) of its own
        out["storage_prefetch_wait"] = 0.0
        out["storage_staging_wait"] = 0.0
    out["forward_entry_time"] = _wall(admitted)
    if not req.prebuilt:
        out["prefill_finished_time"] = _wall(req.first_token_at or now)
    out |= {
        "queue_time": max(admitted - req.arrival, 0.0),
        "reasoning_tokens": 0,
        "completion_tokens": completion,
        "cached_tokens": cached,
    }
    if finished:
        out["weight_versions"] = weight_versions(completion)
    out["cached_tokens_details"] = details if details is not None else _cached_details(cached)
    out["dp_rank"] = None
    if finished:
        end = req.finished_at or now
        out["e2e_latency"] = end - req.arrival
        out["request_received_ts"] = _wall(req.arrival)
        if req.first_token_at is not None and req.first_token_at > req.arrival:
            out["first_token_latency"] = req.first_token_at - req.arrival
        out["api_server_dispatch_finish_ts"] = _wall(req.arrival)
        if req.sent_at is not None:
            out["response_sent_to_client_ts"] = _wall(req.sent_at)
        out["request_finished_ts"] = _wall(end)
        if completion > 1 and req.first_token_at is not None and end > req.first_token_at and not req.prebuilt:
            out["decode_throughput"] = (completion - 1) / (end - req.first_token_at)
    if req.sent_at is None and (first_chunk or finished):
        req.sent_at = now
        out["response_sent_to_client_ts"] = _wall(now)
    return out


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int, details: bool = True) -> dict[str, Any]:
    """OpenAI ``usage`` as 0.5.23 reports it with ``--enable-cache-report``.

    ``details`` is False for the usage chunk of a streamed ``/v1/completions``, which has no
    ``completion_tokens_details`` key.
    """
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
        "reasoning_tokens": 0,
    }
    if details:
        out["completion_tokens_details"] = None
    return out


def model_info(model: str, tokenizer_path: str) -> dict[str, Any]:
    """``/model_info`` of a plain generation model (a Llama), every key of 0.5.23."""
    return {
        "model_path": model,
        "served_model_name": model,
        "tokenizer_path": tokenizer_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "load_format": "auto",
        "reasoning_parser": None,
        "tool_call_parser": None,
        "disaggregation_mode": "null",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "embedding": {
            "family": "none",
            "task": "none",
            "execution": "none",
            "attention": "none",
            "pooling": "model_defined",
            "normalize": False,
            "postprocessor": "none",
            "tokenizer_special_tokens": "model_default",
            "supports_dimensions": False,
            "supports_token_embeddings": False,
            "supports_multimodal": False,
            "requires_embedding_flag": False,
            "auto_enable_embedding": False,
            "bcg_eligibility": "disabled",
            "safe_disable_kv_cache": False,
            "safe_disable_radix_cache": False,
            "safe_disable_chunked_prefill": False,
            "enabled": False,
            "matryoshka_dimensions": [],
            "bcg": {
                "prefill_backend": "disabled",
                "enabled": False,
                "capture_token_budget": 4096,
                "capture_batch_sizes": [4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096],
            },
            "cache": {"kv_cache_disabled": False, "radix_cache_disabled": False, "chunked_prefill_disabled": False},
        },
    }

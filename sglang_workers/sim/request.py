"""One generation request as a simulated worker's scheduler tracks it, from submission to its last token.

Shared by the scheduler (which fills it in), the front doors (which read its tokens from ``updates`` and its
counts for ``meta_info`` and ``usage``) and the metrics (recorded when it finishes).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .radix_cache import TreeNode

__all__ = ["HEALTH_CHECK_RID_PREFIX", "Request"]

HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK"  # SGLang's rid prefix of /health generations (not counted in stats)


def _monotonic() -> float:
    """``time.monotonic()`` looked up at each call: the virtual fleet points this module's ``time`` at its clock."""
    return time.monotonic()


@dataclass(eq=False)
class Request:
    """One generation request as the scheduler tracks it."""

    rid: str
    input_ids: list[int]
    max_new_tokens: int
    cache_salt: str | None = None
    output_ids: list[int] = field(default_factory=list)
    cached_tokens: int = -1  # prefix found in the cache at first admission (-1: not admitted yet)
    cached_device: int = 0  # ... of which on the GPU, loaded back from host memory, from L3 storage
    cached_host: int = 0
    cached_storage: int = 0
    inserted_len: int = 0  # tokens this request already inserted into the tree (HiCache hit counts)
    load_tokens: int = 0  # host tokens loaded back for the chunk being prefilled
    storage_landed: int = 0  # tokens its storage prefetch grafted into host memory
    kv_len: int = 0  # tokens whose KV exists (in the tree or private)
    tree_len: int = 0  # tokens of the locked tree path
    last_node: TreeNode | None = None
    chunk_prefix: int = 0  # cached context of the chunk being prefilled
    chunk_len: int = 0
    arrival: float = field(default_factory=_monotonic)
    sim_arrival: float = 0.0  # simulated GPU clock at submission
    sim_first_token: float | None = None
    sim_finished: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished_at: float | None = None
    error: str | None = None  # set when the request failed instead of finishing
    stream: bool = False  # the client streams it (SGLang labels its request metrics is_streaming)
    dp_rank: int = 0  # the data-parallel rank (scheduler) running it
    retracted: bool = False  # was retracted once: its next prefill recomputes work (not a cache statistic)
    num_retractions: int = 0
    admitted_at: float | None = None  # monotonic time of its first admission (SGLang's forward entry)
    sent_at: float | None = None  # when its first answer (chunk) left the HTTP server
    updates: asyncio.Queue[list[int] | None] = field(default_factory=asyncio.Queue)
    rng: random.Random | None = None
    # -- prefill/decode disaggregation and /abort_request (``disaggregation``) --
    abort_message: str | None = None  # ended by /abort_request: finish_reason abort with this message
    pd_failure: bool = False  # ``error`` is a PD hand-off failure (SGLang answers it as an HTTPException 500)
    finish_length: int | None = None  # finish_reason length's value when not max_new_tokens (prefill: 0)
    first_token: int | None = None  # decode: the first output token, sampled by the prefill worker
    prebuilt: bool = False  # decode: the prompt's KV arrived from the prefill worker (no prefill compute)
    on_computed: Callable[[Request], object] | None = None  # prefill: called instead of ending the response

    @property
    def fill_ids(self) -> list[int]:
        return self.input_ids + self.output_ids

    @property
    def finished(self) -> bool:
        return self.finished_at is not None

    @property
    def health_check(self) -> bool:
        """A ``/health`` generation: served like any request, counted in no statistic (SGLang's log_metrics=False)."""
        return self.rid.startswith(HEALTH_CHECK_RID_PREFIX)

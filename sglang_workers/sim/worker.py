"""One simulated SGLang worker, assembled: tokenizer, caches, a scheduler and a KV-event publisher per DP rank.

``SimWorker`` wires the parts together from a ``SimWorkerConfig`` and is what both front doors serve: the HTTP API
(``http_api``) and SGLang's gRPC scheduler API (``grpc_server``) check and queue requests through ``submit`` and
read the reports of ``reports``. It owns the readiness SGLang reports (``ready`` once the simulated load time is
over, ``healthy`` unless a ``/health`` check found no answer) and the length checks SGLang makes before a
request reaches its scheduler.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
import uuid

from prefix_common.tokenization import DEFAULT_TOKENIZER_DIR, ModelTokenizer, TokenizerLoadError, load_tokenizer

from .config import SimWorkerConfig
from .disaggregation import Bootstrap, DecodeSide, PrefillSide, missing_room_error
from .hiradix_cache import HiRadixCache, host_pool_tokens
from .kv_events import KVEventPublisher
from .radix_cache import RadixCache
from .request import Request
from .responses import ApiError, ErrorKind
from .scheduler import Scheduler, device_pool_tokens
from .timing import get_profile, profile_list

__all__ = ["HEALTH_CHECK_TIMEOUT_S", "HEALTH_POLL_S", "SimWorker", "output_vocabulary"]

logger = logging.getLogger(__name__)

HEALTH_POLL_S = 1.0  # SGLang's health_generate sleeps this long before it first looks for an answer
HEALTH_CHECK_TIMEOUT_S = 20.0  # SGLANG_HEALTH_CHECK_TIMEOUT default: no answer by then -> 503, unhealthy


def output_vocabulary(tokenizer: ModelTokenizer) -> list[int]:
    """Ids the simulated model 'generates': plain lower-case words, so outputs read as text.

    Special and added tokens are never produced (a real model emits them only to stop).
    """
    special = set(tokenizer.tokenizer.get_added_tokens_decoder())
    vocab = tokenizer.tokenizer.get_vocab()
    words = sorted(i for tok, i in vocab.items() if i not in special and re.fullmatch(r"(Ġ|▁)[a-z]{3,}", tok))
    if len(words) >= 64:
        return words
    return sorted(i for i in vocab.values() if i not in special)


class SimWorker:
    """The parts of one simulated SGLang worker and their lifecycle (``start`` / ``stop``), no front door."""

    def __init__(self, config: SimWorkerConfig) -> None:
        self.config = config
        # ``--profile a,b`` cycles the profiles over the DP ranks (one worker, mixed GPUs); rank 0's
        # profile describes the worker where one figure is reported for all of it.
        self.profiles = [get_profile(name) for name in profile_list(config.profile)]
        self.profile = self.profiles[0]
        try:
            self.tokenizer = load_tokenizer(config.tokenizer, config.chat_template)
        except TokenizerLoadError as exc:
            raise ValueError(str(exc)) from exc
        self.host_tokens = 0  # HiCache host pool (0: no host tier)
        if config.enable_hierarchical_cache:
            device = device_pool_tokens(config, self.profile)
            self.host_tokens = host_pool_tokens(
                device, config.page_size, config.hicache_ratio, config.hicache_size, self.profile.kv_bytes_per_token
            )
            if self.host_tokens <= device:  # SGLang warns too; the host tier then adds little
                logger.warning(
                    "host pool (%d tokens) is smaller than the device pool (%d tokens): "
                    "L2 cache effectiveness is reduced",
                    self.host_tokens,
                    device,
                )
            if config.hicache_storage_backend == "file":
                try:
                    config.storage_dir().mkdir(parents=True, exist_ok=True)
                except OSError as exc:
                    raise ValueError(f"cannot create the HiCache file storage directory: {exc}") from None
        self.ready = False  # weights "loaded" and warmed up (SGLang's ServerStatus leaves Starting)
        self.healthy = True  # False after a /health found no answer in time (SGLang's ServerStatus.UnHealthy)
        self.publishers: list[KVEventPublisher] = []  # one per data-parallel rank
        self.schedulers: list[Scheduler] = []  # one per data-parallel rank, each with its own radix cache
        self._next_rank = 0  # SGLang's default load balancing of unpinned requests: round robin
        # SGLang applies x-override-* request headers only with this set (its header-override mechanism).
        self.header_overrides = os.environ.get("SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES", "").lower() in ("1", "true")
        self.started_at = time.time()
        self.bound_port: int | None = None  # the HTTP port, once the HTTP server listens (reported in /server_info)
        self.disaggregation: PrefillSide | DecodeSide | None = None  # the PD side (--disaggregation-mode)

    @property
    def tokenizer_path(self) -> str:
        """Where the tokenizer lives (the built-in one's directory by default), for routers that load it."""
        return self.config.tokenizer or str(DEFAULT_TOKENIZER_DIR)

    @property
    def scheduler(self) -> Scheduler | None:
        """Rank 0's scheduler (the only one without ``--dp-size``)."""
        return self.schedulers[0] if self.schedulers else None

    @property
    def publisher(self) -> KVEventPublisher | None:
        return self.publishers[0] if self.publishers else None

    # -- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start every rank's publisher and scheduler; ``ready`` turns True after ``load_time``."""
        cfg = self.config
        vocab = output_vocabulary(self.tokenizer)
        for rank in range(cfg.dp_size):
            rank_cfg = cfg.rank(rank)
            publisher = None
            if cfg.kv_events:
                publisher = KVEventPublisher(
                    host=rank_cfg.kv_events_host,
                    port=rank_cfg.kv_events_port,
                    replay_port=rank_cfg.replay_port,
                    topic=rank_cfg.kv_topic,
                    buffer_steps=rank_cfg.kv_buffer_steps,
                    dp_rank=rank_cfg.dp_rank,
                    event_format=rank_cfg.event_format,
                    replay_format=rank_cfg.replay_format,
                )
                publisher.start()
                self.publishers.append(publisher)
            cache = (
                HiRadixCache(
                    cfg.page_size,
                    enable_events=cfg.kv_events,
                    host_capacity=self.host_tokens,
                    write_policy=cfg.hicache_write_policy,
                )
                if cfg.enable_hierarchical_cache
                # SGLang's decode server has no radix cache, so it publishes no KV events.
                else RadixCache(cfg.page_size, enable_events=cfg.kv_events and cfg.disaggregation_mode != "decode")
            )
            scheduler = Scheduler(rank_cfg, self.profiles[rank % len(self.profiles)], cache, publisher, vocab)
            scheduler.start()
            self.schedulers.append(scheduler)
        if cfg.disaggregation_mode == "prefill":
            self.disaggregation = PrefillSide(cfg, self.schedulers[0], self.profiles[0])
        elif cfg.disaggregation_mode == "decode":
            self.disaggregation = DecodeSide(cfg, self.schedulers[0])
        if self.disaggregation is not None:
            await self.disaggregation.start()
        if cfg.load_time > 0:
            asyncio.get_running_loop().call_later(cfg.load_time, self._set_ready)
        else:
            self._set_ready()

    def _set_ready(self) -> None:
        self.ready = True

    async def stop(self) -> None:
        self.ready = False
        if self.disaggregation is not None:
            await self.disaggregation.stop()
        for scheduler in self.schedulers:
            await scheduler.stop()
        for publisher in self.publishers:
            await publisher.close()

    # -- admission at the front door ---------------------------------------------------------------
    def require_ready(self) -> Scheduler:
        """Rank 0's scheduler, or the 503 SGLang answers while it starts."""
        if not self.ready or self.scheduler is None:
            raise ApiError(503, "The server is not ready yet.")
        return self.scheduler

    def check_length(self, input_ids: list[int], kind: ErrorKind, max_new_tokens: int | None = None) -> None:
        """SGLang's length checks, in its order: the prompt against the context length, prompt plus the
        requested ``max_new_tokens`` against it (only when the client asked for a number: SGLang's
        validate_total_tokens), then the prompt against what the KV pool can hold (scheduler side)."""
        context = self.config.context_length
        if len(input_ids) >= context:
            raise ApiError(
                400,
                f"The input ({len(input_ids)} tokens) is longer than the model's context length ({context} tokens).",
                kind,
            )
        if max_new_tokens is not None and len(input_ids) + max_new_tokens > context:
            total = len(input_ids) + max_new_tokens
            raise ApiError(
                400,
                f"Requested token count exceeds the model's maximum context length of {context} tokens. You "
                f"requested a total of {total} tokens: {len(input_ids)} tokens from the input messages and "
                f"{max_new_tokens} tokens for the completion. Please reduce the number of tokens in the input "
                "messages or the completion to fit within the limit.",
                kind,
            )
        limit = min(self.config.context_length - 1, self.require_ready().capacity - 1) - 5  # max_req_input_len
        if len(input_ids) >= limit:
            raise ApiError(
                400,
                f"Input length ({len(input_ids)} tokens) exceeds the maximum allowed length ({limit} tokens). "
                "Use a shorter input or enable --allow-auto-truncate.",
                kind,
            )

    def submit(
        self,
        input_ids: list[int],
        max_new_tokens: int,
        salt: str | None,
        rid: str | None,
        rank: int | None = None,
        stream: bool = False,
        kind: ErrorKind = "openai",
        requested: bool = True,
        bootstrap: Bootstrap | None = None,
    ) -> Request:
        """Check and queue one tokenized request: the admission path of both front doors (HTTP and gRPC).

        ``requested``: the client named ``max_new_tokens`` (else SGLang does not check prompt + output
        against the context length). ``bootstrap``: a PD request's bootstrap fields."""
        self.require_ready()
        self.check_length(input_ids, kind, max_new_tokens if requested else None)
        return self.enqueue(self.rank_scheduler(rank), input_ids, max_new_tokens, salt, rid, stream, kind, bootstrap)

    def enqueue(
        self,
        scheduler: Scheduler,
        input_ids: list[int],
        max_new_tokens: int,
        salt: str | None,
        rid: str | None,
        stream: bool = False,
        kind: ErrorKind = "openai",
        bootstrap: Bootstrap | None = None,
    ) -> Request:
        """Queue a checked request on ``scheduler``; a PD worker first stages it (``disaggregation``).

        A PD worker refuses a request without ``bootstrap_room`` as SGLang's scheduler does (400)."""
        pd = self.disaggregation
        if pd is None:
            return scheduler.submit(input_ids, max_new_tokens, salt, rid, stream)
        if bootstrap is None or bootstrap.room is None:
            raise missing_room_error(rid or uuid.uuid4().hex, kind)
        req = scheduler.new_request(input_ids, max_new_tokens, salt, rid or uuid.uuid4().hex, stream)
        pd.submit(req, bootstrap)
        return req

    def abort_request(self, rid: str, abort_all: bool = False) -> int:
        """SGLang's ``/abort_request``: end every request whose rid starts with ``rid`` (all with ``abort_all``);
        an empty rid without ``abort_all`` is ignored, as SGLang ignores it. Returns how many were ended."""
        if not rid and not abort_all:
            return 0
        ended = self.disaggregation.abort(rid, abort_all) if self.disaggregation is not None else 0
        return ended + sum(s.abort_matching(rid, abort_all) for s in self.schedulers)

    def rank_scheduler(self, rank: int | None) -> Scheduler:
        """The scheduler of ``rank``, or the next one round robin (SGLang's default for unpinned requests)."""
        if rank is None:
            rank = self._next_rank
            self._next_rank = (self._next_rank + 1) % len(self.schedulers)
        return self.schedulers[rank]

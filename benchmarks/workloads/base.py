"""What every benchmark workload is: chat requests with arrival times, over text whose tokens are known.

Every contender replays the *same* list, byte for byte: prompt text is drawn from PRNGs seeded by
the workload seed and by block identities (Mooncake ``hash_ids``, group and session numbers), never
from wall-clock state. Text is made of words that are each exactly one token of the default
tokenizer (a leading space plus a lower-case word that is itself a vocabulary entry), so a block of
``n`` words is ``n`` tokens, and concatenating blocks concatenates their token ids: byte-level BPE
pre-tokenizes at every `` word`` boundary, so no merge crosses two blocks. That is what makes "two
requests share the first k hash ids" mean "their prompts share the first k x block-size tokens".
The generators are in ``generated`` and ``trace``; ``flags`` builds one from a suite's command line.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import xxhash

from prefix_common.tokenization import load_tokenizer

__all__ = [
    "PLAIN_WORDS",
    "BenchRequest",
    "Workload",
    "block_text",
    "iter_token_ids",
    "poisson_arrivals",
    "prefix_hash",
    "word_vocabulary",
]


@dataclass(frozen=True)
class BenchRequest:
    """One chat request of a workload, with its scheduled send time."""

    index: int
    arrival_s: float  # offset from the start of the run
    messages: list[dict[str, str]]
    max_tokens: int
    session: str | None = None  # multi-turn session id (sent as x-session-id)

    def prompt_chars(self) -> str:
        """All message contents joined: what character-based routers (and ring hash) look at."""
        return "".join(m["content"] for m in self.messages)


@dataclass
class Workload:
    """A named request list plus what produced it (recorded in the JSON results)."""

    name: str
    requests: list[BenchRequest]
    params: dict[str, Any] = field(default_factory=dict)
    # The token ids of ``requests`` as they were when computed (a replaced or cut list is recomputed).
    _token_ids: tuple[list[BenchRequest], int, list[list[int]]] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    def token_ids(self) -> list[list[int]]:
        """Every request's prompt token ids (``iter_token_ids``), computed once per workload.

        A virtual-fleet cell runs each seed's workload through every policy and the oracle; tokenizing
        a trace's 10k-token prompts again for each took half of a round-robin run's time.
        """
        cached = self._token_ids
        if cached is None or cached[0] is not self.requests or cached[1] != len(self.requests):
            cached = self._token_ids = (self.requests, len(self.requests), list(iter_token_ids(self.requests)))
        return cached[2]

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s if self.requests else 0.0

    @property
    def offered_rate(self) -> float:
        """Requests per second the arrival schedule offers (count / span)."""
        if len(self.requests) < 2 or self.duration_s <= 0:
            return 0.0
        return (len(self.requests) - 1) / self.duration_s


# Plain English words for prose-like prompts whose exact tokens do not matter (--suite overhead and
# --suite soak, which draws from the first 15).
# fmt: off
PLAIN_WORDS = (
    "alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo",
    "lima", "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango", "uniform", "victor",
    "whiskey", "xray", "yankee", "zulu", "gateway", "router", "worker", "cache", "prefix", "token", "block",
    "envoy", "filter", "stream", "header", "metadata", "cluster", "health", "policy"
)
# fmt: on


# -- text -----------------------------------------------------------------------------------

_WORD = re.compile(r"[a-z]{3,9}")


@lru_cache(maxsize=1)
def word_vocabulary() -> tuple[str, ...]:
    """Lower-case words that the default tokenizer encodes as exactly one token (with a leading space)."""
    tokenizer = load_tokenizer()
    vocab = tokenizer.tokenizer.get_vocab()
    words = sorted(k[1:] for k in vocab if k.startswith("\u0120") and _WORD.fullmatch(k[1:]))
    return tuple(w for w in words if len(tokenizer.encode_text(" " + w, add_special_tokens=False)) == 1)


def _words(seed_material: str, count: int) -> str:
    vocab = word_vocabulary()
    rng = random.Random(xxhash.xxh3_64_intdigest(seed_material.encode()))
    return "".join(" " + vocab[rng.randrange(len(vocab))] for _ in range(count))


@lru_cache(maxsize=65536)
def block_text(namespace: str, block_id: int, tokens: int) -> str:
    """``tokens`` one-token words for block ``block_id``: same inputs, same text, in every process."""
    return _words(f"{namespace}/{block_id}", tokens)


def prefix_hash(text: str, chars: int) -> str:
    """The ring-hash key a client computes: xxh64 of the prompt's first ``chars`` characters."""
    return xxhash.xxh64_hexdigest(text[:chars].encode())


# -- arrivals -------------------------------------------------------------------------------


def poisson_arrivals(count: int, rate: float, rng: random.Random) -> list[float]:
    """``count`` arrival offsets of a Poisson process at ``rate`` per second, the first at 0."""
    if rate <= 0:
        raise ValueError("rate must be positive")
    times, now = [], 0.0
    for i in range(count):
        if i:
            now += rng.expovariate(rate)
        times.append(now)
    return times


def iter_token_ids(requests: Sequence[BenchRequest]) -> Iterator[list[int]]:
    """Prompt token ids as an SGLang worker builds them (chat template, default tokenizer)."""
    tokenizer = load_tokenizer()
    for request in requests:
        yield tokenizer.encode_chat(request.messages)

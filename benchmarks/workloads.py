"""Benchmark workloads: deterministic request lists with arrival times.

Every contender replays the *same* list, byte for byte: prompt text is drawn from PRNGs seeded by
the workload seed and by block identities (Mooncake ``hash_ids``, group and session numbers), never
from wall-clock state. Text is made of words that are each exactly one token of the default
tokenizer (a leading space plus a lower-case word that is itself a vocabulary entry), so a block of
``n`` words is ``n`` tokens, and concatenating blocks concatenates their token ids: byte-level BPE
pre-tokenizes at every `` word`` boundary, so no merge crosses two blocks. That is what makes "two
requests share the first k hash ids" mean "their prompts share the first k x block-size tokens".

Three generators:

- ``gsp``: SGLang bench_serving's *generated-shared-prefix*: ``groups`` system prompts, each shared
  by ``prompts_per_group`` questions; requests shuffled and sent as Poisson arrivals.
- ``multiturn``: chat sessions whose history grows turn by turn (user question + a fixed assistant
  answer appended each turn); sessions start as a Poisson process, turns follow at a fixed interval.
- ``trace``: Mooncake-format JSONL (``timestamp`` ms, ``input_length``, ``output_length``,
  ``hash_ids``) with a configurable block size, time compression, rate scaling and a window.
- ``longctx``: the tiered-cache scenario (``prefix-router bench --suite tiered``): document QA over
  long documents interleaved with multi-turn chat sessions, sized so that the fleet's GPU pool holds
  only part of the working set.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import xxhash

from prefix_common.tokenization import load_tokenizer

__all__ = [
    "BenchRequest",
    "TraceError",
    "TraceWindow",
    "Workload",
    "block_text",
    "docqa_workload",
    "gsp_workload",
    "hot_burst_workload",
    "longctx_workload",
    "multiturn_workload",
    "poisson_arrivals",
    "prefix_hash",
    "read_trace",
    "trace_workload",
    "word_vocabulary",
]


class TraceError(ValueError):
    """A trace file is missing or malformed (the message names the file and line)."""


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

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s if self.requests else 0.0

    @property
    def offered_rate(self) -> float:
        """Requests per second the arrival schedule offers (count / span)."""
        if len(self.requests) < 2 or self.duration_s <= 0:
            return 0.0
        return (len(self.requests) - 1) / self.duration_s


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


# -- generated shared prefix ----------------------------------------------------------------


def gsp_workload(
    *,
    groups: int,
    prompts_per_group: int,
    system_prompt_len: int,
    question_len: int,
    output_len: int,
    rate: float,
    seed: int,
) -> Workload:
    """SGLang's generated-shared-prefix: each group's questions share one long system prompt."""
    if min(groups, prompts_per_group, system_prompt_len, question_len, output_len) <= 0:
        raise ValueError("gsp sizes must all be positive")
    ns = f"gsp/{seed}"
    pairs = [(g, p) for g in range(groups) for p in range(prompts_per_group)]
    rng = random.Random(seed)
    rng.shuffle(pairs)
    arrivals = poisson_arrivals(len(pairs), rate, rng)
    requests = []
    for i, ((g, p), t) in enumerate(zip(pairs, arrivals)):
        system = block_text(ns + "/system", g, system_prompt_len)
        question = block_text(ns + f"/q{g}", p, question_len)
        requests.append(
            BenchRequest(
                index=i,
                arrival_s=t,
                max_tokens=output_len,
                messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
            )
        )
    return Workload(
        "gsp",
        requests,
        {
            "groups": groups,
            "prompts_per_group": prompts_per_group,
            "system_prompt_len": system_prompt_len,
            "question_len": question_len,
            "output_len": output_len,
            "rate": rate,
            "seed": seed,
        },
    )


# -- multi-turn chat ------------------------------------------------------------------------


def multiturn_workload(
    *,
    sessions: int,
    turns: int,
    system_prompt_len: int,
    question_len: int,
    answer_len: int,
    output_len: int,
    turn_interval_s: float,
    rate: float,
    seed: int,
) -> Workload:
    """Chat sessions whose history grows: turn k resends turns 0..k-1 plus a new question.

    The assistant messages in the history are fixed text (``answer_len`` tokens), not what the
    worker generated, so every contender sends identical bytes. ``rate`` is the overall request rate:
    sessions start as a Poisson process at ``rate / turns``.
    """
    if min(sessions, turns, system_prompt_len, question_len, answer_len, output_len) <= 0:
        raise ValueError("multiturn sizes must all be positive")
    if turn_interval_s < 0:
        raise ValueError("turn interval must be >= 0")
    ns = f"multiturn/{seed}"
    rng = random.Random(seed)
    starts = poisson_arrivals(sessions, rate / turns, rng)
    system = block_text(ns + "/system", 0, system_prompt_len)
    timed: list[tuple[float, str, list[dict[str, str]]]] = []
    for s, start in enumerate(starts):
        history: list[dict[str, str]] = [{"role": "system", "content": system}]
        for k in range(turns):
            history = history + [{"role": "user", "content": block_text(ns + f"/s{s}/q", k, question_len)}]
            timed.append((start + k * turn_interval_s, f"s{s}", list(history)))
            history = history + [{"role": "assistant", "content": block_text(ns + f"/s{s}/a", k, answer_len)}]
    timed.sort(key=lambda item: item[0])
    requests = [
        BenchRequest(index=i, arrival_s=t, messages=msgs, max_tokens=output_len, session=sid)
        for i, (t, sid, msgs) in enumerate(timed)
    ]
    return Workload(
        "multiturn",
        requests,
        {
            "sessions": sessions,
            "turns": turns,
            "system_prompt_len": system_prompt_len,
            "question_len": question_len,
            "answer_len": answer_len,
            "output_len": output_len,
            "turn_interval_s": turn_interval_s,
            "rate": rate,
            "seed": seed,
        },
    )


# -- hot-prefix bursts ---------------------------------------------------------------------


def _zipf_weights(count: int, exponent: float) -> list[float]:
    return [1.0 / (rank + 1) ** exponent for rank in range(count)]


def hot_burst_workload(
    *,
    prefixes: int,
    prefix_len: int,
    question_len: int,
    output_len: int,
    burst_size: int,
    burst_spacing_s: float,
    zipf: float,
    rate: float,
    count: int,
    seed: int,
) -> Workload:
    """Hot tenants in bursts: a few system prompts with Zipf popularity, each arrival a burst.

    Bursts start as a Poisson process at ``rate / burst_size``; a burst is ``burst_size`` requests on
    one prefix (Zipf-chosen), ``burst_spacing_s`` apart, each with its own question: siblings arrive
    before any KV event of the first can, and the hottest prefix wants more than one worker.
    """
    if min(prefixes, prefix_len, question_len, output_len, burst_size, count) <= 0 or burst_spacing_s < 0:
        raise ValueError("hot-burst sizes must all be positive")
    ns = f"hot/{seed}"
    rng = random.Random(seed)
    weights = _zipf_weights(prefixes, zipf)
    starts = poisson_arrivals(-(-count // burst_size), rate / burst_size, rng)
    timed: list[tuple[float, int, int]] = []
    for b, start in enumerate(starts):
        prefix = rng.choices(range(prefixes), weights)[0]
        timed.extend((start + k * burst_spacing_s, prefix, b * burst_size + k) for k in range(burst_size))
    timed.sort()
    requests = [
        BenchRequest(
            index=i,
            arrival_s=t,
            max_tokens=output_len,
            messages=[
                {"role": "system", "content": block_text(ns + "/system", prefix, prefix_len)},
                {"role": "user", "content": block_text(ns + "/q", q, question_len)},
            ],
        )
        for i, (t, prefix, q) in enumerate(timed[:count])
    ]
    params = {
        "prefixes": prefixes,
        "prefix_len": prefix_len,
        "question_len": question_len,
        "output_len": output_len,
        "burst_size": burst_size,
        "burst_spacing_s": burst_spacing_s,
        "zipf": zipf,
        "rate": rate,
        "count": count,
        "seed": seed,
    }
    return Workload("hot-burst", requests, params)


# -- long-document QA -----------------------------------------------------------------------


def docqa_workload(
    *,
    documents: int,
    document_len: int,
    question_len: int,
    output_len: int,
    zipf: float,
    rate: float,
    count: int,
    seed: int,
) -> Workload:
    """Questions about long documents: each request is a short instruction, one document, a question.

    Documents are Zipf-popular and long (several thousand tokens), so the fleet's GPU caches hold
    only part of the working set: where a document is cached decides most of the prefill.
    """
    if min(documents, document_len, question_len, output_len, count) <= 0:
        raise ValueError("docqa sizes must all be positive")
    ns = f"docqa/{seed}"
    rng = random.Random(seed)
    weights = _zipf_weights(documents, zipf)
    instruction = block_text(ns + "/instruction", 0, 64)
    requests = []
    for i, t in enumerate(poisson_arrivals(count, rate, rng)):
        doc = rng.choices(range(documents), weights)[0]
        requests.append(
            BenchRequest(
                index=i,
                arrival_s=t,
                max_tokens=output_len,
                messages=[
                    {"role": "system", "content": instruction},
                    {
                        "role": "user",
                        "content": block_text(ns + "/doc", doc, document_len)
                        + "\n\nQuestion:"
                        + block_text(ns + "/q", i, question_len),
                    },
                ],
            )
        )
    params = {
        "documents": documents,
        "document_len": document_len,
        "question_len": question_len,
        "output_len": output_len,
        "zipf": zipf,
        "rate": rate,
        "count": count,
        "seed": seed,
    }
    return Workload("docqa", requests, params)


# -- long-context: document QA + multi-turn chat ----------------------------------------------


def longctx_workload(
    *,
    docs: int,
    doc_len: int,
    questions_per_doc: int,
    question_len: int,
    sessions: int,
    turns: int,
    system_prompt_len: int,
    turn_len: int,
    output_len: int,
    duration_s: float,
    seed: int,
) -> Workload:
    """Long-context traffic whose working set is larger than the fleet's GPU memory.

    Document QA: ``docs`` documents of ``doc_len`` tokens (sent as the system message, as retrieved
    context is), each asked ``questions_per_doc`` questions at random moments over the run, so every
    document stays in the working set from start to end. Multi-turn chat: ``sessions`` sessions
    sharing one ``system_prompt_len`` system prompt, each turn resending the history plus a
    ``turn_len`` question (with a ``turn_len`` answer appended), turns spread evenly over the rest of
    the run after the session starts. Arrivals of both are Poisson over ``duration_s``.
    """
    if min(docs, doc_len, questions_per_doc, question_len, sessions, turns, system_prompt_len, turn_len) <= 0:
        raise ValueError("longctx sizes must all be positive")
    if duration_s <= 0 or output_len <= 0:
        raise ValueError("longctx duration and output length must be positive")
    doc_requests = docs * questions_per_doc
    qa = gsp_workload(
        groups=docs,
        prompts_per_group=questions_per_doc,
        system_prompt_len=doc_len,
        question_len=question_len,
        output_len=output_len,
        rate=doc_requests / duration_s,
        seed=seed,
    )
    # Sessions start over the first half of the run; their turns spread over the rest of it.
    interval = duration_s / 2 / max(turns - 1, 1)
    chat = multiturn_workload(
        sessions=sessions,
        turns=turns,
        system_prompt_len=system_prompt_len,
        question_len=turn_len,
        answer_len=turn_len,
        output_len=output_len,
        turn_interval_s=interval,
        rate=sessions * turns / (duration_s / 2),
        seed=seed,
    )
    merged = sorted(qa.requests + chat.requests, key=lambda r: (r.arrival_s, r.session or "", r.index))
    requests = [dataclasses.replace(r, index=i) for i, r in enumerate(merged)]
    return Workload(
        "longctx",
        requests,
        {
            "docs": docs,
            "doc_len": doc_len,
            "questions_per_doc": questions_per_doc,
            "question_len": question_len,
            "sessions": sessions,
            "turns": turns,
            "system_prompt_len": system_prompt_len,
            "turn_len": turn_len,
            "output_len": output_len,
            "duration_s": duration_s,
            "seed": seed,
        },
    )


# -- Mooncake traces ------------------------------------------------------------------------


@dataclass(frozen=True)
class TraceRecord:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True)
class TraceWindow:
    """Which part of a trace to replay and how fast.

    ``sample`` keeps that fraction of prefix families (whole conversations): a record is kept when
    xxh64 of its second hash id (its first id when it has one block) falls in the fraction. In the
    Mooncake conversation trace the first id is a system prompt every request shares and the second
    one starts a conversation, so sampling shrinks the trace to fit a small cluster while every kept
    conversation keeps all its turns (and so its reuse). ``start`` then skips that many of the kept
    records; ``max_requests`` keeps at most that many. ``time_scale`` divides inter-arrival gaps (2.0 =
    twice as fast); ``rate``, when set, replaces the timestamps with Poisson arrivals at that rate (the
    prefix structure and order are kept).
    """

    sample: float = 1.0
    start: int = 0
    max_requests: int | None = None
    time_scale: float = 1.0
    rate: float | None = None
    max_output: int | None = None  # cap output_length (long decodes cost client CPU, not routing insight)
    max_input: int | None = None  # truncate longer prompts (their leading blocks, hence their reuse, stay)


def _family_kept(hash_ids: Sequence[int], sample: float) -> bool:
    if sample >= 1.0:
        return True
    family = hash_ids[1] if len(hash_ids) > 1 else hash_ids[0]
    return xxhash.xxh64_intdigest(str(family).encode()) % 1_000_000 < sample * 1_000_000


def read_trace(path: str | Path, start: int = 0, limit: int | None = None, sample: float = 1.0) -> list[TraceRecord]:
    """Records ``start .. start+limit`` of a Mooncake JSONL trace (after family sampling, see
    ``TraceWindow``); clear errors for bad lines."""
    path = Path(path)
    try:
        handle = path.open()
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror}") from exc
    records: list[TraceRecord] = []
    skipped = 0
    with handle:
        for lineno, line in enumerate(handle, 1):
            if not line.strip():
                continue
            if limit is not None and len(records) >= limit:
                break
            try:
                raw = json.loads(line)
                record = TraceRecord(
                    float(raw["timestamp"]),
                    int(raw["input_length"]),
                    int(raw["output_length"]),
                    tuple(int(h) for h in raw["hash_ids"]),
                )
            except (ValueError, KeyError, TypeError) as exc:
                raise TraceError(
                    f"{path}:{lineno}: not a Mooncake record ({exc!r}); expected "
                    "timestamp, input_length, output_length, hash_ids"
                ) from exc
            if record.input_length <= 0 or not record.hash_ids:
                raise TraceError(f"{path}:{lineno}: input_length and hash_ids must be non-empty")
            if not _family_kept(record.hash_ids, sample):
                continue
            if skipped < start:
                skipped += 1
                continue
            records.append(record)
    if not records:
        raise TraceError(f"{path}: no records in the selected window (start={start})")
    return records


def trace_prompt(record: TraceRecord, block_size: int, namespace: str) -> str:
    """Concatenated block texts, the last block cut so the prompt is ``input_length`` tokens."""
    parts = []
    remaining = record.input_length
    for hid in record.hash_ids:
        if remaining <= 0:
            break
        # Always build the full block and cut it: a partial block is a prefix of the full one.
        text = block_text(namespace, hid, block_size)
        take = min(block_size, remaining)
        parts.append(text if take == block_size else _cut_words(text, take))
        remaining -= take
    return "".join(parts)


def _cut_words(text: str, words: int) -> str:
    # Every word starts with one space: the (words+1)-th space marks the cut.
    pos = -1
    for _ in range(words + 1):
        pos = text.find(" ", pos + 1)
        if pos < 0:
            return text
    return text[:pos]


def trace_workload(
    path: str | Path, *, block_size: int = 512, window: TraceWindow = TraceWindow(), seed: int = 0
) -> Workload:
    """Replay a Mooncake trace: one user message per record, its text built from the hash ids."""
    if block_size <= 0:
        raise ValueError("trace block size must be positive")
    if window.time_scale <= 0:
        raise ValueError("time scale must be positive")
    if not 0.0 < window.sample <= 1.0:
        raise ValueError("trace sample must be in (0, 1]")
    records = read_trace(path, window.start, window.max_requests, window.sample)
    if window.rate is not None:
        arrivals = poisson_arrivals(len(records), window.rate, random.Random(seed))
    else:
        t0 = records[0].timestamp_ms
        arrivals = [(r.timestamp_ms - t0) / 1000.0 / window.time_scale for r in records]
    ns = f"trace/{seed}"
    requests = []
    for i, (original, t) in enumerate(zip(records, arrivals)):
        record = original
        if window.max_input is not None and record.input_length > window.max_input:
            record = TraceRecord(record.timestamp_ms, window.max_input, record.output_length, record.hash_ids)
        out = max(1, record.output_length)
        if window.max_output is not None:
            out = min(out, window.max_output)
        requests.append(
            BenchRequest(
                index=i,
                arrival_s=t,
                max_tokens=out,
                messages=[{"role": "user", "content": trace_prompt(record, block_size, ns)}],
            )
        )
    return Workload(
        "trace",
        requests,
        {
            "trace": str(path),
            "block_size": block_size,
            "sample": window.sample,
            "start": window.start,
            "max_requests": window.max_requests,
            "time_scale": window.time_scale,
            "rate": window.rate,
            "max_output": window.max_output,
            "max_input": window.max_input,
            "seed": seed,
        },
    )


def iter_token_ids(requests: Sequence[BenchRequest]) -> Iterator[list[int]]:
    """Prompt token ids as an SGLang worker builds them (chat template, default tokenizer)."""
    tokenizer = load_tokenizer()
    for request in requests:
        yield tokenizer.encode_chat(request.messages)

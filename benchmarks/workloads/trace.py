"""Mooncake-format traces (``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids``) as workloads.

Each hash id becomes a block of one-token words (``base.block_text``), so two records that share
their first k hash ids share their first k x block-size tokens; a window, a family sample, time
compression and rate scaling shrink a trace recorded on a large fleet to a small cluster.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import xxhash

from benchmarks.workloads.base import BenchRequest, Workload, block_text, poisson_arrivals

__all__ = ["TraceError", "TraceRecord", "TraceWindow", "read_trace", "trace_prompt", "trace_workload"]


class TraceError(ValueError):
    """A trace file is missing or malformed (the message names the file and line)."""


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
    sample_salt: int = 0  # which fraction ``sample`` keeps: another salt keeps other conversations
    start: int = 0
    max_requests: int | None = None
    time_scale: float = 1.0
    rate: float | None = None
    max_output: int | None = None  # cap output_length (long decodes cost client CPU, not routing insight)
    max_input: int | None = None  # truncate longer prompts (their leading blocks, hence their reuse, stay)


def _family_kept(hash_ids: Sequence[int], sample: float, salt: int = 0) -> bool:
    if sample >= 1.0:
        return True
    family = hash_ids[1] if len(hash_ids) > 1 else hash_ids[0]
    return xxhash.xxh64_intdigest(str(family).encode(), seed=salt) % 1_000_000 < sample * 1_000_000


def read_trace(
    path: str | Path, start: int = 0, limit: int | None = None, sample: float = 1.0, salt: int = 0
) -> list[TraceRecord]:
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
            if not _family_kept(record.hash_ids, sample, salt):
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
    records = read_trace(path, window.start, window.max_requests, window.sample, window.sample_salt)
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
            "sample_salt": window.sample_salt,
            "start": window.start,
            "max_requests": window.max_requests,
            "time_scale": window.time_scale,
            "rate": window.rate,
            "max_output": window.max_output,
            "max_input": window.max_input,
            "seed": seed,
        },
    )

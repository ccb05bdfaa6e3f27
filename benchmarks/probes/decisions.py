"""Decision latency measured in this process: ``Router.route()`` (the serving app's router,
in process) end to end on a fleet of N workers.

For chat prompts of about 1k / 8k / 32k tokens: render the chat template, tokenize, hash the blocks,
look them up, choose, trace. Cold is a prompt never seen before (nothing in the piece cache, no block
in the index); warm is a later turn of a conversation seen before (its document and earlier turns
tokenized already, their blocks held by one worker in the index, as its KV events would have
reported), the conversations' turns arriving interleaved, as many users' do. No worker runs. Used by
``--suite decision-latency`` and ``--suite scale``.
"""

from __future__ import annotations

import random
import time

from benchmarks.stats import sorted_percentile
from extproc.config import EventsConfig, IndexConfig, PolicyConfig, RouterConfig
from extproc.decision.request import ParsedRequest
from extproc.fleet.workers import Worker, WorkerRegistry
from extproc.serving.app import RouterApp
from prefix_common.tokenization import load_tokenizer

__all__ = ["PAGE", "SIZES", "decision_latency"]

PAGE = 16
SIZES = (1024, 8192, 32768)


def _vocabulary(rng: random.Random) -> list[str]:
    letters = "abcdefghijklmnopqrstuvwxyz"
    return ["".join(rng.choice(letters) for _ in range(rng.randint(2, 10))) for _ in range(3000)]


def _document(rng: random.Random, vocab: list[str], tokens: int) -> str:
    """Paragraphs of pseudo-words, about ``tokens`` tokens long under the default tokenizer."""
    tok = load_tokenizer()
    paragraphs: list[str] = []
    count = 0
    while count < tokens:
        para = " ".join(rng.choice(vocab) for _ in range(rng.randint(20, 60))) + "."
        paragraphs.append(para)
        count += len(tok.encode_whole(para, False)) + 1
    return "\n\n".join(paragraphs)


def _percentiles(values: list[float]) -> tuple[float, float]:
    """p50 and p99 in ms."""
    ordered = sorted(values)
    return sorted_percentile(ordered, 50) * 1000, sorted_percentile(ordered, 99) * 1000


def decision_latency(
    samples: int, workers: int, max_candidates: int | None = None
) -> list[tuple[int, int, tuple[float, float], tuple[float, float]]]:
    """Per prompt size: (size, tokens, cold p50/p99, warm p50/p99); ``max_candidates`` overrides the shortlist."""
    rng = random.Random(42)
    vocab = _vocabulary(rng)
    fleet = [
        Worker(id=f"w{i}", url=f"http://127.0.0.1:{41000 + i}", ip="127.0.0.1", port=41000 + i) for i in range(workers)
    ]
    policy = PolicyConfig() if max_candidates is None else PolicyConfig(max_candidates=max_candidates)
    config = RouterConfig(events=EventsConfig(enabled=False), index=IndexConfig(default_block_size=PAGE), policy=policy)
    app = RouterApp(config, WorkerRegistry(fleet))
    router, index = app.router, app.index
    # One throw-away decision: the tokenizer's first call initialises lazily (~10 ms), once per process.
    router.finish(router.route(ParsedRequest(path="/generate", kind="generate", model="m", prompt_text="warm up")))
    results = []
    for size in SIZES:
        cold: list[float] = []
        warm: list[float] = []
        tokens = 0
        sessions: list[list[dict[str, str]]] = []
        for _ in range(samples):
            doc = _document(rng, vocab, size)
            history = [
                {"role": "system", "content": "You answer questions about the document."},
                {"role": "user", "content": doc + "\n\nSummarise it."},
            ]
            parsed = ParsedRequest(path="/v1/chat/completions", kind="chat", model="m", messages=history)
            start = time.perf_counter()
            outcome = router.route(parsed)
            cold.append(time.perf_counter() - start)
            router.finish(outcome)
            tokens = len(outcome.request.token_ids or [])
            # The worker prefilled it and reported its blocks (what its KV events would have said).
            index.store(outcome.worker.id, outcome.request.block_keys)
            sessions.append([*history, {"role": "assistant", "content": "A summary."}])
        # Later turns interleaved across the sessions, as many users' conversations arrive.
        for turn in range(3):
            for i, history in enumerate(sessions):
                history += [{"role": "user", "content": f"Question {turn} about paragraph {i}?"}]
                parsed = ParsedRequest(path="/v1/chat/completions", kind="chat", model="m", messages=list(history))
                start = time.perf_counter()
                outcome = router.route(parsed)
                warm.append(time.perf_counter() - start)
                router.finish(outcome)
                assert outcome.matched_blocks > 0
                history += [{"role": "assistant", "content": "An answer."}]
        results.append((size, tokens, _percentiles(cold), _percentiles(warm)))
    return results

"""The generated workloads: deterministic request lists of a known shape (see ``base`` for the text).

- ``gsp``: SGLang bench_serving's *generated-shared-prefix*: ``groups`` system prompts, each shared
  by ``prompts_per_group`` questions; requests shuffled and sent as Poisson arrivals.
- ``multiturn``: chat sessions whose history grows turn by turn (user question + a fixed assistant
  answer appended each turn); sessions start as a Poisson process, turns follow at a fixed interval.
- ``hot-burst``: a few Zipf-popular system prompts, each arrival a burst of siblings.
- ``docqa``: questions about long, Zipf-popular documents.
- ``longctx``: the tiered-cache scenario (``--suite tiered``): document QA over long documents
  interleaved with multi-turn chat sessions, sized so that the fleet's GPU pool holds only part of
  the working set.
- ``burst``: fan-out bursts of requests sharing a prefix within a few ms (``--suite replicas``).
- ``agent``: agent sessions: Zipf-popular tenants' long tool-definition prompts, shared tenant
  documents, histories that grow by an action and a tool result per step, and steps that fan out
  into parallel calls; every length a whole number of 64-token blocks.
"""

from __future__ import annotations

import dataclasses
import random

from benchmarks.workloads.base import BenchRequest, Workload, block_text, poisson_arrivals

__all__ = [
    "agent_workload",
    "burst_workload",
    "docqa_workload",
    "gsp_workload",
    "hot_burst_workload",
    "longctx_workload",
    "multiturn_workload",
]


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


# -- fan-out bursts ------------------------------------------------------------------------


def burst_workload(
    *,
    groups: int,
    burst_size: int,
    bursts_per_group: int,
    system_prompt_len: int,
    question_len: int,
    output_len: int,
    gap_s: float,
    spacing_s: float,
    seed: int,
) -> Workload:
    """Fan-out bursts: ``burst_size`` requests sharing a group's system prompt within a few ms.

    The pattern of an agent issuing parallel calls on one context: all requests of a burst arrive
    before the worker that got the first one has finished its prefill, so only the routers' own
    (unconfirmed) decisions can keep the burst together. Bursts start every ``gap_s`` and cycle over
    the groups, so a group's later bursts also test that confirmed state (events) is shared.
    """
    if min(groups, burst_size, bursts_per_group, system_prompt_len, question_len, output_len) <= 0 or gap_s <= 0:
        raise ValueError("burst sizes and the gap must be positive")
    ns = f"burst/{seed}"
    requests: list[BenchRequest] = []
    for b in range(groups * bursts_per_group):
        group, round_ = b % groups, b // groups
        system = block_text(ns + "/system", group, system_prompt_len)
        for i in range(burst_size):
            question = block_text(ns + f"/q{group}", round_ * burst_size + i, question_len)
            requests.append(
                BenchRequest(
                    index=len(requests),
                    arrival_s=b * gap_s + i * spacing_s,
                    max_tokens=output_len,
                    messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
                )
            )
    return Workload(
        "burst",
        requests,
        {
            "groups": groups,
            "burst_size": burst_size,
            "bursts_per_group": bursts_per_group,
            "system_prompt_len": system_prompt_len,
            "question_len": question_len,
            "output_len": output_len,
            "gap_s": gap_s,
            "spacing_s": spacing_s,
            "seed": seed,
        },
    )


# -- agent sessions -------------------------------------------------------------------------

AGENT_BLOCK = 64  # every length of the agent workload is a whole number of these tokens


def _blocks(rng: random.Random, low: int, high: int) -> int:
    """A length in tokens: a whole number of ``AGENT_BLOCK`` blocks between ``low`` and ``high`` blocks."""
    return AGENT_BLOCK * rng.randint(low, high)


def agent_requests_per_session(steps: tuple[int, int], fan_out: int, fan_out_share: float) -> float:
    """How many requests an agent session sends on average (its steps, each fanned-out step ``fan_out``)."""
    return (steps[0] + steps[1]) / 2 * (1 + fan_out_share * (fan_out - 1))


def agent_workload(
    *,
    sessions: int,
    tenants: int,
    tenant_zipf: float,
    docs_per_tenant: int,
    doc_zipf: float,
    doc_share: float,
    steps: tuple[int, int],
    step_s: float,
    fan_out: int,
    fan_out_share: float,
    output_len: int,
    rate: float,
    seed: int,
) -> Workload:
    """Agent sessions: what a fleet serving coding or support agents sees.

    A session belongs to a tenant (Zipf-popular, exponent ``tenant_zipf``) whose system prompt is its
    long tool definitions (8-32 blocks of 64 tokens); with probability ``doc_share`` it starts from one
    of the tenant's ``docs_per_tenant`` documents (Zipf ``doc_zipf``, 4-32 blocks: a repository file, a
    knowledge-base article), then a task (2-4 blocks). Each of its ``steps`` (uniform in the closed
    range) resends the whole history plus the last tool result (1-6 blocks); the next step follows
    0.5-1.5 x ``step_s`` later (the tool's run time, open loop) with the model's action (1-3 blocks,
    fixed text so every contender sends the same bytes) and that result appended. With probability
    ``fan_out_share`` a step is ``fan_out`` parallel calls 5 ms apart, each with its own tool result on
    the same history, and the session goes on from the first. Sessions start as a Poisson process at
    ``rate`` over the mean requests per session, so ``rate`` is the overall request rate.
    """
    if min(sessions, tenants, docs_per_tenant, fan_out, output_len) <= 0 or not 1 <= steps[0] <= steps[1]:
        raise ValueError("agent sizes must all be positive, steps a range low <= high")
    if not 0.0 <= doc_share <= 1.0 or not 0.0 <= fan_out_share <= 1.0 or step_s < 0:
        raise ValueError("agent shares must be in [0, 1] and the step time >= 0")
    ns = f"agent/{seed}"
    rng = random.Random(seed)
    per_session = agent_requests_per_session(steps, fan_out, fan_out_share)
    starts = poisson_arrivals(sessions, rate / per_session, rng)
    tenant_weights = _zipf_weights(tenants, tenant_zipf)
    doc_weights = _zipf_weights(docs_per_tenant, doc_zipf)
    # Each tenant's and each document's length is fixed by the seed, like its text.
    shape = random.Random(f"{seed}/shape")
    system_len = [_blocks(shape, 8, 32) for _ in range(tenants)]
    doc_len = [[_blocks(shape, 4, 32) for _ in range(docs_per_tenant)] for _ in range(tenants)]
    timed: list[tuple[float, int, str, list[dict[str, str]]]] = []
    for s, start in enumerate(starts):
        tenant = rng.choices(range(tenants), tenant_weights)[0]
        opening = block_text(f"{ns}/s{s}/task", 0, _blocks(rng, 2, 4))
        if rng.random() < doc_share:
            doc = rng.choices(range(docs_per_tenant), doc_weights)[0]
            opening = block_text(f"{ns}/t{tenant}/doc", doc, doc_len[tenant][doc]) + "\n\nTask:" + opening
        history: list[dict[str, str]] = [
            {"role": "system", "content": block_text(f"{ns}/tools", tenant, system_len[tenant])},
            {"role": "user", "content": opening},
        ]
        now, sid, count = start, f"s{s}", rng.randint(*steps)
        timed.append((now, len(timed), sid, history))
        for k in range(1, count):
            now += step_s * (0.5 + rng.random())
            action = block_text(f"{ns}/{sid}/action", k, _blocks(rng, 1, 3))
            history = history + [{"role": "assistant", "content": action}]
            calls = fan_out if rng.random() < fan_out_share else 1
            results = [block_text(f"{ns}/{sid}/result{k}", j, _blocks(rng, 1, 6)) for j in range(calls)]
            for j, result in enumerate(results):
                timed.append((now + j * 0.005, len(timed), sid, history + [{"role": "user", "content": result}]))
            history = history + [{"role": "user", "content": results[0]}]
    timed.sort(key=lambda item: (item[0], item[1]))
    requests = [
        BenchRequest(index=i, arrival_s=t, messages=msgs, max_tokens=output_len, session=sid)
        for i, (t, _, sid, msgs) in enumerate(timed)
    ]
    params = {
        "sessions": sessions,
        "tenants": tenants,
        "tenant_zipf": tenant_zipf,
        "docs_per_tenant": docs_per_tenant,
        "doc_zipf": doc_zipf,
        "doc_share": doc_share,
        "steps": list(steps),
        "step_s": step_s,
        "fan_out": fan_out,
        "fan_out_share": fan_out_share,
        "output_len": output_len,
        "rate": rate,
        "seed": seed,
    }
    return Workload("agent", requests, params)

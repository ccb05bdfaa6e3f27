"""Property-based fuzzing of request bodies through the real Envoy, router and a simulated worker.

Whatever a client sends to the three generation APIs (random bytes, random JSON of random types,
the right shape with wrong types, ids out of range, lone surrogates, deep nesting), the answer is a
4xx with an OpenAI-style JSON error or a 200, never a 5xx, and the router keeps serving. The example
count is modest so the default suite stays quick; raise FUZZ_EXAMPLES for a longer hunt.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import pytest

from prefix_router.stack import GatewayStack
from tests.support.gateway_http import post

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytestmark = pytest.mark.timeout(300)

PATHS = ("/v1/chat/completions", "/v1/completions", "/generate")
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "60"))

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=20,
)
token_ids = st.lists(st.integers(min_value=-(2**70), max_value=2**70), min_size=0, max_size=40)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "tool", ""]) | json_values},
        optional={"content": st.text(max_size=200) | json_values},
    )
    | json_values,
    max_size=6,
)
shaped = st.fixed_dictionaries(
    {},
    optional={
        "model": st.text(max_size=20) | json_values,
        "messages": messages,
        "prompt": st.text(max_size=300) | token_ids | json_values,
        "text": st.text(max_size=300) | json_values,
        "input_ids": token_ids | json_values,
        "max_tokens": st.integers(min_value=-5, max_value=10**7) | json_values,
        "stream": st.booleans() | json_values,
        "sampling_params": st.fixed_dictionaries({}, optional={"max_new_tokens": st.integers(-5, 10**7)}) | json_values,
    },
)


def _encode(value: Any) -> bytes:
    return json.dumps(value).encode()


bodies = st.one_of(
    st.binary(max_size=300),
    json_values.map(_encode),
    shaped.map(_encode),
    st.text(max_size=100).map(lambda t: ('{"prompt": "' + t + '\\ud800"}').encode()),  # a lone surrogate
    st.integers(min_value=1, max_value=20_000).map(lambda n: b"[" * n + b"]" * n),  # deep nesting
)


@pytest.fixture(scope="module")
def stack(envoy_bin: str) -> Iterator[GatewayStack]:
    with GatewayStack(sim_workers=1, sim_worker_options={"profile": "instant", "default_max_new_tokens": 4}) as gw:
        yield gw


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(PATHS), body=bodies)
def test_any_body_gets_a_4xx_json_error_or_an_answer_never_a_5xx(stack: GatewayStack, path: str, body: bytes) -> None:
    reply = post(stack.url + path, body, timeout=30)
    assert reply.status < 500, (path, body[:200], reply.status, reply.body[:300])
    if reply.status >= 400:
        error = json.loads(reply.body)
        assert isinstance(error, dict) and ("error" in error or error.get("object") == "error"), reply.body[:300]


def test_the_router_still_serves_after_the_fuzzing(stack: GatewayStack) -> None:
    assert stack.router_process is not None and stack.router_process.poll() is None
    reply = post(stack.url + "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert reply.status == 200 and reply.headers.get("x-upstream-host")

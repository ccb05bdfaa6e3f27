"""The simulator's radix cache against SGLang 0.5.23's own recorded KV-event payloads, plus its invariants."""

from __future__ import annotations

import json

import msgpack
import pytest

from sglang_workers.sim.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    decode_payload,
    encode_payload,
)
from sglang_workers.sim.radix_cache import RadixCache
from tests.support.sim_fixtures import GOLDEN_DIR, sha256_chain


def _golden() -> dict:
    path = GOLDEN_DIR / "golden.json"
    if not path.is_file():
        pytest.skip(f"golden SGLang payloads not found at {path} (../shared absent)")
    return json.loads(path.read_text())


def _scenarios() -> list[str]:
    path = GOLDEN_DIR / "golden.json"
    return sorted(json.loads(path.read_text())["scenarios"]) if path.is_file() else ["(absent)"]


def _replay(scenario: dict) -> list[tuple[dict, list]]:
    """Run the scenario's operations on a fresh cache: (step, events published by it) pairs."""
    cache = RadixCache(scenario["page_size"])
    construction = cache.take_events()
    assert [type(e).__name__ for e in construction] == [e["type"] for e in scenario["events_at_construction"]]
    out = []
    for step in scenario["steps"]:
        if step["op"] == "insert":
            cache.insert(step["arg"], scenario["cache_salt"])
        elif step["op"] == "evict":
            cache.evict(step["arg"])
        else:
            assert step["op"] == "reset"
            cache.reset()
        out.append((step, cache.take_events()))
    return out


@pytest.mark.parametrize("name", [n for n in _scenarios() if not n.endswith("dynamo")])
def test_replays_golden_operations_byte_identical(name: str) -> None:
    scenario = _golden()["scenarios"][name]
    for step, events in _replay(scenario):
        batch = step["batch"]
        if batch is None:
            assert events == [], f"step {step['step']} must publish nothing"
            continue
        expected = bytes.fromhex(batch["payload_hex"])
        ts = msgpack.unpackb(expected)[0]  # the timestamp is the only field allowed to differ
        assert encode_payload(events, ts, dp_rank=0) == expected, f"step {step['step']} ({step['op']})"
        assert (GOLDEN_DIR / batch["file"]).read_bytes() == expected


def test_dynamo_format_scenario_matches_except_hash_values() -> None:
    """SGLang's "dynamo" event format hashes salted blocks another way, which the simulator does not
    reproduce (it publishes the default format's hashes). Everything else must still be identical:
    the batches, the field layout, and which block each hash names (a consistent one-to-one mapping)."""
    golden = _golden()["scenarios"]
    scenario = next((golden[n] for n in golden if n.endswith("dynamo")), None)
    if scenario is None:
        pytest.skip("no dynamo-format scenario in golden.json")
    mapping: dict[int, int] = {}
    for step, events in _replay(scenario):
        batch = step["batch"]
        assert (batch is None) == (events == [])
        if batch is None:
            continue
        expected = bytes.fromhex(batch["payload_hex"])
        ts, want, rank = msgpack.unpackb(expected)
        for ours, theirs in zip(events, want):
            for a, b in zip(ours.block_hashes, theirs["block_hashes"]):
                assert mapping.setdefault(a, b) == b
            if isinstance(ours, BlockStored) and ours.parent_block_hash is not None:
                assert mapping[ours.parent_block_hash] == theirs["parent_block_hash"]
        renamed = msgpack.unpackb(encode_payload(events, ts, dp_rank=rank))
        for event in renamed[1]:
            event["block_hashes"] = [mapping[h] for h in event["block_hashes"]]
            if event.get("parent_block_hash") is not None:
                event["parent_block_hash"] = mapping[event["parent_block_hash"]]
        assert msgpack.packb(renamed) == expected
    assert len(set(mapping.values())) == len(mapping)


def test_hashes_equal_an_independent_sha256_chain() -> None:
    tokens = list(range(1000, 1037))
    cache = RadixCache(page_size=8)
    cache.take_events()
    cache.insert(tokens)
    (stored,) = cache.take_events()
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == sha256_chain(tokens, 8)
    assert stored.token_ids == tokens[:32]  # the partial last page is neither cached nor published
    cache.insert(tokens[:16] + [7] * 16, salt=None)
    (branch,) = cache.take_events()
    assert isinstance(branch, BlockStored)
    assert branch.parent_block_hash == sha256_chain(tokens, 8)[1]
    assert branch.block_hashes == sha256_chain(tokens[:16] + [7] * 16, 8)[2:]


def test_salted_chain_is_namespaced() -> None:
    cache = RadixCache(page_size=4)
    cache.insert([1, 2, 3, 4, 5, 6, 7, 8], salt="tenant-A")
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9])[0] == 0  # unsalted lookups do not see it
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9], salt="tenant-A")[0] == 8
    stored = [e for e in cache.take_events() if isinstance(e, BlockStored)]
    assert stored[0].block_hashes == sha256_chain([1, 2, 3, 4, 5, 6, 7, 8], 4, salt="tenant-A")
    assert stored[0].cache_salt == "tenant-A"


def test_locked_pages_are_never_evicted() -> None:
    cache = RadixCache(page_size=2)
    cache.insert([1, 2, 3, 4])
    cache.insert([9, 9, 8, 8])
    length, node = cache.match_prefix([1, 2, 3, 4, 5])
    assert length == 4
    cache.lock(node)
    cache.take_events()
    assert cache.evict(100) == 4
    (removed,) = cache.take_events()
    assert removed == BlockRemoved(sha256_chain([9, 9, 8, 8], 2))
    assert cache.match_prefix([1, 2, 3, 4])[0] == 4
    assert (cache.evictable_size, cache.protected_size) == (0, 4)
    cache.unlock(node)
    assert cache.evict(1) == 4  # a whole leaf goes, even when fewer tokens were asked for
    assert cache.total_size == 0


def test_positional_encoding_decodes_to_the_same_events() -> None:
    events: list[KVEvent] = [AllBlocksCleared(), BlockStored([5, -6], None, [1, 2, 3, 4], 2), BlockRemoved([5])]
    tagged = decode_payload(encode_payload(events, 1.0, 0, "tagged"))
    positional = decode_payload(encode_payload(events, 1.0, 0, "positional"))
    assert tagged == positional == (1.0, events, 0)
    raw = msgpack.unpackb(encode_payload(events, 1.0, 0, "positional"))
    assert raw[1][1] == ["BlockStored", [5, -6], None, [1, 2, 3, 4], 2, None, "GPU"]
    assert raw[1][2] == ["BlockRemoved", [5], "GPU"]

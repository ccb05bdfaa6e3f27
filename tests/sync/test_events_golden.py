"""The event decoder against payloads recorded from real SGLang 0.5.23 (../shared/sglang-events).

Oracle independent of the decoder: the block set each step should leave is derived from the
scenario's operations (the token ids inserted) and the recorded event list in golden.json; the
router's own keys are recomputed from those token ids with ``extproc.fleet.blocks``.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import msgpack
import pytest

from extproc.fleet.blocks import block_keys, chain_seed
from extproc.fleet.index import BlockIndex
from extproc.sync.cache_view import WorkerCacheView
from extproc.sync.event_wire import AllBlocksCleared, BlockRemoved, BlockStored, decode_payload
from tests.support.kv_batches import apply_events

GOLDEN_DIR = Path(__file__).resolve().parents[2].parent / "shared" / "sglang-events"

pytestmark = pytest.mark.skipif(
    not (GOLDEN_DIR / "golden.json").is_file(), reason=f"golden KV-event payloads not found at {GOLDEN_DIR}"
)


def _golden() -> dict:
    return json.loads((GOLDEN_DIR / "golden.json").read_text())


def _scenarios() -> list[str]:
    if not (GOLDEN_DIR / "golden.json").is_file():
        return []
    return sorted(_golden()["scenarios"])


def _sglang_hashes(tokens: list[int], page: int, salt: str | None) -> list[int]:
    """SGLang's published block hashes (default format), per the rule in the golden README."""
    prior = hashlib.sha256(b"sglang-cache-salt-v1\0" + salt.encode()).digest() if salt else b""
    out = []
    for i in range(len(tokens) // page):
        chunk = tokens[i * page : (i + 1) * page]
        if max(chunk) >= 1 << 32:
            body = b"\xff" + struct.pack(f"<{page}Q", *chunk)
        else:
            body = struct.pack(f"<{page}I", *chunk)
        prior = hashlib.sha256(prior + body).digest()
        out.append(int.from_bytes(prior[:8], "big", signed=True))
    return out


@pytest.mark.parametrize("name", _scenarios())
def test_decoder_rebuilds_the_recorded_block_sets(name: str) -> None:
    scenario = _golden()["scenarios"][name]
    page, salt = scenario["page_size"], scenario["cache_salt"]
    seed = chain_seed("m", None, salt)
    index = BlockIndex()
    view = WorkerCacheView("w", index, model="m")
    live: set[int] = set()  # engine hashes alive according to the recorded (JSON) events
    own_of: dict[int, int] = {}  # engine hash -> own key, from the inserted token ids
    applied = 0
    for step in scenario["steps"]:
        batch = step.get("batch")
        if step["op"] == "insert":
            tokens = step["arg"]
            full = len(tokens) // page * page
            keys = block_keys(tokens[:full], page, seed)
            if batch:
                stored = [e for e in batch["decoded"][1] if e["type"] == "BlockStored"]
                hashes = [h for e in stored for h in e["block_hashes"]]
                # The published pages are the trailing full pages of what was inserted.
                for h, key in zip(hashes, keys[len(keys) - len(hashes) :]):
                    own_of[h] = key
                if scenario["format"] == "default":
                    assert hashes == _sglang_hashes(tokens[:full], page, salt)[len(keys) - len(hashes) :]
        if not batch:
            assert index.blocks("w") == {own_of[h] for h in live}  # nothing published, nothing changed
            continue
        payload = (GOLDEN_DIR / batch["file"]).read_bytes()
        assert payload.hex() == batch["payload_hex"]
        assert view.ingest(batch["frames"]["seq"], payload) is None
        applied += 1
        apply_events(live, batch["decoded"][1])
        assert index.blocks("w") == {own_of[h] for h in live}, f"{name} step {step['step']}"
        assert view.state == "synced"
    assert view.stats.batches == applied
    assert view.stats.orphans == 0 and view.stats.decode_errors == 0


def test_merged_multi_page_store_and_removal_are_exact() -> None:
    scenario = _golden()["scenarios"]["p4_basic"]
    first = (GOLDEN_DIR / scenario["steps"][0]["batch"]["file"]).read_bytes()
    batch = decode_payload(first)
    (event,) = batch.events
    assert isinstance(event, BlockStored)
    assert len(event.block_hashes) == 3 and len(event.token_ids) == 12 and event.block_size == 4
    assert event.parent_block_hash is None and event.medium == "GPU"
    removal = decode_payload((GOLDEN_DIR / scenario["steps"][4]["batch"]["file"]).read_bytes())
    assert isinstance(removal.events[0], BlockRemoved) and len(removal.events[0].block_hashes) == 3
    reset = decode_payload((GOLDEN_DIR / scenario["steps"][7]["batch"]["file"]).read_bytes())
    assert reset.events == [AllBlocksCleared()]


def _positional(event: dict) -> list:
    """The pre-0.5.20 encoding of the same event: tagged array, trailing defaults omitted."""
    if event["type"] == "BlockStored":
        fields = [
            event["block_hashes"],
            event["parent_block_hash"],
            event["token_ids"],
            event["block_size"],
            event["lora_id"],
            event.get("medium"),
        ]
        while fields and fields[-1] is None:
            fields.pop()
        return ["BlockStored", *fields]
    if event["type"] == "BlockRemoved":
        return ["BlockRemoved", event["block_hashes"]] + ([event["medium"]] if event.get("medium") else [])
    return ["AllBlocksCleared"]


@pytest.mark.parametrize("name", _scenarios())
def test_positional_encoding_decodes_to_the_same_events(name: str) -> None:
    for step in _golden()["scenarios"][name]["steps"]:
        batch = step.get("batch")
        if not batch:
            continue
        tagged = decode_payload((GOLDEN_DIR / batch["file"]).read_bytes())
        ts, events, rank = batch["decoded"]
        older = msgpack.packb([ts, [_positional(e) for e in events], rank])
        decoded = decode_payload(older)
        for new, old in zip(tagged.events, decoded.events, strict=True):
            if isinstance(new, BlockStored):
                assert isinstance(old, BlockStored)
                # cache_salt is not part of the old positional layout
                assert (new.block_hashes, new.parent_block_hash, new.token_ids, new.block_size) == (
                    old.block_hashes,
                    old.parent_block_hash,
                    old.token_ids,
                    old.block_size,
                )
            else:
                assert new == old

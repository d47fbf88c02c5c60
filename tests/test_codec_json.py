"""JSON codec in the LLM API shape (WIRE.md 6): exact shapes, round trips, clear errors."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from events.wire.codec import DecodeError, from_json, to_json
from events.wire.model import (
    AllBlocksCleared,
    Created,
    EventDiff,
    KVCacheEvent,
    Removed,
    Stored,
    StoredBlock,
    Updated,
)


def test_stored_event_has_the_llm_api_shape() -> None:
    event = KVCacheEvent(
        event_id=3,
        data=Stored(
            parent_hash=None,
            blocks=[StoredBlock(block_hash=42, tokens=[7, 8], lora_id=None, cache_salt_id=9)],
            block_size=2,
        ),
        window_size=4096,
        attention_dp_rank=1,
    )
    assert to_json(event) == {
        "event_id": 3,
        "data": {
            "type": "stored",
            "parent_hash": None,
            "blocks": [
                {
                    "type": "stored_block",
                    "block_hash": 42,
                    "tokens": [
                        {"type": "unique_token", "token_id": 7, "token_extra_id": 0},
                        {"type": "unique_token", "token_id": 8, "token_extra_id": 0},
                    ],
                    "lora_id": None,
                    "cache_level": 0,
                    "priority": 35,
                    "cache_salt_id": 9,
                }
            ],
        },
        "window_size": 4096,
        "hash_algo": "v1_block_key",
        "attention_dp_rank": 1,
    }


@pytest.mark.parametrize(
    ("data", "shape"),
    [
        (
            Created([100, 400]),
            {"type": "created", "num_blocks_per_cache_level": [100, 400]},
        ),
        (Removed([1, 2]), {"type": "removed", "block_hashes": [1, 2]}),
        (Removed([1], cache_level=1), {"type": "removed", "block_hashes": [1], "cache_level": 1}),
        (
            Updated(5, EventDiff(0, 1), None),
            {
                "type": "updated",
                "block_hash": 5,
                "cache_level": {"type": "event_diff", "old_value": 0, "new_value": 1},
                "priority": None,
            },
        ),
        (AllBlocksCleared(), {"type": "all_blocks_cleared"}),
    ],
)
def test_other_event_shapes(data: Any, shape: dict[str, Any]) -> None:
    out = to_json(KVCacheEvent(1, data))
    assert out == {"event_id": 1, "data": shape, "window_size": 0, "hash_algo": "v1_block_key"}
    assert "attention_dp_rank" not in out


U64 = st.integers(0, 2**64 - 1)
HASH = st.one_of(U64, st.binary(min_size=32, max_size=32).map(bytes.hex))
DIFF = st.one_of(st.none(), st.builds(EventDiff, st.integers(0, 100), st.integers(0, 100)))
BLOCK = st.builds(
    StoredBlock,
    block_hash=HASH,
    tokens=st.lists(st.integers(0, 2**31 - 1), max_size=8),
    lora_id=st.one_of(st.none(), U64),
    cache_level=st.integers(0, 3),
    priority=st.integers(0, 100),
    cache_salt_id=st.one_of(st.none(), U64),
)
DATA = st.one_of(
    st.builds(Stored, st.one_of(st.none(), HASH), st.lists(BLOCK, max_size=4)),
    st.builds(Removed, st.lists(HASH, max_size=5), st.one_of(st.none(), st.integers(0, 3))),
    st.builds(Updated, HASH, DIFF, DIFF),
    st.builds(Created, st.lists(st.integers(0, 10**6), max_size=3)),
    st.just(AllBlocksCleared()),
)
EVENT = st.builds(
    KVCacheEvent,
    event_id=st.integers(0, 2**40),
    data=DATA,
    window_size=st.integers(0, 10**6),
    hash_algo=st.sampled_from(["v1_block_key", "v2_sha256", "v2_sha256_64"]),
    attention_dp_rank=st.one_of(st.none(), st.integers(0, 64)),
)


@settings(max_examples=200, deadline=None)
@given(event=EVENT)
def test_round_trip_through_json_text(event: KVCacheEvent) -> None:
    assert from_json(json.loads(json.dumps(to_json(event)))) == event


def test_block_size_does_not_travel_in_json() -> None:
    event = KVCacheEvent(0, Stored(None, [StoredBlock(1, [1, 2])], block_size=2))
    decoded = from_json(to_json(event))
    assert isinstance(decoded.data, Stored)
    assert decoded.data.block_size is None


def test_bare_token_ids_and_missing_defaults_are_accepted() -> None:
    obj = {
        "event_id": 0,
        "data": {
            "type": "stored",
            "parent_hash": None,
            "blocks": [{"type": "stored_block", "block_hash": 1, "tokens": [4, 5]}],
        },
    }
    assert from_json(obj) == KVCacheEvent(0, Stored(None, [StoredBlock(1, [4, 5])]))


def _stored(**block: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"type": "stored_block", "block_hash": 1, "tokens": [1]}
    base.update(block)
    return {"event_id": 0, "data": {"type": "stored", "parent_hash": None, "blocks": [base]}}


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        ([], "event: expected an object, got list"),
        ({"data": {"type": "all_blocks_cleared"}}, "event.event_id: expected an int, got nothing"),
        ({"event_id": True, "data": {}}, "event.event_id: expected an int, got bool"),
        ({"event_id": 0, "data": {"type": "moved"}}, "unknown event type 'moved'"),
        ({"event_id": 0, "data": {"type": "removed", "block_hashes": [-1]}}, "block_hashes[0]"),
        (
            {"event_id": 0, "data": {"type": "removed", "block_hashes": ["ABCD"]}},
            "64 lowercase hex",
        ),
        (_stored(tokens=[{"token_id": 1, "token_extra_id": 5}]), "token_extra_id: 5"),
        (_stored(tokens=[2**31]), "blocks[0].tokens[0]: 2147483648 is outside"),
        (_stored(priority=200), "blocks[0].priority"),
        (_stored(lora_id="a"), "blocks[0].lora_id: expected an int, got str"),
        (
            {"event_id": 0, "data": {"type": "updated", "block_hash": 1, "priority": {}}},
            "event.data.priority.old_value",
        ),
        ({"event_id": 0, "data": {"type": "all_blocks_cleared"}, "hash_algo": 1}, "hash_algo"),
    ],
)
def test_malformed_json_raises_decode_error_naming_the_field(obj: Any, message: str) -> None:
    with pytest.raises(DecodeError, match=re.escape(message)):
        from_json(obj)

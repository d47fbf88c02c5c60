"""The event pipeline's record builders (StoredBlock records, wire runs): one Python
implementation each, checked here against references written in the tests (the V1 hash's
readable form, slices and runs spelled out by hand)."""

from __future__ import annotations

import gc
from array import array
from typing import Any

import msgpack
import msgspec
import pytest
from _reference import v1_block_hash as v1_block_hash_ref
from hypothesis import given, settings
from hypothesis import strategies as st

from events.manager import KVCacheEventManager
from events.wire import _records, codec
from events.wire.codec import decode_batch, encode_batch
from events.wire.model import KVCacheEvent, Removed, Stored, StoredBlock, wire_runs
from kvcache.config import KVCacheManagerConfig, TierConfig
from kvcache.manager import KVCacheManager
from kvcache.scope import ReuseScope

TOKEN_MAX = 2**31 - 1
U64_MAX = 2**64 - 1
opt_u64 = st.one_of(st.none(), st.integers(0, U64_MAX))


def test_a_record_is_frozen_unhashable_and_equal_by_its_token_ids() -> None:
    record = StoredBlock(5, [1, 2], 7, 1, 80, 11)
    assert record == StoredBlock(5, array("i", [1, 2]), 7, 1, 80, 11)
    assert (record != StoredBlock(5, array("i", [1, 2]), 7, 1, 80, 11)) is False
    assert record != StoredBlock(5, [1, 3], 7, 1, 80, 11)
    with pytest.raises(TypeError, match="unhashable"):
        hash(record)
    with pytest.raises(AttributeError):
        record.priority = 3  # type: ignore[misc]
    assert not gc.is_tracked(record)  # a gc=False struct: never part of a cycle


def test_split_gives_each_block_its_slice() -> None:
    blocks = _records.stored_blocks(["a", "b", "c"], list(range(7)), 3, None, 1, 40, 9)
    assert blocks == [
        StoredBlock("a", [0, 1, 2], None, 1, 40, 9),
        StoredBlock("b", [3, 4, 5], None, 1, 40, 9),
        StoredBlock("c", [6], None, 1, 40, 9),
    ]
    packed = _records.stored_blocks([1, 2], array("i", [7, 8, 9]), 2, None, 0, 35, None)
    assert [type(b.tokens) for b in packed] == [array, array]


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, TOKEN_MAX), max_size=40),
    parent=st.integers(0, U64_MAX),
    lora=opt_u64,
    salt=opt_u64,
    level=st.integers(0, 3),
    priority=st.integers(0, 100),
)
def test_hash_and_record_of_one_block(
    tokens: list[int], parent: int, lora: int | None, salt: int | None, level: int, priority: int
) -> None:
    packed = array("i", tokens)
    record = _records.v1_stored_block(packed, parent, lora, salt, level, priority)
    assert record == StoredBlock(
        v1_block_hash_ref(tokens, parent, lora, salt), tokens, lora, level, priority, salt
    )
    assert record.tokens is packed  # the block's array, shared


def test_one_block_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match=r"negative|2\*\*31"):
        _records.v1_stored_block(array("i", [1, -2]), 0, None, None, 0, 35)
    with pytest.raises((ValueError, OverflowError), match=r"2\*\*64"):
        _records.v1_stored_block(array("i", [1]), -1, None, None, 0, 35)
    with pytest.raises(ValueError, match="4-byte"):
        _records.v1_stored_block(b"abc", 0, None, None, 0, 35)  # type: ignore[arg-type]
    copied = _records.v1_stored_block(array("i", [4, 5]).tobytes(), 0, None, None, 0, 35)  # type: ignore[arg-type]
    assert type(copied.tokens) is array and list(copied.tokens) == [4, 5]


def _events_of_a_cache_run() -> list[KVCacheEvent]:
    """Commits, offloads and evictions on a small two-tier cache, in two scopes."""
    events = KVCacheEventManager(moves_as="removed_stored")
    cache = KVCacheManager(
        KVCacheManagerConfig(
            tokens_per_block=4,
            tiers=[TierConfig(name="device", num_blocks=6), TierConfig(name="host", num_blocks=6)],
        ),
        event_sink=events,
    )
    scopes = [None, ReuseScope(lora_id=3, salt=77)]
    for r in range(8):
        prompt = [(r % 3) * 100 + i for i in range(10 + r)]
        with cache.create_kv_cache(prompt, reuse_scope=scopes[r % 2]) as seq:
            seq.commit(prompt)
            seq.stop_committing()
        events.flush()
    return events.get_latest_events()


def test_a_cache_run_round_trips_through_the_wire() -> None:
    events = _events_of_a_cache_run()
    assert any(b.cache_salt_id is not None for e in events for b in getattr(e.data, "blocks", []))
    decoded = decode_batch(encode_batch(events, 1.0, 0))
    assert decoded.malformed == []
    # every stored record's hash is its V1 hash under its scope, chained as announced
    for event in events:
        if isinstance(event.data, Stored):
            parent = event.data.parent_hash or 0
            for b in event.data.blocks:
                assert isinstance(parent, int)
                assert b.block_hash == v1_block_hash_ref(
                    list(b.tokens), parent, b.lora_id, b.cache_salt_id
                )
                parent = int(b.block_hash)
    stored = [b for e in decoded.events if isinstance(e.data, Stored) for b in e.data.blocks]
    sent = [b for e in events if isinstance(e.data, Stored) for b in e.data.blocks]
    assert [b.block_hash for b in stored] == [b.block_hash for b in sent]


def test_wire_runs_split_on_attributes_and_short_blocks() -> None:
    a = StoredBlock(1, [1, 2], None, 0, 35, None)
    short = StoredBlock(2, [3], None, 0, 35, None)
    other_level = StoredBlock(3, [4, 5], None, 1, 35, None)
    blocks = [a, short, a, other_level, other_level]
    expected = [(2, [1, 2, 3], [1, 2]), (3, [1, 2], [1]), (5, [4, 5, 4, 5], [3, 3])]
    assert codec._stored_runs(blocks, 2) == expected
    with pytest.raises(ValueError, match=r"1\.\.block_size"):
        codec._stored_runs([StoredBlock(1, [])], 2)


def test_wire_runs_is_where_every_writer_splits() -> None:
    """The rule's one statement: hand-derived ends for each field and the short-block case, and
    both writers split where it says."""
    base = StoredBlock(1, array("i", [1, 2]), None, 0, 35, None)
    cases = [
        ([base, base, base], [3]),
        ([base, StoredBlock(2, array("i", [3]), None, 0, 35, None)], [2]),  # a short last one
        ([StoredBlock(2, array("i", [3]), None, 0, 35, None), base], [1, 2]),  # ends its event
        ([base, StoredBlock(2, array("i", [3, 4]), 7, 0, 35, None)], [1, 2]),  # LoRA
        ([base, StoredBlock(2, array("i", [3, 4]), None, 1, 35, None)], [1, 2]),  # tier
        ([base, StoredBlock(2, array("i", [3, 4]), None, 0, 20, None)], [1, 2]),  # priority
        ([base, StoredBlock(2, array("i", [3, 4]), None, 0, 35, 9), base], [1, 2, 3]),  # salt
        ([], []),
    ]
    for blocks, ends in cases:
        assert wire_runs(blocks, 2) == ends, blocks
        if not blocks:
            continue
        event = [KVCacheEvent(1, Stored(None, blocks, 2))]
        sizes = [len(e.data.blocks) for e in decode_batch(encode_batch(event, 0.0)).events]
        assert sizes == [b - a for a, b in zip([0, *ends], ends, strict=False)], blocks
    odd = StoredBlock(1, [1], lora_id=2**64)  # fields compare by value, whatever they hold
    other = StoredBlock(1, [1], lora_id=int(str(2**64)))  # an equal int, another object
    assert wire_runs([odd, odd, other], 1) == [3]
    assert wire_runs([odd, StoredBlock(1, [1], lora_id=2**64 + 1)], 1) == [1, 2]
    with pytest.raises(AttributeError):
        wire_runs([object()], 1)

    class Shrinking:  # a block whose attributes empty the list being read
        def __init__(self, victim: list[object]) -> None:
            self.victim = victim
            self.tokens = [1]
            self.cache_level = self.priority = self.cache_salt_id = None

        @property
        def lora_id(self) -> None:
            self.victim.clear()
            return None

    victim: list[object] = []
    victim += [Shrinking(victim), Shrinking(victim), Shrinking(victim)]
    assert wire_runs(victim, 1) == [3] and victim == []  # read as they were at the call


uint_edges = st.sampled_from([0, 1, 127, 128, 255, 256, 65535, 65536, 2**31, 2**32 - 1])


@settings(max_examples=100, deadline=None)
@given(
    tokens=st.lists(st.one_of(uint_edges, st.integers(0, 2**31 - 1)), min_size=60, max_size=140),
    ts=st.floats(allow_nan=False, allow_infinity=False),
    dp_rank=st.one_of(st.none(), st.integers(0, 7)),
    hashes=st.lists(st.integers(0, 2**64 - 1), min_size=3, max_size=3),
)
def test_payload_is_what_the_msgpack_reference_writes(
    tokens: list[int], ts: float, dp_rank: int | None, hashes: list[int]
) -> None:
    """The encoder (msgspec) writes byte for byte what msgpack-python writes for the same
    objects: smallest int forms, float64, maps in insertion order, bin for bytes."""
    stored = Stored(
        None, [StoredBlock(hashes[i], tokens[i * 20 : i * 20 + 20]) for i in range(3)], 20
    )
    events = [
        KVCacheEvent(0, stored),
        KVCacheEvent(1, Removed([1, 2], 0)),
        KVCacheEvent(2, Stored(9, [StoredBlock(10, [1, 2])])),
        KVCacheEvent(3, Removed(["ab" * 32], 1), hash_algo="v2_sha256"),
    ]
    structs: list[Any] = []
    for event in events:
        codec._encode_event(event, dp_rank, structs)
    # each wire event as a map: its type, then the fields it sets, in the Struct's order
    wire = [
        {
            "type": type(e).__struct_config__.tag,
            **{k: v for k, v in msgspec.structs.asdict(e).items() if v is not msgspec.UNSET},
        }
        for e in structs
    ]
    expected = msgpack.packb([float(ts), wire, dp_rank], use_bin_type=True)
    assert encode_batch(events, ts, dp_rank) == expected

"""Native fast paths of the event pipeline (StoredBlock builders, wire runs) equal their pure
references and the dataclass constructor."""

from __future__ import annotations

import gc
from array import array

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from events import manager
from events.hashing import v1_block_hash_py
from events.manager import KVCacheEventManager
from events.wire import _records, codec
from events.wire import values as wire_values
from events.wire._records import stored_block, stored_blocks_py, v1_stored_block_py
from events.wire.codec import decode_batch, encode_batch
from events.wire.model import KVCacheEvent, Removed, Stored, StoredBlock
from kvcache.config import KVCacheManagerConfig, TierConfig
from kvcache.manager import KVCacheManager
from kvcache.scope import ReuseScope

needs_native = pytest.mark.skipif(not _records.NATIVE, reason="native extension not built")

TOKEN_MAX = 2**31 - 1
U64_MAX = 2**64 - 1
opt_u64 = st.one_of(st.none(), st.integers(0, U64_MAX))


def test_fast_record_is_the_frozen_dataclass() -> None:
    fast = stored_block(5, [1, 2], 7, 1, 80, 11)
    assert fast == StoredBlock(5, [1, 2], 7, 1, 80, 11)
    assert type(fast) is StoredBlock
    # like the dataclass (its tokens are a list), the record cannot be hashed
    for record in (fast, StoredBlock(5, [1, 2], 7, 1, 80, 11)):
        with pytest.raises(TypeError, match="unhashable"):
            hash(record)
    with pytest.raises(AttributeError):
        fast.priority = 3  # type: ignore[misc]


def test_pure_split_gives_each_block_its_slice() -> None:
    blocks = stored_blocks_py(["a", "b", "c"], list(range(7)), 3, None, 1, 40, 9)
    assert blocks == [
        StoredBlock("a", [0, 1, 2], None, 1, 40, 9),
        StoredBlock("b", [3, 4, 5], None, 1, 40, 9),
        StoredBlock("c", [6], None, 1, 40, 9),
    ]


@needs_native
@settings(max_examples=200, deadline=None)
@given(
    count=st.integers(0, 40),
    block_size=st.integers(1, 9),
    extra=st.integers(0, 3),
    lora=opt_u64,
    level=st.integers(0, 3),
    priority=st.integers(0, 100),
    salt=opt_u64,
)
def test_native_split_equals_the_reference(
    count: int,
    block_size: int,
    extra: int,
    lora: int | None,
    level: int,
    priority: int,
    salt: int | None,
) -> None:
    tokens = list(range(1000, 1000 + count))
    # as many hashes as the tokens fill, and a few beyond (their blocks get no tokens)
    hashes: list[int | str] = [*range(-(-count // block_size) + extra)]
    native = _records.stored_blocks(hashes, tokens, block_size, lora, level, priority, salt)
    assert native == stored_blocks_py(hashes, tokens, block_size, lora, level, priority, salt)
    assert all(type(b) is StoredBlock for b in native)


@needs_native
@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, TOKEN_MAX), max_size=40),
    parent=st.integers(0, U64_MAX),
    lora=opt_u64,
    salt=opt_u64,
    level=st.integers(0, 3),
    priority=st.integers(0, 100),
)
def test_native_hash_and_record_equal_the_reference(
    tokens: list[int], parent: int, lora: int | None, salt: int | None, level: int, priority: int
) -> None:
    packed = array("i", tokens)
    native = _records.v1_stored_block(packed, parent, lora, salt, level, priority)
    assert native == v1_stored_block_py(packed, parent, lora, salt, level, priority)
    assert native.block_hash == v1_block_hash_py(tokens, parent, lora, salt)
    assert native.tokens == packed and native.tokens is packed  # the block's array, shared


@pytest.mark.pure
@needs_native
def test_native_builders_refuse_bad_input() -> None:
    with pytest.raises(ValueError, match="negative"):
        _records.v1_stored_block(array("i", [1, -2]), 0, None, None, 0, 35)
    with pytest.raises(ValueError, match="2\\*\\*64"):
        _records.v1_stored_block(array("i", [1]), -1, None, None, 0, 35)
    with pytest.raises(ValueError, match="block_size"):
        _records.stored_blocks([1], [1], 0, None, 0, 35, None)
    with pytest.raises(TypeError, match="lists"):
        _records.stored_blocks((1,), [1], 1, None, 0, 35, None)  # type: ignore[arg-type]


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


def test_manager_codec_and_decoder_agree_with_their_pure_paths(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fast = _events_of_a_cache_run()
    fast_payload = encode_batch(fast, 1.0, 0)
    fast_decoded = decode_batch(fast_payload)
    monkeypatch.setattr(manager, "v1_stored_block", v1_stored_block_py)
    monkeypatch.setattr(codec, "_stored_runs", codec._stored_runs_py)
    monkeypatch.setattr(wire_values, "stored_blocks", stored_blocks_py)
    pure = _events_of_a_cache_run()
    assert pure == fast
    assert any(b.cache_salt_id is not None for e in fast for b in getattr(e.data, "blocks", []))
    assert encode_batch(pure, 1.0, 0) == fast_payload
    assert decode_batch(fast_payload) == fast_decoded


block_st = st.builds(
    StoredBlock,
    block_hash=st.integers(0, 50),
    tokens=st.lists(st.integers(0, 9), min_size=0, max_size=5),
    lora_id=st.sampled_from([None, 1]),
    cache_level=st.integers(0, 1),
    priority=st.sampled_from([35, 80]),
    cache_salt_id=st.sampled_from([None, 7]),
)


def _runs_or_error(fn: object, blocks: list[StoredBlock], block_size: int) -> object:
    try:
        return fn(blocks, block_size)  # type: ignore[operator]
    except ValueError as exc:
        return str(exc)


@needs_native
@settings(max_examples=300, deadline=None)
@given(blocks=st.lists(block_st, max_size=8), block_size=st.integers(1, 4))
def test_native_wire_runs_equal_the_reference(blocks: list[StoredBlock], block_size: int) -> None:
    native = _runs_or_error(codec._native_stored_runs, blocks, block_size)
    assert native == _runs_or_error(codec._stored_runs_py, blocks, block_size)


def test_wire_runs_split_on_attributes_and_short_blocks() -> None:
    a = StoredBlock(1, [1, 2], None, 0, 35, None)
    short = StoredBlock(2, [3], None, 0, 35, None)
    other_level = StoredBlock(3, [4, 5], None, 1, 35, None)
    blocks = [a, short, a, other_level, other_level]
    expected = [(2, [1, 2, 3], [1, 2]), (3, [1, 2], [1]), (5, [4, 5, 4, 5], [3, 3])]
    assert codec._stored_runs_py(blocks, 2) == expected
    if codec._native_stored_runs is not None:
        assert codec._native_stored_runs(blocks, 2) == expected


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
    wire: list[dict[str, object]] = []
    for event in events:
        codec._encode_event(event, dp_rank, wire)
    expected = msgpack.packb([float(ts), wire, dp_rank], use_bin_type=True)
    assert encode_batch(events, ts, dp_rank) == expected


@needs_native
def test_native_records_of_ints_are_left_out_of_the_cycle_collector() -> None:
    record = _records.v1_stored_block(array("i", [5, 6]), 0, None, None, 0, 35)
    decoded = _records.stored_blocks([1, 2], [7, 8, 9], 2, None, 0, 35, None)
    assert [record.tokens, decoded[0].tokens, decoded[1].tokens] == [
        array("i", [5, 6]),
        [7, 8],
        [9],
    ]
    for r in (record, *decoded):
        assert not gc.is_tracked(r.tokens)  # ints only: no cycle can run through them
        assert not gc.is_tracked(r)  # records are gc=False structs: never tracked
    # a token list of anything but plain ints (only possible through a direct call) stays
    # tracked; the record holding it is not (a record is never part of a cycle)
    odd = _records.stored_blocks([1], [[1], 2], 2, None, 0, 35, None)
    assert gc.is_tracked(odd[0].tokens) and not gc.is_tracked(odd[0])
    # untracked lists still behave as lists
    decoded[0].tokens.append(7)
    assert decoded[0].tokens == [7, 8, 7] and decoded[0].tokens[1:] == [8, 7]

"""StoredBlock builders of the per-block paths: native and pure forms equal the constructor."""

from __future__ import annotations

from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from events import _records, manager, wire_decode
from events._records import stored_block, stored_blocks_py, v1_stored_block_py
from events.codec import decode_batch, encode_batch
from events.hashing import v1_block_hash_py
from events.manager import KVCacheEventManager
from events.model import KVCacheEvent, StoredBlock
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
    assert hash(fast.block_hash) == hash(5)
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
    assert native.tokens == tokens and type(native.tokens) is list


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


def test_manager_and_decoder_agree_with_their_pure_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    fast = _events_of_a_cache_run()
    fast_decoded = decode_batch(encode_batch(fast, 1.0, 0))
    monkeypatch.setattr(manager, "v1_stored_block", v1_stored_block_py)
    monkeypatch.setattr(wire_decode, "stored_blocks", stored_blocks_py)
    pure = _events_of_a_cache_run()
    assert pure == fast
    assert any(b.cache_salt_id is not None for e in fast for b in getattr(e.data, "blocks", []))
    assert decode_batch(encode_batch(pure, 1.0, 0)) == fast_decoded

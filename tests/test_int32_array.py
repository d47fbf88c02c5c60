"""Arrays the native extensions make for their callers to fill (events/_int32_array.h): made
without a first pass of zeros where CPython's array layout checks out, they must be ordinary
arrays, equal to the ones made by filling first (the check can be turned off to compare)."""

from __future__ import annotations

import pickle
from array import array
from collections.abc import Iterator

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from events.wire import codec
from events.wire.model import KVCacheEvent, Stored, StoredBlock
from router_sim.sim.workloads import expand_hash_ids

_match = pytest.importorskip("router_sim.router._match")
_wire = pytest.importorskip("events.wire._wire")


@pytest.fixture
def both() -> Iterator[None]:
    """Restores the fast path (where the layout check passes) after a test turned it off."""
    yield
    _match.int32_array_raw(True)
    _wire.int32_array_raw(True)


def test_the_layout_check_passes_on_this_interpreter() -> None:
    # CPython 3.11's arrayobject: the fast path is on (if this fails, the arrays are made by
    # repeat, correct but slower: the check found another layout)
    assert _match.int32_array_raw() is True
    assert _wire.int32_array_raw() is True


@settings(max_examples=60, deadline=None)
@given(
    ids=st.lists(st.integers(0, 2**40), min_size=1, max_size=6),
    cut=st.integers(0, 511),
)
def test_prompts_are_the_same_either_way(ids: list[int], cut: int) -> None:
    length = max(1, len(ids) * 512 - cut)
    try:
        fast = expand_hash_ids(tuple(ids), length, 512)
        _match.int32_array_raw(False)
        slow = expand_hash_ids(tuple(ids), length, 512)
    finally:
        _match.int32_array_raw(True)
    assert type(fast) is array and fast.typecode == "i"
    assert fast == slow and len(fast) == length
    assert fast.tobytes() == slow.tobytes()


def _payload(blocks: list[list[int]]) -> bytes:
    stored = Stored(
        parent_hash=None,
        blocks=[StoredBlock(block_hash=i + 1, tokens=array("i", b)) for i, b in enumerate(blocks)],
        block_size=len(blocks[0]),
    )
    return codec.encode_batch([KVCacheEvent(event_id=1, data=stored)], 1.0)


def test_decoded_token_arrays_are_the_same_either_way(both: None) -> None:
    payload = _payload([[5, 70000, 2**31 - 1, 0], [9, 9, 9, 9], [1, 2, 3, 4]])
    fast = codec.decode_batch(payload)
    _wire.int32_array_raw(False)
    slow = codec.decode_batch(payload)
    assert fast == slow
    tokens = [b.tokens for e in fast.events for b in getattr(e.data, "blocks", [])]
    assert [list(t) for t in tokens] == [[5, 70000, 2**31 - 1, 0], [9, 9, 9, 9], [1, 2, 3, 4]]
    assert msgpack.unpackb(payload, strict_map_key=False)  # a valid frame to begin with


def test_a_fast_array_is_an_ordinary_array() -> None:
    arr = expand_hash_ids((3, 4), 1000, 512)
    copy = array("i", arr.tobytes())
    arr.extend(range(10))  # grows the storage the extension allocated
    copy.extend(range(10))
    assert arr == copy
    del arr[5:600]
    del copy[5:600]
    arr.append(-7)
    copy.append(-7)
    assert arr == copy and arr[-1] == -7
    assert pickle.loads(pickle.dumps(arr)) == copy
    assert memoryview(arr).tobytes() == copy.tobytes()
    arr *= 3
    copy *= 3
    assert arr == copy


def test_turning_it_back_on_checks_again(both: None) -> None:
    assert _match.int32_array_raw(False) is False
    assert _match.int32_array_raw() is False
    assert _match.int32_array_raw(True) is True
    with pytest.raises(TypeError):
        _match.int32_array_raw(1, 2)

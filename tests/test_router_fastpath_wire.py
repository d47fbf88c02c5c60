"""The native reader's token loop (events/wire/_wire.c ``decode_events``: four uint32 ids at a
time, one id at a time otherwise) against an independent msgpack encoder: the same ids read from
its bytes, the same refusals; and msgspec's writer of packed ids gives that encoder's bytes."""

from __future__ import annotations

from array import array

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from events.wire.codec import decode_batch, encode_batch
from events.wire.decode import decode_general
from events.wire.fast import decode_native
from events.wire.model import KVCacheEvent, Stored, StoredBlock


def _pack(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)  # an independent encoder


# ids around every boundary the loops test: the msgpack forms, the four-at-a-time form
# ([2**16, 2**31)), the sign
ID = st.one_of(
    st.sampled_from([0, 1, 127, 128, 255, 256, 0xFFFF, 0x10000, 0x10001, 2**24, 2**31 - 1]),
    st.integers(0x10000, 2**31 - 1),
    st.integers(0x10000, 2**31 - 1),
    st.integers(0, 2**31 - 1),
)
SIGNED = st.one_of(ID, st.integers(-(2**31), -1), st.sampled_from([-1, -32, -33, -(2**31)]))


def _store(ids: list[int]) -> bytes:
    """A batch of one map-form store of ``ids`` in one block, written by msgpack-python."""
    event = {
        "type": "BlockStored",
        "block_hashes": [1],
        "parent_block_hash": None,
        "token_ids": ids,
        "block_size": max(1, len(ids)),
    }
    return _pack([1.0, [event], None])


def _native_ids(payload: bytes) -> list[int] | None:
    batch = decode_native(payload)
    if batch is None:
        return None
    data = batch.events[0].data
    assert isinstance(data, Stored)
    tokens = data.blocks[0].tokens
    assert type(tokens) is array and tokens.typecode == "i"
    return tokens.tolist()


@settings(max_examples=300, deadline=None)
@given(st.lists(ID, min_size=1, max_size=70))
def test_read_ids_are_the_written_ones(ids: list[int]) -> None:
    assert _native_ids(_store(ids)) == ids


@settings(max_examples=200, deadline=None)
@given(st.lists(SIGNED, min_size=1, max_size=70))
def test_a_negative_id_is_refused(ids: list[int]) -> None:
    got = _native_ids(_store(ids))
    assert got == (ids if min(ids) >= 0 else None)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0x10000, 2**31 - 1), min_size=8, max_size=24),
    st.data(),
)
def test_an_id_past_int32_among_uint32s_is_refused(ids: list[int], data: st.DataObject) -> None:
    at = data.draw(st.integers(0, len(ids) - 1))
    ids[at] = data.draw(st.sampled_from([2**31, 2**32 - 1, 2**31 + 12345]))
    tokens = _pack(ids)  # every id a uint32 (0xce): the four-at-a-time form with a sign bit
    head = 1 if len(ids) < 16 else 3  # fixarray, else array16
    assert all(tokens[head + 5 * i] == 0xCE for i in range(len(ids)))
    assert _native_ids(_store(ids)) is None


def test_a_cut_batch_is_refused_at_every_length() -> None:
    ids = [(j << 21) | 77 for j in range(1, 14)]
    data = _store(ids)
    for cut in range(len(data)):
        assert decode_native(data[:cut]) is None
    assert decode_native(data + b"\x00") is None  # bytes left over
    assert _native_ids(data) == ids


def _trace_batch(blocks: int, first_id: int) -> list[KVCacheEvent]:
    """A store of trace-like blocks of 512 ids (token j of block h: j << 21 | h): the first id
    of each block small, the others uint32s."""
    out = [
        StoredBlock(1000 + b, array("i", [(j << 21) | (first_id + b) for j in range(512)]))
        for b in range(blocks)
    ]
    return [KVCacheEvent(0, Stored(None, out, 512))]


@pytest.mark.parametrize(("blocks", "first_id"), [(1, 0), (3, 5), (4, 0x10000), (7, 2**20)])
def test_trace_batches_round_trip_as_the_general_paths_do(blocks: int, first_id: int) -> None:
    events = _trace_batch(blocks, first_id)
    payload = encode_batch(events, 1.5, None)
    # msgspec's bytes for the packed ids are msgpack's for the same ints as a list
    ids = [t for b in events[0].data.blocks for t in b.tokens]  # type: ignore[union-attr]
    assert _pack(ids) in payload
    got = decode_batch(payload)
    assert got == decode_general(payload)
    assert got.events == events


def test_a_store_with_an_id_past_int32_is_left_out_as_the_general_path_does() -> None:
    ids = [(j << 21) | 9 for j in range(1, 17)]
    ids[6] = 2**31 + 5
    event = {
        "type": "BlockStored",
        "block_hashes": [1],
        "parent_block_hash": None,
        "token_ids": ids,
        "block_size": 16,
    }
    payload = _pack([1.0, [event], None])
    got = decode_batch(payload)
    assert got == decode_general(payload)
    assert got.events == [] and len(got.malformed) == 1  # the batch stands, the event named

"""The wire codec's token loops (events/wire/_wire.c: four uint32 ids at a time, one id at a
time otherwise) against an independent msgpack encoder: the same bytes written, the same ids
read, the same refusals."""

from __future__ import annotations

from array import array

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from events.wire import _wire
from events.wire.codec import decode_batch, encode_batch
from events.wire.decode import decode_general
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


@settings(max_examples=300, deadline=None)
@given(st.lists(SIGNED, max_size=70))
def test_written_ids_are_msgpacks(ids: list[int]) -> None:
    assert _wire.pack_tokens(array("i", ids)) == _pack(ids)


@settings(max_examples=300, deadline=None)
@given(st.lists(ID, max_size=70))
def test_read_ids_are_the_written_ones(ids: list[int]) -> None:
    got = _wire.tokens_from_msgpack(_pack(ids), 1000)
    assert got is not None and got.tolist() == ids


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0x10000, 2**31 - 1), min_size=8, max_size=24),
    st.data(),
)
def test_an_id_past_int32_among_uint32s_is_refused(ids: list[int], data: st.DataObject) -> None:
    at = data.draw(st.integers(0, len(ids) - 1))
    ids[at] = data.draw(st.sampled_from([2**31, 2**32 - 1, 2**31 + 12345]))
    payload = _pack(ids)  # every id a uint32 (0xce): the four-at-a-time form with a sign bit
    head = 1 if len(ids) < 16 else 3  # fixarray, else array16
    assert all(payload[head + 5 * i] == 0xCE for i in range(len(ids)))
    assert _wire.tokens_from_msgpack(payload, 1000) is None


def test_a_cut_array_is_refused_at_every_length() -> None:
    data = _pack([(j << 21) | 77 for j in range(1, 14)])
    for cut in range(len(data)):
        assert _wire.tokens_from_msgpack(data[:cut], 1000) is None
    assert _wire.tokens_from_msgpack(data + b"\x00", 1000) is None  # bytes left over
    got = _wire.tokens_from_msgpack(data, 1000)
    assert got is not None and got.tolist() == [(j << 21) | 77 for j in range(1, 14)]


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
    # the token writer's bytes are msgpack's for the same ints as a list
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

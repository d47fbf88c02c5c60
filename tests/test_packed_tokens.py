"""Token ids stay packed (``array('i')``) on the event path: the wire encoder writes them as
msgpack writes the same ints as a list, the typed decoder reads them into an array and refuses
(to the general path, with its errors) anything else, records compare by ids whatever the
container, and the native code holds no reference or buffer it should not."""

from __future__ import annotations

import gc
import sys
from array import array
from typing import Any

import msgpack
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from events.manager import KVCacheEventManager
from events.wire import _records, codec
from events.wire.codec import DecodeError, decode_batch, encode_batch
from events.wire.decode import decode_general, decode_structs, decode_typed
from events.wire.fast import decode_native
from events.wire.limits import DEFAULT_LIMITS, DecodeLimits
from events.wire.model import DecodedBatch, KVCacheEvent, Removed, Stored, StoredBlock
from kvcache import _v1hash as native
from kvcache.config import KVCacheManagerConfig, TierConfig
from kvcache.manager import KVCacheManager

MAX_TOKENS = DEFAULT_LIMITS.max_tokens_per_event
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

TOKEN_EDGES = [0, 1, 127, 128, 255, 256, 65535, 65536, 2**31 - 1]
token = st.one_of(st.sampled_from(TOKEN_EDGES), st.integers(0, 2**31 - 1))
# every msgpack int form, both signs, at each boundary
INT_EDGES = [
    *TOKEN_EDGES,
    2**32 - 1,
    2**32,
    2**63,
    2**64 - 1,
    -1,
    -32,
    -33,
    -128,
    -129,
    -32768,
    -32769,
    -(2**31),
    -(2**31) - 1,
    -(2**63),
]
wide_int = st.one_of(st.sampled_from(INT_EDGES), st.integers(-(2**63), 2**64 - 1))
# lengths around the msgpack array headers (fixarray < 16, array16 < 2**16, array32)
length = st.sampled_from([0, 1, 15, 16, 17, 65535, 65536])


def _pack(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)  # an independent encoder


# --- encoding: the bytes msgspec writes for the list ---------------------------------------


@SETTINGS
@given(tokens=st.lists(st.integers(-(2**31), 2**31 - 1), max_size=40))
def test_packed_ids_are_written_as_their_list(tokens: list[int]) -> None:
    packed = array("i", tokens)
    assert msgspec.msgpack.encode(codec.wire_tokens(packed)) == _pack(tokens)
    assert codec.wire_tokens(tokens) is tokens  # a list is written as it is


@settings(max_examples=14, deadline=None)
@given(n=length, fill=token)
def test_packed_ids_get_each_array_header_as_msgpack_writes_it(n: int, fill: int) -> None:
    tokens = [fill] * n
    assert msgspec.msgpack.encode(codec.wire_tokens(array("i", tokens))) == _pack(tokens)


@SETTINGS
@given(
    sizes=st.lists(st.integers(1, 4), min_size=1, max_size=6),
    tokens=st.lists(token, min_size=24, max_size=24),
    form=st.sampled_from(["map", "positional"]),
)
def test_packed_and_listed_stores_encode_to_the_same_bytes(
    sizes: list[int], tokens: list[int], form: str
) -> None:
    # blocks of 4 (a short one ends a run), on two tiers (a tier change splits a run too)
    listed: list[StoredBlock] = []
    at = 0
    for i, size in enumerate(sizes):
        listed.append(StoredBlock(100 + i, tokens[at : at + size], None, i // 3, 35, None))
        at += size
    packed = [
        StoredBlock(b.block_hash, array("i", b.tokens), None, b.cache_level, 35, None)
        for b in listed
    ]

    def payload(blocks: list[StoredBlock]) -> bytes | str:
        events = [KVCacheEvent(0, Stored(7, blocks, 4)), KVCacheEvent(1, Removed([100], 0))]
        try:
            return encode_batch(events, 1.5, 0, form=form)
        except ValueError as exc:  # a short block inside a run: the same error either way
            return str(exc)

    assert payload(packed) == payload(listed)


def test_runs_of_packed_blocks_join_into_one_array() -> None:
    a = StoredBlock(1, array("i", [1, 2]))
    b = StoredBlock(2, array("i", [3]))
    c = StoredBlock(3, [4, 5])
    runs = codec._stored_runs
    ((end, token_ids, hashes),) = runs([a, b], 2)
    assert (end, hashes) == (2, [1, 2])
    assert type(token_ids) is array and token_ids == array("i", [1, 2, 3])
    ((_, mixed, _),) = runs([c, a], 2)  # a run holding a list: a list
    assert type(mixed) is list and mixed == [4, 5, 1, 2]


# --- decoding: straight into an array, or left to the general path -------------------------


_HEAD = msgpack.packb(
    [0.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": [7], "block_size": 64}]]
)
_AT = _HEAD.index(b"\xa9token_ids") + 10


def _typed_ids(token_bytes: bytes, limits: DecodeLimits | None = None) -> array[int] | None:
    """The ids the strict Structs read from ``token_bytes`` as a store's ``token_ids`` (a
    store of one block of up to 64 tokens), or None when they refuse the batch."""
    payload = _HEAD[:_AT] + token_bytes + _HEAD[_AT + 2 :]
    batch = decode_structs(payload) if limits is None else decode_typed_under(payload, limits)
    if batch is None:
        return None
    native = decode_native(payload)
    assert native is None or native == batch
    (event,) = batch.events
    assert isinstance(event.data, Stored)
    tokens = event.data.blocks[0].tokens
    assert type(tokens) is array and tokens.typecode == "i"
    return tokens


def decode_typed_under(payload: bytes, limits: DecodeLimits) -> DecodedBatch | None:
    """The batch when it is read under ``limits`` with no malformed event; None otherwise
    (past a limit the whole payload is refused)."""
    try:
        batch = decode_batch(payload, limits)
    except DecodeError:
        return None
    return batch if not batch.malformed else None


def test_the_splice_reads_a_token_array() -> None:
    assert _HEAD[_AT : _AT + 2] == b"\x91\x07"
    assert _typed_ids(b"\x91\x07") == array("i", [7])


@SETTINGS
@given(tokens=st.lists(token, min_size=1, max_size=40))
def test_typed_reader_round_trips_token_lists(tokens: list[int]) -> None:
    assert _typed_ids(_pack(tokens)) == array("i", tokens)


def _forms(value: int) -> list[bytes]:
    """Every msgpack int form that holds a non-negative ``value`` (not only the smallest)."""
    forms = [bytes([value])] if value < 128 else []
    for tag, width in ((0xCC, 1), (0xCD, 2), (0xCE, 4), (0xCF, 8)):
        if value < 2 ** (8 * width):
            forms.append(bytes([tag]) + value.to_bytes(width, "big"))
    for tag, width in ((0xD0, 1), (0xD1, 2), (0xD2, 4), (0xD3, 8)):
        if value < 2 ** (8 * width - 1):
            forms.append(bytes([tag]) + value.to_bytes(width, "big"))
    return forms


def test_typed_reader_reads_every_int_form_of_a_token() -> None:
    for value in TOKEN_EDGES:
        for form in _forms(value):
            for header in (b"\x91", b"\xdc\x00\x01", b"\xdd\x00\x00\x00\x01"):
                data = header + form
                assert _typed_ids(data) == array("i", [value]), data


REFUSED = [
    b"",  # nothing
    b"\xc0",  # nil
    b"\x80",  # a map
    b"\xa1a",  # a string
    b"\x01",  # an int
    b"\x91",  # truncated: an item missing
    b"\x92\x01",
    b"\xdc\x00",  # truncated header
    b"\xdd\x00\x00\x00",
    b"\xdd\xff\xff\xff\xff" + bytes(64),  # announces more items than bytes follow
    b"\x91\xcd\x01",  # truncated item
    b"\x91\xcf" + bytes(7),
    b"\x91\xff",  # -1 (negative fixint)
    b"\x91\xd0\xff",  # -1 (int8)
    b"\x91\xd3\x80" + bytes(7),  # -2**63
    b"\x91\xce\x80\x00\x00\x00",  # 2**31: too big
    b"\x91\xcf\xff\xff\xff\xff\xff\xff\xff\xff",  # 2**64 - 1
    b"\x91\xca\x00\x00\x00\x00",  # float32
    b"\x91\xcb" + bytes(8),  # float64
    b"\x91\xc0",  # nil item
    b"\x91\xc3",  # true
    b"\x91\x80",  # map item
    b"\x91\x91\x01",  # nested array (SGLang's bigram pages)
    b"\x91\xa1a",  # string item
    b"\x91\xc4\x01a",  # bin item
    b"\x91\x01\x01",  # a stray byte after the ids
]


def test_typed_reader_refuses_everything_but_a_flat_array_of_tokens() -> None:
    for data in REFUSED:
        assert _typed_ids(data) is None, data


def test_typed_reader_refuses_more_items_than_the_limit() -> None:
    data = _pack([1, 2, 3])
    assert _typed_ids(data, DecodeLimits(max_tokens_per_event=3)) == array("i", [1, 2, 3])
    assert _typed_ids(data, DecodeLimits(max_tokens_per_event=2)) is None
    over = _pack([0] * (MAX_TOKENS + 1))
    assert _typed_ids(over) is None


@SETTINGS
@given(tokens=st.lists(token, min_size=1, max_size=40), cut=st.integers(0, 400))
def test_truncated_token_arrays_are_refused(tokens: list[int], cut: int) -> None:
    data = _pack(tokens)
    assert _typed_ids(data[: cut % len(data)]) is None


def _store(token_ids: Any, hashes: int = 1, block_size: int = 4) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": list(range(1, hashes + 1)),
        "token_ids": token_ids,
        "block_size": block_size,
    }


def _both_paths(payload: bytes) -> object:
    """The decoded batch (checking the typed path, when it takes the payload, agrees), or the
    general path's error message."""
    try:
        general: object = decode_general(payload)
    except DecodeError as exc:
        general = f"DecodeError: {exc}"
    try:
        full: object = decode_batch(payload)
    except DecodeError as exc:
        full = f"DecodeError: {exc}"
    assert full == general
    typed = decode_typed(payload)
    if typed is not None:
        assert typed == general
    return general


@SETTINGS
@given(
    tokens=st.lists(token, min_size=1, max_size=24),
    block_size=st.integers(1, 8),
    positional=st.booleans(),
)
def test_typed_stores_hold_arrays_and_equal_the_general_paths(
    tokens: list[int], block_size: int, positional: bool
) -> None:
    hashes = -(-len(tokens) // block_size)
    event: Any = _store(tokens, hashes, block_size)
    if positional:
        event = ["BlockStored", event["block_hashes"], None, tokens, block_size]
    payload = _pack([2.0, [event]])
    typed = decode_typed(payload)
    assert typed is not None
    (decoded,) = typed.events
    blocks = decoded.data.blocks  # type: ignore[union-attr]
    assert all(type(b.tokens) is array for b in blocks)
    assert [t for b in blocks for t in b.tokens] == tokens
    general = decode_general(payload)
    # every path reads the ids into an array('i'), each block a slice of it
    assert all(type(b.tokens) is array for b in general.events[0].data.blocks)  # type: ignore[union-attr]
    assert typed == general == decode_batch(payload)


BAD_TOKEN_IDS = [
    [1, -1],
    [1, 2**31],
    [1, 2**64 - 1],
    [1, 1.5],
    [1, None],
    [1, {"a": 1}],
    [1, "2"],
    [1, True],
    [[1, 2], [2, 3]],
    None,
    {"a": 1},
    "1234",
]


def test_bad_token_ids_go_to_the_general_path_and_its_errors() -> None:
    seen = set()
    for bad in BAD_TOKEN_IDS:
        good = _store([5, 6, 7, 8])
        payload = _pack([0.0, [good, _store(bad, block_size=2)]])
        assert decode_typed(payload) is None, bad
        result = _both_paths(payload)
        if isinstance(result, str):
            seen.add(result)
        else:  # one bad event costs that event: the general path names it
            assert len(result.events) in (1, 2), bad  # type: ignore[attr-defined]
            seen.update(result.malformed)  # type: ignore[attr-defined]
    assert any("token id" in m or "token_ids" in m for m in seen), seen


def test_truncated_token_ids_inside_a_payload_go_to_the_general_path() -> None:
    payload = _pack([0.0, [_store([300, 70000, 5, 6])]])
    for cut in range(len(payload)):
        assert decode_typed(payload[:cut]) is None
        with pytest.raises(DecodeError):
            decode_batch(payload[:cut])


def test_hostile_token_ids_cost_no_more_than_their_bytes() -> None:
    # token ids nested far deeper than any payload may be, or announcing 2**32 - 1 items: the
    # typed path refuses without allocating, the general path names the bound
    head = _pack([0.0, [_store([7])]])
    at = head.index(b"\xa9token_ids") + 10
    assert head[at : at + 2] == b"\x91\x07"
    for body in (b"\x91" * 100_000 + b"\x07", b"\xdd\xff\xff\xff\xff\x07", b"\xdc\xff\xff"):
        payload = head[:at] + body + head[at + 2 :]
        assert decode_typed(payload) is None
        with pytest.raises(DecodeError):
            decode_batch(payload)


# --- records: equal whatever holds their ids ------------------------------------------------


def test_records_compare_by_ids_not_by_container() -> None:
    listed = StoredBlock(1, [1, 2], 3, 1, 40, 9)
    packed = StoredBlock(1, array("i", [1, 2]), 3, 1, 40, 9)
    assert listed == packed and packed == listed
    assert not listed.__ne__(packed)
    assert StoredBlock(1, (1, 2), 3, 1, 40, 9) == packed
    assert StoredBlock(1, array("i", [1, 3]), 3, 1, 40, 9) != listed
    assert StoredBlock(1, array("i", [1]), 3, 1, 40, 9) != listed
    assert StoredBlock(2, array("i", [1, 2]), 3, 1, 40, 9) != listed
    assert StoredBlock(1, array("i", [1, 2]), 3, 1, 41, 9) != listed
    assert Stored(None, [listed], 2) == Stored(None, [packed], 2)
    assert listed != (1, [1, 2], 3, 1, 40, 9)
    for record in (listed, packed):
        with pytest.raises(TypeError, match="unhashable"):
            hash(record)


def _cache_events() -> tuple[KVCacheManager, list[KVCacheEvent]]:
    events = KVCacheEventManager()
    cache = KVCacheManager(
        KVCacheManagerConfig(tokens_per_block=4, tiers=[TierConfig(name="device", num_blocks=8)]),
        event_sink=events,
    )
    prompt = list(range(100, 114))
    with cache.create_kv_cache(prompt) as seq:
        seq.commit(prompt)
    events.flush()
    return cache, events.get_latest_events()


def test_manager_records_hold_packed_ids_and_encode_as_lists_would() -> None:
    _, events = _cache_events()
    blocks = [b for e in events for b in getattr(e.data, "blocks", [])]
    assert blocks and all(type(b.tokens) is array for b in blocks)
    as_lists = [
        KVCacheEvent(
            e.event_id,
            Stored(
                e.data.parent_hash,
                [
                    StoredBlock(b.block_hash, list(b.tokens), b.lora_id, b.cache_level)
                    for b in e.data.blocks
                ],
                e.data.block_size,
            ),
        )
        for e in events
        if isinstance(e.data, Stored)
    ]
    assert encode_batch(events, 3.0, 0) == encode_batch(as_lists, 3.0, 0)
    assert decode_batch(encode_batch(events, 3.0, 0)).events == as_lists


def test_chain_lists_reads_arrays_as_lists_and_stops_at_an_empty_one() -> None:
    lists = [[1, 2, 3], [4, 5, 6], [7]]
    arrays = [array("i", t) for t in lists]
    expected = native.chain_lists(lists, 5, 3, 9)
    assert len(expected) == 3
    assert native.chain_lists(arrays, 5, 3, 9) == expected
    assert native.chain_lists([arrays[0], array("i"), arrays[1]], 5, 3, 9) == expected[:1]
    assert native.chain_lists([lists[0], []], 5, 3, 9) == expected[:1]
    with pytest.raises(ValueError, match="negative"):
        native.chain_lists([array("i", [1, -1])], 0, None, None)


# --- references, buffers and the collector ---------------------------------------------------


def test_the_native_reader_releases_its_buffer_and_references() -> None:
    # a bytearray with a buffer still exported cannot be resized: each call below must have
    # released its own
    data = bytearray(_pack([0.0, [_store([1, 300, 70000, 5])]]))
    before = sys.getrefcount(data)
    for _ in range(3):
        batch = decode_native(data)
        assert batch is not None and batch.events[0].data.blocks[0].tokens == array(  # type: ignore[union-attr]
            "i", [1, 300, 70000, 5]
        )
        assert decode_native(data[:-1]) is None
        assert decode_native(data + b"\x00") is None
    assert sys.getrefcount(data) == before
    data.append(0)  # no export left


def test_records_share_arrays_and_give_them_back() -> None:
    tokens = array("i", [5, 6, 7])
    before = sys.getrefcount(tokens)
    record = _records.v1_stored_block(tokens, 0, None, None, 0, 35)
    held = sys.getrefcount(tokens)  # (pytest's rewritten asserts hold what they compare)
    assert record.tokens is tokens
    assert held == before + 1
    del record
    assert sys.getrefcount(tokens) == before
    tokens.append(8)  # no buffer left exported
    # a packed buffer that is not an array('i') is copied into one
    copied = _records.v1_stored_block(tokens.tobytes(), 0, None, None, 0, 35)  # type: ignore[arg-type]
    assert type(copied.tokens) is array and copied.tokens == tokens
    # a decoded store's array: each block gets its own slice, the whole array is not kept
    whole = array("i", range(10))
    before = sys.getrefcount(whole)
    blocks = _records.stored_blocks([1, 2, 3], whole, 4, None, 0, 35, None)
    assert [b.tokens for b in blocks] == [whole[0:4], whole[4:8], whole[8:10]]
    assert all(type(b.tokens) is array for b in blocks)
    after = sys.getrefcount(whole)
    assert after == before
    refs = [sys.getrefcount(b.tokens) for b in blocks]
    assert refs == [2, 2, 2]  # held by its record alone (and getrefcount's argument)


def test_packed_records_are_left_out_of_the_cycle_collector() -> None:
    record = _records.v1_stored_block(array("i", [5, 6]), 0, None, None, 0, 35)
    decoded = _records.stored_blocks([1, 2], array("i", [7, 8, 9]), 2, None, 0, 35, None)
    for r in (record, *decoded):
        assert not gc.is_tracked(r)  # a gc=False struct (its array is the caller's)
    typed = decode_typed(_pack([0.0, [_store([1, 2, 3, 4, 5], 2)]]))
    assert typed is not None
    for b in typed.events[0].data.blocks:  # type: ignore[union-attr]
        assert not gc.is_tracked(b.tokens) and not gc.is_tracked(b)

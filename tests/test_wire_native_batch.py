"""The native whole-batch reader (``events.wire._wire.decode_events``) agrees with the event
Structs it stands in front of: it gives batches equal to those of the strict Structs
(``decode_structs``) and the general path, on this project's payloads and on payloads written
by an independent encoder (msgpack) in shapes this project never sends. What it does not take
it answers None for (the Structs then read or name it); on mutated or hostile bytes it raises
nothing and never answers differently from the Structs. The writer is msgspec's: checked here
against hand-derived bytes and msgspec's own output."""

from __future__ import annotations

import gc
import sys
from array import array
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from events.wire import _records
from events.wire import fast as wire_fast
from events.wire.codec import DecodeError, decode_batch, encode_batch
from events.wire.decode import decode_general, decode_structs, decode_typed
from events.wire.fast import decode_native
from events.wire.model import (
    AllBlocksCleared,
    DecodedBatch,
    KVCacheEvent,
    Removed,
    Stored,
    StoredBlock,
)

U64 = 2**64
SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _pack(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)  # an independent encoder


# --- generated batches of this project's events ---------------------------------------------

TOKEN = st.one_of(st.integers(0, 127), st.integers(0, 2**16), st.integers(0, 2**31 - 1))
HASH = st.one_of(st.integers(0, 255), st.integers(2**63, U64 - 1), st.integers(0, U64 - 1))
OPT_U64 = st.one_of(st.none(), st.integers(0, 300), st.integers(0, U64 - 1))
ALGO = st.sampled_from(["v1_block_key", "v2_sha256_64", "x" * 31, "y" * 40, "z" * 300, "é"])


@st.composite
def stored(draw: st.DrawFn) -> Stored:
    bs = draw(st.integers(1, 9))
    n = draw(st.integers(0, 6))
    blocks = []
    for i in range(n):
        size = bs if draw(st.integers(0, 4)) else draw(st.integers(1, bs))
        if i == n - 1 and draw(st.booleans()):
            size = draw(st.integers(1, bs))
        blocks.append(
            StoredBlock(
                draw(HASH),
                array("i", draw(st.lists(TOKEN, min_size=size, max_size=size))),
                draw(st.one_of(st.none(), st.integers(0, 3))),
                draw(st.sampled_from([0, 0, 0, 1, 2])),
                draw(st.sampled_from([35, 35, 0, 100])),
                draw(st.one_of(st.none(), st.just(7), st.integers(0, U64 - 1))),
            )
        )
    block_size = draw(st.sampled_from([None, bs]))
    if blocks and len(blocks[0].tokens) != bs:
        block_size = bs  # without it, the first block's length is the block size
    return Stored(draw(st.one_of(st.none(), HASH)), blocks, block_size)


DATA = st.one_of(
    stored(),
    stored(),
    st.builds(Removed, st.lists(HASH, max_size=20), st.sampled_from([None, None, 0, 1, 2])),
    st.just(AllBlocksCleared()),
)
EVENT = st.builds(
    KVCacheEvent,
    st.integers(0, U64 - 1),
    DATA,
    st.sampled_from([0, 0, 1, 300]),
    ALGO,
    st.sampled_from([None, None, 0, 3]),
)
BATCH = st.lists(EVENT, max_size=24)
TS = st.floats(allow_nan=False, allow_infinity=False)
DP_RANK = st.sampled_from([None, 0, 2])


@SETTINGS
@given(events=BATCH, ts=TS, dp_rank=DP_RANK)
def test_native_reader_gives_the_structs_batch(
    events: list[KVCacheEvent], ts: float, dp_rank: int | None
) -> None:
    payload = encode_batch(events, ts, dp_rank)
    assert encode_batch(iter(events), ts, dp_rank) == payload  # any iterable
    got = decode_native(payload)
    assert got is not None  # taken, not left to the structs
    want = decode_structs(payload)
    assert got == want == decode_general(payload)
    assert decode_batch(payload) == want
    for a, b in zip(got.events, want.events, strict=True):
        assert type(a.data) is type(b.data)
        if isinstance(a.data, Stored):
            assert isinstance(b.data, Stored)
            for x, y in zip(a.data.blocks, b.data.blocks, strict=True):
                assert type(x.tokens) is type(y.tokens) is array


def test_hand_derived_payload() -> None:
    """One store of two 2-token blocks, written out byte by byte from WIRE.md section 4 and
    msgpack's spec (maps in insertion order, each int in its smallest form)."""
    event = KVCacheEvent(
        5,
        Stored(None, [StoredBlock(1, array("i", [1, 2])), StoredBlock(300, array("i", [70000]))]),
    )
    want = (
        b"\x93\xcb"
        + bytes.fromhex("3ff8000000000000")  # [1.5,
        + b"\x91\x8c"  # [ {12 keys
        + b"\xa4type\xabBlockStored"
        + b"\xacblock_hashes\x92\x01\xcd\x01\x2c"
        + b"\xb1parent_block_hash\xc0"
        + b"\xa9token_ids\x93\x01\x02\xce\x00\x01\x11\x70"
        + b"\xaablock_size\x02"
        + b"\xa7lora_id\xc0"
        + b"\xa6medium\xa3GPU"
        + b"\xa9lora_name\xc0"
        + b"\xadcache_salt_id\xc0"
        + b"\xa9hash_algo\xacv1_block_key"
        + b"\xa8priority\x23"
        + b"\xa8event_id\x05"
        + b"\xc0"  # ], None]
    )
    assert encode_batch([event], 1.5) == want
    batch = decode_batch(want)
    blocks = event.data.blocks  # type: ignore[union-attr]
    assert batch.events == [KVCacheEvent(5, Stored(None, blocks, 2))]  # the size travels
    assert [list(b.tokens) for b in batch.events[0].data.blocks] == [[1, 2], [70000]]  # type: ignore[union-attr]


def _block(h: Any = 1, tokens: Any = None, **kw: Any) -> StoredBlock:
    return StoredBlock(h, array("i", [1, 2]) if tokens is None else tokens, **kw)


# --- the reader on shapes this project's writer never sends ----------------------------------


def _map_store(fields: dict[str, Any]) -> dict[str, Any]:
    return {"type": "BlockStored", **fields}


@st.composite
def foreign_event(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared"]))
    out: dict[str, Any] = {"type": kind}
    signed_hash = st.one_of(st.integers(-(2**63), -1), st.integers(0, U64 - 1))
    if kind != "AllBlocksCleared":
        out["block_hashes"] = draw(st.lists(signed_hash, min_size=1, max_size=5))
    if kind == "BlockStored":
        bs = draw(st.integers(1, 6))
        n = len(out["block_hashes"])
        count = draw(st.integers((n - 1) * bs + 1, n * bs))
        out["token_ids"] = draw(st.lists(TOKEN, min_size=count, max_size=count))
        out["block_size"] = bs
        optional: dict[str, Any] = {
            "parent_block_hash": st.one_of(st.none(), signed_hash),
            "lora_id": OPT_U64,
            "medium": st.sampled_from([None, "GPU", "CPU", "cpu_pinned", "TIER7", "odd"]),
            "lora_name": st.one_of(st.none(), st.just("adapter-1")),
            "cache_salt_id": OPT_U64,
            "priority": st.integers(0, 100),
            "cache_salt": st.one_of(st.none(), st.just("tenant-a")),
            "extra_keys": st.none(),
            "group_idx": st.one_of(st.none(), st.integers(0, 3)),
        }
    elif kind == "BlockRemoved":
        optional = {
            "medium": st.sampled_from([None, "GPU", "CPU", "STORAGE"]),
            "group_idx": st.one_of(st.none(), st.integers(0, 3)),
        }
    else:
        optional = {}
    optional.update(
        event_id=st.integers(0, U64 - 1),
        window_size=st.integers(0, 1000),
        hash_algo=st.sampled_from(["v1_block_key", "v2_sha256_64"]),
        attention_dp_rank=st.one_of(st.none(), st.integers(0, U64 - 1)),
    )
    for name, strategy in optional.items():
        if draw(st.booleans()):
            out[name] = draw(strategy)
    items = list(out.items())
    order = draw(st.permutations(range(len(items))))
    return dict(items[i] for i in order)  # fields in any order, "type" anywhere


@SETTINGS
@given(
    events=st.lists(foreign_event(), max_size=6),
    ts=TS,
    top=st.sampled_from(["two", "nil", "rank"]),
)
def test_reader_agrees_on_foreign_payloads(
    events: list[dict[str, Any]], ts: float, top: str
) -> None:
    envelope: list[Any] = [ts, events] + ([] if top == "two" else [None if top == "nil" else 9])
    payload = _pack(envelope)
    got = decode_native(payload)
    assert got is not None
    assert got == decode_structs(payload) == decode_general(payload)


def test_reader_gives_unranked_events_the_batch_rank() -> None:
    payload = _pack(
        [
            0.5,
            [{"type": "AllBlocksCleared"}, {"type": "AllBlocksCleared", "attention_dp_rank": None}],
            4,
        ]
    )
    got = decode_native(payload)
    assert got is not None and got == decode_structs(payload)
    assert [e.attention_dp_rank for e in got.events] == [4, None]
    assert [e.event_id for e in got.events] == [0, 1]  # the index where none is sent


def _stored_payload(**fields: Any) -> bytes:
    base: dict[str, Any] = {"block_hashes": [1, 2], "token_ids": [1, 2, 3], "block_size": 2}
    return _pack([1.0, [_map_store({**base, **fields})]])


REFUSED = {
    "unknown field": _stored_payload(shiny=1),
    "vLLM 0.33 field": _stored_payload(kv_cache_spec_kind="full"),
    "extra_keys list": _stored_payload(extra_keys=[["adapter"], None]),
    "bin hash": _stored_payload(block_hashes=[b"\x01" * 32, 2]),
    "placeholder": _stored_payload(token_ids=[], block_size=0),
    "masked": _stored_payload(token_ids=[1, 2, 3, 4, 5, 6]),
    "too few tokens": _stored_payload(token_ids=[1, 2]),
    "no hashes": _stored_payload(block_hashes=[], token_ids=[]),
    "negative token": _stored_payload(token_ids=[1, -2, 3]),
    "token 2**31": _stored_payload(token_ids=[1, 2**31, 3]),
    "bigram page": _stored_payload(token_ids=[[1, 2], [2, 3], [3, 4]]),
    "float block size": _stored_payload(block_size=2.0),
    "priority 101": _stored_payload(priority=101),
    "negative lora": _stored_payload(lora_id=-1),
    "group 2**31": _stored_payload(group_idx=2**31),
    "bool event id": _stored_payload(event_id=True),
    "updated": _pack([1.0, [{"type": "BlockUpdated", "block_hash": 1}]]),
    "created": _pack([1.0, [{"type": "CacheCreated", "num_blocks_per_cache_level": [1]}]]),
    "unknown type": _pack([1.0, [{"type": "BlockShiny"}]]),
    "no type": _pack([1.0, [{"block_hashes": [1]}]]),
    "removed with tokens": _pack(
        [1.0, [{"type": "BlockRemoved", "block_hashes": [1], "token_ids": []}]]
    ),
    "positional": _pack([1.0, [["BlockRemoved", [1], None]]]),
    "int ts": _pack([1, [{"type": "AllBlocksCleared"}]]),
    "float32 ts": b"\x92\xca\x3f\x80\x00\x00\x91\x81\xa4type\xb0AllBlocksCleared",
    "nan ts": _pack([float("nan"), []]),
    "4-element envelope": _pack([1.0, [], None, None]),
    "rank 2**31": _pack([1.0, [], 2**31]),
    "trailing byte": _pack([1.0, []]) + b"\xc0",
    "truncated": _stored_payload()[:-1],
    "map envelope": _pack({"ts": 1.0}),
    "empty": b"",
    "not UTF-8 medium": _stored_payload(medium="GPU").replace(b"\xa3GPU", b"\xa3\xff\xfe\xfd"),
}
# a repeated key (msgspec keeps the last; the native reader leaves it to msgspec)
REFUSED["repeated key"] = (
    _stored_payload(priority=3)
    .replace(b"\xa8priority\x03", b"\xa8priority\x03\xa8priority\x04")
    .replace(b"\x91\x85", b"\x91\x86", 1)
)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_reader_leaves_other_payloads_to_the_structs(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    payload = REFUSED[name]
    assert decode_native(payload) is None
    got = _outcome(payload)
    monkeypatch.setattr(wire_fast, "decode_native", lambda payload: None)
    assert _outcome(payload) == got  # the same batch or error as without the reader


def _outcome(payload: bytes) -> Any:
    try:
        return decode_batch(payload)
    except DecodeError as exc:
        return str(exc)


def test_reader_takes_other_buffers() -> None:
    payload = encode_batch([KVCacheEvent(1, Removed([1, 2]))], 3.0)
    want = decode_structs(payload)
    assert decode_native(bytearray(payload)) == want
    assert decode_native(memoryview(payload)) == want
    strided = memoryview(bytes(b for c in payload for b in (c, 0)))[::2]
    assert decode_native(strided) is None  # not one contiguous buffer: the structs'
    assert decode_native("text") is None  # type: ignore[arg-type]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=BATCH, data=st.data())
def test_reader_on_mutated_bytes(events: list[KVCacheEvent], data: st.DataObject) -> None:
    """Flipped, cut and inserted bytes: the reader raises nothing, and what it takes the
    structs read the same."""
    payload = bytearray(encode_batch(events, 1.0, None))
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        at = data.draw(st.integers(0, len(payload)))
        if op == "flip" and at < len(payload):
            payload[at] = data.draw(st.integers(0, 255))
        elif op == "cut":
            del payload[at:]
        else:
            payload[at:at] = bytes([data.draw(st.integers(0, 255))])
    raw = bytes(payload)
    got = decode_native(raw)
    if got is not None:
        assert got == decode_structs(raw)


def test_reader_refuses_hostile_lengths_without_allocating_them() -> None:
    """Declared lengths far beyond the bytes present are refused before anything is built."""
    huge_events = b"\x93\xcb" + bytes(8) + b"\xdd\x00\x00\xff\xff" + b"\xc0"
    huge_tokens = (
        b"\x92\xcb" + bytes(8) + b"\x91\x84\xa4type\xabBlockStored\xacblock_hashes\x91\x01"
        b"\xaablock_size\x01\xa9token_ids\xdd\x00\x0f\xff\xff\x01"
    )
    huge_hashes = (
        b"\x92\xcb"
        + bytes(8)
        + b"\x91\x82\xa4type\xacBlockRemoved\xacblock_hashes\xdd\x7f\xff\xff\xff"
    )
    for payload in (huge_events, huge_tokens, huge_hashes):
        assert decode_native(payload) is None
        assert decode_structs(payload) is None


# --- the Structs alone (what every batch the native reader leaves takes) ----------------------


@pytest.fixture(params=["native", "structs"])
def path(request: pytest.FixtureRequest) -> Iterator[str]:
    with pytest.MonkeyPatch.context() as m:
        if request.param == "structs":  # the native reader leaves every batch
            m.setattr(wire_fast, "decode_native", lambda payload: None)
        yield request.param


def test_round_trip_on_either_path(path: str) -> None:
    blocks = [
        StoredBlock(11, array("i", [5, 6]), 1, 0, 35, 9),
        StoredBlock(12, array("i", [7]), 1, 0, 35, 9),
    ]
    events = [
        KVCacheEvent(1, Stored(3, blocks, 2)),
        KVCacheEvent(2, Removed([11], 0)),
        KVCacheEvent(3, AllBlocksCleared(), 0, "v2_sha256_64", 1),
    ]
    payload = encode_batch(events, 4.0, 0)
    batch = decode_typed(payload)
    assert batch == DecodedBatch(4.0, events, 0, []) == decode_general(payload)
    assert (wire_fast.decode_native(payload) is None) == (path == "structs")


def test_record_setters_follow_the_fields() -> None:
    assert [d.__name__ for d in _records.record_setters(StoredBlock)] == list(_records._FIELDS)
    assert [d.__name__ for d in _records.record_setters(KVCacheEvent)] == [
        "event_id",
        "data",
        "window_size",
        "hash_algo",
        "attention_dp_rank",
    ]


# --- references, buffers and token runs -------------------------------------------------------


def test_native_codec_releases_buffers_and_references() -> None:
    tokens = [array("i", [70000 + i for i in range(9)]), array("i", [1, 2**20])]
    blocks = [StoredBlock(2**40 + i, t) for i, t in enumerate(tokens)]  # uncached ints
    events = [KVCacheEvent(2**41, Stored(2**42, blocks, 9)), KVCacheEvent(3, Removed([2**43]))]
    counts = [sys.getrefcount(x) for x in (*tokens, *blocks, *events)]
    payload = bytearray(encode_batch(events, 1.0))
    for _ in range(3):
        assert encode_batch(events, 1.0) == bytes(payload)
        assert decode_native(payload) is not None
        assert decode_native(payload[:-1]) is None
    assert [sys.getrefcount(x) for x in (*tokens, *blocks, *events)] == counts
    for t in tokens:
        t.append(0)  # no buffer left exported
    payload.append(0)


def test_decoded_records_are_left_out_of_the_cycle_collector() -> None:
    payload = encode_batch([KVCacheEvent(0, Stored(None, [_block(), _block(2)], 2))], 0.0)
    batch = decode_native(payload)
    assert batch is not None
    for b in batch.events[0].data.blocks:  # type: ignore[union-attr]
        assert not gc.is_tracked(b.tokens) and not gc.is_tracked(b)
    # a lone block holds the store's whole array (no slice of it is made)
    one = decode_native(encode_batch([KVCacheEvent(0, Stored(None, [_block()], 4))], 0.0))
    assert one is not None and list(one.events[0].data.blocks[0].tokens) == [1, 2]  # type: ignore[union-attr]


@given(
    runs=st.lists(
        st.tuples(st.integers(1, 9), st.sampled_from([5, 200, 60000, 70000, 2**31 - 1])),
        min_size=1,
        max_size=8,
    )
)
@settings(max_examples=100, deadline=None)
def test_token_runs_of_every_width(runs: list[tuple[int, int]]) -> None:
    """Ids written and read four at a time where four uint32s follow one another, one at a
    time elsewhere: runs of each width at every alignment."""
    ids = array("i", [v - k % 3 for n, v in runs for k in range(n)])
    event = KVCacheEvent(0, Stored(None, [StoredBlock(1, ids)], len(ids)))
    payload = encode_batch([event], 0.0)
    assert msgpack.packb(list(ids)) in payload  # an independent writer's bytes for the ids
    batch = decode_native(payload)
    assert batch is not None and batch == decode_structs(payload)

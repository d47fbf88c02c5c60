"""Wire codec (WIRE.md 4): golden payloads, round trips, tolerance, and typed rejection."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from events.wire import decode as wire_decode
from events.wire import fast as wire_fast
from events.wire.codec import DecodeError, DecodeLimits, decode_batch, encode_batch, from_json
from events.wire.model import (
    AllBlocksCleared,
    Created,
    DecodedBatch,
    EventDiff,
    KVCacheEvent,
    Removed,
    Stored,
    StoredBlock,
    Updated,
)
from kvcache.hashing import chain_hashes
from kvcache.scope import ReuseScope

WIRE_DIR = Path(__file__).parent / "data" / "wire"
GOLDEN = ["vllm_map_form", "vllm_array_form", "encoder_map_form"]


def _hex_source(name: str) -> bytes:
    text = (WIRE_DIR / f"{name}.hex").read_text()
    return bytes.fromhex("".join(re.sub(r"#.*", "", line) for line in text.splitlines()))


def _expected(name: str) -> DecodedBatch:
    doc = json.loads((WIRE_DIR / f"{name}.expected.json").read_text())
    events = []
    for obj in doc["events"]:
        event = from_json(obj)
        if isinstance(event.data, Stored):  # the wire block_size rides beside the JSON shape
            data = Stored(
                event.data.parent_hash,
                event.data.blocks,
                obj["data"]["block_size"],
                lora_name=obj["data"].get("lora_name"),
            )
            event = KVCacheEvent(
                event.event_id, data, event.window_size, event.hash_algo, event.attention_dp_rank
            )
        events.append(event)
    return DecodedBatch(ts=doc["ts"], events=events, dp_rank=doc["dp_rank"])


def _pack(obj: object) -> bytes:
    packed: bytes = msgpack.packb(obj, use_bin_type=True)
    return packed


# --- golden payloads --------------------------------------------------------------------------


@pytest.mark.parametrize("name", GOLDEN)
def test_golden_payload_matches_its_hand_assembled_source(name: str) -> None:
    assert (WIRE_DIR / f"{name}.msgpack").read_bytes() == _hex_source(name)


@pytest.mark.parametrize("name", GOLDEN)
def test_golden_payload_decodes_to_its_expected_batch(name: str) -> None:
    assert decode_batch((WIRE_DIR / f"{name}.msgpack").read_bytes()) == _expected(name)


def test_encoder_output_is_byte_exact() -> None:
    batch = _expected("encoder_map_form")
    # the golden payload holds this project's extension event BlockUpdated: asked for
    payload = encode_batch(batch.events, ts=batch.ts, dp_rank=batch.dp_rank, extensions=True)
    assert payload == (WIRE_DIR / "encoder_map_form.msgpack").read_bytes()


# --- round trips ------------------------------------------------------------------------------

U64 = st.integers(0, 2**64 - 1)
HASH = st.one_of(U64, st.binary(min_size=32, max_size=32).map(bytes.hex))
OPT_U64 = st.one_of(st.none(), U64)


@st.composite
def stored_data(draw: st.DrawFn) -> Stored:
    block_size = draw(st.integers(1, 8))
    n = draw(st.integers(1, 5))
    last = draw(st.integers(1, block_size))
    lora, level, prio, salt = (
        draw(OPT_U64),
        draw(st.integers(0, 2)),
        draw(st.integers(0, 100)),
        draw(OPT_U64),
    )
    blocks = [
        StoredBlock(
            block_hash=draw(HASH),
            tokens=draw(
                st.lists(
                    st.integers(0, 2**31 - 1),
                    min_size=block_size if i < n - 1 else last,
                    max_size=block_size if i < n - 1 else last,
                )
            ),
            lora_id=lora,
            cache_level=level,
            priority=prio,
            cache_salt_id=salt,
        )
        for i in range(n)
    ]
    return Stored(
        parent_hash=draw(st.one_of(st.none(), HASH)), blocks=blocks, block_size=block_size
    )


DIFF = st.one_of(st.none(), st.builds(EventDiff, st.integers(0, 100), st.integers(0, 100)))
EVENT_DATA = st.one_of(
    stored_data(),
    st.builds(Removed, st.lists(HASH, max_size=6), st.one_of(st.none(), st.integers(0, 2))),
    st.builds(Updated, HASH, DIFF, DIFF),
    st.builds(Created, st.lists(st.integers(0, 10**6), max_size=3)),
    st.just(AllBlocksCleared()),
)


@st.composite
def batches(draw: st.DrawFn) -> DecodedBatch:
    dp_rank = draw(st.one_of(st.none(), st.integers(0, 7)))
    events = [
        KVCacheEvent(
            event_id=i,
            data=draw(EVENT_DATA),
            window_size=draw(st.sampled_from([0, 0, 4096])),
            hash_algo=draw(st.sampled_from(["v1_block_key", "v2_sha256", "v2_sha256_64"])),
            attention_dp_rank=draw(st.sampled_from([dp_rank, dp_rank, None, 3])),
        )
        for i in range(draw(st.integers(0, 6)))
    ]
    ts = draw(st.floats(0, 2e9, allow_nan=False))
    return DecodedBatch(ts=ts, events=events, dp_rank=dp_rank)


@settings(max_examples=200, deadline=None)
@given(batch=batches())
def test_round_trip(batch: DecodedBatch) -> None:
    payload = encode_batch(batch.events, batch.ts, batch.dp_rank, extensions=True)
    assert decode_batch(payload) == batch


def test_v2_sha256_hashes_travel_as_32_byte_bin() -> None:
    h = "ab" * 32
    event = KVCacheEvent(0, Removed([h]), hash_algo="v2_sha256")
    wire = msgpack.unpackb(encode_batch([event], 1.0), raw=False)
    assert wire[1][0]["block_hashes"] == [bytes.fromhex(h)]
    assert decode_batch(encode_batch([event], 1.0)).events == [event]


def test_stored_blocks_with_different_attributes_split_into_chained_wire_events() -> None:
    blocks = [
        StoredBlock(1, [1, 2], lora_id=4),
        StoredBlock(2, [3, 4], lora_id=4),
        StoredBlock(3, [5], lora_id=4),  # partial: must end its wire event
        StoredBlock(4, [6, 7], lora_id=4, cache_level=1),
    ]
    payload = encode_batch([KVCacheEvent(5, Stored(9, blocks, block_size=2))], 1.0)
    wire = msgpack.unpackb(payload, raw=False)[1]
    assert [(e["block_hashes"], e["parent_block_hash"], e["medium"]) for e in wire] == [
        ([1, 2, 3], 9, "GPU"),
        ([4], 3, "CPU"),
    ]
    decoded = decode_batch(payload).events
    assert [e.data for e in decoded] == [
        Stored(9, blocks[:3], block_size=2),
        Stored(3, blocks[3:], block_size=2),
    ]


def test_block_size_defaults_to_the_first_blocks_token_count() -> None:
    blocks = [StoredBlock(1, [1, 2, 3]), StoredBlock(2, [4, 5])]
    wire = msgpack.unpackb(encode_batch([KVCacheEvent(0, Stored(None, blocks))], 0.0))[1][0]
    assert (wire["block_size"], wire["token_ids"]) == (3, [1, 2, 3, 4, 5])


def test_decoded_blocks_rehash_to_the_published_v1_chain() -> None:
    """A router re-derives each block's hash from the decoded tokens, adapter and salt. The
    payload carries the published V1 chain (tests/data/v1_hash_vectors.json, transcribed from
    WIRE.md 3, not computed here), so decoding must keep every field the hash depends on and
    the router's hashing must agree with the published values."""
    vectors = json.loads((Path(__file__).parent / "data" / "v1_hash_vectors.json").read_text())
    case = vectors["v1_chain"][1]  # tokens 0..7, 4 per block, ReuseScope(lora_id=7, salt=11)
    tpb, tokens, published = case["tokens_per_block"], case["tokens"], case["hashes"]
    lora, salt = case["scope"]["lora_id"], case["scope"]["salt"]
    blocks = [
        StoredBlock(h, tokens[tpb * i : tpb * (i + 1)], lora_id=lora, cache_salt_id=salt)
        for i, h in enumerate(published)
    ]
    payload = encode_batch([KVCacheEvent(0, Stored(None, blocks, tpb))], 0.0)
    data = decode_batch(payload).events[0].data
    assert isinstance(data, Stored)
    first = data.blocks[0]
    scope = ReuseScope(lora_id=first.lora_id, salt=first.cache_salt_id)
    decoded_tokens = [t for b in data.blocks for t in b.tokens]
    assert chain_hashes(decoded_tokens, tpb, scope) == published
    assert [b.block_hash for b in data.blocks] == published


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (Removed([-1]), "not an unsigned 64-bit"),
        (Removed([2**64]), "not an unsigned 64-bit"),
        (Removed(["xyz"]), "neither a uint64 nor"),
        (Updated("zz" * 32), "neither a uint64 nor"),
        (Stored(None, [StoredBlock(1, [])]), "block 0 has 0 tokens"),
        (Stored(None, [StoredBlock(1, [1])], block_size=0), "block_size must be >= 1"),
        (Stored(None, [StoredBlock(1, [1, 2, 3])], block_size=2), "1..block_size"),
    ],
)
def test_encoder_rejects_what_the_wire_cannot_carry(data: Any, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        encode_batch([KVCacheEvent(0, data)], 0.0, extensions=True)


# --- tolerant decoding ------------------------------------------------------------------------


def _stored_map(**over: Any) -> dict[str, Any]:
    event: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": [10, 11],
        "parent_block_hash": None,
        "token_ids": [1, 2, 3, 4, 5, 6],
        "block_size": 3,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    event.update(over)
    return event


def test_negative_int64_hashes_read_as_twos_complement() -> None:
    payload = _pack([0.0, [_stored_map(block_hashes=[-1, 5], parent_block_hash=-(2**63))]])
    data = decode_batch(payload).events[0].data
    assert isinstance(data, Stored)
    assert data.parent_hash == 2**63
    assert [b.block_hash for b in data.blocks] == [2**64 - 1, 5]


def test_missing_extensions_decode_as_defaults() -> None:
    (event,) = decode_batch(_pack([0.0, [_stored_map(medium=None)]])).events
    assert isinstance(event.data, Stored)
    assert event.data.blocks[1] == StoredBlock(11, [4, 5, 6], None, 0, 35, None)
    assert (event.event_id, event.hash_algo, event.window_size) == (0, "v1_block_key", 0)


def test_unknown_medium_names_map_through_cache_level_of() -> None:
    (event,) = decode_batch(_pack([0.0, [_stored_map(medium="TIER4")]])).events
    assert isinstance(event.data, Stored)
    assert event.data.blocks[0].cache_level == 4


def test_legacy_array_event_with_extra_trailing_fields() -> None:
    legacy = ["BlockRemoved", [7], "CPU", "future", [1, [2]]]
    (event,) = decode_batch(_pack([1.0, [legacy], None])).events
    assert event.data == Removed([7], cache_level=1)


def test_empty_stored_event_is_skipped() -> None:
    assert decode_batch(_pack([0.0, [_stored_map(block_hashes=[], token_ids=[])]])).events == []


# --- strict rejection -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"", "empty payload"),
        (b"\xc1", "not a valid msgpack payload"),
        (_pack([0.0, []]) + b"\x00", "trailing bytes"),
        (_pack({"ts": 0.0}), "payload must be an array"),
        (_pack([0.0, [], 0, 1]), "got 4 elements"),
        (_pack([float("nan"), []]), "finite number"),
        (_pack([True, []]), "finite number"),
        (_pack([0.0, {}]), "payload[1] (events): expected an array"),
        (_pack([0.0, [], -1]), "dp_rank"),
        (_pack([0.0, [5]]), "must be a map or an array"),
        (_pack([0.0, [[]]]), "type name as element 0"),
        (_pack([0.0, [{"type": 3}]]), "events[0].type: expected a string"),
        (_pack([0.0, [_stored_map(token_ids=[1, 2, 3])]]), "3 token_ids do not fit 2 blocks"),
        (_pack([0.0, [_stored_map(token_ids=list(range(7)))]]), "expected 4..6"),
        (_pack([0.0, [_stored_map(block_hashes=[], token_ids=[1])]]), "do not fit 0 blocks"),
        (_pack([0.0, [_stored_map(block_size=0)]]), "block_size: 0 is outside"),
        (_pack([0.0, [_stored_map(block_size=None)]]), "block_size: expected `int`, got `None`"),
        (_pack([0.0, [_stored_map(token_ids=[1, 2, 3, 4, 5, -6])]]), "token id -6"),
        (_pack([0.0, [_stored_map(token_ids=[1, 2, 3, 4, 5, 2**31])]]), "outside [0, 2**31)"),
        (_pack([0.0, [_stored_map(token_ids=[1, 2, 3, 4, 5, True])]]), "got bool"),
        (_pack([0.0, [_stored_map(block_hashes=[1.5, 2])]]), "block_hashes[0]"),
        (_pack([0.0, [_stored_map(block_hashes=[b"\x01" * 65, 2])]]), "of 65 bytes"),
        (_pack([0.0, [_stored_map(lora_id=-1)]]), "lora_id: expected `int` >= 0"),
        (_pack([0.0, [_stored_map(medium=1)]]), "medium: expected `str | null`, got `int`"),
        (_pack([0.0, [_stored_map(lora_name=[1])]]), "lora_name"),
        (_pack([0.0, [_stored_map(priority=101)]]), "priority: expected `int` <= 100"),
        (
            _pack([0.0, [{"type": "BlockUpdated", "block_hash": 1, "cache_level": [1]}]]),
            "cache_level: expected `array` of length 2, got 1",
        ),
        (b"\x92\xcb" + b"\x00" * 8 + b"\x91\x81\x01\x02", "not a valid msgpack payload"),
        (b"\x92\xcb" + b"\x00" * 8 + b"\xd4\x01\x00", "not a valid msgpack payload"),
        # msgpack's timestamp extension (msgspec reads it as a datetime): not the format either
        (b"\x92\xcb" + b"\x00" * 8 + b"\x91\xd6\xff" + bytes(4), "not a valid msgpack payload"),
        (b"\x92\xcb" + b"\x00" * 8 + b"\x91\x81\xc4\x01k\x01", "events[0].type"),
    ],
)
def test_malformed_payloads_raise_decode_error(payload: bytes, message: str) -> None:
    _rejected(payload, message)


def _rejected(payload: bytes, message: str) -> None:
    """A malformed envelope refuses the payload; a malformed event is left out of the batch
    and named in ``malformed`` (the rest of the batch stands)."""
    try:
        batch = decode_batch(payload)
    except DecodeError as exc:
        assert message in str(exc)
        return
    assert batch.events == []
    assert len(batch.malformed) == 1 and message in batch.malformed[0], batch.malformed


def test_decode_error_is_a_value_error() -> None:
    assert issubclass(DecodeError, ValueError)
    with pytest.raises(DecodeError, match="payload must be bytes"):
        decode_batch("text")  # type: ignore[arg-type]


def test_limits_bound_the_payload_before_and_while_unpacking() -> None:
    payload = _pack([0.0, [_stored_map()] * 3])
    with pytest.raises(DecodeError, match="max_payload_bytes"):
        decode_batch(payload, DecodeLimits(max_payload_bytes=len(payload) - 1))
    with pytest.raises(DecodeError, match="max_events"):
        decode_batch(payload, DecodeLimits(max_events=2))
    with pytest.raises(DecodeError, match="max_tokens_per_event"):
        decode_batch(payload, DecodeLimits(max_tokens_per_event=5))
    with pytest.raises(
        DecodeError,
        match=r"block_hashes: expected `array` of length <= 1 \(DecodeLimits.max_blocks",
    ):
        decode_batch(payload, DecodeLimits(max_blocks_per_event=1))
    with pytest.raises(DecodeError, match="max_str_len"):
        decode_batch(_pack([0.0, [_stored_map(lora_name="x" * 100)]]), DecodeLimits(max_str_len=50))
    assert len(decode_batch(payload, DecodeLimits(max_events=3)).events) == 3


def test_limits_are_validated() -> None:
    with pytest.raises(ValueError, match="max_events must be a positive int"):
        DecodeLimits(max_events=0)
    with pytest.raises(ValueError, match="max_depth must be >= 4"):
        DecodeLimits(max_depth=3)


def test_huge_declared_lengths_are_refused_before_allocation() -> None:
    prefix = b"\x92\xcb" + b"\x00" * 8
    # msgspec checks every declared length against the bytes left before it allocates
    headers = [b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff"]
    for header in [*headers, b"\xc6\xff\xff\xff\xff"]:
        with pytest.raises(DecodeError, match=r"exceeds max_|incomplete input"):
            decode_batch(prefix + header + bytes(64))


@pytest.mark.parametrize("typed", [True, False], ids=["typed-first", "general-only"])
def test_deep_nesting_is_rejected_even_in_ignored_fields(
    monkeypatch: pytest.MonkeyPatch, typed: bool
) -> None:
    if not typed:
        monkeypatch.setattr(wire_fast, "decode_native", lambda payload: None)
        monkeypatch.setattr(wire_decode, "_strict_event", lambda *args: wire_decode._UNREAD)
    nested: Any = 1
    for _ in range(6):
        nested = [nested]
    with pytest.raises(DecodeError, match="max_depth"):
        decode_batch(_pack([0.0, [_stored_map(future=nested)]]))
    with pytest.raises(DecodeError, match="max_depth"):
        decode_batch(_pack([0.0, [{"type": "FromTheFuture", "x": nested}]]))
    with pytest.raises(DecodeError, match=r"nested (too deep|deeper)"):
        decode_batch(b"\x92\xcb" + b"\x00" * 8 + b"\x91" * 5000 + b"\x90")
    # within the limit, an unknown field is simply ignored
    assert len(decode_batch(_pack([0.0, [_stored_map(future=[[[1]]])]])).events) == 1
    # a tighter limit refuses what the default accepts
    with pytest.raises(DecodeError, match="max_depth"):
        decode_batch(_pack([0.0, [_stored_map(future=[[[1]]])]]), DecodeLimits(max_depth=5))


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        ([1, 2, 3, 4, 5, -6], "token_ids[5]: token id -6"),
        ([1, 2, 3, 4, 2**31, 6], "token_ids[4]: token id 2147483648"),
        ([1, 2, False, 4, 5, 6], "token_ids[2]: token ids must be ints, got bool"),
        ([1, 2, 3, 4, 5, 6.0], "token_ids[5]: token ids must be ints, got float"),
    ],
)
@pytest.mark.parametrize("typed", [True, False], ids=["typed-first", "general-only"])
def test_token_checks_agree_on_both_paths(
    monkeypatch: pytest.MonkeyPatch, tokens: list[Any], message: str, typed: bool
) -> None:
    if not typed:
        monkeypatch.setattr(wire_fast, "decode_native", lambda payload: None)
        monkeypatch.setattr(wire_decode, "_strict_event", lambda *args: wire_decode._UNREAD)
    _rejected(_pack([0.0, [_stored_map(token_ids=tokens)]]), message)
    assert len(decode_batch(_pack([0.0, [_stored_map()]])).events) == 1


# --- the general path's limits walk ----------------------------------------------------------


def _depth(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    return 0


def _has_ext(value: Any) -> bool:
    if isinstance(value, msgpack.ExtType):
        return True
    if isinstance(value, list):
        return any(map(_has_ext, value))
    if isinstance(value, dict):
        return any(map(_has_ext, value.values()))
    return False


WIDE = st.recursive(
    st.one_of(
        st.none(),
        st.integers(-(2**63), 2**64 - 1),
        st.floats(),
        st.text(max_size=40),
        st.binary(max_size=300),
        st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=20)),
        st.booleans(),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=20), st.dictionaries(st.text(max_size=3), inner, max_size=18)
    ),
    max_leaves=25,
)


@settings(max_examples=150, deadline=None)
@given(value=WIDE, limit=st.integers(4, 10))
def test_the_limits_walk_measures_depth_as_msgpack_nests(value: Any, limit: int) -> None:
    """Whatever the payload, the general path refuses it for depth iff it nests deeper than
    max_depth (an independent count over the value that was packed); ext types never pass."""
    payload = msgpack.packb(value, use_bin_type=True)
    roomy = DecodeLimits(max_depth=limit, max_fields=1 << 10)
    if _has_ext(value):  # refused as not the format, or for depth when it also nests too deep
        with pytest.raises(DecodeError, match=r"not a valid msgpack payload|max_depth"):
            wire_decode._whole(payload, roomy)
    elif _depth(value) > limit:
        with pytest.raises(DecodeError, match="max_depth"):
            wire_decode._whole(payload, roomy)
    else:
        # compared re-packed: NaN, which the value may hold, is not equal to itself
        got = msgpack.packb(wire_decode._whole(payload, roomy), use_bin_type=True)
        assert got == msgpack.packb(msgpack.unpackb(payload), use_bin_type=True)
    if len(payload) > 1:  # every proper prefix is refused
        with pytest.raises(DecodeError):
            wire_decode._whole(payload[:-1], roomy)
    with pytest.raises(DecodeError, match="trailing bytes"):
        wire_decode._whole(payload + b"\xc0", roomy)


@pytest.mark.parametrize("form", ["", "Map", "msgpack"])
def test_an_unknown_form_is_refused_on_every_path(form: str) -> None:
    """The native writer only takes the map form: any other name reaches msgspec's path,
    which refuses it (with or without events, with or without the extension events)."""
    stored = KVCacheEvent(0, Stored(None, [StoredBlock(1, [1, 2])], 2))
    for events in ([], [stored]):
        for extensions in (False, True):
            with pytest.raises(ValueError, match="form must be 'map' or 'positional'"):
                encode_batch(events, 0.0, form=form, extensions=extensions)

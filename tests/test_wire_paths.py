"""The wire decoder's two paths agree: what the typed msgspec path accepts, the general path
decodes to an equal batch, and both give the batch the generating model implies (hashes as
ints incl. >= 2**63 and negative int64, bin hashes, LoRA, salts, groups, media, unknown
fields, both event forms). On mutated or ill-typed input the decoder raises nothing but
DecodeError, and one bad event costs only that event."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgpack
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from events.tools.capture import read_capture
from events.wire import decode as wire_decode
from events.wire.codec import DecodeError, DecodeLimits, decode_batch, encode_batch
from events.wire.decode import POSITIONAL_FIELDS, decode_general, decode_typed
from events.wire.limits import at_least_default
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
    cache_level_of,
)
from events.wire.structs import FAST_DEPTH, event_types

ENGINES = Path(__file__).parent / "data" / "engines"
U64 = 2**64
SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _pack(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)  # an independent encoder


# --- the event Structs declare the format's fields, in both variants --------------------------

_COMMON = {"type", "event_id", "window_size", "hash_algo", "attention_dp_rank"}
# WIRE.md section 4, written out by hand: vLLM's fields, SGLang's, this project's extensions
MAP_FIELDS = {
    "BlockStored": _COMMON
    | {"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"}
    | {"lora_name", "cache_salt_id", "priority", "cache_salt", "extra_keys", "group_idx"}
    | {"kv_cache_spec_kind", "kv_cache_spec_sliding_window"},
    "BlockRemoved": _COMMON | {"block_hashes", "medium", "group_idx"},
    "AllBlocksCleared": _COMMON,
    "BlockUpdated": _COMMON | {"block_hash", "cache_level", "priority"},
    "CacheCreated": _COMMON | {"num_blocks_per_cache_level"},
}
# vLLM 0.11's array_like order, then the project's positional extensions
POSITIONAL = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    ),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
    "BlockUpdated": ("block_hash", "cache_level", "priority"),
    "CacheCreated": ("num_blocks_per_cache_level",),
}


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "lenient"])
def test_event_structs_declare_the_formats_fields(strict: bool) -> None:
    types = event_types(DecodeLimits(), strict)
    assert wire_decode._KNOWN_FIELDS == MAP_FIELDS and POSITIONAL_FIELDS == POSITIONAL
    for kind, fields in MAP_FIELDS.items():
        cls = types.map_types[kind]
        assert {"type", *cls.__struct_fields__} == fields, kind
        assert cls.__struct_config__.tag == kind
        assert cls.__struct_config__.forbid_unknown_fields is strict
        positional = types.pos_types[kind]
        assert positional.__struct_fields__ == POSITIONAL[kind], kind
        assert positional.__struct_config__.tag == kind
        assert positional.__struct_config__.array_like


# --- generated valid payloads: the model's batch on every path -----------------------------

HASH = st.one_of(
    st.integers(0, U64 - 1),
    st.integers(2**63, U64 - 1),
    st.integers(-(2**63), -1),  # a signed sender's uint64
    st.binary(min_size=1, max_size=64),
)
MEDIA = [None, "GPU", "CPU", "DISK", "CPU_PINNED", "STORAGE", "TIER3", "gpu"]
OPT_U64 = st.one_of(st.none(), st.integers(0, U64 - 1))
NAME = st.one_of(st.none(), st.text(min_size=1, max_size=12))


def _hash_value(h: int | bytes) -> int | str:
    if isinstance(h, bytes):
        return h.hex()
    return h + U64 if h < 0 else h


def _level(medium: str | None) -> int:
    # independent of cache_level_of for the names the format fixes
    fixed = {None: 0, "GPU": 0, "gpu": 0, "CPU": 1, "DISK": 2, "TIER3": 3}
    return fixed[medium] if medium in fixed else cache_level_of(medium)


@st.composite
def stored_event(draw: st.DrawFn, positional: bool) -> tuple[Any, Stored | None]:
    n = draw(st.integers(0, 4))
    block_size = draw(st.integers(1, 8))
    placeholder = n > 0 and draw(st.integers(0, 5)) == 0
    last = draw(st.integers(1, block_size))
    count = 0 if placeholder or n == 0 else (n - 1) * block_size + last
    tokens = draw(st.lists(st.integers(0, 2**31 - 1), min_size=count, max_size=count))
    hashes = draw(st.lists(HASH, min_size=n, max_size=n))
    parent = draw(st.one_of(st.none(), HASH))
    lora_id, medium, lora_name = draw(OPT_U64), draw(st.sampled_from(MEDIA)), draw(NAME)
    wire_size = draw(st.sampled_from([0, 16])) if placeholder else block_size
    fields: dict[str, Any] = {
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": wire_size,
        "lora_id": lora_id,
        "medium": medium,
        "lora_name": lora_name,
    }
    salt_id = priority = group = salt = None
    spec: tuple[str, int] | None = None
    if not positional:
        salt_id, group = draw(OPT_U64), draw(st.one_of(st.none(), st.integers(0, 2**31 - 1)))
        priority = draw(st.one_of(st.none(), st.integers(0, 100)))
        fields.update(cache_salt_id=salt_id, group_idx=group)
        if priority is not None:
            fields["priority"] = priority
        how = draw(st.sampled_from(["none", "field", "extra_keys"]))
        if how == "field":
            salt = draw(st.text(min_size=1, max_size=10))
            fields["cache_salt"] = salt
        elif how == "extra_keys" and n:
            salt = draw(st.one_of(st.none(), st.text(min_size=1, max_size=10)))
            first: list[Any] = [["mm-hash", 7]] if draw(st.booleans()) else []
            if lora_name is not None:
                first.append(lora_name)
            if salt is not None:
                first.append(salt)
            fields["extra_keys"] = [first or None] + [None] * (n - 1)
        if draw(st.booleans()):  # what vLLM >= 0.25 adds for a sliding-window group
            fields.update(kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=32)
            spec = ("sliding_window", 32)
    if n == 0:
        expected = None
    else:
        tpb = max(wire_size, 1) if placeholder else block_size
        blocks = [
            StoredBlock(
                _hash_value(h),
                tokens[i * tpb : (i + 1) * tpb],
                lora_id,
                _level(medium),
                35 if priority is None else priority,
                salt_id,
            )
            for i, h in enumerate(hashes)
        ]
        expected = Stored(
            None if parent is None else _hash_value(parent),
            blocks,
            wire_size,
            group,
            lora_name,
            salt,
        )
        if spec is not None:  # the group's spec, decoded (these stores are never masked)
            expected = msgspec.structs.replace(expected, group_kind=spec[0], sliding_window=spec[1])
    if positional:
        names = POSITIONAL_FIELDS["BlockStored"]
        cut = draw(st.integers(4, len(names)))  # trailing fields may be left out
        if any(fields[k] is not None for k in names[cut:]):
            cut = len(names)
        return ["BlockStored", *(fields[k] for k in names[:cut])], expected
    return {"type": "BlockStored", **fields}, expected


@st.composite
def other_event(draw: st.DrawFn, positional: bool) -> tuple[Any, Any]:
    kind = draw(st.sampled_from(["BlockRemoved", "AllBlocksCleared", "BlockUpdated", "Created"]))
    if kind == "BlockRemoved":
        hashes, medium = draw(st.lists(HASH, max_size=4)), draw(st.sampled_from(MEDIA))
        group = None if positional else draw(st.one_of(st.none(), st.integers(0, 9)))
        data: Any = Removed(
            [_hash_value(h) for h in hashes], None if medium is None else _level(medium), group
        )
        fields: dict[str, Any] = {"block_hashes": hashes, "medium": medium}
        if group is not None:
            fields["group_idx"] = group
    elif kind == "AllBlocksCleared":
        data, fields = AllBlocksCleared(), {}
    elif kind == "BlockUpdated":
        h = draw(HASH)
        diff = st.one_of(st.none(), st.tuples(st.integers(0, 5), st.integers(0, 100)))
        level, prio = draw(diff), draw(diff)
        data = Updated(
            _hash_value(h),
            None if level is None else EventDiff(*level),
            None if prio is None else EventDiff(*prio),
        )
        fields = {
            "block_hash": h,
            "cache_level": None if level is None else list(level),
            "priority": None if prio is None else list(prio),
        }
    else:
        kind = "CacheCreated"
        counts = draw(st.lists(st.integers(0, U64 - 1), max_size=3))
        data, fields = Created(counts), {"num_blocks_per_cache_level": counts}
    if positional:
        return [kind, *(fields[k] for k in POSITIONAL_FIELDS[kind])], data
    return {"type": kind, **fields}, data


@st.composite
def valid_batch(draw: st.DrawFn) -> tuple[bytes, DecodedBatch, bool]:
    """(payload, the batch it means, whether it carries a field the typed structs lack)."""
    positional = draw(st.booleans())
    dp_rank = draw(st.one_of(st.none(), st.integers(0, 7)))
    ts = draw(st.floats(0, 2e9))
    wire: list[Any] = []
    events: list[KVCacheEvent] = []
    unknown = False
    for i in range(draw(st.integers(0, 5))):
        strategy = stored_event(positional) if draw(st.booleans()) else other_event(positional)
        raw, data = draw(strategy)
        event_id, window, algo, rank = i, 0, "v1_block_key", dp_rank
        if not positional:
            if draw(st.booleans()):
                event_id = draw(st.integers(0, U64 - 1))
                raw["event_id"] = event_id
            if draw(st.booleans()):
                window, algo = draw(st.integers(0, 4096)), draw(st.sampled_from(["xxh", "v2"]))
                raw.update(window_size=window, hash_algo=algo)
            if draw(st.booleans()):
                rank = draw(st.one_of(st.none(), st.integers(0, 7)))
                raw["attention_dp_rank"] = rank
            if draw(st.integers(0, 4)) == 0:
                raw["from_the_future"] = draw(st.sampled_from([1, "x", [1, [2]], {"a": None}]))
                unknown = True
        elif draw(st.integers(0, 4)) == 0:
            raw = [*raw, *([None] * (len(POSITIONAL_FIELDS[raw[0]]) + 1 - len(raw))), "extra"]
            unknown = True
        wire.append(raw)
        if data is not None:
            events.append(KVCacheEvent(event_id, data, window, algo, rank))
    envelope = [ts, wire, dp_rank] if dp_rank is not None or draw(st.booleans()) else [ts, wire]
    return _pack(envelope), DecodedBatch(ts, events, dp_rank), unknown


@SETTINGS
@given(case=valid_batch())
def test_both_paths_give_the_model_batch(case: tuple[bytes, DecodedBatch, bool]) -> None:
    payload, expected, unknown = case
    typed = decode_typed(payload)
    if unknown:
        assert typed is None  # a field the structs lack: the general path decides
    else:
        assert typed == expected
    assert decode_general(payload) == expected
    assert decode_batch(payload) == expected


@SETTINGS
@given(case=valid_batch(), bad=st.sampled_from(["tokens", "hash", "size", "medium", "kind"]))
def test_one_bad_event_costs_that_event_on_every_path(
    case: tuple[bytes, DecodedBatch, bool], bad: str
) -> None:
    payload, expected, _ = case
    top = msgpack.unpackb(payload, raw=False)
    broken: Any = {
        "tokens": {"type": "BlockStored", "block_hashes": [1], "token_ids": [-1], "block_size": 1},
        "hash": {"type": "BlockRemoved", "block_hashes": [1.5]},
        "size": {
            "type": "BlockStored",
            "block_hashes": [1],
            "token_ids": [1, 2, 3],
            "block_size": 2,
        },
        "medium": ["BlockRemoved", [1], 7],
        "kind": {"type": 5},
    }[bad]
    top[1].append(broken)
    batch = decode_batch(_pack(top))
    assert batch.events == expected.events and len(batch.malformed) == 1
    assert decode_general(_pack(top)) == batch


# --- any bytes: whatever the typed path accepts, the general path decodes equally -----------


def _agree(payload: bytes, limits: DecodeLimits | None = None) -> None:
    typed = decode_typed(payload)
    try:
        general: DecodedBatch | None = decode_general(payload, limits)
    except DecodeError:
        general = None
    if typed is not None and (limits is None or at_least_default(limits)):
        assert typed == general
    try:
        assert decode_batch(payload, limits) == general
    except DecodeError:
        assert general is None


SEEDS = [
    encode_batch(
        [
            KVCacheEvent(0, Stored(None, [StoredBlock(2**64 - 1, [1, 2]), StoredBlock(5, [3])], 2)),
            KVCacheEvent(1, Removed(["ab" * 32], 1), hash_algo="v2_sha256"),
            KVCacheEvent(2, Updated(7, EventDiff(0, 1), EventDiff(35, 80))),
        ],
        12.5,
        2,
        extensions=True,
    ),
    encode_batch(
        [KVCacheEvent(0, Stored(3, [StoredBlock(4, [7, 8, 9])], 4))], 1.0, form="positional"
    ),
]


@settings(max_examples=400, deadline=None)
@given(
    index=st.integers(0, len(SEEDS) - 1),
    edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=3),
)
def test_mutated_payloads_never_split_the_paths(index: int, edits: list[tuple[int, int]]) -> None:
    data = bytearray(SEEDS[index])
    for where, byte in edits:
        data[where % len(data)] = byte
    _agree(bytes(data))


VALUES = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**63), U64 - 1),
        st.floats(),
        st.text(max_size=6),
        st.binary(max_size=70),
        st.sampled_from(["BlockStored", "BlockRemoved", "GPU", "type", "token_ids"]),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(
            st.sampled_from(["type", "block_hashes", "token_ids", "block_size", "medium", "x"]),
            inner,
            max_size=4,
        ),
    ),
    max_leaves=10,
)


@settings(max_examples=300, deadline=None)
@given(
    event=st.fixed_dictionaries(
        {"type": st.sampled_from(["BlockStored", "BlockRemoved", "BlockUpdated", "Nope"])},
        optional={
            "block_hashes": VALUES,
            "token_ids": VALUES,
            "block_size": VALUES,
            "medium": VALUES,
            "block_hash": VALUES,
            "extra_keys": VALUES,
            "priority": VALUES,
        },
    ),
    positional=st.booleans(),
)
def test_ill_typed_events_never_split_the_paths(event: dict[str, Any], positional: bool) -> None:
    raw: Any = [event.pop("type"), *event.values()] if positional else event
    _agree(_pack([1.0, [raw], None]))
    _agree(_pack([1.0, [raw], None]), DecodeLimits(max_depth=5, max_fields=8, max_str_len=8))


# --- bounds the typed path keeps --------------------------------------------------------------


def test_typed_nesting_is_bounded_by_its_types() -> None:
    def payload(extra_keys: Any) -> bytes:
        event = {"type": "BlockStored", "block_hashes": [1], "token_ids": [1], "block_size": 1}
        return _pack([0.0, [{**event, "extra_keys": extra_keys}]])

    six_deep = payload([[["mm", 1], "salt"]])  # envelope, events, event, keys, entry, tuple
    assert decode_typed(six_deep) is not None
    assert decode_batch(six_deep).events[0].data.salt == "salt"  # type: ignore[union-attr]
    assert decode_typed(payload([[[["mm"]]]])) is None  # deeper than the types: general path
    # limits tighter than the defaults keep the typed path out: the general path refuses
    with pytest.raises(DecodeError, match="max_depth"):
        decode_batch(six_deep, DecodeLimits(max_depth=5))
    assert wire_decode.DEFAULT_LIMITS.max_depth >= FAST_DEPTH


def test_typed_path_refuses_what_it_cannot_tell_apart() -> None:
    stored = {"type": "BlockStored", "block_hashes": [1], "token_ids": [1], "block_size": 1}
    cases = [
        [0.0, [stored], None, 1],  # a 4-element envelope
        [0.0, [{**stored, "token_ids": [[1, 2]]}]],  # a bigram page
        [0.0, [{**stored, "extra_keys": [[b"digest"]]}]],  # bytes in extra_keys
        [float("inf"), [stored]],
        [True, [stored]],
        [0.0, [{"type": "FromTheFuture"}]],
    ]
    for top in cases:
        payload = _pack(top)
        assert decode_typed(payload) is None, top
        _agree(payload)
    # each event is read on its own: a batch mixing the two forms is the strict Structs'
    mixed = _pack([0.0, [stored, ["BlockRemoved", [1]]]])
    assert decode_typed(mixed) == decode_general(mixed)
    assert [type(e.data) for e in decode_general(mixed).events] == [Stored, Removed]


def test_duplicate_keys_read_as_the_general_path_reads_them() -> None:
    # {"type": "BlockRemoved", "block_hashes": [1], "block_hashes": [2]}: the last one wins
    event = b"\x83\xa4type\xacBlockRemoved\xacblock_hashes\x91\x01\xacblock_hashes\x91\x02"
    payload = b"\x92\xcb" + bytes(8) + b"\x91" + event
    assert decode_typed(payload) == decode_general(payload)
    assert decode_batch(payload).events[0].data == Removed([2])
    # a second, different tag: the event says two types, so it is malformed (the rest stands)
    twice = b"\x82\xa4type\xacBlockRemoved\xa4type\xb0AllBlocksCleared"
    payload = b"\x92\xcb" + bytes(8) + b"\x92" + twice + event
    assert decode_typed(payload) is None
    batch = decode_batch(payload)
    assert [e.data for e in batch.events] == [Removed([2])]
    assert batch.malformed == ["events[0].type: invalid value 'BlockRemoved'"]


def test_msgspec_checks_declared_lengths_before_allocating() -> None:
    # the property both paths rely on for memory: a header that announces more elements than
    # bytes follow is refused as truncated, not allocated
    for header in (b"\xdd\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff"):
        with pytest.raises(msgspec.DecodeError, match="truncated"):
            msgspec.msgpack.decode(header + bytes(64))
        assert decode_typed(b"\x92\xcb" + bytes(8) + header + bytes(64)) is None


# --- engine captures --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", sorted(p.name for p in ENGINES.iterdir() if (p / "stream.jsonl").is_file())
)
def test_engine_captures_decode_identically_on_both_paths(name: str) -> None:
    payloads = [m.frames[-1] for m in read_capture(ENGINES / name / "stream.jsonl").messages]
    payloads += [
        m.frames[-1]
        for m in read_capture(ENGINES / name / "replay_raw.jsonl").messages
        if m.frames[-2] != b"\xff" * 8
    ]
    typed = 0
    for payload in payloads:
        fast = decode_typed(payload)
        general = decode_general(payload)
        if fast is not None:
            typed += 1
            assert fast == general
        assert decode_batch(payload) == general
    assert typed > 0, "no payload of this capture took the typed path"
    assert json.loads((ENGINES / name / "expected.json").read_text())  # the capture is whole

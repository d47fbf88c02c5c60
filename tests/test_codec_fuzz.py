"""Malformed wire payloads: whatever the bytes, decode_batch returns a batch or raises
DecodeError, never another exception (random bytes, truncations, mutations, wrong types,
huge declared lengths, deep nesting)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from events.wire import decode as wire_decode
from events.wire import fast as wire_fast
from events.wire.codec import DecodeError, DecodeLimits, decode_batch, encode_batch
from events.wire.model import (
    AllBlocksCleared,
    DecodedBatch,
    EventDiff,
    KVCacheEvent,
    Removed,
    Stored,
    StoredBlock,
    Updated,
)

WIRE_DIR = Path(__file__).parent / "data" / "wire"
SMALL_LIMITS = DecodeLimits(max_payload_bytes=4096, max_events=16, max_tokens_per_event=64)


def _valid_payloads() -> list[bytes]:
    golden = [p.read_bytes() for p in sorted(WIRE_DIR.glob("*.msgpack"))]
    events = [
        KVCacheEvent(0, Stored(None, [StoredBlock(2**64 - 1, [1, 2]), StoredBlock(5, [3])], 2)),
        KVCacheEvent(1, Removed(["ab" * 32], 1), hash_algo="v2_sha256"),
        KVCacheEvent(2, Updated(7, EventDiff(0, 1), EventDiff(35, 80))),
        KVCacheEvent(3, AllBlocksCleared(), window_size=128),
    ]
    return [*golden, encode_batch(events, 12.5, 2)]


VALID = _valid_payloads()


def _decodes_or_rejects(payload: bytes, limits: DecodeLimits | None = None) -> None:
    try:
        batch = decode_batch(payload, limits)
    except DecodeError as exc:
        assert str(exc)  # every rejection says something
        return
    assert isinstance(batch, DecodedBatch)


FUZZ = settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@pytest.fixture(autouse=True, params=["typed", "general", "staged"])
def decoder_build(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs with the typed path first (the native batch reader), on the general path
    alone, and on the general path with no costly-object budget (every event read field by
    field, as one past the budget is)."""
    if request.param in ("general", "staged"):
        monkeypatch.setattr(wire_fast, "decode_native", lambda payload: None)
        monkeypatch.setattr(wire_decode, "_strict_event", lambda *args: wire_decode._UNREAD)
    if request.param == "staged":
        monkeypatch.setattr(wire_decode, "OBJECT_BUDGET", 0)
    return str(request.param)


def limits(top: int) -> st.SearchStrategy[DecodeLimits]:
    """Any limits up to ``top`` per field: tiny ones that refuse almost everything, ones near
    the payloads' own sizes, the defaults, and large ones (the format needs a depth of 4)."""
    field = st.one_of(st.integers(1, 16), st.integers(1, 1 << 12), st.integers(1, top))
    values = st.fixed_dictionaries({name: field for name in DecodeLimits.__slots__})
    return values.map(lambda v: DecodeLimits(**{**v, "max_depth": max(4, v["max_depth"])}))


@FUZZ
@given(index=st.integers(0, len(VALID) - 1), lim=limits((1 << 31) - 1))
def test_valid_payloads_under_any_limits(index: int, lim: DecodeLimits) -> None:
    _decodes_or_rejects(VALID[index], lim)
    # limits that hold the payload's whole size decode it as the defaults do
    roomy = {n: max(getattr(lim, n), len(VALID[index])) for n in DecodeLimits.__slots__}
    assert decode_batch(VALID[index], DecodeLimits(**roomy)) == decode_batch(VALID[index])


_HUGE_LIMITS_CHECK = """
import resource, sys
from pathlib import Path
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))  # a runaway allocation fails fast
from events.wire import decode as wire_decode
from events.wire import fast as wire_fast
from events.wire.codec import DecodeLimits, decode_batch
if sys.argv[1] == "general":
    wire_fast.decode_native = lambda payload: None
    wire_decode._strict_event = lambda *args: wire_decode._UNREAD
for path in sys.argv[2:]:
    payload = Path(path).read_bytes()
    for big in (1 << 31, 1 << 32, 1 << 40, 1 << 63, 1 << 64):
        try:
            limits = DecodeLimits(**{n: big for n in DecodeLimits.__slots__})
        except ValueError:
            continue  # refusing such limits up front is fine too
        assert decode_batch(payload, limits) == decode_batch(payload), (path, big)
"""


def test_huge_limits_are_refused_or_harmless(
    request: pytest.FixtureRequest, decoder_build: str, tmp_path: Path
) -> None:
    """Limits far above any payload must not crash the decoder (run in a child process with
    capped memory: no limit may size an allocation; every bound is checked against what the
    payload holds)."""
    paths = []
    for i, payload in enumerate(VALID):
        paths.append(tmp_path / f"{i}.msgpack")
        paths[-1].write_bytes(payload)
    argv = [sys.executable, "-c", _HUGE_LIMITS_CHECK, decoder_build, *map(str, paths)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr[-2000:]


@FUZZ
@given(payload=st.binary(max_size=256))
def test_random_bytes(payload: bytes) -> None:
    _decodes_or_rejects(payload)


@FUZZ
@given(
    prefix=st.sampled_from([b"\x92\xcb" + bytes(8), b"\x93\xcb" + bytes(8) + b"\x91"]),
    tail=st.binary(max_size=128),
)
def test_random_bytes_behind_a_valid_envelope_header(prefix: bytes, tail: bytes) -> None:
    _decodes_or_rejects(prefix + tail)


@pytest.mark.parametrize("index", range(len(VALID)))
def test_every_truncation(index: int) -> None:
    payload = VALID[index]
    for end in range(len(payload)):
        with pytest.raises(DecodeError):
            decode_batch(payload[:end])


@FUZZ
@given(
    index=st.integers(0, len(VALID) - 1),
    edits=st.lists(
        st.tuples(st.sampled_from(["flip", "set", "insert", "delete"]), st.integers(0, 10**6)),
        min_size=1,
        max_size=4,
    ),
    byte=st.integers(0, 255),
    lim=limits((1 << 31) - 1),
)
def test_mutations_of_valid_payloads(
    index: int, edits: list[tuple[str, int]], byte: int, lim: DecodeLimits
) -> None:
    data = bytearray(VALID[index])
    for op, where in edits:
        pos = where % len(data) if data else 0
        if op == "flip" and data:
            data[pos] ^= 1 << (where % 8)
        elif op == "set" and data:
            data[pos] = byte
        elif op == "insert":
            data.insert(pos, byte)
        elif data:
            del data[pos]
    _decodes_or_rejects(bytes(data))
    _decodes_or_rejects(bytes(data), SMALL_LIMITS)
    _decodes_or_rejects(bytes(data), lim)


# Any msgpack value at all, in the positions the decoder reads.
FIELD_NAMES = [
    "type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
    "lora_name", "cache_salt_id", "priority", "block_hash", "cache_level", "event_id",
    "window_size", "hash_algo", "attention_dp_rank", "num_blocks_per_cache_level", "x",
]  # fmt: skip
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.binary(max_size=40),
    st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "BlockUpdated", "GPU"]),
)
ANY = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.sampled_from(FIELD_NAMES), inner, max_size=4),
    ),
    max_leaves=8,
)
TYPED_LISTS = st.one_of(
    st.lists(st.integers(-(2**63), 2**64 - 1), max_size=6),
    st.lists(st.one_of(st.integers(-3, 2**31 + 3), st.booleans(), st.none()), max_size=6),
    st.lists(st.binary(min_size=31, max_size=33), max_size=3),
)


VALID_FIELDS: dict[str, dict[str, Any]] = {
    "BlockStored": {
        "block_hashes": [1, 2],
        "parent_block_hash": None,
        "token_ids": [1, 2, 3],
        "block_size": 2,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "cache_salt_id": None,
        "priority": 35,
    },
    "BlockRemoved": {"block_hashes": [1], "medium": "CPU"},
    "BlockUpdated": {"block_hash": 1, "cache_level": [0, 1], "priority": None},
    "CacheCreated": {"num_blocks_per_cache_level": [10]},
    "AllBlocksCleared": {},
    "Unknown": {},
}


@st.composite
def wrong_types(draw: st.DrawFn) -> Any:
    """A valid payload with one to three values replaced by arbitrary msgpack values."""
    kind = draw(st.sampled_from(sorted(VALID_FIELDS)))
    fields = dict(VALID_FIELDS[kind])
    for name in draw(st.lists(st.sampled_from(FIELD_NAMES), min_size=1, max_size=3)):
        fields[name] = draw(st.one_of(SCALARS, TYPED_LISTS, ANY))
    event: Any = {"type": kind, **fields}
    if draw(st.booleans()):
        event = [fields.pop("type", kind), *fields.values()]
    # rarely break the envelope itself, so that most examples reach the event fields
    rarely = st.integers(0, 30).map(lambda n: n == 7)
    ts = draw(SCALARS) if draw(rarely) else draw(st.floats(0, 2e9))
    envelope = [ts, [event]]
    if draw(st.booleans()):
        envelope.append(draw(SCALARS) if draw(rarely) else draw(st.sampled_from([None, 0, 3])))
    return draw(ANY) if draw(rarely) else envelope


@FUZZ
@given(value=wrong_types())
def test_wrong_types_anywhere(value: Any) -> None:
    _decodes_or_rejects(msgpack.packb(value, use_bin_type=True))


LENGTH_CODES = [b"\xdc", b"\xdd", b"\xde", b"\xdf", b"\xd9", b"\xda", b"\xdb", b"\xc4", b"\xc5"]
LENGTH_CODES += [b"\xc6", b"\xc7", b"\xc8", b"\xc9"]


@FUZZ
@given(
    code=st.sampled_from(LENGTH_CODES),
    length=st.integers(2**15, 2**32 - 1),
    where=st.sampled_from(["top", "events", "tokens"]),
)
def test_huge_declared_lengths(code: bytes, length: int, where: str) -> None:
    width = {b"\xdc": 2, b"\xde": 2, b"\xda": 2, b"\xc5": 2, b"\xc8": 2, b"\xd9": 1, b"\xc4": 1}
    size = width.get(code, 4)
    header = code + (length % (1 << (8 * size))).to_bytes(size, "big")
    prefixes = {
        "top": b"",
        "events": b"\x92\xcb" + bytes(8),
        "tokens": b"\x92\xcb" + bytes(8) + b"\x91\x82\xa4type\xabBlockStored\xa9token_ids",
    }
    # refused whole, or (a declared length that the bytes happen to hold) the event refused
    try:
        batch = decode_batch(prefixes[where] + header + b"\x00" * 16)
    except DecodeError:
        return
    assert batch.events == [] and len(batch.malformed) == 1


@pytest.mark.parametrize("depth", [10, 100, 1023, 1025, 100_000])
@pytest.mark.parametrize("opener", [b"\x91", b"\x81\xa1k"])
def test_deep_nesting(depth: int, opener: bytes) -> None:
    inner = opener * depth + b"\xc0"
    for payload in (
        inner,
        b"\x92\xcb" + bytes(8) + inner,
        b"\x92\xcb" + bytes(8) + b"\x91" + inner,
    ):
        # refused whole, or (nested where an event belongs) that event left out
        try:
            batch = decode_batch(payload)
        except DecodeError:
            continue
        assert batch.events == [] and len(batch.malformed) == 1

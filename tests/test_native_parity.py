"""The native parser of network bytes answers as its references on the same bytes.

One C function reads bytes that come off the network: ``events.wire._wire.decode_events`` (a
whole map-form batch, behind ``events.wire.fast.decode_native``). It is fed the bytes its
references get: the typed structs (``decode_structs``, msgspec) and the general path
(``decode_general``, field by field); what the native reader takes must equal both, and
``decode_batch`` with the native reader must give what it gives without it, the same batch or
the same ``DecodeError``.

The bytes: the payloads vLLM 0.11 / 0.25 / 0.26 / 0.33 and SGLang 0.5 sent in the recorded
captures (``tests/data/engines/*/stream.jsonl``), the golden payloads of ``tests/data/wire``, and
this project's own; mutated by structure (a value swapped for an edge value of another type, a
field dropped or added, an item dropped or repeated, an event tag changed), re-encoded with any
of msgpack's forms for each value (an int of 1 in a uint64, a short string in a str32: what a
different encoder may send), and then by bytes (flipped, cut, inserted); and random bytes. Each
is handed over in an exactly sized buffer, so that a read one byte past the end is an error
under AddressSanitizer (``scripts/sanitize.sh`` runs this file on a sanitized build).
"""

from __future__ import annotations

import base64
import copy
import json
import math
import random
import struct
from array import array
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from events.wire import fast as wire_fast
from events.wire.codec import DecodeError, decode_batch, encode_batch
from events.wire.decode import decode_general, decode_structs
from events.wire.fast import decode_native
from events.wire.model import (
    AllBlocksCleared,
    DecodedBatch,
    KVCacheEvent,
    Removed,
    Stored,
    StoredBlock,
)

DATA = Path(__file__).parent / "data"
U64 = 2**64
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _captured() -> dict[str, list[bytes]]:
    """Each recorded engine's payloads (the last frame of each message: topic, sequence
    number, payload)."""
    out: dict[str, list[bytes]] = {}
    for path in sorted((DATA / "engines").glob("*/stream.jsonl")):
        payloads = []
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if "frames" in record:
                payloads.append(base64.b64decode(record["frames"][-1]))
        out[path.parent.name] = payloads
    return out


CAPTURED = _captured()
OWN = [
    encode_batch(
        [
            KVCacheEvent(
                2**63,
                Stored(7, [StoredBlock(U64 - 1, array("i", [1, 2**31 - 1])), StoredBlock(3, [4])]),
            ),
            KVCacheEvent(1, Removed([5, 6], 1), 128, "v2_sha256_64", 2),
            KVCacheEvent(2, AllBlocksCleared()),
        ],
        1.25,
        3,
    ),
    encode_batch([KVCacheEvent(0, Stored(None, [StoredBlock(9, [1] * 70)], 70))], 0.0),
]
SEEDS = [p for ps in CAPTURED.values() for p in ps]
SEEDS += [p.read_bytes() for p in sorted((DATA / "wire").glob("*.msgpack"))] + OWN


def test_the_seeds_hold_every_engine_and_both_readers() -> None:
    """The captures are there (a missing folder would leave the engines' layouts untested),
    and the native reader takes some of each kind of seed and leaves others to the structs, so
    that both branches of the comparison below are reached."""
    assert {"sglang-0.5.23", "vllm-0.11.0", "vllm-0.25.1", "vllm-0.33.0"} <= set(CAPTURED)
    assert all(CAPTURED.values())
    taken = [decode_native(p) is not None for p in SEEDS]
    assert any(taken) and not all(taken)
    # SGLang's stores and this project's are map-form batches of the common shape
    assert decode_native(CAPTURED["sglang-0.5.23"][0]) is not None
    assert all(decode_native(p) is not None for p in OWN)
    # vLLM 0.11's events are positional, which only the structs read
    assert all(decode_native(p) is None for p in CAPTURED["vllm-0.11.0"])


# --- an encoder that may write any of msgpack's forms of a value -----------------------------


def _int_forms(v: int) -> list[bytes]:
    forms = []
    if 0 <= v < 128 or -32 <= v < 0:
        forms.append(struct.pack("b", v) if v < 0 else bytes([v]))
    if v >= 0:
        for tag, fmt, top in ((0xCC, "B", 8), (0xCD, ">H", 16), (0xCE, ">I", 32), (0xCF, ">Q", 64)):
            if v < 2**top:
                forms.append(bytes([tag]) + struct.pack(fmt, v))
    for tag, fmt, top in ((0xD0, "b", 8), (0xD1, ">h", 16), (0xD2, ">i", 32), (0xD3, ">q", 64)):
        if -(2 ** (top - 1)) <= v < 2 ** (top - 1):
            forms.append(bytes([tag]) + struct.pack(fmt, v))
    return forms


def _len_forms(n: int, fix: int | None, fix_max: int, tags: tuple[int, ...]) -> list[bytes]:
    forms = [bytes([fix | n])] if fix is not None and n <= fix_max else []
    widths = ((8, "B"), (16, ">H"), (32, ">I"))[-len(tags) :]
    for tag, (top, fmt) in zip(tags, widths, strict=True):
        if n < 2**top:
            forms.append(bytes([tag]) + struct.pack(fmt, n))
    return forms


def encode_any(obj: Any, rng: random.Random | None) -> bytes:
    """msgpack of ``obj``; each value in its smallest form when ``rng`` is None (as msgpack and
    msgspec write), else in a form ``rng`` picks among those that hold it."""

    def pick(forms: list[bytes]) -> bytes:
        return forms[0] if rng is None else rng.choice(forms)

    if obj is None:
        return b"\xc0"
    if obj is True or obj is False:
        return b"\xc3" if obj else b"\xc2"
    if isinstance(obj, int):
        return pick(_int_forms(obj))
    if isinstance(obj, float):
        forms = [b"\xcb" + struct.pack(">d", obj)]
        if math.isnan(obj) or struct.unpack(">f", struct.pack(">f", obj))[0] == obj:
            forms.append(b"\xca" + struct.pack(">f", obj))  # float32 holds it exactly
        return pick(forms)
    if isinstance(obj, str):
        raw = obj.encode("utf-8", "surrogatepass")
        return pick(_len_forms(len(raw), 0xA0, 31, (0xD9, 0xDA, 0xDB))) + raw
    if isinstance(obj, bytes):
        return pick(_len_forms(len(obj), None, 0, (0xC4, 0xC5, 0xC6))) + obj
    if isinstance(obj, list):
        head = pick(_len_forms(len(obj), 0x90, 15, (0xDC, 0xDD)))
        return head + b"".join(encode_any(x, rng) for x in obj)
    if isinstance(obj, dict):
        head = pick(_len_forms(len(obj), 0x80, 15, (0xDE, 0xDF)))
        return head + b"".join(encode_any(k, rng) + encode_any(v, rng) for k, v in obj.items())
    raise TypeError(type(obj))


def test_the_encoder_writes_what_msgpack_reads() -> None:
    """Hand-checked against msgpack's spec: each form reads back as the value."""
    assert encode_any(1, None) == b"\x01" and encode_any(-1, None) == b"\xff"
    assert encode_any(-33, None) == b"\xd0\xdf" and encode_any(2**64 - 1, None)[0] == 0xCF
    assert encode_any("GPU", None) == b"\xa3GPU" and encode_any([1], None) == b"\x91\x01"
    rng = random.Random(5)
    for seed in SEEDS:
        tree = _tree(seed)
        assert encode_any(tree, None) == msgpack.packb(tree, use_bin_type=True)
        for _ in range(5):
            assert _tree(encode_any(tree, rng)) == tree


def _tree(payload: bytes) -> Any:
    return msgpack.unpackb(payload, raw=False, strict_map_key=False, use_list=True)


# --- structure-aware mutations ----------------------------------------------------------------

FIELDS = [
    "type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
    "medium", "lora_name", "cache_salt_id", "cache_salt", "priority", "extra_keys",
    "group_idx", "event_id", "window_size", "hash_algo", "attention_dp_rank", "shiny",
]  # fmt: skip
TAGS = ["BlockStored", "BlockRemoved", "AllBlocksCleared", "BlockUpdated", "CacheCreated", "X"]
INT_EDGES = [0, 1, 2, 35, 100, 101, 127, 128, 255, 256, 2**16, 2**31 - 1, 2**31, 2**32]
INT_EDGES += [2**63 - 1, 2**63, U64 - 1, -1, -32, -33, -(2**31), -(2**63)]
EDGE = st.one_of(
    st.sampled_from(INT_EDGES),
    st.integers(-(2**63), U64 - 1),
    st.none(),
    st.booleans(),
    st.sampled_from([0.0, -0.0, 1.5, float("nan"), float("inf"), 2.0**31]),
    st.sampled_from(["", "GPU", "CPU", "cpu_pinned", "TIER3", "v1_block_key", *TAGS]),
    st.text(max_size=4),
    st.binary(max_size=33),
    st.sampled_from([[], {}, [[1, 2]], [None], [1, -1], ["adapter"], [[1], None]]),
).map(copy.deepcopy)  # an edit may change it in place


def _paths(node: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [at]
    if isinstance(node, list):
        for i, item in enumerate(node):
            out += _paths(item, (*at, i))
    elif isinstance(node, dict):
        for key, item in node.items():
            out += _paths(item, (*at, key))
    return out


def _get(node: Any, path: tuple[Any, ...]) -> Any:
    for step in path:
        node = node[step]
    return node


def _set(root: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    _get(root, path[:-1])[path[-1]] = value
    return root


@st.composite
def mutated_tree(draw: st.DrawFn, tree: Any) -> Any:
    """``tree`` with one to three structural edits."""
    for _ in range(draw(st.sampled_from([1, 1, 2, 3]))):
        paths = _paths(tree)
        # most edits land deep inside (tokens and hashes are most of a payload's values)
        path = draw(st.sampled_from(paths))
        node = _get(tree, path)
        op = draw(st.sampled_from(["value", "value", "drop", "add", "repeat", "tag"]))
        if op == "value":
            tree = _set(tree, path, draw(EDGE))
        elif op == "drop" and isinstance(node, (list, dict)) and node:
            keys = list(range(len(node))) if isinstance(node, list) else list(node)
            del node[draw(st.sampled_from(keys))]
        elif op == "add" and isinstance(node, dict):
            node[draw(st.sampled_from(FIELDS))] = draw(EDGE)
        elif op == "add" and isinstance(node, list):
            node.insert(draw(st.integers(0, len(node))), draw(EDGE))
        elif op == "repeat" and isinstance(node, list) and node:
            node.append(node[draw(st.integers(0, len(node) - 1))])
        elif op == "tag" and isinstance(node, dict) and "type" in node:
            node["type"] = draw(st.sampled_from(TAGS))
    return tree


@st.composite
def byte_edits(draw: st.DrawFn, data: bytes) -> bytes:
    out = bytearray(data)
    for _ in range(draw(st.sampled_from([0, 0, 0, 1, 2]))):
        op = draw(st.sampled_from(["flip", "cut", "insert"]))
        at = draw(st.integers(0, len(out)))
        if op == "flip" and at < len(out):
            out[at] = draw(st.integers(0, 255))
        elif op == "cut":
            del out[at:]
        else:
            out[at:at] = bytes([draw(st.integers(0, 255))])
    return bytes(out)


TAKEN = [p for p in SEEDS if decode_native(p) is not None]


@st.composite
def hostile_payload(draw: st.DrawFn) -> bytes:
    """A seed, mutated by structure, written in any forms, then mutated by bytes."""
    # half of them from the seeds the native reader takes, so edits reach its deeper branches
    seed = draw(st.sampled_from(TAKEN if draw(st.booleans()) else SEEDS))
    tree = _tree(seed)
    if draw(st.integers(0, 5)):
        tree = draw(mutated_tree(tree))
    rng = draw(st.randoms(use_true_random=False)) if draw(st.booleans()) else None
    return draw(byte_edits(encode_any(tree, rng)))


# --- the comparisons --------------------------------------------------------------------------


def _exact(data: bytes) -> memoryview:
    """``data`` in a buffer of exactly its size (a bytes object keeps a NUL past its end, so a
    read one byte too far would go unseen there)."""
    return memoryview(array("B", data))


def _outcome(payload: bytes) -> tuple[str, Any]:
    try:
        return "batch", decode_batch(payload)
    except DecodeError as exc:
        return type(exc).__name__, str(exc)


def _same_batches(got: DecodedBatch, want: DecodedBatch) -> None:
    assert got == want
    for a, b in zip(got.events, want.events, strict=True):
        assert type(a.data) is type(b.data)
        if isinstance(a.data, Stored):
            for x, y in zip(a.data.blocks, b.data.blocks, strict=True):  # type: ignore[union-attr]
                assert type(x.tokens) is type(y.tokens)


def check_batch_parity(payload: bytes) -> bool:
    """The native reader on ``payload`` against its references; True when it took it."""
    got = decode_native(_exact(payload))
    assert decode_native(payload) == got  # whatever buffer holds the bytes
    if got is not None:
        want = decode_structs(payload)
        assert want is not None, "the native reader took what the structs refuse"
        _same_batches(got, want)
        assert got == decode_general(payload)  # its records hold lists, equal by their ids
    with_native = _outcome(payload)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(wire_fast, "decode_native", lambda payload: None)
        without = _outcome(payload)
    assert with_native == without
    return got is not None


@FUZZ
@given(payload=hostile_payload())
def test_batch_reader_answers_as_its_references(payload: bytes) -> None:
    event("native" if check_batch_parity(payload) else "left to the structs")


@FUZZ
@given(payload=st.binary(max_size=200))
def test_batch_reader_on_random_bytes(payload: bytes) -> None:
    check_batch_parity(payload)


@FUZZ
@given(payload=st.binary(max_size=120))
def test_batch_reader_on_random_bytes_behind_an_envelope(payload: bytes) -> None:
    for head in (b"\x92\xcb" + bytes(8), b"\x93\xcb" + bytes(8) + b"\x91", b"\x92\xcb" + bytes(8)):
        check_batch_parity(head + payload)


def _in_subset(tree: Any, data: st.DataObject) -> Any:
    """``tree`` with its token ids, block hashes and event ids swapped for other values of
    their ranges (a different prompt on a different engine)."""
    for event_map in tree[1]:
        for name, values in event_map.items():
            if name == "token_ids":
                n = len(values)
                event_map[name] = data.draw(
                    st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n)
                )
            elif name == "block_hashes":
                n = len(values)
                event_map[name] = data.draw(
                    st.lists(st.integers(-(2**63), U64 - 1), min_size=n, max_size=n)
                )
            elif name == "event_id":
                event_map[name] = data.draw(st.integers(0, U64 - 1))
    tree[0] = data.draw(st.floats(allow_nan=False, allow_infinity=False))
    return tree


@FUZZ
@given(index=st.integers(0, len(TAKEN) - 1), data=st.data())
def test_batch_reader_takes_other_values_of_what_it_takes(index: int, data: st.DataObject) -> None:
    """The comparison above is not won by refusing: a payload the native reader takes is still
    taken, and read as the references read it, with any token ids, hashes, event ids and
    timestamp in their ranges."""
    tree = _in_subset(_tree(TAKEN[index]), data)
    assert check_batch_parity(msgpack.packb(tree, use_bin_type=True))

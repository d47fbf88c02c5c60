"""The general decode path's memory stays a small multiple of the payload, whatever it holds.

msgpack spends one byte on an empty map or array, which costs CPython 56-64 bytes; decoding a
hostile payload untyped in one go would build ~64 bytes of objects per byte received. These
payloads each reach the general path (the typed one refuses them) and are measured with
tracemalloc, which sees msgspec's allocations as well as Python's.
"""

from __future__ import annotations

import struct
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import msgspec
import pytest

from events.tools.capture import read_capture
from events.wire import decode as wire_decode
from events.wire.codec import DecodeError, decode_batch
from events.wire.decode import OBJECT_BUDGET, decode_general

MB = 1 << 20


def _peak(fn: Callable[[], Any]) -> tuple[int, Any]:
    """The peak of traced memory while ``fn`` runs, and what it returned or raised."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        try:
            result: Any = fn()
        except DecodeError as exc:
            result = exc
        return tracemalloc.get_traced_memory()[1] - base, result
    finally:
        tracemalloc.stop()


def _array32(n: int, item: bytes) -> bytes:
    return b"\xdd" + struct.pack(">I", n) + item * n


def _envelope(events: bytes) -> bytes:
    return b"\x92\xcb" + struct.pack(">d", 0.0) + events


def _stored(**extra: Any) -> dict[str, Any]:
    event: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": [11, 12],
        "parent_block_hash": None,
        "token_ids": [1, 2, 3, 4],
        "block_size": 2,
        "lora_id": None,
        "medium": "GPU",
    }
    event.update(extra)
    return event


def test_sixteen_megabytes_of_empty_maps_as_events_build_nothing() -> None:
    payload = _envelope(_array32(16 * MB - 32, b"\x80"))
    peak, result = _peak(lambda: decode_batch(payload))
    assert isinstance(result, DecodeError) and "max_events" in str(result)
    assert peak < 4 * MB, peak


def test_many_small_events_are_decoded_one_at_a_time() -> None:
    # 700 events of an unknown type, each with 200 empty maps: ~140 kB that would build
    # 140k dicts (~64 bytes each, past the budget) at once; each event is built, skipped and
    # dropped before the next
    junk = msgpack.packb({"type": "FutureEvent", "junk": [{}] * 200})
    payload = _envelope(_array32(700, junk))
    assert OBJECT_BUDGET < 700 * 200
    peak, result = _peak(lambda: decode_general(payload))
    assert not isinstance(result, DecodeError), result
    assert result.events == [] and result.malformed == []
    assert peak < 4 * len(payload), (peak, len(payload))


def test_an_unknown_field_too_costly_to_build_is_never_built() -> None:
    # the known fields, then one unknown field holding 4M empty maps
    fields = msgpack.packb(_stored())
    body = b"\x88" + fields[1:] + msgpack.packb("future_field") + _array32(4 * MB, b"\x80")
    payload = _envelope(b"\x91" + body)
    peak, result = _peak(lambda: decode_batch(payload))
    assert not isinstance(result, DecodeError), result
    [got] = result.events
    want = decode_batch(msgpack.packb([0.0, [_stored()]]))
    assert got == want.events[0]
    # the event's bytes copied and counted (two transient copies), nothing built of them
    assert peak < 2 * len(payload) + 2 * MB, peak


@pytest.mark.parametrize(
    "field,value,error",
    [
        # token ids that are maps: a malformed event, found without building the maps
        ("token_ids", _array32(1 << 20, b"\x80"), "token ids must be ints"),
        # a million empty maps nested in extra_keys: beyond what an event holds
        ("extra_keys", _array32(1000, _array32(1000, b"\x80")), "more than"),
        # a block-hash list of lists of maps
        (
            "block_hashes",
            _array32(1000, _array32(1000, b"\x80")),
            "block_hashes[0]: expected `int | bytes`, got `array`",
        ),
    ],
    ids=["token_ids", "extra_keys", "block_hashes"],
)
def test_a_costly_known_field_is_refused_without_building_it(
    field: str, value: bytes, error: str
) -> None:
    known = _stored()
    known.pop(field, None)
    packed = msgpack.packb(known)
    assert packed[0] == 0x80 + len(known)  # a fixmap: one more field goes in its header
    body = bytes([packed[0] + 1]) + packed[1:] + msgpack.packb(field) + value
    payload = _envelope(b"\x91" + body)
    peak, result = _peak(lambda: decode_general(payload))
    text = str(result) if isinstance(result, DecodeError) else " ".join(result.malformed)
    assert error in text, text
    assert peak < 8 * MB, (peak, len(payload))


def test_a_long_valid_store_decodes_on_the_general_path_as_on_the_typed_one() -> None:
    # 320,000 tokens in 8-token blocks: more costly objects than the budget, so read field by
    # field (an unknown field keeps it off the typed path); the same batch as the typed path's
    n_blocks = 40_000
    tokens = list(range(1000, 1000 + 8 * n_blocks))
    assert len(tokens) > OBJECT_BUDGET
    event = _stored(
        block_hashes=list(range(1 << 40, (1 << 40) + n_blocks)), token_ids=tokens, block_size=8
    )
    plain = msgpack.packb([0.0, [event]])
    with_unknown = msgpack.packb([0.0, [{**event, "future_field": 1}]])
    typed = decode_batch(plain)
    peak, general = _peak(lambda: decode_general(with_unknown))
    assert not isinstance(general, DecodeError), general
    assert general.events == typed.events and general.malformed == []
    blocks = general.events[0].data.blocks
    assert [list(b.tokens) for b in blocks[:2]] == [tokens[:8], tokens[8:16]]
    assert peak < 64 * MB, (peak, len(with_unknown))


def test_bigram_pages_past_the_budget_are_read_as_pairs() -> None:
    # SGLang's bigram pages (EAGLE): [t, t+1] pairs; their first elements are the tokens
    tokens = list(range(2000, 2000 + 140_000))
    pairs = [[t, t + 1] for t in tokens]
    event = _stored(
        block_hashes=list(range(1, 1 + len(tokens) // 4)), token_ids=pairs, block_size=4
    )
    _, got = _peak(lambda: decode_general(msgpack.packb([0.0, [event]])))
    assert not isinstance(got, DecodeError), got
    assert got.malformed == []
    flat = [t for b in got.events[0].data.blocks for t in b.tokens]
    assert flat == tokens


def _real_payloads() -> list[bytes]:
    """Every engine's captured payloads (live and replayed) and the golden wire vectors."""
    engines = Path(__file__).parent / "data" / "engines"
    payloads = [p.read_bytes() for p in sorted((engines.parent / "wire").glob("*.msgpack"))]
    for stream in sorted(engines.glob("*/*.jsonl")):
        for message in read_capture(stream).messages:
            frame = message.frames[-1]
            if frame and message.frames[-2:-1] != (b"\xff" * 8,):
                payloads.append(frame)
    return payloads


def test_reading_field_by_field_gives_what_reading_at_once_gives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With no budget, every event is read field by field: on every real payload the batches
    (malformed lists included) are those of the one-shot read."""
    payloads = _real_payloads()
    assert len(payloads) > 50
    at_once = [decode_general(p) for p in payloads]
    monkeypatch.setattr(wire_decode, "OBJECT_BUDGET", 0)
    staged = [decode_general(p) for p in payloads]
    assert staged == at_once
    assert sum(len(b.events) for b in staged) > 100


def test_payloads_declaring_many_lengths_do_not_each_build_a_decoder(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Length-capped decoders are made per limit. Made per declared length, a stream of
    # batches of 1, 2, 3, ... events (or a garbage stream declaring any length) would build a
    # new msgspec Decoder for most payloads once the small cache of them is full.
    made: list[object] = []
    real = msgspec.msgpack.Decoder

    def counting(*args: Any, **kwargs: Any) -> Any:
        made.append(args)
        return real(*args, **kwargs)

    def batch_of(n: int) -> bytes:
        # a malformed event (a medium that is not a string) sends each batch through the
        # event-by-event steps, which split the event list by its declared length
        good = ["BlockStored", [n], None, [1, 2, 3, 4], 4, None, "gpu"]
        return msgpack.packb([0.0, [good] * n + [["BlockRemoved", [1], 7]]])

    monkeypatch.setattr(wire_decode, "_RAW_LISTS", {})
    decode_batch(batch_of(1))  # the first one makes what every later one uses
    monkeypatch.setattr(msgspec.msgpack, "Decoder", counting)
    for n in range(2, 101):
        batch = decode_batch(batch_of(n))
        assert len(batch.events) == n and len(batch.malformed) == 1
    assert made == [], f"{len(made)} decoders made for 99 payloads"

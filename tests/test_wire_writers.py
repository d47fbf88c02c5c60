"""Every writer's events are Structs declared from the one wire table
(``events.wire.structs.WRITERS``), and an engine's writer writes that engine's frames byte for
byte: its fields, in its order, with its header form (msgspec writes a map16 header for a Struct
of more than 15 fields, the tag included, however few it writes).

The golden values are the engines' own: the payloads their publishers sent
(tests/data/engines/*/stream.jsonl, replay_raw.jsonl) and their event structs' fields
(tests/data/engines/decoder_rules.json), recorded from their released wheels.
"""

from __future__ import annotations

import base64
import json
from array import array
from pathlib import Path

import msgpack
import msgspec
import pytest

from events.wire.codec import decode_batch, encode_batch
from events.wire.model import KVCacheEvent, Removed, Stored, StoredBlock
from events.wire.structs import WRITERS, map_fields, writer_types
from router_sim.sim.dialects import make_dialect
from router_sim.sim.workloads import Request

ENGINES = Path(__file__).parent / "data" / "engines"
RULES = json.loads((ENGINES / "decoder_rules.json").read_text())
TPB = 16


def _payloads(release: str) -> list[bytes]:
    """Every batch payload a release's capture holds: the live stream's and the replay's."""
    out: list[bytes] = []
    for name in ("stream.jsonl", "replay_raw.jsonl"):
        for line in (ENGINES / release / name).read_text().splitlines():
            record = json.loads(line)
            if "frames" not in record:
                continue
            payload = base64.b64decode(record["frames"][-1])
            try:
                batch = msgspec.msgpack.decode(payload)
            except msgspec.DecodeError:
                continue  # a replay's end marker or sequence frame
            if isinstance(batch, list) and len(batch) == 3 and isinstance(batch[1], list):
                out.append(payload)
    return out


def _headers(payload: bytes) -> list[int]:
    """The first byte of each event in a payload ``[ts, events, dp_rank]``: its map header."""
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(payload)
    assert unpacker.read_array_header() == 3
    unpacker.skip()  # ts
    out = []
    for _ in range(unpacker.read_array_header()):
        out.append(payload[unpacker.tell()])
        unpacker.skip()
    return out


@pytest.mark.parametrize(
    ("release", "writer"),
    [("vllm-0.33.0", "vllm"), ("vllm-0.33.0-bin32", "vllm"), ("sglang-0.5.23", "sglang")],
)
def test_an_engine_writer_writes_the_engines_captured_payloads_byte_for_byte(
    release: str, writer: str
) -> None:
    types = writer_types(writer).map
    payloads = _payloads(release)
    assert len(payloads) >= 10
    kinds = set()
    for payload in payloads:
        ts, events, rank = msgspec.msgpack.decode(payload)
        structs = []
        for event in events:
            fields = dict(event)
            kind = fields.pop("type")
            kinds.add(kind)
            structs.append(types[kind](**fields))
        assert msgspec.msgpack.encode([ts, structs, rank]) == payload
    assert kinds == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}


@pytest.mark.parametrize(
    ("release", "writer"), [("vllm-0.33.0", "vllm"), ("sglang-0.5.23", "sglang")]
)
def test_an_engine_writer_declares_the_engines_fields_in_its_order(
    release: str, writer: str
) -> None:
    rules = RULES[release]["events"]
    omit, kinds = WRITERS[writer]
    assert omit  # both engines leave out fields at their defaults
    for kind, struct in writer_types(writer).map.items():
        fields = rules[kind]["fields"]
        assert struct.__struct_fields__ == tuple(name for name, _ in fields)
        # the fields the engine requires are the ones always written
        required = {name for name, needed in fields if needed}
        assert required == {name for name, default in kinds[kind] if default is msgspec.NODEFAULT}


def test_the_positional_form_is_vllm_0_11s() -> None:
    rules = RULES["vllm-0.11.0"]["events"]
    native = writer_types("native")
    assert set(native.positional) == set(rules)
    for kind, struct in native.positional.items():
        assert struct.__struct_config__.array_like
        assert struct.__struct_fields__ == tuple(name for name, _ in rules[kind]["fields"])


def test_the_native_writer_keeps_a_fixmap_header() -> None:
    # 15 or fewer fields (the tag included): a fixmap, as this project's frames have always had
    for struct in writer_types("native").map.values():
        assert len(struct.__struct_fields__) + 1 <= 15
    store = Stored(None, [StoredBlock(7, [1, 2, 3, 4])])
    payload = encode_batch([KVCacheEvent(0, store), KVCacheEvent(1, Removed([7]))], 0.0)
    assert [h >> 4 for h in _headers(payload)] == [0x8, 0x8]


def _store_with_adapter_and_salt(engine: str) -> bytes:
    dialect = make_dialect(engine, 0, TPB)
    prompt = array("i", range(1, 2 * TPB + 1))
    req = Request(0, 0.0, 2 * TPB, 2, lora_id=3, cache_salt="tenant-a", prompt=prompt)
    dialect.learn(req)
    scope = dialect.scope(req)
    blocks = [
        StoredBlock(h, prompt[i * TPB : (i + 1) * TPB], scope.lora_id, 0, 35, scope.salt)
        for i, h in enumerate((11, 12))
    ]
    removed = KVCacheEvent(1, Removed([12], 0))
    return dialect.encode([KVCacheEvent(0, Stored(None, blocks, TPB)), removed], 0.0)


def test_the_vllm_dialect_writes_vllm_0_33s_headers_and_order() -> None:
    captured = [h for p in _payloads("vllm-0.33.0") for h in _headers(p)]
    assert 0xDE in captured  # vLLM 0.33's stores: a map16 header
    payload = _store_with_adapter_and_salt("vllm")
    decode_batch(payload)
    assert _headers(payload) == [0xDE, 0x84]  # a store as vLLM writes it; a removal's fixmap
    store, removal = msgspec.msgpack.decode(payload)[1]
    order = ["type", *(name for name, _ in RULES["vllm-0.33.0"]["events"]["BlockStored"]["fields"])]
    assert list(store) == [name for name in order if name in store]
    assert store["extra_keys"] == [["adapter-3", "tenant-a"], ["adapter-3"]]
    assert list(removal) == ["type", "block_hashes", "medium", "group_idx"]


def test_the_sglang_dialect_writes_sglangs_order() -> None:
    payload = _store_with_adapter_and_salt("sglang")
    decode_batch(payload)
    store, _ = msgspec.msgpack.decode(payload)[1]
    # SGLang's BlockStored declares cache_salt before lora_name
    assert list(store)[-2:] == ["cache_salt", "lora_name"]
    order = [
        "type",
        *(name for name, _ in RULES["sglang-0.5.23"]["events"]["BlockStored"]["fields"]),
    ]
    assert list(store) == [name for name in order if name in store]
    assert _headers(payload)[0] >> 4 == 0x8  # 10 fields: a fixmap, as SGLang's


def test_every_writer_field_is_the_tables_but_vllms_four_it_never_sets() -> None:
    """The writers write the table's fields (what the decoder reads); only the engines' fields
    this project never sets are outside it (vLLM 0.33's four, SGLang's session id)."""
    table = map_fields()
    never_set = {
        "native": set(),
        "vllm": {"locality", "ownership", "session_id", "lookahead_token_ids"},
        "sglang": {"session_id"},
    }
    for writer, (_, kinds) in WRITERS.items():
        for kind, fields in kinds.items():
            outside = {name for name, _ in fields} - table[kind]
            assert outside <= never_set[writer], (writer, kind, outside)
            if outside:
                assert all(default is None for name, default in fields if name in outside)

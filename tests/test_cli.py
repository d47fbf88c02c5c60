"""kv-events CLI: hash golden vectors, the doctor on recorded captures and synthetic streams,
and listen/record against a loopback publisher made of raw ZeroMQ sockets."""

from __future__ import annotations

import base64
import io
import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Final

import msgpack
import pytest
import zmq

from events.tools.capture import CaptureWriter, read_capture
from events.tools.cli import main
from events.tools.diagnosis import v1_salt_every_block
from events.tools.doctor import Doctor, DoctorOptions
from events.wire.codec import encode_batch
from events.wire.model import EventData, KVCacheEvent, Removed, Stored, StoredBlock
from kvcache.hashing import HashAlgo, v1_block_hash
from kvcache.scope import ReuseScope

CAPTURES = Path(__file__).parent / "data" / "captures"
pytestmark = pytest.mark.timeout(60)


def run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    code = main(list(argv), out=out)
    return code, out.getvalue()


# ---------------------------------------------------------------------------------- hash


def test_hash_prints_the_wire_md_golden_vectors() -> None:
    code, text = run("hash", "--tokens", "0,1,2,3,4,5,6,7,8,9", "--tokens-per-block", "4")
    assert code == 0
    # WIRE.md 2 and 3
    assert "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d" in text
    assert "7b894451a88bc03088bd0c44f01139922b089a1ab691d157c273185c78ca83b2" in text
    assert "181684b4f09a9fc1689624a565bc5c9ed96cede3e0863cf373463b1a93c45369" in text
    assert "bce38df8ba29204a4e3b070bd62b78b7ff8a60a3be4e57634620c537ca8fb069" in text
    assert "v1_block_key 733356887393045\n" in text
    assert "v1_block_key 6310903394565074474\n" in text
    assert "block 2 tokens [8:10] partial" in text


def test_hash_json_under_a_scope() -> None:
    code, text = run(
        "hash", "--tokens", "0 1 2 3 4 5 6 7", "--tokens-per-block", "4", "--lora-id", "7",
        "--salt-id", "11", "--json",
    )  # fmt: skip
    assert code == 0
    table = json.loads(text)
    assert table["scope_bytes"] == "0307000000000000000b00000000000000"
    assert [b["v1_block_key"] for b in table["blocks"]] == [
        11481563305523318472,
        9304211693877664517,
    ]
    first = table["blocks"][0]
    assert first["key"] == "9b0fd0e09150ccecc056c02607ac5a1102556d12560862529f46bd5fe9d443bb"
    assert first["v2_sha256"] == first["key"]
    assert first["v2_sha256_64"] == int(first["key"][:16], 16)


def test_hash_cache_salt_and_tokens_file(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.json"
    tokens.write_text("[1, 2, 3, 4]")
    code, text = run(
        "hash", "--tokens-file", str(tokens), "--tokens-per-block", "4", "--cache-salt",
        "tenant-a", "--json",
    )  # fmt: skip
    assert code == 0
    table = json.loads(text)
    assert table["salt_id"] == 16248643848220682112  # WIRE.md 1
    salt = table["salt_id"]
    assert table["blocks"][0]["v1_block_key"] == v1_block_hash([1, 2, 3, 4], 0, None, salt)


@pytest.mark.parametrize(
    "argv",
    [
        ["hash", "--tokens", "1,x", "--tokens-per-block", "4"],
        ["hash", "--tokens", "1,-2", "--tokens-per-block", "4"],
        ["hash", "--tokens", "1,2", "--tokens-per-block", "0"],
        ["hash", "--tokens", "1,2"],
        ["hash", "--tokens", "1", "--tokens-per-block", "4", "--cache-salt", "a", "--salt-id", "1"],
        ["hash", "--tokens-file", "/nonexistent/tokens", "--tokens-per-block", "4"],
        ["doctor", "/nonexistent/capture.jsonl"],
        ["listen", "not-an-endpoint", "--timeout", "1"],  # used to hang in ctx.term()
        ["listen", "tcp://127.0.0.1:5557", "tcp://nohost", "--timeout", "1"],
        ["listen", "tcp://127.0.0.1:5557", "--replay-endpoint", "garbage", "--timeout", "1"],
        ["listen", "tcp://127.0.0.1:5557", "--record", "/nonexistent/dir/run.jsonl"],
        ["frobnicate"],
    ],
)
@pytest.mark.timeout(20)
def test_usage_errors_exit_2(argv: list[str]) -> None:
    assert main(argv, out=io.StringIO()) == 2


def test_a_binary_tokens_file_is_a_usage_error(tmp_path: Path) -> None:
    binary = tmp_path / "tokens.bin"
    binary.write_bytes(b"\xff\xfe\x00")
    argv = ["hash", "--tokens-file", str(binary), "--tokens-per-block", "4"]
    assert main(argv, out=io.StringIO()) == 2


def test_doctor_rejects_a_file_that_is_not_a_capture(tmp_path: Path) -> None:
    bogus = tmp_path / "bogus.jsonl"
    bogus.write_text('{"hello": 1}\n')
    assert run("doctor", str(bogus))[0] == 2
    binary = tmp_path / "binary.jsonl"
    header = (CAPTURES / "clean.jsonl").read_bytes().split(b"\n")[0]
    binary.write_bytes(header + b"\n\xff\xfe\n")
    assert run("doctor", str(binary))[0] == 2


# -------------------------------------------------------------- doctor on the captures


M64: Final = (1 << 64) - 1


def _wire_v1_hash(tokens: Sequence[int], parent: int, lora: int | None, salt: int | None) -> int:
    """TensorRT-LLM's V1 block hash transcribed from WIRE.md 3, independently of kvcache.hashing
    (checked against the published vectors before it is trusted)."""
    m1, m2, c32, g = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0x45D9F3B, 0x9E3779B9

    def mix64(b: int, seed: int) -> int:
        b = ((b ^ (b >> 30)) * m1) & M64
        b = ((b ^ (b >> 27)) * m2) & M64
        b ^= b >> 31
        return seed ^ ((b + g + (seed << 6) + (seed >> 2)) & M64)

    seed = len(tokens) ^ ((parent * m1) & M64)
    if parent == 0 and salt is not None:
        seed = mix64(salt, seed)
    for tok in tokens:
        a = tok & 0xFFFFFFFF
        a = (((a >> 16) ^ a) * c32) & 0xFFFFFFFF
        a = (((a >> 16) ^ a) * c32) & 0xFFFFFFFF
        a = (a >> 16) ^ a
        seed = seed ^ ((((a + g) & 0xFFFFFFFF) + (seed << 6) + (seed >> 2)) & M64)
    if lora is not None:
        seed = mix64(lora, seed)
    return seed


def test_doctor_passes_the_clean_capture() -> None:
    """The capture was made with this project's hashing, so the doctor's OK alone would prove
    nothing: every stored block is re-hashed here from its frames (plain msgpack) with the
    WIRE.md transcription, and the doctor must have verified exactly those blocks."""
    vectors = json.loads((Path(__file__).parent / "data" / "v1_hash_vectors.json").read_text())
    for v in vectors["v1_block"]:
        assert _wire_v1_hash(v["tokens"], v["parent_hash"], v["lora_id"], v["salt_id"]) == v["hash"]
    blocks = 0
    for line in (CAPTURES / "clean.jsonl").read_text().splitlines()[1:]:
        payload = base64.b64decode(json.loads(line)["frames"][2])
        for ev in msgpack.unpackb(payload, raw=False)[1]:
            if ev["type"] != "BlockStored":
                continue
            parent, size, toks = ev["parent_block_hash"] or 0, ev["block_size"], ev["token_ids"]
            for i, h in enumerate(ev["block_hashes"]):
                want = _wire_v1_hash(
                    toks[i * size : (i + 1) * size], parent, ev["lora_id"], ev.get("cache_salt_id")
                )
                assert h & M64 == want, (json.loads(line)["i"], i)
                parent = want
                blocks += 1
    code, text = run("doctor", str(CAPTURES / "clean.jsonl"))
    assert code == 0, text
    assert "result: OK" in text
    verified = text.split("hashes verified ")[1].split()[0]
    assert verified == f"{blocks}/{blocks}" and blocks > 50


@pytest.mark.parametrize(
    ("capture", "expected"),
    [
        ("salt_not_mixed.jsonl", "explained by: the salt is not mixed into the first block"),
        ("wrong_block_size.jsonl", "events say block_size 32 but their hashes cover blocks of 16"),
        ("broken_parent_chain.jsonl", "broken parent chain"),
        ("gap.jsonl", "sequence gap: seq 5 never arrived"),
    ],
)
def test_doctor_finds_each_injected_fault(capture: str, expected: str) -> None:
    code, text = run("doctor", str(CAPTURES / capture))
    assert code == 1
    problems = [line for line in text.splitlines() if line.startswith("PROBLEM")]
    assert any(expected in line for line in problems), text


def test_doctor_flags_a_router_block_size_mismatch() -> None:
    code, text = run("doctor", str(CAPTURES / "clean.jsonl"), "--block-size", "32")
    assert code == 1
    assert "events carry block_size 16 but the router uses 32" in text


def test_doctor_flags_another_algorithm() -> None:
    code, text = run("doctor", str(CAPTURES / "clean.jsonl"), "--hash-algo", "v2_sha256_64")
    assert code == 1
    assert "events say hash_algo v1_block_key, the router uses v2_sha256_64" in text
    assert "explained by: another algorithm: the hashes are v1_block_key" in text


# --------------------------------------------------------- doctor on synthetic streams

TOKENS = [list(range(i * 4, i * 4 + 4)) for i in range(3)]


def stored_chain(
    scope: ReuseScope, hash_fn: object = None, parent: int | None = None, first: int = 0
) -> Stored:
    """A chain of TOKENS[first:] under ``scope``, hashed by ``hash_fn(tokens, parent, lora,
    salt)`` (default: V1 as specified)."""
    fn = v1_block_hash if hash_fn is None else hash_fn
    blocks = []
    prev = parent or 0
    for toks in TOKENS[first:]:
        prev = fn(toks, prev, scope.lora_id, scope.salt)  # type: ignore[operator]
        blocks.append(StoredBlock(prev, toks, scope.lora_id, 0, 35, scope.salt))
    return Stored(parent, blocks, 4)


def frames(seq: int, *datas: object) -> list[bytes]:
    events = [KVCacheEvent(i, d) for i, d in enumerate(datas)]  # type: ignore[arg-type]
    return [b"", seq.to_bytes(8, "big"), encode_batch(events, ts=float(seq))]


def doctor_of(
    messages: Sequence[list[bytes] | tuple[list[bytes], bool]], options: DoctorOptions | None = None
) -> Doctor:
    doctor = Doctor(options)
    for m in messages:
        if isinstance(m, tuple):
            doctor.feed(0, m[0], m[1])
        else:
            doctor.feed(0, m)
    doctor.finish()
    return doctor


def messages_of(doctor: Doctor, severity: str) -> list[str]:
    return [f.message for f in doctor.findings if f.severity == severity]


@pytest.mark.parametrize(
    ("scope", "buggy", "cause"),
    [
        (ReuseScope(3, None), lambda t, p, lo, sa: v1_block_hash(t, p, None, sa), "LoRA id"),
        (ReuseScope(3, 9), lambda t, p, lo, sa: v1_block_hash(t, p, None, None), "neither"),
        (ReuseScope(None, 9), v1_salt_every_block, "salt is mixed into every block"),
        (ReuseScope(None, 9), lambda t, p, lo, sa: v1_block_hash(t, 0, lo, sa), "not chained"),
    ],
)
def test_doctor_names_the_cause_of_a_hash_mismatch(
    scope: ReuseScope, buggy: object, cause: str
) -> None:
    doctor = doctor_of([frames(0, stored_chain(scope, buggy))])
    (problem,) = messages_of(doctor, "problem")
    assert "explained by" in problem and cause in problem


def test_doctor_uses_the_routers_scope_when_given() -> None:
    stream = [frames(0, stored_chain(ReuseScope(None, 9)))]
    assert messages_of(doctor_of(stream), "problem") == []
    other = DoctorOptions(scope=ReuseScope(None, 10))
    (problem,) = messages_of(doctor_of(stream, other), "problem")
    assert "publisher's own scope" in problem


def test_doctor_sees_restarts_duplicates_and_replayed_gaps() -> None:
    scope = ReuseScope()
    chain = stored_chain(scope)
    first = chain.blocks[0].block_hash
    restart = [b"", (0).to_bytes(8, "big"), encode_batch([KVCacheEvent(0, chain)], ts=99.0)]
    stream: list[list[bytes] | tuple[list[bytes], bool]] = [
        frames(0, chain),
        frames(0, chain),  # duplicate
        frames(3, Removed([first])),  # 1..2 missing for now
        (frames(1, Removed([chain.blocks[2].block_hash])), True),  # replayed
        (frames(2, Removed([chain.blocks[1].block_hash])), True),
        restart,  # seq 0 again with another payload: a restarted publisher
    ]
    doctor = doctor_of(stream)
    assert messages_of(doctor, "problem") == []
    warnings = " | ".join(messages_of(doctor, "warning"))
    assert "duplicate batch" in warnings and "publisher restarted" in warnings
    assert "a missing batch replayed" in " | ".join(messages_of(doctor, "info"))


def test_doctor_flags_a_partial_block_with_children() -> None:
    scope = ReuseScope()
    chain = stored_chain(scope)
    # The engine says block_size 8 but stores 4-token blocks one event at a time.
    one = Stored(None, chain.blocks[:1], 8)
    two = Stored(chain.blocks[0].block_hash, chain.blocks[1:2], 8)
    doctor = doctor_of([frames(0, one), frames(1, two)])
    assert any("has children" in m for m in messages_of(doctor, "problem"))


def test_doctor_flags_malformed_frames_and_payloads() -> None:
    doctor = doctor_of([[b"", b"\x00"], [b"", (0).to_bytes(8, "big"), b"\xc1garbage"]])
    problems = " | ".join(messages_of(doctor, "problem"))
    assert "malformed message" in problems and "payload does not decode" in problems


def test_doctor_verifies_v2_hashes_through_the_key_chain() -> None:
    from kvcache.hashing import blockchain_keys

    scope = ReuseScope(None, 9)
    keys = blockchain_keys(scope, [t for toks in TOKENS for t in toks], 4)
    blocks = [
        StoredBlock(int.from_bytes(k[:8], "big"), toks, None, 0, 35, 9)
        for k, toks in zip(keys, TOKENS, strict=True)
    ]
    event = KVCacheEvent(0, Stored(None, blocks, 4), hash_algo=HashAlgo.V2_SHA256_64.value)
    good = [b"", (0).to_bytes(8, "big"), encode_batch([event], ts=0.0)]
    doctor = doctor_of([good])
    assert messages_of(doctor, "problem") == []
    assert doctor.summaries[0].hashes_ok == 3
    as_v1 = doctor_of([good], DoctorOptions(hash_algo=HashAlgo.V1_BLOCK_KEY))
    problems = messages_of(as_v1, "problem")
    assert "events say hash_algo v2_sha256_64, the router uses v1_block_key" in problems
    assert any("the hashes are v2_sha256_64, not v1_block_key" in m for m in problems)


# ------------------------------------------------------------------- listen and record


class FakePublisher:
    """An XPUB (live) and a ROUTER (replay) on loopback ports, driven by the test thread."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.XPUB)
        self.router = self.ctx.socket(zmq.ROUTER)
        for s in (self.pub, self.router):
            s.setsockopt(zmq.LINGER, 0)
        port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        rport = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.replay_endpoint = f"tcp://127.0.0.1:{rport}"

    def wait_subscriber(self) -> None:
        assert self.pub.poll(20_000), "no subscription arrived"
        assert self.pub.recv()[0] == 1  # XPUB subscription frame: b"\x01" + topic

    def close(self) -> None:
        self.pub.close(linger=0)
        self.router.close(linger=0)
        self.ctx.term()


def listen_in_thread(argv: list[str]) -> tuple[threading.Thread, list[object]]:
    result: list[object] = []

    def target() -> None:
        out = io.StringIO()
        result.append(main(argv, out=out))
        result.append(out.getvalue())

    thread = threading.Thread(target=target)
    thread.start()
    return thread, result


def test_listen_prints_and_records_then_doctor_reads_the_recording(tmp_path: Path) -> None:
    pub = FakePublisher()
    record = tmp_path / "rec.jsonl"
    datas: list[EventData] = [stored_chain(ReuseScope()), Removed([1234], 0)]
    sent = [
        [b"", (i).to_bytes(8, "big"), encode_batch([KVCacheEvent(i, d)], ts=float(i))]
        for i, d in enumerate(datas)
    ]
    try:
        thread, result = listen_in_thread(
            ["listen", pub.endpoint, "--count", "2", "--timeout", "30", "--record", str(record)]
        )
        pub.wait_subscriber()
        for f in sent:
            pub.pub.send_multipart(f)
        thread.join(40)
        assert not thread.is_alive()
    finally:
        pub.close()
    code, text = result
    assert code == 0
    lines = str(text).splitlines()
    assert lines[0].startswith("w0 seq=0 #0 BlockStored n=3 ")
    assert "tokens=12 block_size=4 medium=GPU" in lines[0]
    assert lines[1] == "w0 seq=1 #1 BlockRemoved n=1 [0000000000] medium=GPU"
    capture = read_capture(record)
    assert capture.endpoints == [pub.endpoint]
    assert [list(m.frames) for m in capture.messages] == sent
    code, report = run("doctor", str(record))
    assert "removed a block that was never stored" in report
    assert code == 0


def test_listen_fills_a_gap_from_the_replay_socket(tmp_path: Path) -> None:
    pub = FakePublisher()
    record = tmp_path / "rec.jsonl"
    chain = stored_chain(ReuseScope())
    hashes = [b.block_hash for b in chain.blocks]
    batches: list[EventData] = [
        chain,
        Removed(hashes[2:], 0),
        Removed(hashes[1:2], 0),
        Removed(hashes[:1], 0),
    ]
    sent = [
        [b"kv", (i).to_bytes(8, "big"), encode_batch([KVCacheEvent(i, d)], ts=float(i))]
        for i, d in enumerate(batches)
    ]
    try:
        thread, result = listen_in_thread(
            ["listen", pub.endpoint, "--replay-endpoint", pub.replay_endpoint, "--count", "2",
             "--timeout", "30", "--record", str(record)]
        )  # fmt: skip
        pub.wait_subscriber()
        pub.pub.send_multipart(sent[0])
        pub.pub.send_multipart(sent[3])  # 1 and 2 lost on the way
        assert pub.router.poll(20_000), "no replay request"
        ident, empty, start = pub.router.recv_multipart()
        assert empty == b"" and int.from_bytes(start, "big") == 1
        for f in sent[1:]:
            pub.router.send_multipart([ident, b"", *f])
        pub.router.send_multipart([ident, b"", b"", b"\xff" * 8, b""])
        thread.join(40)
        assert not thread.is_alive()
    finally:
        pub.close()
    assert result[0] == 0
    capture = read_capture(record)
    got = [(int.from_bytes(m.frames[1], "big"), m.replay) for m in capture.messages]
    assert got == [(0, False), (1, True), (2, True), (3, False)]
    code, report = run("doctor", str(record))
    assert code == 0, report
    assert "hashes verified 3/3" in report


def test_doctor_listens_to_a_live_endpoint() -> None:
    pub = FakePublisher()
    try:
        thread, result = listen_in_thread(
            ["doctor", pub.endpoint, "--count", "1", "--timeout", "30"]
        )
        pub.wait_subscriber()
        pub.pub.send_multipart(frames(0, stored_chain(ReuseScope(None, 9), v1_salt_every_block)))
        thread.join(40)
        assert not thread.is_alive()
    finally:
        pub.close()
    code, report = result
    assert code == 1
    assert "salt is mixed into every block" in str(report)


def test_doctor_on_a_silent_endpoint_reports_that_nothing_was_checked() -> None:
    pub = FakePublisher()
    try:
        code, report = run("doctor", pub.endpoint, "--timeout", "0.2")
    finally:
        pub.close()
    assert code == 1
    assert "nothing was checked" in report


def test_capture_writer_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    with open(path, "w", encoding="utf-8") as stream:
        writer = CaptureWriter(stream, ["inproc://x"])
        writer.write(2, [b"a", b"\x00" * 8, b"\xff"], replay=True)
    capture = read_capture(path)
    assert capture.endpoints == ["inproc://x"]
    (m,) = capture.messages
    assert (m.index, m.worker, m.frames, m.replay) == (0, 2, (b"a", b"\x00" * 8, b"\xff"), True)


def test_engine_to_listener_end_to_end_with_a_lost_frame(tmp_path: Path) -> None:
    """KVCacheManager -> KVCacheEventManager -> ZmqEventPublisher (one live frame withheld)
    -> `kv-events listen --replay-endpoint --record` -> `kv-events doctor`: the recording is
    complete, in order, and every hash verifies."""
    from events.manager import KVCacheEventManager
    from events.stream.publisher import ZmqEventPublisher
    from kvcache.config import KVCacheManagerConfig, TierConfig
    from kvcache.manager import KVCacheManager

    events = KVCacheEventManager(moves_as="removed_stored")
    config = KVCacheManagerConfig(
        tokens_per_block=4,
        tiers=[TierConfig(name="device", num_blocks=6), TierConfig(name="host", num_blocks=6)],
    )
    cache = KVCacheManager(config, event_sink=events)
    record = tmp_path / "engine.jsonl"
    with ZmqEventPublisher(
        "tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", drop_live=lambda s: s == 2
    ) as pub:
        assert pub.replay_endpoint is not None
        thread, result = listen_in_thread(
            ["listen", pub.endpoint, "--replay-endpoint", pub.replay_endpoint, "--count", "3",
             "--timeout", "30", "--record", str(record)]
        )  # fmt: skip
        assert pub.wait_for_subscribers(1, timeout_s=20)
        scope = ReuseScope.for_request(cache_salt="tenant-a")
        for i in range(4):  # the third batch is withheld from the live socket
            prompt = list(range(i * 100, i * 100 + 16))
            with cache.create_kv_cache(prompt, reuse_scope=scope) as seq:
                seq.commit(prompt[seq.num_tokens :])
            events.flush()
            pub.publish(events.get_latest_events())
        assert pub.flush(timeout_s=20)
        thread.join(40)
        assert not thread.is_alive()
    assert result[0] == 0
    capture = read_capture(record)
    got = [(int.from_bytes(m.frames[1], "big"), m.replay) for m in capture.messages]
    assert got == [(0, False), (1, False), (2, True), (3, False)]
    code, report = run("doctor", str(record), "--block-size", "4", "--cache-salt", "tenant-a")
    assert code == 0, report
    ok, total = report.split("hashes verified ")[1].split()[0].split("/")
    assert ok == total and int(total) >= 16  # 16 committed blocks, plus re-stores of moves

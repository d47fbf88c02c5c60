"""The drift matrix: a small engine of its own hashes 32-token blocks (WIRE.md 3, transcribed
here from the text and checked against its published vectors), one drift injected at a time,
and each drift goes through the three tools a CI gate uses:

- the pytest plugin (``kv_golden.check(request_hasher=...)``: the engine gets the raw
  ``cache_salt`` string, so its own salt derivation is under test);
- ``kv-events hash --check GOLDEN --capture CAP`` on the engine's recorded stream;
- ``kv-events doctor CAP --block-size 32`` on the same stream, once with the events declaring
  ``hash_algo`` and announcing salt ids, once as a vLLM-style stream that does neither (the
  user names the algorithm with ``--hash-algo``).

Each asserts its verdict (exit status) and its diagnosis. Correct streams, with and without
announced salt ids, pass with honest counts; engine-native hashes are their own verdict.
The golden values are the correct engine's (the WIRE.md transcription), never kvcache.hashing's.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from events.tools.capture import write_capture
from events.tools.cli import main
from events.tools.doctor import Doctor, DoctorOptions
from events.tools.hashcheck import Case, Golden, write_golden
from events.wire.model import BlockHash
from kvcache.hashing import HashAlgo
from kvcache.scope import ReuseScope

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.timeout(300)

M64 = (1 << 64) - 1
M1, M2, C32, G = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0x45D9F3B, 0x9E3779B9
TPB = 32
SALTS = ("tenant-a", "tenant-b")


def mix32(a: int, seed: int) -> int:
    a &= 0xFFFFFFFF
    a = (((a >> 16) ^ a) * C32) & 0xFFFFFFFF
    a = (((a >> 16) ^ a) * C32) & 0xFFFFFFFF
    a = (a >> 16) ^ a
    return seed ^ ((((a + G) & 0xFFFFFFFF) + (seed << 6) + (seed >> 2)) & M64)


def mix64(b: int, seed: int) -> int:
    b = ((b ^ (b >> 30)) * M1) & M64
    b = ((b ^ (b >> 27)) * M2) & M64
    b ^= b >> 31
    return seed ^ ((b + G + (seed << 6) + (seed >> 2)) & M64)


@dataclass(frozen=True)
class TinyEngine:
    """An engine's own block hasher, as a team would write it from WIRE.md, with ``drift``
    (one of :data:`DRIFTS`, or None for the correct one) injected."""

    drift: str | None = None

    @property
    def size(self) -> int:
        """The tokens per hash the engine's hasher uses (its announced blocks hold 32)."""
        m = re.fullmatch(r"block-size-(\d+)", self.drift or "")
        return int(m.group(1)) if m else TPB

    def salt_id(self, cache_salt: str | None) -> int | None:
        if cache_salt is None:
            return None
        data = cache_salt.encode("utf-8")
        if self.drift == "salt-blake3":
            return int.from_bytes(blake3.blake3(data).digest(8), "little")
        if self.drift == "salt-raw":
            return int.from_bytes(data[:8].ljust(8, b"\0"), "little")
        if self.drift == "salt-raw-be":
            return int.from_bytes(data[:8].ljust(8, b"\0"), "big")
        if self.drift == "salt-sha256-be":
            return int.from_bytes(hashlib.sha256(data).digest()[:8], "big")
        return int.from_bytes(hashlib.sha256(data).digest()[:8], "little")

    def block_hash(
        self, tokens: Sequence[int], parent: int, lora: int | None, salt: int | None
    ) -> int:
        d = self.drift
        if d == "lora-none-as-0" and lora is None:
            lora = 0
        if d == "lora-0-as-none" and lora == 0:
            lora = None
        if d == "parent":
            parent = 0
        seed = (parent * M1) & M64
        if d != "seed-no-count":
            seed ^= len(tokens)
        if d == "seed-count-twice":
            seed = mix64(len(tokens), seed)
        if salt is not None and (parent == 0 or d == "salt-every-block"):
            seed = mix64(salt, seed)
        for tok in tokens:
            seed = mix32(tok, seed)
        if lora is not None:
            seed = mix64(lora, seed)
        return seed

    def publish(self, h: int) -> int:
        if self.drift == "signed":
            return h - (1 << 64) if h >= 1 << 63 else h
        if self.drift == "byte-order":
            return int.from_bytes(h.to_bytes(8, "little"), "big")
        return h

    def hashes(self, tokens: Sequence[int], lora: int | None, cache_salt: str | None) -> list[int]:
        """The hashes the engine gives a request's blocks (full ones; and the trailing
        partial one with the "partial" drift)."""
        size, salt = self.size, self.salt_id(cache_salt)
        end = len(tokens) if self.drift == "partial" else len(tokens) - len(tokens) % size
        out, parent = [], 0
        for start in range(0, end, size):
            parent = self.block_hash(tokens[start : start + size], parent, lora, salt)
            out.append(self.publish(parent))
        return out

    def request_hasher(self, tokens: list[int], tpb: int, request: Any, algo: str) -> list[int]:
        """The plugin's request hasher: the engine's own path from the raw cache_salt."""
        assert tpb == TPB and algo == "v1_block_key"
        return self.hashes(tokens, request.lora_id, request.cache_salt)


def _wire_vectors_hold() -> None:
    """The transcription reproduces WIRE.md's published values before anything trusts it."""
    engine = TinyEngine()
    assert engine.block_hash([1, 2, 3, 4], 0, None, None) == 924206229973855
    assert engine.block_hash([5, 6], 924206229973855, None, None) == 6875034662206558884
    assert engine.block_hash([1, 2, 3, 4], 0, None, 123) == 6280297290684427985
    assert engine.block_hash([1, 2, 3, 4], 0, 123, None) == 15718075209399076427
    assert engine.salt_id("tenant-a") == 16248643848220682112
    assert TinyEngine("salt-blake3").salt_id("tenant-a") == 15947361407820284973


_wire_vectors_hold()

# (name, tokens, lora, cache_salt); "plain-more" continues "plain" (a child event)
PROMPTS: list[tuple[str, list[int], int | None, str | None]] = [
    ("plain", [(7919 * i) % 50_021 for i in range(150)], None, None),
    ("tenant-a", [(104_729 * i + 11) % 50_021 for i in range(100)], None, "tenant-a"),
    ("lora3-tenant-b", [(15_485_863 * i + 5) % 50_021 for i in range(140)], 3, "tenant-b"),
    ("lora0", [(32_452_843 * i + 3) % 50_021 for i in range(96)], 0, None),
]
MORE = PROMPTS[0][1] + [(49_999 * i + 1) % 50_021 for i in range(64)]

DRIFTS: dict[str, tuple[str, str]] = {
    # drift: (diagnosis from the plugin and hash --check, diagnosis from the doctor)
    "signed": ("returns its hashes as signed 64-bit ints", "negative (signed) int64s"),
    "byte-order": ("bytes reversed", "bytes reversed"),
    "lora-none-as-0": ("absent LoRA id (None) as LoRA 0", "absent LoRA id (None) as LoRA 0"),
    "lora-0-as-none": ("LoRA id 0 as no LoRA", "LoRA id 0 as no LoRA"),
    "salt-blake3": ("from the first 8 bytes of blake3", "from the first 8 bytes of blake3"),
    "salt-raw": ("from the raw UTF-8 bytes", "from the raw UTF-8 bytes"),
    "salt-raw-be": ("zero-padded) read big-endian", "zero-padded) read big-endian"),
    "salt-sha256-be": ("sha256(cache_salt UTF-8) read big-endian", "read big-endian"),
    "salt-every-block": ("salt is mixed into every block", "salt is mixed into every block"),
    "block-size-1": ("hashes are of 1-token blocks, not 32", "of 1-token blocks, not 32"),
    "block-size-16": ("hashes are of 16-token blocks, not 32", "of 16-token blocks, not 32"),
    "block-size-31": ("hashes are of 31-token blocks, not 32", "of 31-token blocks, not 32"),
    "block-size-33": ("hashes are of 33-token blocks, not 32", "of 33-token blocks, not 32"),
    "block-size-64": ("hashes are of 64-token blocks, not 32", "of 64-token blocks, not 32"),
    "seed-no-count": ("seed has no token-count term", "seed has no token-count term"),
    "seed-count-twice": ("token count into the seed a second time", "a second time"),
    "partial": ("hashes the trailing partial block", "announces a trailing partial block"),
    "parent": ("parent chain is broken", "parent hash is not chained"),
}


def golden_file(path: Path) -> Path:
    """The corpus with the correct engine's hashes (an independent WIRE.md transcription)."""
    engine = TinyEngine()
    cases = [
        Case(
            name,
            tokens,
            TPB,
            ReuseScope.for_request(lora_id=lora, cache_salt=salt),
            salt,
            {"v1_block_key": list[BlockHash](engine.hashes(tokens, lora, salt))},
        )
        for name, tokens, lora, salt in [*PROMPTS, ("plain-more", MORE, None, None)]
    ]
    write_golden(path, Golden(TPB, ["v1_block_key"], cases))
    return path


def _stored(
    engine: TinyEngine,
    tokens: list[int],
    lora: int | None,
    salt: str | None,
    hashes: list[int],
    parent: int | None,
    extensions: bool,
) -> dict[str, Any]:
    event: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": TPB,
        "lora_id": lora,
        "medium": "GPU",
        "lora_name": None,
    }
    if extensions:  # this project's extension fields: the algorithm and the salt id
        event["hash_algo"] = "v1_block_key"
        event["cache_salt_id"] = engine.salt_id(salt)
    return event


def engine_capture(path: Path, engine: TinyEngine, extensions: bool, restarts: int = 0) -> Path:
    """The engine serving every prompt, then "plain-more" (a prefix hit: only its new blocks,
    chained to "plain"'s last one), recorded as ``kv-events listen --record`` writes it;
    ``restarts`` times more, each from seq 0 again (a restarted publisher)."""
    events, announced = [], []
    for _name, tokens, lora, salt in PROMPTS:
        hashes = engine.hashes(tokens, lora, salt)
        blocks = -(-len(tokens) // TPB) if engine.drift == "partial" else len(tokens) // TPB
        n = min(len(hashes), blocks)
        announced.append(n)
        events.append(_stored(engine, tokens[: n * TPB], lora, salt, hashes[:n], None, extensions))
    plain = len(PROMPTS[0][1]) // TPB if engine.drift == "partial" else announced[0]
    chain = engine.hashes(MORE, None, None)
    full = min(len(chain), len(MORE) // TPB)
    if full > plain:
        tokens = MORE[plain * TPB : full * TPB]
        parent = chain[plain - 1]
        events.append(_stored(engine, tokens, None, None, chain[plain:full], parent, extensions))
    frames = [
        (0, [b"kv", seq.to_bytes(8, "big"), msgpack.packb([float(attempt + seq), [e], None])])
        for attempt in range(restarts + 1)
        for seq, e in enumerate(events)
    ]
    write_capture(path, frames, ["tcp://127.0.0.1:5557"])
    return path


def run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    return main(list(argv), out=out), out.getvalue()


def _doctor_lines(text: str, severity: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(severity)]


# ------------------------------------------------------------------------ the doctor


@pytest.mark.parametrize("extensions", [True, False], ids=["declared", "vllm-style"])
@pytest.mark.parametrize("drift", list(DRIFTS))
def test_the_doctor_names_each_drift(tmp_path: Path, drift: str, extensions: bool) -> None:
    cap = engine_capture(tmp_path / "cap.jsonl", TinyEngine(drift), extensions)
    argv = ["doctor", str(cap), "--block-size", "32", *[f"--cache-salt={s}" for s in SALTS]]
    if not extensions:
        argv += ["--hash-algo", "v1_block_key"]  # the user names the algorithm
    code, text = run(*argv)
    want = DRIFTS[drift][1]
    if drift == "signed":
        # WIRE.md 4: decoders read a negative int64 as its unsigned value, so the hashes
        # verify; the doctor warns that strict uint64 readers would reject the batches
        assert code == 0, text
        assert any(want in line for line in _doctor_lines(text, "WARNING")), text
        assert "result: OK" in text
        return
    assert code == 1, text
    problems = _doctor_lines(text, "PROBLEM")
    assert any(want in line for line in problems), text
    assert "result: PROBLEMS FOUND" in text
    verified, checked = _counts(text)
    assert verified <= checked


@pytest.mark.parametrize("drift", ["byte-order", "seed-no-count", "lora-none-as-0"])
def test_the_doctor_never_calls_a_drift_engine_native(tmp_path: Path, drift: str) -> None:
    """The issue's three: a vLLM-style stream (no hash_algo, no salt ids), no flags at all:
    still problems, each named, never "engine-native" and never OK."""
    cap = engine_capture(tmp_path / "cap.jsonl", TinyEngine(drift), extensions=False)
    code, text = run("doctor", str(cap), "--block-size", "32")
    assert code == 1, text
    assert "engine-native" not in text and "result: OK" not in text
    assert any(DRIFTS[drift][1] in line for line in _doctor_lines(text, "PROBLEM")), text


def _counts(text: str) -> tuple[int, int]:
    m = re.search(r"hashes verified (\d+)/(\d+)", text)
    assert m is not None, text
    return int(m.group(1)), int(m.group(2))


# blocks the correct engine announces: 4 + 3 + 4 + 3 full blocks, then 2 more of "plain-more"
BLOCKS = 16
SALTED_ROOTS = 2  # the first blocks of "tenant-a" and "lora3-tenant-b"


def test_a_correct_stream_that_announces_salts_verifies_every_block(tmp_path: Path) -> None:
    cap = engine_capture(tmp_path / "cap.jsonl", TinyEngine(), extensions=True)
    for extra in (
        [],
        ["--require-verified"],
        ["--cache-salt", "tenant-a", "--cache-salt", "tenant-b"],
    ):
        code, text = run("doctor", str(cap), "--block-size", "32", *extra)
        assert code == 0, text
        assert _counts(text) == (BLOCKS, BLOCKS)
        assert "result: OK: 0 problem(s), 0 warning(s)" in text


def test_a_correct_stream_without_salt_ids_is_honest_about_what_it_could_not_check(
    tmp_path: Path,
) -> None:
    cap = engine_capture(tmp_path / "cap.jsonl", TinyEngine(), extensions=False)
    code, text = run("doctor", str(cap), "--block-size", "32")
    assert code == 0, text
    # the salted first blocks cannot be recomputed without the salt: counted apart
    assert _counts(text) == (BLOCKS - SALTED_ROOTS, BLOCKS - SALTED_ROOTS)
    assert f"{SALTED_ROOTS} unverifiable (scope unknown)" in text
    assert "unverifiable: scope unknown (a salt the stream does not announce?)" in text
    assert "result: NOT VERIFIED" in text and "PROBLEM" not in text
    # the algorithm named: still not drift
    code, text = run("doctor", str(cap), "--block-size", "32", "--hash-algo", "v1_block_key")
    assert code == 0 and "result: NOT VERIFIED" in text, text
    # a CI gate refuses it
    code, text = run("doctor", str(cap), "--block-size", "32", "--require-verified")
    assert code == 3, text
    # given the salts, every block is checked and verifies
    code, text = run(
        "doctor", str(cap), "--block-size", "32", "--require-verified",
        "--cache-salt", "tenant-a", "--cache-salt", "tenant-b",
    )  # fmt: skip
    assert code == 0, text
    assert _counts(text) == (BLOCKS, BLOCKS) and "result: OK" in text
    # one salt missing: its block is checkable now (the salts were named), so it is a problem
    code, text = run("doctor", str(cap), "--block-size", "32", "--cache-salt", "tenant-a")
    assert code == 1, text
    assert _counts(text) == (BLOCKS - 1, BLOCKS)


def test_engine_native_hashes_are_their_own_verdict(tmp_path: Path) -> None:
    """Hashes no algorithm or drift reproduces (an engine's sha256 of its own encoding)."""

    class Native(TinyEngine):
        def block_hash(
            self, tokens: Sequence[int], parent: int, lora: int | None, salt: int | None
        ) -> int:
            body = repr((parent, list(tokens), lora, salt)).encode()
            return int.from_bytes(hashlib.sha256(body).digest()[:8], "big")

    cap = engine_capture(tmp_path / "cap.jsonl", Native(), extensions=False)
    code, text = run("doctor", str(cap), "--block-size", "32")
    assert code == 0, text
    assert "result: ENGINE-NATIVE HASHES, NOT CHECKED" in text and "result: OK" not in text
    assert _counts(text) == (0, 0) and f"{BLOCKS} engine-native (not checked)" in text
    assert run("doctor", str(cap), "--block-size", "32", "--require-verified")[0] == 3
    code, text = run("doctor", str(cap), "--block-size", "32", "--hash-algo", "v1_block_key")
    assert code == 1 and "engine-native" not in text, text
    # the stream itself declaring v1_block_key: the same
    cap = engine_capture(tmp_path / "declared.jsonl", Native(), extensions=True)
    code, text = run("doctor", str(cap), "--block-size", "32")
    assert code == 1 and "engine-native" not in text, text
    assert "block hashes do not match v1_block_key" in text


def test_a_publisher_restart_does_not_forget_what_was_found(tmp_path: Path) -> None:
    """A restart (seq back to 0) resets the worker's blocks, not what was found: mismatches
    no drift explains before it, then a stream that verifies after it, is still a problem."""

    class Garbled(TinyEngine):
        def publish(self, h: int) -> int:
            return h ^ 0x5A5A_5A5A  # nothing in the catalog

    salts = ["--cache-salt", "tenant-a", "--cache-salt", "tenant-b"]
    cap = engine_capture(tmp_path / "ok.jsonl", TinyEngine(), False, restarts=1)
    code, text = run("doctor", str(cap), "--block-size", "32", *salts)
    assert code == 0 and "publisher restarted" in text, text
    assert _counts(text) == (2 * BLOCKS, 2 * BLOCKS) and "result: OK" in text
    garbled = engine_capture(tmp_path / "garbled.jsonl", Garbled(), False).read_text()
    good = engine_capture(tmp_path / "good.jsonl", TinyEngine(), False).read_text()
    header, *first = garbled.splitlines()
    body = first + good.splitlines()[1:]
    (tmp_path / "both.jsonl").write_text("\n".join([header, *body]) + "\n", encoding="utf-8")
    code, text = run("doctor", str(tmp_path / "both.jsonl"), "--block-size", "32", *salts)
    assert code == 1 and "publisher restarted" in text, text
    assert _counts(text) == (BLOCKS, 2 * BLOCKS)
    assert "block hashes do not match v1_block_key" in text and "engine-native" not in text


# ------------------------------------------------------------------ kv-events hash --check


@pytest.mark.parametrize("extensions", [True, False], ids=["declared", "vllm-style"])
@pytest.mark.parametrize("drift", [None, *DRIFTS])
def test_hash_check_on_the_engines_capture(
    tmp_path: Path, drift: str | None, extensions: bool
) -> None:
    golden = golden_file(tmp_path / "golden.json")
    cap = engine_capture(tmp_path / "cap.jsonl", TinyEngine(drift), extensions)
    code, text = run("hash", "--check", str(golden), "--capture", str(cap))
    if drift in (None, "signed", "partial"):
        # a capture's hashes are read as routers read them (int64 as unsigned, WIRE.md 4),
        # and a trailing partial block is not part of a golden chain: stable
        assert code == 0, text
        assert text.startswith("stable: 5 case(s)")
        return
    assert code == 1, text
    causes = [line for line in text.splitlines() if "likely cause:" in line]
    assert causes and all(DRIFTS[drift][0] in line for line in causes), text


# ----------------------------------------------------------------- the pytest plugin


INNER = """
import pytest
from test_drift_matrix import DRIFTS, TinyEngine

pytestmark = pytest.mark.kv_golden("golden.json")

@pytest.mark.parametrize("drift", [None, *DRIFTS])
def test_engine(kv_golden, drift):
    kv_golden.check(request_hasher=TinyEngine(drift).request_hasher)
"""


def test_the_plugin_names_each_drift(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    golden = golden_file(pytester.path / "golden.json")
    before = golden.read_bytes()
    pytester.makepyfile(test_inner=INNER)
    recorder = pytester.inline_run("-p", "events.tools.pytest_plugin")
    reports = [r for r in recorder.getreports("pytest_runtest_logreport") if r.when == "call"]
    outcome = {re.search(r"\[(.*)\]", r.nodeid).group(1): r for r in reports}  # type: ignore[union-attr]
    assert outcome["None"].passed
    for drift, (cause, _) in DRIFTS.items():
        report = outcome[drift]
        assert report.failed, drift
        text = report.longreprtext
        assert "KV event hash drift against" in text and "first diverging block" in text
        causes = [line for line in text.splitlines() if "likely cause:" in line]
        assert causes and all(cause in line for line in causes), (drift, text)
    # recording a drift under the known name is refused (with the diff), the file untouched
    result = pytester.runpytest_inprocess(
        "-p", "events.tools.pytest_plugin", "--kv-golden-update", "-k", "salt-blake3"
    )
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*refusing to record 2 case(s) under v1_block_key*"])
    assert golden.read_bytes() == before
    assert os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] == "1"


def test_golden_file_has_provenance(tmp_path: Path) -> None:
    raw = json.loads(golden_file(tmp_path / "g.json").read_text(encoding="utf-8"))
    provenance = raw["provenance"]
    assert provenance["library"].startswith("scoped-kv-router ")
    assert provenance["algorithms"] == ["v1_block_key"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", provenance["date"])
    assert provenance["command"] == "events.tools.hashcheck.write_golden"


# ------------------------------------------------------------- counts, for any stream


@settings(max_examples=60, deadline=None)
@given(
    served=st.lists(
        st.tuples(
            st.integers(0, len(PROMPTS) - 1),
            st.sampled_from([None, None, "byte-order", "salt-blake3", "partial", "native"]),
            st.booleans(),
        ),
        min_size=1,
        max_size=6,
    ),
    salts=st.lists(st.sampled_from(SALTS), unique=True),
    named=st.booleans(),
)
def test_every_block_lands_in_exactly_one_count(
    served: list[tuple[int, str | None, bool]], salts: list[str], named: bool
) -> None:
    """Whatever the mix of engines, flags and announcements: verified <= checked, every
    block with tokens is counted once (checked, unverifiable or engine-native), and a stream
    with any wrong hash is never OK."""
    options = DoctorOptions(
        block_size=TPB,
        hash_algo=HashAlgo.V1_BLOCK_KEY if named else None,
        salts=tuple(salts),
    )
    doctor = Doctor(options)
    blocks, wrong = 0, False
    for seq, (index, drift, extensions) in enumerate(served):
        _name, tokens, lora, salt = PROMPTS[index]
        engine = TinyEngine(None if drift == "native" else drift)
        hashes = engine.hashes(tokens, lora, salt)
        if drift == "native":
            hashes = [
                int.from_bytes(hashlib.sha256(bytes([seq, i])).digest()[:8], "big")
                for i in range(len(hashes))
            ]
        n = len(hashes) if drift == "partial" else len(tokens) // TPB
        event = _stored(engine, tokens[: n * TPB], lora, salt, hashes[:n], None, extensions)
        payload = msgpack.packb([float(seq), [event], None])
        doctor.feed(0, [b"kv", seq.to_bytes(8, "big"), payload])
        blocks += n
        # a salt derived another way verifies against the engine's own announced id: the
        # doctor sees it when the stream announces no id or the salt string is given
        detectable = salt is not None and (not extensions or salt in salts)
        wrong = (
            wrong or drift in ("byte-order", "native") or (drift == "salt-blake3" and detectable)
        )
    doctor.finish()
    s = doctor.summaries[0]
    assert 0 <= s.hashes_ok <= s.hashes_checked
    assert (
        s.hashes_checked + s.hashes_unverifiable + s.hashes_unrecomputable + s.hashes_engine
        == blocks
    )
    if wrong:
        assert doctor.verdict() != "OK", doctor.render()
    if doctor.verdict() == "OK":
        assert s.hashes_ok == blocks


# ------------------------------------------------------------------ a v2 engine's drifts


def v2_hashes(
    tokens: Sequence[int], lora: int | None, salt: int | None, drift: str | None = None
) -> list[int]:
    """WIRE.md 1-3 transcribed: the scope's root key, chained sha256 block keys, the first 8
    bytes big-endian (v2_sha256_64), with ``drift`` injected."""
    if drift == "lora-none-as-0" and lora is None:
        lora = 0
    mask = (lora is not None) | (salt is not None) << 1
    scope = bytes([mask]) + b"".join(v.to_bytes(8, "little") for v in (lora, salt) if v is not None)
    root = key = hashlib.sha256(scope).digest()
    out = []
    for start in range(0, len(tokens) - len(tokens) % TPB, TPB):
        body = b"".join(t.to_bytes(4, "little") for t in tokens[start : start + TPB])
        if drift == "count-in-key":
            body = TPB.to_bytes(4, "little") + body
        key = hashlib.sha256((root if drift == "parent" else key) + body).digest()
        out.append(int.from_bytes(key[:8], "little" if drift == "byte-order" else "big"))
    return out


def test_the_v2_transcription_holds_wire_md() -> None:
    root = hashlib.sha256(b"\x00").hexdigest()
    assert root == "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d"
    key = hashlib.sha256(bytes.fromhex(root) + b"".join(t.to_bytes(4, "little") for t in range(4)))
    assert key.hexdigest().startswith("7b894451a88bc030")  # WIRE.md 2, block [0,1,2,3]


V2_DRIFTS = {
    "byte-order": "first 8 bytes little-endian",
    "parent": "parent hash is not chained",
    "lora-none-as-0": "absent LoRA id (None) as LoRA 0",
    "count-in-key": "4-byte token count before the tokens",
}


@pytest.mark.parametrize("drift", [None, *V2_DRIFTS])
def test_a_v2_streams_drifts_are_named_by_the_doctor(tmp_path: Path, drift: str | None) -> None:
    events = []
    for _name, tokens, lora, salt in PROMPTS:
        salt_id = TinyEngine().salt_id(salt)
        n = len(tokens) // TPB
        event = _stored(TinyEngine(), tokens[: n * TPB], lora, salt, [], None, True)
        event["block_hashes"] = v2_hashes(tokens, lora, salt_id, drift)
        event["hash_algo"] = "v2_sha256_64"
        events.append(event)
    frames = [
        (0, [b"kv", seq.to_bytes(8, "big"), msgpack.packb([0.0, [e], None])])
        for seq, e in enumerate(events)
    ]
    write_capture(tmp_path / "cap.jsonl", frames)
    code, text = run("doctor", str(tmp_path / "cap.jsonl"), "--block-size", "32")
    if drift is None:
        assert code == 0 and "result: OK" in text and _counts(text) == (14, 14), text
        return
    assert code == 1, text
    assert any(V2_DRIFTS[drift] in line for line in _doctor_lines(text, "PROBLEM")), text


@pytest.mark.parametrize("drift", list(V2_DRIFTS))
def test_a_v2_hashers_drifts_are_named_against_a_golden_file(drift: str) -> None:
    from events.tools.hashcheck import compare

    cases = []
    for name, tokens, lora, salt in PROMPTS:
        scope = ReuseScope.for_request(lora_id=lora, cache_salt=salt)
        want = list[BlockHash](v2_hashes(tokens, lora, scope.salt))
        cases.append(Case(name, tokens, TPB, scope, salt, {"v2_sha256_64": want}))
    golden = Golden(TPB, ["v2_sha256_64"], cases)
    drifts = compare(golden, lambda t, n, s, a: v2_hashes(t, s.lora_id, s.salt, drift))
    assert drifts
    want = V2_DRIFTS[drift].replace("parent hash is not chained", "parent chain is broken")
    assert all(want in d.cause for d in drifts), [d.cause for d in drifts]


def test_the_salts_a_doctor_tries_are_bounded(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cap = engine_capture(tmp_path / "cap.jsonl", TinyEngine(), extensions=False)
    salts = [f"--cache-salt=tenant-{i}" for i in range(257)]
    assert run("doctor", str(cap), *salts)[0] == 2
    assert "--cache-salt is given 257 times; at most 256" in capsys.readouterr().err
    code, text = run(
        "doctor",
        str(cap),
        "--block-size",
        "32",
        *salts[:254],
        *[f"--cache-salt={s}" for s in SALTS],
    )
    assert code == 0 and _counts(text) == (BLOCKS, BLOCKS), text

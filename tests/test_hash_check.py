"""Golden hash files: each injected drift is diagnosed, captures from any engine are checked,
and ``kv-events hash --check / --record`` exit 0 (stable), 1 (drift) or 2 (usage)."""

from __future__ import annotations

import importlib.util
import io
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from types import ModuleType

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from events.tools.capture import write_capture
from events.tools.capture_hashes import CaptureHashes, compare_capture
from events.tools.cli import main
from events.tools.diagnosis import UNEXPLAINED, XXH3_CONTENT, explain_chain, v1_salt_every_block
from events.tools.hashcheck import (
    Case,
    Golden,
    GoldenError,
    compare,
    load_golden,
    parse_golden,
    record,
    shipped_path,
    write_golden,
)
from events.wire.codec import encode_batch
from events.wire.model import BlockHash, KVCacheEvent, Stored, StoredBlock
from kvcache.hashing import BlockKey, chain_hashes, hash_from_key
from kvcache.scope import ReuseScope

ROOT = Path(__file__).resolve().parent.parent
CAPTURES = ROOT / "tests" / "data" / "captures"
ENGINES = ROOT / "tests" / "data" / "engines"
pytestmark = pytest.mark.timeout(60)


def _generator() -> ModuleType:
    """scripts/make_golden_vectors.py: an implementation of WIRE.md 1-3 that imports nothing
    from this project (checked against every WIRE.md vector), the independent reference."""
    path = ROOT / "scripts" / "make_golden_vectors.py"
    spec = importlib.util.spec_from_file_location("make_golden_vectors", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.check_against_wire()
    return module


GEN = _generator()


def independent(tokens: list[int], tpb: int, scope: ReuseScope, algo: str) -> list[BlockHash]:
    return list(GEN.hashes(algo, tokens, tpb, scope.lora_id, scope.salt))


def run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    return main(["hash", *argv], out=out), out.getvalue()


# ------------------------------------------------------------------------------- diagnosis

SALTED = ReuseScope.for_request(lora_id=3, cache_salt="tenant-a")
TOKENS = [(7919 * i) % 151_000 for i in range(70)]  # the shipped "tenant-a-lora3-16" case


def _chunks(tokens: Sequence[int], tpb: int) -> list[list[int]]:
    return [list(tokens[i : i + tpb]) for i in range(0, len(tokens) - len(tokens) % tpb, tpb)]


def _v1_salt_everywhere(tokens: list[int], tpb: int, scope: ReuseScope) -> list[BlockHash]:
    parent, out = 0, []
    for chunk in _chunks(tokens, tpb):
        parent = v1_salt_every_block(chunk, parent, scope.lora_id, scope.salt)
        out.append(parent)
    return out


def _wide(tokens: list[int], tpb: int, scope: ReuseScope, algo: str) -> list[BlockHash]:
    import hashlib

    parent = hashlib.sha256(scope.to_bytes()).digest()
    out: list[BlockHash] = []
    for chunk in _chunks(tokens, tpb):
        parent = hashlib.sha256(parent + b"".join(t.to_bytes(8, "little") for t in chunk)).digest()
        out.append(hash_from_key(algo, BlockKey(parent)))
    return out


Drifted = Callable[[str, list[int], int, ReuseScope], list[BlockHash]]
DRIFTS: list[tuple[str, Drifted, str, tuple[str, ...]]] = [
    (
        "salt",
        lambda a, t, n, s: chain_hashes(t, n, ReuseScope(s.lora_id, None), a),
        "the salt is not mixed in",
        ("v1_block_key", "v2_sha256", "v2_sha256_64"),
    ),
    (
        "lora",
        lambda a, t, n, s: chain_hashes(t, n, ReuseScope(None, s.salt), a),
        "the LoRA id is not mixed in",
        ("v1_block_key", "v2_sha256", "v2_sha256_64"),
    ),
    (
        "scope",
        lambda a, t, n, s: chain_hashes(t, n, ReuseScope(), a),
        "neither the salt nor the LoRA id is mixed in",
        ("v1_block_key", "v2_sha256", "v2_sha256_64"),
    ),
    (
        "salt-everywhere",
        lambda a, t, n, s: _v1_salt_everywhere(t, n, s),
        "the salt is mixed into every block",
        ("v1_block_key",),
    ),
    (
        "parent",
        lambda a, t, n, s: [chain_hashes(c, n, s, a)[0] for c in _chunks(t, n)],
        "the parent chain is broken",
        ("v1_block_key", "v2_sha256", "v2_sha256_64"),
    ),
    (
        "block-size",
        lambda a, t, n, s: independent(t, 2 * n, s, a),
        "another block size: the hashes are of 32-token blocks, not 16",
        ("v1_block_key", "v2_sha256", "v2_sha256_64", XXH3_CONTENT),
    ),
    (
        "algorithm",
        lambda a, t, n, s: independent(
            t, n, s, "v2_sha256_64" if a == "v1_block_key" else "v1_block_key"
        ),
        "another algorithm: the hashes are",
        ("v1_block_key", "v2_sha256", "v2_sha256_64", XXH3_CONTENT),
    ),
    (
        "token-width",
        lambda a, t, n, s: _wide(t, n, s, a),
        "8-byte ints",
        ("v2_sha256", "v2_sha256_64"),
    ),
]


@pytest.mark.parametrize("name, drifted, cause, algos", DRIFTS, ids=[d[0] for d in DRIFTS])
def test_each_drift_is_named(
    name: str, drifted: Drifted, cause: str, algos: tuple[str, ...]
) -> None:
    for algo in algos:
        golden = load_golden(shipped_path(algo))
        case = next(c for c in golden.cases if c.name == "tenant-a-lora3-16")
        assert case.scope == SALTED and case.tokens == TOKENS
        drifts = compare(replace(golden, cases=[case]), lambda t, n, s, a: drifted(a, t, n, s))
        assert len(drifts) == 1, (name, algo)
        assert cause in drifts[0].cause, (name, algo, drifts[0].cause)
        want, got = case.hashes[algo], drifted(algo, TOKENS, 16, SALTED)
        i = next(i for i, (w, g) in enumerate(zip(want, got, strict=False)) if w != g)
        text = drifts[0].render()
        assert f"first diverging block: {i} (tokens [{16 * i}:{16 * i + 16}])" in text
        assert f"golden: {want[i]}\n    actual: {got[i]}" in text


@settings(max_examples=40, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**31 - 1), min_size=16, max_size=48),
    tpb=st.integers(1, 8),
    lora=st.integers(0, 2**64 - 1),
    salt=st.integers(0, 2**64 - 1),
    algo=st.sampled_from(["v1_block_key", "v2_sha256", "v2_sha256_64"]),
)
def test_dropped_salt_and_doubled_block_size_are_always_named(
    tokens: list[int], tpb: int, lora: int, salt: int, algo: str
) -> None:
    scope = ReuseScope(lora, salt)
    want = independent(tokens, tpb, scope, algo)
    no_salt = chain_hashes(tokens, tpb, ReuseScope(lora, None), algo)
    cause = explain_chain(algo, tokens, tpb, scope, want, no_salt)
    assert cause.startswith("the salt is not mixed in"), cause
    doubled = independent(tokens, 2 * tpb, scope, algo)
    cause = explain_chain(algo, tokens, tpb, scope, want, doubled)
    assert cause.startswith(f"another block size: the hashes are of {2 * tpb}-token"), cause


def test_missing_extra_and_unexplained() -> None:
    want = independent(TOKENS, 16, SALTED, "v1_block_key")
    assert "only the first 2 of 4" in explain_chain(
        "v1_block_key", TOKENS, 16, SALTED, want, want[:2]
    )
    assert "extra blocks: 1" in explain_chain("v1_block_key", TOKENS, 16, SALTED, want, [*want, 5])
    assert explain_chain("v1_block_key", TOKENS, 16, SALTED, want, [1, 2, 3, 4]) == UNEXPLAINED
    assert "not one of this project" in explain_chain("engine-x", TOKENS, 16, SALTED, [1], [2])


def test_a_golden_file_recorded_the_wrong_way_is_named_as_such() -> None:
    # the golden file says salted, but its hashes were recorded without the salt
    wrong = independent(TOKENS, 16, ReuseScope(3, None), "v1_block_key")
    right = independent(TOKENS, 16, SALTED, "v1_block_key")
    cause = explain_chain("v1_block_key", TOKENS, 16, SALTED, wrong, right)
    assert cause.startswith("the hashes are this library's v1_block_key")
    assert "they look like: the salt is not mixed in" in cause


def test_a_case_without_golden_hashes_must_be_recorded_first() -> None:
    corpus = Golden(16, ["v1_block_key"], [Case("c", TOKENS, 16, SALTED)])
    with pytest.raises(GoldenError, match="record them first"):
        compare(corpus, independent)
    recorded = record(corpus, independent)
    assert recorded.cases[0].hashes["v1_block_key"] == independent(
        TOKENS, 16, SALTED, "v1_block_key"
    )
    assert compare(recorded, independent) == []
    # recording another algorithm keeps the first one's hashes
    both = record(recorded, independent, ["v2_sha256"])
    assert both.algorithms == ["v1_block_key", "v2_sha256"]
    assert both.cases[0].hashes["v1_block_key"] == recorded.cases[0].hashes["v1_block_key"]
    assert compare(both, independent) == []
    # an algorithm without hashes in the corpus is not carried into the golden file
    assert record(corpus, independent, ["v2_sha256"]).algorithms == ["v2_sha256"]


# -------------------------------------------------------------------------------- captures


def _publish(
    path: Path,
    chains: Sequence[tuple[list[int], ReuseScope, list[BlockHash], int]],
    split_parent: bool = False,
) -> None:
    """Write a capture of an engine that announced each (tokens, scope, hashes, block size)
    as one Stored event; ``split_parent`` announces every chain's tail in a second event
    without a parent (a broken parent chain)."""
    events = []
    for tokens, scope, hashes, size in chains:
        blocks = [
            StoredBlock(
                h, tokens[i * size : (i + 1) * size], scope.lora_id, cache_salt_id=scope.salt
            )
            for i, h in enumerate(hashes)
        ]
        if split_parent:
            events.append(Stored(None, blocks[:1], size))
            events.append(Stored(None, blocks[1:], size))
        else:
            events.append(Stored(None, blocks, size))
    frames = [
        (0, [b"kv", i.to_bytes(8, "big"), encode_batch([KVCacheEvent(i, e)], ts=0.0)])
        for i, e in enumerate(events)
    ]
    write_capture(path, frames, ["tcp://127.0.0.1:5557"])


def _golden_file(tmp_path: Path, algo: str = "v1_block_key") -> Path:
    corpus = Golden(
        16,
        [algo],
        [
            Case("plain", list(range(64)), 16, ReuseScope()),
            Case("tenant-a", TOKENS, 16, SALTED, "tenant-a"),
        ],
    )
    path = tmp_path / "golden.json"
    write_golden(path, record(corpus, independent))
    return path


def test_an_engine_capture_that_matches_is_stable(tmp_path: Path) -> None:
    golden = load_golden(_golden_file(tmp_path))
    # the engine also announces the prompt's trailing 6-token partial block: not golden
    plain, salted = golden.cases
    assert salted.tokens == TOKENS and len(TOKENS) % 16 == 6
    chains = [
        (plain.tokens, plain.scope, plain.hashes["v1_block_key"], 16),
        (TOKENS, SALTED, [*salted.hashes["v1_block_key"], 999_999], 16),
    ]
    _publish(tmp_path / "run.jsonl", chains)
    assert compare_capture(golden, CaptureHashes(tmp_path / "run.jsonl"), "v1_block_key") == []


@pytest.mark.parametrize(
    "engine, cause",
    [
        ("salt", "the salt is not mixed in"),
        ("size", "another block size: the engine's blocks hold [32] tokens, not 16"),
        ("parent", "the parent chain is broken: block 1 was announced with parent none"),
        ("absent", "the prompt is not in the capture"),
        ("other-lora", "the prompt is not in the capture"),
    ],
)
def test_a_drifting_engine_capture_is_diagnosed(tmp_path: Path, engine: str, cause: str) -> None:
    golden = load_golden(_golden_file(tmp_path))
    case = golden.cases[1]
    hashes = case.hashes["v1_block_key"]
    scope, size = case.scope, 16
    if engine == "salt":
        hashes = chain_hashes(case.tokens, 16, ReuseScope(3, None))
    elif engine == "size":
        hashes, size = chain_hashes(case.tokens, 32, scope), 32
    elif engine == "other-lora":
        scope = ReuseScope(4, scope.salt)
    chains = [] if engine == "absent" else [(case.tokens, scope, hashes, size)]
    chains.append(
        (golden.cases[0].tokens, ReuseScope(), golden.cases[0].hashes["v1_block_key"], 16)
    )
    _publish(tmp_path / "run.jsonl", chains, split_parent=engine == "parent")
    drifts = compare_capture(golden, CaptureHashes(tmp_path / "run.jsonl"), "v1_block_key")
    if engine == "parent":  # the plain case's chain was split too
        assert {d.case.name for d in drifts} == {"plain", "tenant-a"}
    else:
        assert [d.case.name for d in drifts] == ["tenant-a"]
    assert cause in drifts[-1].cause, drifts[-1].cause


def _turn0_corpus() -> Golden:
    """The first three blocks of each tenant's first prompt in tests/data/captures (see
    scripts/make_captures.py): plain, cache salt "tenant-a", LoRA 3."""
    cases = []
    for s, (name, scope, salt) in enumerate(
        [
            ("plain", ReuseScope(), None),
            ("tenant-a", ReuseScope.for_request(cache_salt="tenant-a"), "tenant-a"),
            ("lora-3", ReuseScope(3), None),
        ]
    ):
        tokens = [1000 * (s + 1) + i for i in range(40)] + [10_000 + i for i in range(8)]
        cases.append(Case(name, tokens, 16, scope, salt))
    return record(Golden(16, ["v1_block_key"], cases), independent)


def test_this_projects_recorded_worker_captures(tmp_path: Path) -> None:
    golden = _turn0_corpus()
    path = tmp_path / "golden.json"
    write_golden(path, golden)
    assert compare_capture(golden, CaptureHashes(CAPTURES / "clean.jsonl"), "v1_block_key") == []
    code, text = run("--check", str(path), "--capture", str(CAPTURES / "clean.jsonl"))
    assert (code, text.split(":")[0]) == (0, "stable")
    code, text = run("--check", str(path), "--capture", str(CAPTURES / "salt_not_mixed.jsonl"))
    assert code == 1
    assert "1 of 3 checks differ" in text
    assert "case 'tenant-a' [v1_block_key, 16 tokens per block" in text
    assert "likely cause: the salt is not mixed in" in text
    # block_size 32 announced over 16-token blocks: those stores do not decode, and the
    # report says so instead of only "not in the capture"
    wrong = CaptureHashes(CAPTURES / "wrong_block_size.jsonl")
    causes = {d.cause for d in compare_capture(golden, wrong, "v1_block_key")}
    assert (
        len(causes) == 1 and "message(s) or event(s) of the capture did not decode" in causes.pop()
    )


def test_any_engine_recorded_then_checked(tmp_path: Path) -> None:
    """A vLLM capture (its own hashes, opaque to this project): record, check, drift."""
    engine = ENGINES / "vllm-0.26.0"
    expected = json.loads((engine / "expected.json").read_text(encoding="utf-8"))
    route = next(r for r in expected["routes"] if r["blocks"] == 3)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(map(str, route["tokens"])) + "\n", encoding="utf-8")
    golden = tmp_path / "vllm.json"
    stream = str(engine / "stream.jsonl")
    argv = ["--corpus", str(corpus), "--tokens-per-block", "16", "--capture", stream]
    assert run("--record", str(golden), *argv, "--algo", "vllm-0.26.0")[0] == 0
    # the walk found the blocks the engine holds at the end (the scenario's own record)
    hashes = load_golden(golden).cases[0].hashes["vllm-0.26.0"]
    assert hashes == expected["held"]["GPU/0"]
    assert run("--check", str(golden), "--capture", stream)[0] == 0
    raw = json.loads(golden.read_text(encoding="utf-8"))
    raw["cases"][0]["hashes"]["vllm-0.26.0"][1] += 1
    golden.write_text(json.dumps(raw), encoding="utf-8")
    code, text = run("--check", str(golden), "--capture", stream)
    assert code == 1
    assert "first diverging block: 1 (tokens [16:32])" in text
    assert "vllm-0.26.0 is not one of this project's algorithms" in text


# ------------------------------------------------------------------------------------ CLI


def test_cli_check_and_record_exit_codes(tmp_path: Path) -> None:
    assert run("--check", "shipped:v1_block_key")[0] == 0
    assert run("--check", "shipped:v2_sha256", "--hasher", "worker")[0] == 0
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("0 1 2 3 4 5 6 7\n\n1,2,3,4\n", encoding="utf-8")
    golden = tmp_path / "g.json"
    code, text = run(
        "--record", str(golden), "--corpus", str(corpus), "--tokens-per-block", "4",
        "--lora-id", "7", "--salt-id", "11", "--algo", "v1_block_key", "--algo", "v2_sha256",
    )  # fmt: skip
    assert code == 0 and "recorded 2 case(s)" in text
    cases = load_golden(golden).cases
    assert [c.name for c in cases] == ["line-1", "line-3"]
    # WIRE.md 3: the chain of tokens 0..7 under ReuseScope(7, 11)
    assert cases[0].hashes["v1_block_key"] == [11481563305523318472, 9304211693877664517]
    assert run("--check", str(golden))[0] == 0
    assert run("--check", str(golden), "--algo", "v2_sha256", "--hasher", "worker")[0] == 0
    raw = json.loads(golden.read_text(encoding="utf-8"))
    raw["cases"][0]["salt_id"] = None  # the corpus changed under the recorded hashes
    golden.write_text(json.dumps(raw), encoding="utf-8")
    code, text = run("--check", str(golden))
    assert code == 1 and "2 of 4 checks differ" in text


def test_cli_usage_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    golden = tmp_path / "g.json"
    write_golden(
        golden,
        record(
            Golden(4, ["v1_block_key", "v2_sha256"], [Case("a", [1, 2, 3, 4], 4, ReuseScope())]),
            independent,
        ),
    )
    not_golden = tmp_path / "x.json"
    not_golden.write_text('{"format": "something"}', encoding="utf-8")
    bad_tokens = tmp_path / "bad.txt"
    bad_tokens.write_text("1 2 -3 4\n", encoding="utf-8")
    engine = tmp_path / "engine.json"
    raw = json.loads(golden.read_text(encoding="utf-8"))
    raw["algorithms"] = ["engine-x"]
    raw["cases"][0]["hashes"] = {"engine-x": [1]}
    engine.write_text(json.dumps(raw), encoding="utf-8")
    zero = tmp_path / "zero.json"
    zero.write_text(json.dumps({**raw, "tokens_per_block": 0}), encoding="utf-8")
    cases: list[tuple[list[str], str]] = [
        (["--check", str(zero)], "tokens_per_block must be given"),
        (["--check", str(tmp_path / "missing.json")], "cannot read"),
        (["--check", str(not_golden)], "not a golden file"),
        (["--check", "shipped:md5"], "no shipped vectors"),
        (["--check", str(engine)], "not one of this project's algorithms"),
        (["--check", str(golden), "--capture", str(CAPTURES / "clean.jsonl")], "--algo"),
        (["--check", str(golden), "--capture", str(not_golden)], "not a kv-events capture"),
        (["--record", str(tmp_path / "o.json")], "needs a --corpus"),
        (["--record", str(tmp_path / "o.json"), "--corpus", str(bad_tokens)], "--tokens-per-block"),
        (["--record", str(tmp_path / "o.json"), "--corpus", str(bad_tokens),
          "--tokens-per-block", "2"], "[0, 2**31)"),
        (["--record", str(tmp_path / "no" / "o.json"), "--corpus", str(golden)], "cannot write"),
        (["--tokens", "1,2,3"], "--tokens-per-block is required"),
    ]  # fmt: skip
    for argv, message in cases:
        assert run(*argv)[0] == 2, argv
        assert message in capsys.readouterr().err, argv
    assert run("--check", str(golden), "--tokens", "1")[0] == 2  # argparse: not both


# ------------------------------------------------------------------- guarded recording


def test_record_refuses_drifted_hashes_under_a_known_name_unless_forced(tmp_path: Path) -> None:
    """`kv-events hash --record --algo v1_block_key` from an engine whose salt is not mixed in:
    refused with the diff (exit 1, nothing written); recorded under the engine's own name, or
    forced, with the provenance saying so."""
    salted = Case("tenant-a", TOKENS, 16, SALTED, "tenant-a")
    drifted = chain_hashes(TOKENS, 16, ReuseScope(3, None))  # the salt not mixed in
    _publish(tmp_path / "run.jsonl", [(TOKENS, SALTED, drifted, 16)])
    corpus = tmp_path / "corpus.json"
    write_golden(corpus, Golden(16, ["v1_block_key"], [salted]))
    out = tmp_path / "golden.json"
    argv = ["--record", str(out), "--corpus", str(corpus), "--capture", str(tmp_path / "run.jsonl")]
    code, text = run(*argv, "--algo", "v1_block_key")
    assert code == 1 and not out.exists(), text
    assert "refusing to record 1 case(s) under v1_block_key" in text
    want = independent(TOKENS, 16, SALTED, "v1_block_key")  # WIRE.md's value: the library side
    assert f"library: {want[0]}\n    actual: {drifted[0]}" in text
    assert "likely cause: the salt is not mixed in" in text
    # the engine's own name: its hashes are what that name means
    assert run(*argv, "--algo", "my-engine-v1")[0] == 0
    provenance = json.loads(out.read_text(encoding="utf-8"))["provenance"]
    assert provenance["algorithms"] == ["my-engine-v1"] and "forced" not in provenance
    assert provenance["command"].startswith("kv-events hash --record ")
    assert "--algo my-engine-v1" in provenance["command"]
    # forced: written, and the file says it was
    code, text = run(*argv, "--algo", "v1_block_key", "--force")
    assert code == 0, text
    raw = json.loads(out.read_text(encoding="utf-8"))
    assert raw["cases"][0]["hashes"]["v1_block_key"] == drifted
    assert raw["provenance"]["forced"] == ["v1_block_key"]
    assert raw["provenance"]["command"].endswith("--force")


def test_a_request_hasher_gets_the_raw_cache_salt(tmp_path: Path) -> None:
    """The engine's own salt derivation is exercised: one deriving by blake3 is named."""
    import blake3

    from events.tools.hashcheck import Request

    seen: list[Request] = []

    def engine(tokens: list[int], tpb: int, request: Request, algo: str) -> list[BlockHash]:
        seen.append(request)
        salt = request.cache_salt
        salt_id = (
            None
            if salt is None
            else int.from_bytes(blake3.blake3(salt.encode()).digest(8), "little")
        )
        return chain_hashes(tokens, tpb, ReuseScope(request.lora_id, salt_id), algo)

    golden = record(
        Golden(16, ["v1_block_key"], [Case("t", TOKENS, 16, SALTED, "tenant-a")]), independent
    )
    (drift,) = compare(golden, request_hasher=engine)
    assert seen == [Request(3, "tenant-a", 16248643848220682112)]
    assert (
        "derives the salt id of cache_salt 'tenant-a' from the first 8 bytes of blake3"
        in drift.cause
    )
    assert "(15947361407820284973)" in drift.cause  # WIRE.md 1's blake3 value
    with pytest.raises(GoldenError, match="refusing to record 1 case"):
        record(golden, request_hasher=engine)


# ------------------------------------------------------------------------- the docs


def test_the_docs_paths_are_in_the_installed_package() -> None:
    """Every package path docs/HASH_STABILITY.md names exists where the installed package
    has it (package data, not the source tree's tests/), and its golden example is WIRE.md's."""
    from importlib import resources

    text = (ROOT / "docs" / "HASH_STABILITY.md").read_text(encoding="utf-8")
    paths = set(re.findall(r"`(events/[\w/.]+)`", text))
    assert {"events/tools/golden/", "events/tools/golden/README.md"} <= paths
    assert "tests/data" not in text
    for path in paths:
        parts = path.rstrip("/").split("/")
        node = resources.files(parts[0]).joinpath(*parts[1:])
        assert node.is_dir() if path.endswith("/") else node.is_file(), path
    for name in re.findall(r"`(\w+\.json)`", text):
        assert (resources.files("events.tools") / "golden" / name).is_file(), name
    assert shipped_path("v1_block_key").parent == Path(
        str(resources.files("events.tools") / "golden")
    )
    example = json.loads(re.search(r"```json\n(.*?)```", text, re.S).group(1))  # type: ignore[union-attr]
    (case,) = parse_golden(example).cases
    assert case.hashes["v1_block_key"] == independent(
        case.tokens, case.tokens_per_block, case.scope, "v1_block_key"
    )

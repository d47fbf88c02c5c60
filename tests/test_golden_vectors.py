"""The golden vectors shipped in events/tools/golden/: they hold WIRE.md's published values, the
independent generator reproduces them, this library and this project's worker pass them, and
they never change (their digests are pinned)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
from pathlib import Path
from types import ModuleType

import pytest

from events.tools.diagnosis import KNOWN_ALGOS
from events.tools.hashcheck import (
    WORKER_ALGOS,
    compare,
    library_hasher,
    load_golden,
    shipped_path,
    worker_hasher,
)

ROOT = Path(__file__).resolve().parent.parent
WIRE = (ROOT / "docs" / "WIRE.md").read_text(encoding="utf-8")

# sha256 of json.dumps([[case name, hashes] for each case]) per shipped file, taken when the
# files were first shipped: a change here breaks the compatibility promise
PINNED = {
    "v1_block_key": "2749f4852ca85bc1627adf388ce4cd12c7793468b3e61edab38f48ca91cd8419",
    "v2_sha256": "1bcea730871c903513a4bac24c8fb35691654d573beb69fed57c95017a67ba88",
    "v2_sha256_64": "58b25ddf2577731bd75eb5c2fc298c0aa660c5e5150362a35331723786850216",
    "xxh3_content": "4247384a6603f66214bed21efd642f2004553e2fe0a4fcc18722e674ef757a04",
}


def _cases(algo: str) -> dict[str, list[int | str]]:
    golden = load_golden(shipped_path(algo))
    return {c.name: c.hashes[algo] for c in golden.cases}


def _wire_v1_rows() -> list[tuple[list[int], int, int | None, int | None, int]]:
    """The single-block rows of WIRE.md 3's table: tokens, parent, lora, salt, hash."""
    rows = []
    pattern = r"^\| \[([\d,]+)\], (\d+), (-|\d+), (-|\d+) \| (\d+) \|$"
    for m in re.finditer(pattern, WIRE, flags=re.M):
        tokens = [int(t) for t in m.group(1).split(",")]
        lora = None if m.group(3) == "-" else int(m.group(3))
        salt = None if m.group(4) == "-" else int(m.group(4))
        rows.append((tokens, int(m.group(2)), lora, salt, int(m.group(5))))
    return rows


def _wire_chain(scope_text: str) -> list[int]:
    m = re.search(
        r"^\| chain of tokens 0\.\.7, tokens_per_block 4, `" + re.escape(scope_text)
        + r"` \| \[(\d+), (\d+)\] \|$",
        WIRE,
        flags=re.M,
    )  # fmt: skip
    assert m is not None, scope_text
    return [int(m.group(1)), int(m.group(2))]


def _wire_key(what: str) -> str:
    m = re.search(r"^\| " + re.escape(what) + r" \| `([0-9a-f]{64})` \|$", WIRE, flags=re.M)
    assert m is not None, what
    return m.group(1)


def test_every_algorithm_has_a_shipped_file_in_the_golden_format() -> None:
    for algo in KNOWN_ALGOS:
        raw = json.loads(shipped_path(algo).read_text(encoding="utf-8"))
        assert (raw["format"], raw["version"], raw["algorithms"]) == (
            "kv-events-golden",
            1,
            [algo],
        )
        golden = load_golden(shipped_path(algo))
        assert len(golden.cases) == 10
        assert all(c.hashes[algo] for c in golden.cases)


def test_v1_vectors_are_wire_md_section_3() -> None:
    rows = _wire_v1_rows()
    assert len(rows) == 5  # the table as published
    cases = _cases("v1_block_key")
    firsts = {(lora, salt): h for tokens, parent, lora, salt, h in rows if parent == 0}
    assert cases["wire-1..4"] == [firsts[(None, None)]]
    assert cases["wire-1..4-salt123"] == [firsts[(None, 123)]]
    assert cases["wire-1..4-lora123"] == [firsts[(123, None)]]
    assert cases["wire-0..7"] == _wire_chain("ReuseScope()")
    assert cases["wire-0..7-lora7-salt11"] == _wire_chain("ReuseScope(7, 11)")


def test_v2_vectors_are_wire_md_section_2_keys() -> None:
    keys = [_wire_key("block [0,1,2,3] under `ReuseScope()`"), _wire_key("next block [4,5,6,7]")]
    scoped = _wire_key("block [0,1,2,3] under `ReuseScope(7, 11)`")
    hexes = _cases("v2_sha256")
    assert hexes["wire-0..7"] == keys
    assert hexes["wire-0..7-lora7-salt11"][0] == scoped
    ints = _cases("v2_sha256_64")
    # WIRE.md 3: int.from_bytes(key[:8], "big"), i.e. the first 16 hex digits
    assert ints["wire-0..7"] == [int(k[:16], 16) for k in keys]
    assert ints["wire-0..7-lora7-salt11"][0] == int(scoped[:16], 16)
    assert [int(h[:16], 16) for h in hexes["tenant-a-lora3-16"]] == ints["tenant-a-lora3-16"]


def test_xxh3_vector_is_wire_md_section_3() -> None:
    m = re.search(r"\[1,2,3,4\] -> (\d+)\.", WIRE)
    assert m is not None
    assert _cases("xxh3_content")["wire-1..4"] == [int(m.group(1))]


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "make_golden_vectors", ROOT / "scripts" / "make_golden_vectors.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_independent_generator_reproduces_wire_md_and_the_shipped_files(
    tmp_path: Path,
) -> None:
    source = (ROOT / "scripts" / "make_golden_vectors.py").read_text(encoding="utf-8")
    assert not re.search(r"^(from|import) (events|kvcache|router_sim)", source, flags=re.M)
    gen = _generator()
    gen.check_against_wire()
    gen.write(tmp_path)
    for algo in KNOWN_ALGOS:
        assert (tmp_path / f"{algo}.json").read_bytes() == shipped_path(algo).read_bytes()


@pytest.mark.parametrize("algo", KNOWN_ALGOS)
def test_this_library_passes_the_shipped_vectors(algo: str) -> None:
    assert compare(load_golden(shipped_path(algo)), library_hasher) == []


@pytest.mark.parametrize("algo", WORKER_ALGOS)
def test_this_projects_worker_passes_the_shipped_vectors(algo: str) -> None:
    assert compare(load_golden(shipped_path(algo)), worker_hasher) == []


@pytest.mark.parametrize("algo", KNOWN_ALGOS)
def test_shipped_vectors_never_change(algo: str) -> None:
    golden = load_golden(shipped_path(algo))
    body = json.dumps([[c.name, c.hashes[algo]] for c in golden.cases])
    assert hashlib.sha256(body.encode()).hexdigest() == PINNED[algo]

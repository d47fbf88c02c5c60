"""The kv_golden pytest plugin, run inside pytest's own ``pytester``: a stable corpus passes,
each injected drift fails with the first diverging block and its cause, ``--kv-golden-update``
rewrites the golden file, and engine captures are checked the same way."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

import events.tools.pytest_plugin
from events.tools.hashcheck import load_golden, shipped_path

pytest_plugins = ["pytester"]
_AUTOLOAD_OFF = "PYTEST_DISABLE_PLUGIN_AUTOLOAD" in os.environ  # this session's, not inner runs'
pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parent.parent
CAPTURES = ROOT / "tests" / "data" / "captures"


def _args() -> list[str]:
    """Inner runs load only this plugin, by name (entry-point autoloading is off for them, see
    below: the other installed plugins would only slow each run down)."""
    return ["-p", "events.tools.pytest_plugin"]


@pytest.fixture(autouse=True)
def _no_autoload(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")


def _failures(pytester: pytest.Pytester, *args: str) -> tuple[dict[str, str], int]:
    """Run the pytester folder in-process: {test name: failure text}, number passed."""
    recorder = pytester.inline_run(*_args(), *args)
    reports = recorder.getreports("pytest_runtest_logreport")
    failed = {r.nodeid.split("::")[-1]: r.longreprtext for r in reports if r.failed}
    passed = sum(1 for r in reports if r.passed and r.when == "call")
    return failed, passed


def _shipped_copy(pytester: pytest.Pytester, algo: str, name: str = "kv_golden.json") -> Path:
    path = pytester.path / name
    path.write_bytes(shipped_path(algo).read_bytes())
    return path


def test_the_installed_package_registers_the_plugin(pytestconfig: pytest.Config) -> None:
    """This session loaded it through the ``pytest11`` entry point, with no ``-p`` or
    ``pytest_plugins`` anywhere (reinstall the package if this fails on an old install)."""
    if _AUTOLOAD_OFF:
        pytest.skip("this session was started with entry-point autoloading off")
    assert pytestconfig.pluginmanager.is_registered(events.tools.pytest_plugin)
    assert pytestconfig.pluginmanager.get_plugin("kv_golden") is events.tools.pytest_plugin


def test_the_plugin_is_declared_as_a_pytest11_entry_point() -> None:
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    section = re.search(r"^\[project\.entry-points\.pytest11\]\n((?:[^\[\n].*\n)*)", text, re.M)
    assert section is not None
    assert section.group(1).split() == ["kv_golden", "=", '"events.tools.pytest_plugin"']
    data = re.search(r'^"events.tools" = \[(.*)\]$', text, re.M)
    assert data is not None and '"golden/*.json"' in data.group(1)
    assert '"golden/README.md"' in data.group(1)


def test_without_the_fixture_the_plugin_does_nothing(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_plain():\n    assert True\n")
    result = pytester.runpytest_inprocess(*_args(), "--strict-markers")
    result.assert_outcomes(passed=1)
    assert "kv-golden" not in result.stdout.str()
    # the marker is registered, so --strict-markers accepts it
    pytester.makepyfile(
        "import pytest\n@pytest.mark.kv_golden('x.json')\ndef test_marked():\n    pass\n"
    )
    pytester.runpytest_inprocess(*_args(), "--strict-markers").assert_outcomes(passed=1)


def test_a_stable_corpus_passes_for_the_library_and_this_projects_worker(
    pytester: pytest.Pytester,
) -> None:
    _shipped_copy(pytester, "v1_block_key")
    pytester.makepyfile(
        """
        import pytest
        from events.tools.hashcheck import worker_hasher

        pytestmark = pytest.mark.kv_golden("kv_golden.json")

        def test_library(kv_golden):
            kv_golden.check()

        def test_worker(kv_golden):
            kv_golden.check(hasher=worker_hasher)

        def test_shipped_v2(kv_golden):
            kv_golden.check("shipped:v2_sha256", hasher=worker_hasher)
        """
    )
    failed, passed = _failures(pytester)
    assert (failed, passed) == ({}, 3)


DRIFTING_TESTS = """
import pytest
from kvcache.hashing import chain_hashes
from kvcache.scope import ReuseScope

pytestmark = pytest.mark.kv_golden("kv_golden.json")

def chunks(tokens, n):
    return [tokens[i : i + n] for i in range(0, len(tokens) - len(tokens) % n, n)]

def test_salt_dropped(kv_golden):
    kv_golden.check(hasher=lambda t, n, s, a: chain_hashes(t, n, ReuseScope(s.lora_id), a))

def test_lora_dropped(kv_golden):
    kv_golden.check(hasher=lambda t, n, s, a: chain_hashes(t, n, ReuseScope(None, s.salt), a))

def test_block_size_doubled(kv_golden):
    kv_golden.check(hasher=lambda t, n, s, a: chain_hashes(t, 2 * n, s, a))

def test_other_algorithm(kv_golden):
    kv_golden.check(hasher=lambda t, n, s, a: chain_hashes(t, n, s, "v2_sha256_64"))

def test_parent_not_chained(kv_golden):
    kv_golden.check(hasher=lambda t, n, s, a: [chain_hashes(c, n, s, a)[0] for c in chunks(t, n)])
"""

CAUSES = {
    "test_salt_dropped": "likely cause: the salt is not mixed in",
    "test_lora_dropped": "likely cause: the LoRA id is not mixed in",
    "test_block_size_doubled": "likely cause: another block size: the hashes are of 8-token "
    "blocks, not 4",
    "test_other_algorithm": "likely cause: another algorithm: the hashes are v2_sha256_64, not "
    "v1_block_key",
    "test_parent_not_chained": "likely cause: the parent chain is broken",
}


def test_each_injected_drift_fails_with_its_cause(pytester: pytest.Pytester) -> None:
    golden = _shipped_copy(pytester, "v1_block_key")
    before = golden.read_bytes()
    pytester.makepyfile(DRIFTING_TESTS)
    failed, passed = _failures(pytester)
    assert passed == 0 and set(failed) == set(CAUSES)
    wire_scoped = next(c for c in load_golden(golden).cases if c.name == "wire-0..7-lora7-salt11")
    for name, cause in CAUSES.items():
        text = failed[name]
        assert "KV event hash drift against" in text, name
        assert cause in text, (name, text)
        assert "first diverging block:" in text and "golden:" in text and "actual:" in text
        assert "unexplained" not in text.split("likely cause: ")[1].split("\n")[0], name
    # the salted WIRE.md case, whose first block differs once the salt is dropped
    salt = failed["test_salt_dropped"]
    assert "case 'wire-0..7-lora7-salt11' [v1_block_key, 4 tokens per block, lora_id=7" in salt
    assert f"golden: {wire_scoped.hashes['v1_block_key'][0]}" in salt
    assert golden.read_bytes() == before  # a check never writes


def test_update_mode_rewrites_the_golden_file(pytester: pytest.Pytester) -> None:
    # a corpus (the shipped cases without hashes) is recorded by --kv-golden-update
    shipped = json.loads(shipped_path("v2_sha256_64").read_text(encoding="utf-8"))
    corpus = {k: v for k, v in shipped.items() if k in ("format", "version", "algorithms")}
    corpus["tokens_per_block"] = 4
    corpus["cases"] = [{k: v for k, v in c.items() if k != "hashes"} for c in shipped["cases"]]
    golden = pytester.path / "kv_golden.json"
    golden.write_text(json.dumps(corpus), encoding="utf-8")
    pytester.makepyfile(
        """
        import pytest
        from events.tools.hashcheck import worker_hasher
        from events.hashing import chain_hashes

        @pytest.mark.kv_golden("kv_golden.json")
        def test_worker(kv_golden):
            kv_golden.check(hasher=worker_hasher)

        @pytest.mark.kv_golden("kv_golden.json")
        def test_drifted(kv_golden):
            kv_golden.check(hasher=lambda t, n, s, a: chain_hashes(t, 2 * n, s, a))
        """
    )
    failed, _ = _failures(pytester, "-k", "test_worker")
    assert "has no v2_sha256_64 hashes: record them first" in failed["test_worker"]
    result = pytester.runpytest_inprocess(*_args(), "-k", "test_worker", "--kv-golden-update")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*kv-golden: rewrote golden hash files*", "*kv_golden.json"])
    recorded = {c.name: c.hashes for c in load_golden(golden).cases}
    assert recorded == {c["name"]: c["hashes"] for c in shipped["cases"]}  # the WIRE values
    failed, passed = _failures(pytester)
    assert passed == 1 and "another block size" in failed["test_drifted"]
    provenance = json.loads(golden.read_text(encoding="utf-8"))["provenance"]
    assert provenance["command"].endswith(
        "--kv-golden-update test_update_mode_rewrites_the_golden_file.py::test_worker"
    )
    assert provenance["recorded"] == ["v2_sha256_64"] and "forced" not in provenance
    assert provenance["library"].startswith("scoped-kv-router ")
    # drifted hashes under this project's algorithm name: refused with the diff, file kept
    before = golden.read_bytes()
    result = pytester.runpytest_inprocess(*_args(), "-k", "test_drifted", "--kv-golden-update")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*refusing to record 10 case(s) under v2_sha256_64*",
            "*library: *",
            "*actual: *",
            "*likely cause: another block size: the hashes are of 8-token blocks, not 4*",
        ]
    )
    assert golden.read_bytes() == before
    # a deliberate change, forced: the drifting hasher's hashes replace the old ones
    result = pytester.runpytest_inprocess(
        *_args(), "-k", "test_drifted", "--kv-golden-update", "--kv-golden-force"
    )
    result.assert_outcomes(passed=1)
    failed, passed = _failures(pytester)
    assert passed == 1 and "another block size" in failed["test_worker"]
    assert {c.name: c.hashes for c in load_golden(golden).cases} != recorded
    provenance = json.loads(golden.read_text(encoding="utf-8"))["provenance"]
    assert provenance["forced"] == ["v2_sha256_64"] and "--kv-golden-force" in provenance["command"]


def test_update_mode_never_rewrites_the_shipped_vectors(pytester: pytest.Pytester) -> None:
    before = shipped_path("v1_block_key").read_bytes()
    pytester.makepyfile(
        "def test_shipped(kv_golden):\n    kv_golden.check('shipped:v1_block_key')\n"
    )
    failed, _ = _failures(pytester, "--kv-golden-update")
    assert "the shipped vectors are never rewritten" in failed["test_shipped"]
    assert shipped_path("v1_block_key").read_bytes() == before


def test_a_golden_file_must_be_named_and_readable(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        def test_unnamed(kv_golden):
            kv_golden.check()

        def test_missing(kv_golden):
            kv_golden.check("nowhere.json")
        """
    )
    failed, _ = _failures(pytester)
    assert "name the golden file" in failed["test_unnamed"]
    assert re.search(r"cannot read .*nowhere\.json", failed["test_missing"])


def test_engine_captures_against_a_golden_file(pytester: pytest.Pytester) -> None:
    """This project's worker recorded as an engine (tests/data/captures): the first three
    blocks of each tenant's first prompt, golden values from WIRE.md's V1 definition."""
    from test_hash_check import _turn0_corpus

    from events.tools.hashcheck import write_golden

    write_golden(pytester.path / "kv_golden.json", _turn0_corpus())
    pytester.makepyfile(
        f"""
        import pytest

        pytestmark = pytest.mark.kv_golden("kv_golden.json")

        def test_clean(kv_golden):
            kv_golden.check_capture({str(CAPTURES / "clean.jsonl")!r})

        def test_salt_not_mixed(kv_golden):
            kv_golden.check_capture({str(CAPTURES / "salt_not_mixed.jsonl")!r})
        """
    )
    failed, passed = _failures(pytester)
    assert passed == 1 and set(failed) == {"test_salt_not_mixed"}
    text = failed["test_salt_not_mixed"]
    assert "1 of 3 checks differ" in text
    assert "case 'tenant-a'" in text and "likely cause: the salt is not mixed in" in text

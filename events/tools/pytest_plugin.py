"""pytest plugin: fail a test run when a worker's KV event hashes drift from a golden file.

Installed with the package and registered through the ``pytest11`` entry point, it does
nothing until a test asks for its fixture: it adds the ``--kv-golden-update`` option, the
``kv_golden(path)`` marker and the ``kv_golden`` fixture::

    @pytest.mark.kv_golden("kv_golden.json")          # relative to the test file
    def test_hashes_are_stable(kv_golden):
        kv_golden.check(hasher=my_engine_hashes)       # or kv_golden.check_capture("run.jsonl")

``check`` hashes the golden file's corpus with ``hasher(tokens, tokens_per_block, scope,
algo)`` (default: this library; :func:`events.tools.hashcheck.worker_hasher` runs this project's
worker) or with ``request_hasher(tokens, tokens_per_block, request, algo)``, which gets the
request's raw ``cache_salt`` string (:class:`events.tools.hashcheck.Request`) so the engine's own
salt derivation is tested too; ``check_capture`` takes the hashes an engine published in a
capture. A drift fails the test with the first diverging block and its likely cause.

``pytest --kv-golden-update`` records the hashes into the golden file instead (the corpus is
kept, the hashes are replaced, the file's ``provenance`` says by which command and library
version). Hashes filed under one of this project's algorithm names that differ from this
library's own computation are refused with the diff (the test fails, the file is untouched)
unless ``--kv-golden-force`` is given too; the shipped vectors are never rewritten.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from events.tools.capture_hashes import CaptureHashes, compare_capture
from events.tools.hashcheck import (
    Golden,
    GoldenError,
    Hasher,
    RequestHasher,
    compare,
    library_hasher,
    load_golden,
    record,
    render_report,
    resolve,
    shipped_path,
    write_golden,
)

_UPDATED = pytest.StashKey[list[str]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kv-golden", "KV event hash stability (scoped-kv-router)")
    group.addoption(
        "--kv-golden-update",
        action="store_true",
        default=False,
        help="rewrite the golden files the kv_golden fixture checks, instead of comparing",
    )
    group.addoption(
        "--kv-golden-force",
        action="store_true",
        default=False,
        help="with --kv-golden-update: record hashes under this project's algorithm names even "
        "where they differ from the library's own computation",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "kv_golden(path): the golden hash file the kv_golden fixture checks"
    )
    config.stash[_UPDATED] = []


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    updated = terminalreporter.config.stash.get(_UPDATED, [])
    if updated:
        terminalreporter.write_sep("-", "kv-golden: rewrote golden hash files")
        for path in updated:
            terminalreporter.write_line(f"  {path}")


class KVGolden:
    """What the ``kv_golden`` fixture gives a test: checks against golden hash files."""

    def __init__(
        self, config: pytest.Config, base: Path, default: str | None, nodeid: str = ""
    ) -> None:
        self.update: bool = bool(config.getoption("kv_golden_update"))
        self.force: bool = bool(config.getoption("kv_golden_force"))
        self._nodeid = nodeid
        self._config = config
        self._base = base
        self._default = default

    def path(self, golden: str | Path | None = None) -> Path:
        """The golden file: ``golden``, else the ``kv_golden`` marker's; a relative path is
        taken from the test file's folder; ``shipped:ALGO`` names the package's vectors."""
        spec = golden if golden is not None else self._default
        if spec is None:
            raise pytest.UsageError(
                "kv_golden: name the golden file (kv_golden.check(golden=...) or "
                '@pytest.mark.kv_golden("file.json"))'
            )
        path = resolve(spec)
        return path if path.is_absolute() else self._base / path

    def _load(self, path: Path) -> Golden:
        try:
            return load_golden(path)
        except GoldenError as exc:
            pytest.fail(f"kv_golden: {exc}", pytrace=False)

    def _rewrite(self, path: Path, golden: Golden) -> None:
        if path.resolve().is_relative_to(shipped_path("v1_block_key").parent.resolve()):
            pytest.fail("kv_golden: the shipped vectors are never rewritten", pytrace=False)
        command = "pytest --kv-golden-update" + (" --kv-golden-force" if self.force else "")
        write_golden(path, golden, f"{command} {self._nodeid}".rstrip())
        self._config.stash[_UPDATED].append(str(path))

    def check(
        self,
        golden: str | Path | None = None,
        hasher: Hasher = library_hasher,
        algorithms: list[str] | None = None,
        request_hasher: RequestHasher | None = None,
    ) -> None:
        """Hash the golden file's corpus with ``hasher`` (or ``request_hasher``, handed each
        case's raw ``cache_salt``) and fail on any difference (or, with
        ``--kv-golden-update``, write the new hashes into the file)."""
        path = self.path(golden)
        corpus = self._load(path)
        try:
            if self.update:
                recorded = record(
                    corpus, hasher, algorithms, request_hasher=request_hasher, force=self.force
                )
                self._rewrite(path, recorded)
                return
            drifts = compare(corpus, hasher, algorithms, request_hasher=request_hasher)
        except GoldenError as exc:
            pytest.fail(f"kv_golden: {path}: {exc}", pytrace=False)
        if drifts:
            pytest.fail(render_report(str(path), corpus, drifts, algorithms), pytrace=False)

    def check_capture(
        self, capture: str | Path, golden: str | Path | None = None, algo: str | None = None
    ) -> None:
        """Compare the hashes an engine published for the corpus's prompts in ``capture`` (a
        ``kv-events listen --record`` file) with the golden ``algo`` hashes (default: the
        file's one algorithm); ``--kv-golden-update`` records them instead."""
        path = self.path(golden)
        corpus = self._load(path)
        capture_path = Path(capture)
        if not capture_path.is_absolute():
            capture_path = self._base / capture_path
        algos = [algo] if algo is not None else corpus.algorithms
        if len(algos) != 1:
            pytest.fail(f"kv_golden: {path} has {algos}: pass algo=", pytrace=False)
        try:
            published = CaptureHashes(capture_path)
            if self.update:
                self._rewrite(path, record(corpus, published.hasher, algos, force=self.force))
                return
            drifts = compare_capture(corpus, published, algos[0])
        except GoldenError as exc:
            pytest.fail(f"kv_golden: {exc}", pytrace=False)
        if drifts:
            pytest.fail(
                render_report(f"{path} (from {capture_path})", corpus, drifts, algos),
                pytrace=False,
            )


@pytest.fixture
def kv_golden(request: pytest.FixtureRequest) -> KVGolden:
    """Checks a worker's or an engine's block hashes against golden files (see the module)."""
    marker = request.node.get_closest_marker("kv_golden")
    default = str(marker.args[0]) if marker is not None and marker.args else None
    return KVGolden(request.config, request.path.parent, default, request.node.nodeid)

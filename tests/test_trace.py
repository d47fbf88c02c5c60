"""Mooncake-format trace loading: gzip, speed-up, limits, errors, the bundled copy."""

from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from events.tools.cli_args import ArgError, loads_json
from router_sim.sim.trace import TraceError, TraceRow, _row, iter_trace, load_trace, resolve_trace

ROWS = [
    {"timestamp": 1000, "input_length": 600, "output_length": 10, "hash_ids": [0, 1]},
    {"timestamp": 1000, "input_length": 1024, "output_length": 0, "hash_ids": [0, 2]},
    {"timestamp": 500, "input_length": 100, "output_length": 5, "hash_ids": [3]},
]
SHARED = [
    Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "mooncake",
    Path("/work/shared/data/mooncake"),
]
BUNDLED_SHA256 = "b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df"


def _write(path: Path, rows: list[dict[str, object]]) -> Path:
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if path.suffix == ".gz":
        with gzip.open(path, "wt", encoding="utf-8") as fh:
            fh.write(text)
    else:
        path.write_text(text + "\n", encoding="utf-8")  # a trailing blank line is skipped
    return path


@pytest.mark.parametrize("name", ["t.jsonl", "t.jsonl.gz"])
def test_rows_become_requests_in_arrival_order(tmp_path: Path, name: str) -> None:
    reqs = load_trace(_write(tmp_path / name, ROWS))
    assert [r.arrival_ms for r in reqs] == [0.0, 500.0, 500.0]  # relative to the first row
    assert [r.input_length for r in reqs] == [100, 600, 1024]
    assert [r.request_id for r in reqs] == [0, 1, 2]
    assert reqs[2].output_length == 1  # output_length 0 still yields the first token
    assert reqs[1].tokens()[:512] == reqs[2].tokens()[:512]  # shared hash id 0
    assert len(reqs[1].tokens()) == 600


def test_speedup_and_request_limit(tmp_path: Path) -> None:
    path = _write(tmp_path / "t.jsonl", ROWS)
    fast = load_trace(path, speedup=4.0)
    assert [r.arrival_ms for r in fast] == [0.0, 125.0, 125.0]
    assert len(load_trace(path, max_requests=2)) == 2
    with pytest.raises(ValueError, match="speedup"):
        load_trace(path, speedup=0)


def test_spread_evens_out_requests_that_share_a_timestamp(tmp_path: Path) -> None:
    path = _write(tmp_path / "t.jsonl", ROWS)
    reqs = load_trace(path, spread_ms=300.0)
    # rows 1 and 2 share timestamp 1000 (500 after the earliest): 0 and 150 ms into the bucket
    assert [(r.arrival_ms, r.input_length) for r in reqs] == [
        (0.0, 100),
        (500.0, 600),
        (650.0, 1024),
    ]
    fast = load_trace(path, spread_ms=300.0, speedup=2.0)
    assert [r.arrival_ms for r in fast] == [0.0, 250.0, 325.0]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "not JSON"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1}', "missing field 'hash_ids'"),
        (
            '{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}',
            "cannot cover",
        ),
        ('{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}', "input_length"),
        (
            '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [-1]}',
            "non-negative",
        ),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_malformed_lines_name_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n" + line + "\n", encoding="utf-8")
    with pytest.raises(TraceError, match=message) as err:
        load_trace(path)
    assert "bad.jsonl:2" in str(err.value)


def test_unreadable_files_are_trace_errors(tmp_path: Path) -> None:
    not_gzip = tmp_path / "a.jsonl.gz"
    not_gzip.write_bytes(b"plain text")
    truncated = tmp_path / "b.jsonl.gz"
    truncated.write_bytes(gzip.compress((json.dumps(ROWS[0]) + "\n").encode() * 50)[:-12])
    not_utf8 = tmp_path / "c.jsonl"
    not_utf8.write_bytes(b"\xff\xfe\n")
    for path in (not_gzip, truncated, not_utf8, tmp_path):
        with pytest.raises(TraceError, match=r"cannot read it as a \.jsonl or \.jsonl\.gz trace"):
            load_trace(path)


def test_missing_file_says_what_to_give(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="mooncake"):
        resolve_trace(tmp_path / "nope.jsonl")


def test_bundled_mooncake_trace_loads_by_name() -> None:
    rows = list(iter_trace("mooncake"))
    assert len(rows) == 12031
    assert all(r.hash_ids[0] == 0 for r in rows)  # the shared system prompt
    reqs = load_trace("mooncake", max_requests=10)
    assert len(reqs) == 10 and reqs[0].input_length == 6758


def test_bundled_copy_is_the_unchanged_trace() -> None:
    with gzip.open(resolve_trace("mooncake"), "rb") as fh:
        digest = hashlib.sha256(fh.read()).hexdigest()
    assert digest == BUNDLED_SHA256
    shared = next((p / "conversation_trace.jsonl" for p in SHARED if p.exists()), None)
    if shared is not None:
        assert hashlib.sha256(shared.read_bytes()).hexdigest() == BUNDLED_SHA256


# What a trace line may hold: the four fields with values of every JSON type (and numbers at
# and past each bound), present or missing, plus an unknown field.
_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**64), max_value=2**64),
    st.sampled_from([0, 1, 2**20, 2**20 + 1, 2**63 - 1, 2**63, 1e13, -1e13, 1.5e13, 600.0]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=3),
    st.lists(st.integers(min_value=-2, max_value=2**63 + 2), max_size=4),
    st.lists(st.one_of(st.booleans(), st.floats(allow_nan=False), st.text(max_size=2)), max_size=2),
)
_LINES = st.dictionaries(
    st.sampled_from(["timestamp", "input_length", "output_length", "hash_ids", "extra"]),
    _VALUES,
)


# rows of the right shape (the common case), and such rows with one field at or just past
# one of its bounds or of another JSON type
_EDGES = {
    "timestamp": [10**13, -(10**13), 10**13 + 1, -1e13 - 1, 1e14, True, "1", None],
    "input_length": [1, 2**20, 0, -1, 2**20 + 1, 1.0, True],
    "output_length": [0, 2**20, -1, 2**20 + 1, 3.0, False],
    "hash_ids": [[0], [2**63 - 1], [-1], [2**63], [True], [1.0], ["2"], [], 5],
}
_SHAPED = st.fixed_dictionaries(
    {
        "timestamp": st.one_of(st.integers(-(10**13), 10**13), st.floats(-1e13, 1e13)),
        "input_length": st.integers(1, 512),
        "output_length": st.integers(0, 2**20),
        "hash_ids": st.lists(st.integers(0, 2**63 - 1), min_size=1, max_size=3),
    }
)


@st.composite
def _near_good(draw: st.DrawFn) -> dict[str, Any]:
    row = draw(_SHAPED)
    if draw(st.booleans()):
        field = draw(st.sampled_from(sorted(_EDGES)))
        row[field] = draw(st.sampled_from(_EDGES[field]))
    return row


_LINES = st.one_of(_LINES, _near_good()).map(json.dumps)


def _general(line: str, where: str) -> TraceRow:
    """The row as the checks alone read it (json + field checks, no typed pass)."""
    try:
        return _row(loads_json(line, where), where, 512)
    except ArgError as exc:
        raise TraceError(str(exc)) from None


@settings(max_examples=400, deadline=None)
@given(line=_LINES)
def test_typed_pass_reads_exactly_what_the_checks_accept(tmp_path_factory: Any, line: str) -> None:
    """The loader's typed pass (msgspec) and the field checks accept the same lines and read
    them alike; what the checks refuse, the loader refuses with their message."""
    path = tmp_path_factory.mktemp("t") / "t.jsonl"
    path.write_text(line + "\n")
    where = f"{path}:1"
    try:
        want: TraceRow | str = _general(line, where)
    except TraceError as exc:
        want = str(exc)
    try:
        got: TraceRow | str = next(iter_trace(path))
    except TraceError as exc:
        got = str(exc)
    assert got == want
    assert not isinstance(got, TraceRow) or type(got.timestamp) is float
    event("read" if isinstance(got, TraceRow) else "refused")

"""Hostile command lines and files: exit status 2, one line on stderr, no traceback, no hang.

The corpus (``tests/data/bad_inputs/cases.json``, described in its README) runs in process
through each CLI's ``main``; a few end-to-end checks run the real executables, where argv
bytes that are not UTF-8 arrive as the interpreter decodes them.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from events.tools.cli import main as kv_events_main
from router_sim.cli import main as router_sim_main
from router_sim.sim.report import write_json
from router_sim.sim.trace import load_trace

DATA = Path(__file__).parent / "data" / "bad_inputs"
CASES: list[dict[str, Any]] = json.loads((DATA / "cases.json").read_text(encoding="utf-8"))


def _call(cli: str, args: list[str]) -> int:
    main = router_sim_main if cli == "router-sim" else kv_events_main
    try:
        return main(args)
    except SystemExit as exc:  # argparse exits with its status
        return exc.code if isinstance(exc.code, int) else -1


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", CASES, ids=[f"{c['cli']}: {c['why']}" for c in CASES])
def test_bad_input_is_one_line_and_exit_2(
    case: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for folder in case.get("mkdir", []):
        (tmp_path / folder).mkdir(parents=True)
    args = [a.replace("{data}", str(DATA)).replace("{tmp}", str(tmp_path)) for a in case["args"]]
    status = _call(case["cli"], args)
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert status == 2, captured.err
    assert len(lines) == 1, captured.err
    assert "Traceback" not in captured.err
    assert "error" in lines[0] or lines[0].startswith(("router-sim:", "kv-events"))
    assert captured.out == ""  # refused before any work: no table, no stream output


def test_corpus_covers_every_category() -> None:
    seen = {(c["cli"], c["why"].split(":")[0]) for c in CASES}
    for category in ("type", "range", "float", "fault", "choice", "json", "utf8", "file", "trace"):
        assert ("router-sim", category) in seen, category
    for category in ("endpoint", "float", "int", "utf8", "file", "range", "tokens", "choice"):
        assert ("kv-events", category) in seen, category
    commands = {c["args"][0] for c in CASES if c["cli"] == "kv-events" and c["args"]}
    assert {"listen", "doctor", "hash"} <= commands


@pytest.mark.timeout(60)
def test_hashing_two_million_one_token_blocks_is_refused_at_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """2M tokens at 1 token per block used to run past a minute (and print half a gigabyte);
    now the block count is checked before any hashing. The bound holds at the cap too."""
    path = tmp_path / "tokens.txt"
    path.write_text(" ".join(["7"] * 2_000_000))
    status = _call("kv-events", ["hash", "--tokens-file", str(path), "--tokens-per-block", "1"])
    captured = capsys.readouterr()
    assert status == 2 and captured.out == ""
    assert captured.err.count("\n") == 1 and "2000000 blocks; at most 65536" in captured.err
    path.write_text(" ".join(["7"] * 65536))
    status = _call("kv-events", ["hash", "--tokens-file", str(path), "--tokens-per-block", "1"])
    captured = capsys.readouterr()
    assert status == 0 and captured.out.count("  v1_block_key ") == 65536


def test_max_requests_above_a_trace_length_takes_the_whole_trace() -> None:
    assert len(load_trace(DATA / "ok_trace.jsonl", max_requests=10**12)) == 2


def test_report_json_is_standard_json(tmp_path: Path) -> None:
    path = tmp_path / "report.json"
    write_json({"policies": {"p": {"ttft": math.nan, "x": [math.inf, 1.5]}}}, path)

    def refuse(name: str) -> None:
        raise AssertionError(f"non-standard JSON constant {name}")

    assert json.loads(path.read_text(), parse_constant=refuse) == {
        "policies": {"p": {"ttft": None, "x": [None, 1.5]}}
    }


@pytest.mark.timeout(60)
def test_end_to_end_non_utf8_argv_and_a_bad_out_folder(tmp_path: Path) -> None:
    (tmp_path / "out" / "report.json").mkdir(parents=True)
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    runs = [
        (
            [sys.executable, "-m", "events", "listen", "tcp://127.0.0.1:5", b"--topic", b"\xff"],
            "--topic is not valid UTF-8",
        ),
        (
            [
                sys.executable,
                "-m",
                "router_sim",
                "run",
                "--max-requests",
                "5",
                "--out",
                str(tmp_path / "out"),
            ],
            "report.json exists and is not a writable file",
        ),
        (
            [
                sys.executable,
                "-m",
                "router_sim",
                "run",
                "--trace",
                str(DATA / "corrupt_body.jsonl.gz"),
            ],
            "cannot read it as a .jsonl or .jsonl.gz trace",
        ),
    ]
    for argv, message in runs:
        done = subprocess.run(argv, capture_output=True, timeout=50, env=env, check=False)
        err = done.stderr.decode("utf-8", "replace")
        assert done.returncode == 2, err
        assert err.count("\n") == 1 and message in err, err
        assert done.stdout == b""

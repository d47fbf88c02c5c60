"""``router-sim run``: table on stdout, report files, plots, errors."""

from __future__ import annotations

import csv
import gzip
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from router_sim.cli import main

FIXED_FIELDS = (
    "hit_rate",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "e2e_p50_ms",
    "load_max_over_mean",
    "decision_us_p50",
)


def test_run_writes_table_json_csv_and_plots(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert main(["run", "--max-requests", "200", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "compulsory-miss bound" in captured.out
    for policy in ("round_robin", "kv_overlap", "predicted_ttft", "oracle"):
        assert policy in captured.out
    assert "200/200" in captured.err  # the progress bar
    report = json.loads((out / "report.json").read_text())
    assert 0.0 < report["workload"]["bound"] <= 1.0
    assert report["workload"]["requests"] == 200
    assert len(report["policies"]) == 8
    for fields in report["policies"].values():
        for name in FIXED_FIELDS:
            assert isinstance(fields[name], float), name
        assert 0.0 <= fields["hit_rate"] <= report["workload"]["bound"] + 1e-9
        assert fields["completed"] == 200
    rows = list(csv.DictReader((out / "report.csv").open()))
    assert [r["policy"] for r in rows] == list(report["policies"])
    assert (out / "report.txt").read_text().startswith("workload mixed")
    pngs = {p.name for p in out.glob("*.png")}
    if importlib.util.find_spec("matplotlib") is not None:
        assert pngs == {"hit_rate.png", "ttft_cdf.png", "load_per_worker.png"}
        assert all((out / p).stat().st_size > 1000 for p in pngs)


def test_run_on_a_trace_file_with_chosen_policies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.jsonl.gz"
    with gzip.open(trace, "wt") as fh:
        for i in range(30):
            row = {
                "timestamp": i * 200,
                "input_length": 900,
                "output_length": 20,
                "hash_ids": [0, 1 + i % 3],
            }
            fh.write(json.dumps(row) + "\n")
    argv = ["run", "--trace", str(trace), "--workers", "2", "--policies", "round_robin,kv_overlap"]
    argv += ["--tokens-per-block", "64", "--device-blocks", "512", "--no-progress"]
    assert main([*argv, "--out", str(tmp_path / "o")]) == 0
    report = json.loads((tmp_path / "o" / "report.json").read_text())
    assert list(report["policies"]) == ["round_robin", "kv_overlap"]
    assert report["config"]["tokens_per_block"] == 64
    assert capsys.readouterr().err == ""
    # 30 prompts of 900 tokens, ids [0, 1 + i % 3]: id 0 is the first 512 tokens, the second id
    # the other 388. Prompt 0 reuses nothing, prompts 1 and 2 their shared first 512 tokens,
    # the 27 repeats all but the last token (always computed): (2 * 512 + 27 * 899) / 27000.
    assert report["workload"]["bound"] == pytest.approx((2 * 512 + 27 * 899) / (30 * 900))


def test_bad_arguments_fail_with_a_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main(["run", "--policies", "nope"])
    assert "unknown policies" in capsys.readouterr().err
    for options, message in (
        ('{"kv_overlap": {"bogus": 1}}', "unexpected keyword argument 'bogus'"),
        ('{"kv_overlap": 2}', "want an object of objects"),
        ('{"nope": {}}', "unknown policy 'nope'"),
        ("{bad", "not JSON"),
    ):
        with pytest.raises(SystemExit) as exited:
            main(["run", "--policy-options", options, "--max-requests", "5", "--no-progress"])
        assert exited.value.code == 2
        assert message in capsys.readouterr().err
    for flag, message in (
        ("--workers", "--workers must be in [1, 4096], got 0"),
        ("--tokens-per-block", "--tokens-per-block must be in [1, 1048576], got 0"),
        ("--device-blocks", "--device-blocks must be in [1, 2147483648], got 0"),
    ):
        assert main(["run", flag, "0", "--max-requests", "5", "--no-progress"]) == 2, flag
        assert message in capsys.readouterr().err
    blocker = tmp_path / "file"
    blocker.write_text("")
    out = str(blocker / "out")
    assert main(["run", "--out", out, "--max-requests", "5", "--no-progress"]) == 2
    assert f"cannot create --out {out}" in capsys.readouterr().err
    assert main(["run", "--trace", "/nonexistent/trace.jsonl", "--no-progress"]) == 2
    assert "not found" in capsys.readouterr().err
    assert main(["run", "--restart", "9@10", "--max-requests", "5", "--no-progress"]) == 2
    assert "restart names worker 9" in capsys.readouterr().err
    assert main(["run", "--speedup", "0", "--max-requests", "5", "--no-progress"]) == 2
    assert "--speedup must be in [1e-06, 1e+06], got 0" in capsys.readouterr().err


def test_python_dash_m_entry_point() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "router_sim", "run", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "--event-delay-ms" in done.stdout and "--trace" in done.stdout


def test_run_starts_without_the_service_modules() -> None:
    """``run`` parses and simulates without loading ``serve``'s HTTP stack (a third of a
    short run's start-up); ``serve`` still parses with it."""
    code = (
        "import sys, io, contextlib\n"
        "from router_sim.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    rc = main(['run', '--max-requests', '4', '--policies', 'round_robin',"
        " '--no-progress'])\n"
        "print(rc, 'aiohttp' in sys.modules)\n"
        "from router_sim.cli import build_parser\n"
        "print(build_parser().parse_args(['serve', '--fleet', 'f.json']).command)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.split() == ["0", "False", "serve"]

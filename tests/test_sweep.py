"""Sweeps and plans: rows equal the single runs they contain, resume, Ray, the CLI, answers."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from router_sim.cli import main
from router_sim.sim.simulator import SimConfig, simulate
from router_sim.sim.workloads import SyntheticSpec, synthetic_workload
from router_sim.sweep import SweepSpec, WorkloadSpec, run_sweep
from router_sim.sweep.plan import answer, format_plan
from router_sim.sweep.runner import POINTS_FILE, SweepResult

# wall clock and decision time differ between any two runs; everything else is deterministic
_TIMED = {"wall_s", "decision_us_p50"}


def _spec(**kw: Any) -> SweepSpec:
    base: dict[str, Any] = {
        "workload": WorkloadSpec(synthetic="mixed", max_requests=30),
        "policies": ["round_robin", "kv_overlap"],
        "workers": [2, 3],
        "device_blocks": [2048],
        "tokens_per_block": 16,
    }
    base.update(kw)
    return SweepSpec(**base)


def _untimed(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k not in _TIMED} for r in rows]


def test_rows_equal_the_single_runs_they_contain(tmp_path: Path) -> None:
    spec = _spec(speedups=[1.0, 2.0])
    result = run_sweep(spec, tmp_path, jobs=2)
    assert result.ran == 8 and result.resumed == 0 and result.backend == "local processes (2)"
    spec_reqs = SyntheticSpec(num_requests=30)
    for row in result.rows:
        reqs = synthetic_workload("mixed", seed=0, spec=spec_reqs)
        for r in reqs:
            r.arrival_ms /= row["speedup"]
        config = SimConfig(workers=row["workers"], tokens_per_block=16, device_blocks=2048)
        single = simulate(reqs, row["policy"], config).as_dict()
        for name, value in row.items():
            if name in single and name not in _TIMED:
                assert value == single[name], (name, row)
    # grid order: policy fastest, then load, then fleet size
    assert [(r["workers"], r["speedup"], r["policy"]) for r in result.rows[:3]] == [
        (2, 1.0, "round_robin"),
        (2, 1.0, "kv_overlap"),
        (2, 2.0, "round_robin"),
    ]


class _Stop(Exception):
    pass


def test_an_interrupted_sweep_resumes_without_redoing_finished_points(tmp_path: Path) -> None:
    spec = _spec()
    calls: list[int] = []

    def stop_after_two(done: int, total: int) -> None:
        calls.append(done)
        if done == 2:
            raise _Stop

    with pytest.raises(_Stop):
        run_sweep(spec, tmp_path, jobs=1, progress=stop_after_two)
    lines = (tmp_path / POINTS_FILE).read_text().splitlines()
    assert len(lines) == 2
    with (tmp_path / POINTS_FILE).open("a") as f:
        f.write('{"key": "torn wri')  # a write cut short by the interruption
    seen: list[tuple[int, int]] = []
    again = run_sweep(spec, tmp_path, jobs=1, progress=lambda d, t: seen.append((d, t)))
    assert (again.ran, again.resumed) == (2, 2)
    assert seen == [(2, 4), (3, 4), (4, 4)]  # progress counts the whole sweep
    fresh = run_sweep(spec, tmp_path / "fresh", jobs=1)
    assert _untimed(again.rows) == _untimed(fresh.rows)
    # nothing left to do: a third call runs nothing
    assert run_sweep(spec, tmp_path, jobs=1).ran == 0


def test_a_changed_fixed_setting_does_not_reuse_old_points(tmp_path: Path) -> None:
    run_sweep(_spec(workers=[2]), tmp_path, jobs=1)
    other = run_sweep(_spec(workers=[2], tokens_per_block=32), tmp_path, jobs=1)
    assert other.ran == 2


def test_ray_backend_gives_the_local_rows(tmp_path: Path) -> None:
    ray = pytest.importorskip("ray")
    spec = _spec(workers=[2], speedups=[1.0, 3.0])
    local = run_sweep(spec, tmp_path / "local", jobs=1)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        remote = run_sweep(spec, tmp_path / "ray", use_ray=True)
    finally:
        ray.shutdown()
    assert remote.backend.startswith("ray") and remote.ran == 4
    assert _untimed(remote.rows) == _untimed(local.rows)


def test_sweep_cli_reads_a_grid_file_and_writes_table_json_csv(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    grid = tmp_path / "grid.json"
    grid.write_text(
        json.dumps(
            {
                "workload": "shared-prompts",
                "max_requests": 20,
                "policies": ["round_robin", "kv_overlap"],
                "workers": [2],
                "tokens_per_block": 16,
            }
        )
    )
    out = tmp_path / "out"
    argv = ["sweep", "--grid", str(grid), "--rates", "5,10", "--out", str(out)]
    assert main([*argv, "--jobs", "1", "--no-progress"]) == 0
    text = capsys.readouterr()
    assert "4 point(s) run on this process" in text.err
    table = text.out.splitlines()
    assert table[0].split()[:3] == ["policy", "rate_per_s", "hit%"]
    assert len([line for line in table if line.startswith(("round_robin", "kv_overlap"))]) == 4
    data = json.loads((out / "sweep.json").read_text())
    assert {r["rate_per_s"] for r in data["rows"]} == {5.0, 10.0}
    assert (out / "sweep.csv").read_text().splitlines()[0].startswith("policy,workers")
    # run again: everything is resumed
    assert main([*argv, "--no-progress"]) == 0
    assert "0 point(s) run" in capsys.readouterr().err


def test_sweep_cli_refuses_ray_when_it_is_not_installed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    argv = ["sweep", "--workload", "mixed", "--max-requests", "5", "--workers", "2"]
    code = main([*argv, "--out", str(tmp_path), "--ray", "auto", "--no-progress"])
    assert code == 2
    assert "--ray needs Ray" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--trace", "mooncake", "--rates", "1"], "request rates apply to synthetic"),
        (["--workload", "mixed", "--speedups", "0"], "must be > 0"),
        (["--workload", "mixed", "--speedups", "nan"], "--speedups must be a finite number"),
        (["--workload", "mixed", "--workers", "100000"], "--workers must be in [1, 4096]"),
        (["--workload", "mixed", "--workers", "4096", "--device-blocks", "2147483648"], "limit"),
        (["--workload", "mixed", "--max-requests", "0"], "--max-requests"),
        (["--workload", "mixed", "--seeds", "-1"], "--seeds"),
        (["--workload", "mixed", "--event-delay-ms", "inf"], "--event-delay-ms"),
        (["--workload", "mixed", "--jobs", "0"], "--jobs"),
        (["--workload", "mixed", "--rates", "nan"], "--rates"),
    ],
)
def test_sweep_cli_usage_errors(
    tmp_path: Path, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert main(["sweep", *argv, "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not out.exists()  # checked before anything is written


@pytest.mark.parametrize("target", ["nan", "-5", "0", "inf"])
def test_plan_refuses_a_target_that_is_not_a_positive_number(
    tmp_path: Path, target: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["plan", "--workload", "mixed", "--ttft-p99-ms", target, "--out", str(tmp_path / "o")]
    assert main(argv) == 2
    assert "--ttft-p99-ms" in capsys.readouterr().err


def _row(policy: str, workers: int, p99: float, completed: int = 10) -> dict[str, Any]:
    return {
        "policy": policy,
        "workers": workers,
        "ttft_p99_ms": p99,
        "ttft_p50_ms": p99 / 2,
        "hit_rate": 0.5,
        "completed": completed,
        "requests": 10,
    }


def test_plan_picks_the_smallest_fleet_that_meets_the_target() -> None:
    rows = [
        _row("a", 1, 900.0),
        _row("a", 2, 450.0),
        _row("a", 4, 300.0),
        _row("b", 1, 250.0, completed=9),  # fast but a request was dropped: not met
        _row("b", 2, 350.0),
        _row("b", 4, 200.0),
        _row("c", 1, 800.0),
        _row("c", 2, 700.0),
        _row("c", 4, 900.0),
        _row("d", 1, 900.0),
        _row("d", 2, 300.0),
        _row("d", 4, 600.0),
    ]
    plans = {p.policy: p for p in answer(SweepResult(rows, 12, 0, "x"), 400.0)}
    assert plans["a"].workers == 4
    assert plans["b"].workers == 2  # 1 worker is fast enough but dropped a request
    assert plans["c"].workers is None
    assert plans["d"].workers == 2 and not plans["d"].monotone
    text = format_plan(list(plans.values()), 400.0)
    assert "c                none up to 4 workers" in text
    assert "a larger fleet misses it again" in text


def test_plan_cli_answers_with_the_curve(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["plan", "--workload", "shared-prompts", "--max-requests", "40", "--rates", "40"]
    argv += ["--policies", "round_robin,kv_overlap", "--workers", "1,2,4", "--ttft-p99-ms", "150"]
    assert main([*argv, "--tokens-per-block", "16", "--out", str(tmp_path), "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("smallest fleet with TTFT p99 <= 150 ms:")
    data = json.loads((tmp_path / "sweep.json").read_text())
    for policy, workers in data["meta"]["plan"].items():
        curve = [r for r in data["rows"] if r["policy"] == policy]
        meeting = [r["workers"] for r in curve if r["ttft_p99_ms"] <= 150]
        assert workers == (min(meeting) if meeting else None)
    assert len(data["rows"]) == 6

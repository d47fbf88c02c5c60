"""The simulator's fast paths: each one is checked against the slow form it replaces."""

from __future__ import annotations

import gc
from typing import Any

import pytest

import router_sim.cli
import router_sim.sim.simulator
from kvcache.tree import Block
from router_sim.cli import main
from router_sim.sim.simulator import Restart, SimConfig, simulate
from router_sim.sim.worker import SimWorker
from router_sim.sim.workloads import SyntheticSpec, synthetic_workload

SMALL = SyntheticSpec(num_requests=40, rate_per_s=40.0)


def _config(**kw: Any) -> SimConfig:
    base: dict[str, Any] = {"workers": 2, "tokens_per_block": 32, "device_blocks": 400}
    base.update(kw)
    return SimConfig(**base)


@pytest.mark.parametrize("enabled_before", [True, False])
def test_a_run_pauses_the_cyclic_collector_and_restores_it(enabled_before: bool) -> None:
    reqs = synthetic_workload("shared-prompts", seed=1, spec=SMALL)
    seen: list[bool] = []
    was = gc.isenabled()
    try:
        if enabled_before:
            gc.enable()
        else:
            gc.disable()
        simulate(reqs, "round_robin", _config(), lambda done, total: seen.append(gc.isenabled()))
        assert gc.isenabled() is enabled_before
    finally:
        if was:
            gc.enable()
        else:
            gc.disable()
    assert len(seen) == len(reqs) and not any(seen)


def test_the_collector_comes_back_when_a_run_fails() -> None:
    reqs = synthetic_workload("shared-prompts", seed=1, spec=SMALL)

    def fail(done: int, total: int) -> None:
        raise RuntimeError("stop")

    assert gc.isenabled()
    with pytest.raises(RuntimeError, match="stop"):
        simulate(reqs, "round_robin", _config(), fail)
    assert gc.isenabled()


def test_no_progress_builds_no_progress_bar(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # a disabled tqdm bar still starts tqdm's monitor thread: --no-progress must make none
    def no_bar(*args: object, **kwargs: object) -> None:
        raise AssertionError("a progress bar was built")

    monkeypatch.setattr(router_sim.cli, "tqdm", no_bar)
    argv = ["run", "--max-requests", "20", "--policies", "round_robin", "--no-progress"]
    assert main(argv) == 0
    assert "round_robin" in capsys.readouterr().out


def test_a_young_collection_frees_a_finished_runs_caches() -> None:
    """The workers' cache trees are reference cycles: a run must leave them young, so the
    collector's next cheap pass frees them instead of a full walk of the heap much later."""

    def blocks() -> int:
        return sum(1 for o in gc.get_objects() if type(o) is Block)

    gc.collect()
    before = blocks()
    reqs = synthetic_workload("shared-prompts", seed=1, spec=SMALL)
    thresholds = gc.get_threshold()
    gc.set_threshold(50, 1, 1)  # a collector that promotes survivors after a few allocations
    try:
        simulate(reqs, "round_robin", _config())
    finally:
        gc.set_threshold(*thresholds)
    gc.collect(1)  # the young generations only
    assert blocks() == before


@pytest.mark.pure
@pytest.mark.parametrize("restarts", [[], [Restart(0, 2000.0), Restart(1, 4000.0)]])
def test_running_requests_stay_in_admission_order(
    monkeypatch: pytest.MonkeyPatch, restarts: list[Restart]
) -> None:
    """A worker steps its running requests in list order and preempts the last one: that is
    only the oldest-first order and the newest victim if ``running`` stays sorted by admission
    and every waiting request is newer, through admissions, preemptions and restarts."""
    checked = [0]

    class Checked(SimWorker):
        def _step(self, t_ms: float) -> bool:
            stepped = super()._step(t_ms)
            orders = [s.order for s in self.running] + [s.order for s in self.waiting]
            assert orders == sorted(orders), orders
            checked[0] += 1
            return stepped

    monkeypatch.setattr(router_sim.sim.simulator, "SimWorker", Checked)
    reqs = synthetic_workload("mixed", seed=5, spec=SyntheticSpec(num_requests=150, rate_per_s=60))
    run = simulate(reqs, "kv_overlap", _config(device_blocks=220, restarts=restarts))
    assert checked[0] > 100
    assert sum(r.preemptions for r in run.records) > 10

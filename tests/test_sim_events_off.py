"""Runs without the event stream (``SimConfig.events``): for a policy that never reads the
router's index, leaving the stream out changes no routing, caching or timing figure."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from events.tools.cli_args import ArgError
from router_sim.cli import main
from router_sim.router.policies import EVENT_FREE, POLICIES
from router_sim.sim.bound import compulsory_bound
from router_sim.sim.metrics import PolicySummary
from router_sim.sim.report import build_report, format_table
from router_sim.sim.simulator import Restart, SimConfig, Simulation, simulate
from router_sim.sim.workloads import Request, SyntheticSpec, synthetic_workload

SMALL = SyntheticSpec(num_requests=120, system_prompt_len=(300, 700), rate_per_s=30.0)

# What only the event stream produces: the wire, the index's view (the router's predicted
# overlap, its check against the workers, its lookup time) and the mode itself.
_STREAM_ONLY = {
    "overflowed_events",
    "wire_batches",
    "wire_events",
    "wire_bytes",
    "index_mismatch_blocks",
    "events",
    "decision_us_p50",
    "decision_us_p99",
    "decision_us_mean",
    "wall_s",
}


def _config(**kw: object) -> SimConfig:
    base: dict[str, object] = {"workers": 3, "tokens_per_block": 16, "device_blocks": 2048}
    base.update(kw)
    return SimConfig(**base)  # type: ignore[arg-type]


def _records(run: PolicySummary) -> list[tuple[Any, ...]]:
    return [
        (
            r.request_id,
            r.worker,
            r.reused_tokens,
            r.first_token_ms,
            r.finish_ms,
            r.best_overlap_tokens,
            r.chosen_overlap_tokens,
            r.preemptions,
        )
        for r in run.records
    ]


def _fields(run: PolicySummary) -> dict[str, Any]:
    return {k: v for k, v in run.as_dict().items() if k not in _STREAM_ONLY}


def test_the_event_free_policies_are_those_that_never_read_the_index() -> None:
    # listed by hand from the policies' own code: these route by id, load, their own
    # history or the workers' true caches
    assert {"round_robin", "random", "least_loaded", "approximate", "oracle"} == EVENT_FREE
    assert set(POLICIES) > EVENT_FREE


@pytest.mark.parametrize("policy", sorted(EVENT_FREE))
@pytest.mark.parametrize(
    "extra",
    [
        {},
        # evictions and moves to the host tier: Removed events keep the true caches exact
        {"device_blocks": 160, "host_blocks": 1024},
        # the event buffer overflows: the worker's true cache comes from its snapshot
        {"event_buffer": 4},
    ],
    ids=["plain", "small-device-tier", "overflowing-buffer"],
)
def test_leaving_the_stream_out_changes_no_routing_caching_or_timing_figure(
    policy: str, extra: dict[str, object]
) -> None:
    reqs = synthetic_workload("multi-turn", seed=3, spec=SMALL)
    on = simulate(reqs, policy, _config(events="on", **extra))
    off = simulate(reqs, policy, _config(events="off", **extra))
    auto = simulate(reqs, policy, _config(**extra))
    assert on.events and not off.events and not auto.events
    assert _records(off) == _records(on) == _records(auto)
    assert _fields(off) == _fields(on) == _fields(auto)
    assert on.as_dict()["hit_rate"] > 0 and on.wire.events > 0 and on.index_mismatch == 0
    # nothing travels, and the index check is not made (-1) instead of reading "wrong"
    assert off.wire.batches == off.wire.events == 0 and off.wire.bytes is None  # (memory)
    assert off.index_mismatch == -1
    assert all(r.predicted_overlap_blocks == 0 for r in off.records)


def test_a_run_without_the_stream_leaves_the_index_empty() -> None:
    reqs = synthetic_workload("shared-prompts", seed=2, spec=SMALL)
    sim = Simulation("round_robin", _config())
    assert not sim.events
    run = sim.run(reqs)
    assert run.as_dict()["hit_rate"] > 0  # the workers did cache and reuse
    assert all(sim.router.indexer.block_count(w) == 0 for w in range(3))


def test_auto_keeps_the_stream_for_index_policies_and_for_what_exercises_it() -> None:
    cfg = _config()
    assert cfg.events == "auto"
    assert not cfg.events_for("round_robin")
    assert cfg.events_for("kv_overlap") and cfg.events_for("predicted_ttft")
    assert cfg.events_for("cache_aware")
    assert _config(events="on").events_for("round_robin")
    assert _config(drop_rate=0.1).events_for("random")
    assert _config(restarts=[Restart(0, 10.0)]).events_for("oracle")
    assert _config(transport="inproc").events_for("least_loaded")
    assert _config(transport="tcp").events_for("approximate")
    assert not _config(transport="memory").events_for("round_robin")


def test_off_is_refused_where_it_would_change_what_a_run_measures() -> None:
    with pytest.raises(ValueError, match="events off: kv_overlap route"):
        Simulation("kv_overlap", _config(events="off"))
    with pytest.raises(ValueError, match="events off leaves out the event stream"):
        _config(events="off", drop_rate=0.1)
    with pytest.raises(ValueError, match="events off leaves out the event stream"):
        _config(events="off", restarts=[Restart(0, 5.0)])
    with pytest.raises(ValueError, match="events off leaves out the event stream"):
        _config(events="off", transport="inproc")
    with pytest.raises(ValueError, match="events must be one of"):
        _config(events="sometimes")


def test_the_table_shows_no_wire_figures_for_a_run_without_the_stream() -> None:
    reqs: list[Request] = synthetic_workload("mixed", seed=5, spec=SMALL)
    runs = {p: simulate(reqs, p, _config()) for p in ("round_robin", "kv_overlap")}
    report = build_report({"name": "mixed"}, compulsory_bound(reqs, 16), runs, {})
    assert report["policies"]["round_robin"]["events"] is False
    assert report["policies"]["kv_overlap"]["events"] is True
    rows = {line.split()[0]: line.split() for line in format_table(report).splitlines()[3:]}
    # the four wire columns (events, MB wire, gaps, recovered): dashes for round_robin; the
    # memory transport writes no bytes, so MB wire is a dash for kv_overlap too
    assert rows["round_robin"].count("-") == 4
    assert rows["kv_overlap"].count("-") == 1
    assert report["policies"]["kv_overlap"]["wire_events"] > 0


def test_the_command_line_refuses_off_for_an_index_policy(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["run", "--max-requests", "20", "--no-progress", "--events", "off"]
    assert main([*argv, "--policies", "round_robin,kv_overlap"]) == 2
    err = capsys.readouterr().err
    assert "--events off: kv_overlap route(s) by the router's index" in err
    assert main([*argv, "--policies", "round_robin", "--drop-rate", "0.1"]) == 2
    assert "--events off leaves out the event stream" in capsys.readouterr().err
    assert main([*argv, "--policies", "round_robin"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("round_robin"))
    assert row.split().count("-") == 4


def test_arg_error_is_what_the_check_raises() -> None:
    import argparse

    from router_sim.run_args import check_events

    args = argparse.Namespace(
        events="off", policies=["random", "oracle"], drop_rate=0.0, restart=[], transport="tcp"
    )
    with pytest.raises(ArgError, match="--transport inproc/tcp"):
        check_events(args)
    args.transport = "auto"
    check_events(args)  # event-free policies, nothing that needs the stream


def _sweep_spec(**kw: Any) -> Any:
    from router_sim.sweep import SweepSpec, WorkloadSpec

    base: dict[str, Any] = {
        "workload": WorkloadSpec(synthetic="mixed", max_requests=30),
        "policies": ["round_robin", "kv_overlap"],
        "workers": [2],
        "device_blocks": [2048],
        "tokens_per_block": 16,
    }
    base.update(kw)
    return SweepSpec(**base)


def test_a_sweep_passes_its_events_setting_to_every_point(tmp_path: Path) -> None:
    from router_sim.sweep import run_sweep
    from router_sim.sweep.runner import SweepError

    auto = {r["policy"]: r for r in run_sweep(_sweep_spec(), tmp_path / "a", jobs=1).rows}
    on = {r["policy"]: r for r in run_sweep(_sweep_spec(events="on"), tmp_path / "b", jobs=1).rows}
    assert auto["round_robin"]["events"] is False and auto["round_robin"]["wire_events"] == 0
    assert on["round_robin"]["events"] is True and on["round_robin"]["wire_events"] > 0
    assert on["round_robin"]["wire_bytes"] is None  # the memory transport writes no bytes
    assert auto["kv_overlap"]["events"] is True
    for name in (
        "hit_rate",
        "ttft_p50_ms",
        "ttft_p99_ms",
        "load_max_over_mean",
        "locality_given_up",
    ):
        assert auto["round_robin"][name] == on["round_robin"][name], name
    # a sweep made without the setting keeps its points' keys; a set one is part of them
    assert "events" not in _sweep_spec().fixed()
    assert _sweep_spec(events="on").fixed()["events"] == "on"
    with pytest.raises(SweepError, match="events off: kv_overlap"):
        _sweep_spec(events="off")
    with pytest.raises(SweepError, match="events must be one of"):
        _sweep_spec(events="maybe")

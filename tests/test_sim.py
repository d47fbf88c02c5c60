"""The simulator end to end: determinism, scopes, staleness, faults, transports, tiers."""

from __future__ import annotations

import gc
import threading

import pytest

from router_sim.sim.bound import compulsory_bound
from router_sim.sim.report import build_report, deterministic_view
from router_sim.sim.simulator import Restart, SimConfig, Simulation, simulate
from router_sim.sim.workloads import (
    Request,
    SyntheticSpec,
    identical_prompts_for_tenants,
    synthetic_workload,
)

SMALL = SyntheticSpec(num_requests=120, system_prompt_len=(300, 700), rate_per_s=30.0)


def _config(**kw: object) -> SimConfig:
    base: dict[str, object] = {"workers": 3, "tokens_per_block": 16, "device_blocks": 2048}
    base.update(kw)
    return SimConfig(**base)  # type: ignore[arg-type]


def test_equal_seed_and_inputs_give_identical_reports() -> None:
    reqs = synthetic_workload("mixed", seed=5, spec=SMALL)
    bound = compulsory_bound(reqs, 16)

    def report() -> dict[str, object]:
        runs = {p: simulate(reqs, p, _config(seed=5)) for p in ("random", "kv_overlap")}
        return deterministic_view(build_report({"name": "mixed"}, bound, runs, {"seed": 5}))

    first, second = report(), report()
    assert first == second
    fields = first["policies"]["kv_overlap"]  # type: ignore[index]
    assert fields["completed"] == 120 and "decision_us_p50" not in fields


def test_a_run_before_the_process_exit_leaves_its_objects_uncollected() -> None:
    """``exit_after``: the same report, the collector back on, and what the run built out of
    the collector's reach (a default run leaves nothing frozen)."""
    reqs = synthetic_workload("mixed", seed=5, spec=SMALL)
    gc.collect()
    frozen = gc.get_freeze_count()
    normal = simulate(reqs, "kv_overlap", _config(seed=5))
    assert gc.get_freeze_count() == frozen and gc.isenabled()
    try:
        last = simulate(reqs, "kv_overlap", _config(seed=5), exit_after=True)
        assert gc.isenabled()
        assert gc.get_freeze_count() > frozen + 1000  # the workers' trees, the index, ...
    finally:
        gc.unfreeze()  # this test process goes on: let the collector have them back
    drop = {"wall_s", "decision_us_p50", "decision_us_p99", "decision_us_mean"}
    assert {k: v for k, v in last.as_dict().items() if k not in drop} == {
        k: v for k, v in normal.as_dict().items() if k not in drop
    }


def test_a_different_seed_changes_a_seeded_policy() -> None:
    reqs = synthetic_workload("mixed", seed=5, spec=SMALL)
    a = simulate(reqs, "random", _config(seed=1)).as_dict()
    b = simulate(reqs, "random", _config(seed=2)).as_dict()
    assert a["requests_per_worker"] != b["requests_per_worker"]


def test_tenants_with_different_salts_never_share_cache() -> None:
    # two tenants send the same prompts; one worker with room for everything
    reqs = identical_prompts_for_tenants(tenants=2, prompts=3, repeats=3, rate_per_s=2.0)
    run = simulate(reqs, "kv_overlap", _config(workers=1))
    per_tenant = compulsory_bound(reqs, 16)
    for r in reqs:
        r.cache_salt = None
        r.__post_init__()  # recompute the scope without the salt
    pooled = compulsory_bound(reqs, 16)
    assert pooled.token_hit_rate > per_tenant.token_hit_rate
    assert run.as_dict()["hit_rate"] == pytest.approx(per_tenant.token_hit_rate)
    # per request: the first request of each (tenant, prompt) computes everything
    misses = [rec for rec in run.records if rec.reused_tokens == 0]
    assert len(misses) == 2 * 3


def test_stale_events_never_beat_fresh_ones_for_kv_overlap() -> None:
    reqs = synthetic_workload("multi-turn", seed=3, spec=SMALL)
    fresh = simulate(reqs, "kv_overlap", _config(workers=4, event_delay_ms=0.0)).as_dict()
    stale = simulate(reqs, "kv_overlap", _config(workers=4, event_delay_ms=1e9)).as_dict()
    assert stale["hit_rate"] <= fresh["hit_rate"]
    assert stale["hit_rate"] < fresh["hit_rate"]  # here routing blind costs some locality
    assert stale["wire_events"] > 0  # events were published, just never in time


def test_dropped_frames_are_replayed_and_the_index_recovers() -> None:
    reqs = synthetic_workload("shared-prompts", seed=4, spec=SMALL)
    sim = Simulation("kv_overlap", _config(drop_rate=0.25, seed=9))
    fields = sim.run(reqs).as_dict()
    assert fields["dropped_frames"] > 10
    # every lost frame came back by replay, once (a replay also re-sends frames after the gap
    # that had arrived live, so replayed counts more), and no gap had to be repaired by a resync
    assert fields["gaps"] > 0 and fields["recovered"] == fields["dropped_frames"]
    assert fields["replayed"] >= fields["recovered"]
    assert fields["resyncs"] == 0
    assert fields["index_mismatch_blocks"] == 0
    assert fields["completed"] == 120


def test_a_lossy_run_over_zeromq_reports_the_same_figures_every_time() -> None:
    """Frames lost on purpose over real sockets: which replayed frames had also come live
    depends on the host's timing (``replayed``, listed with the wall-clock fields), but the
    report's figures, the recovered count among them, are the same run after run."""
    reqs = synthetic_workload("shared-prompts", seed=4, spec=SMALL)
    bound = compulsory_bound(reqs, 16)
    views = []
    for _ in range(3):
        run = simulate(reqs, "kv_overlap", _config(drop_rate=0.25, seed=9))
        assert run.as_dict()["recovered"] > 10
        views.append(deterministic_view(build_report({"name": "t"}, bound, {"kv": run}, {})))
    assert "replayed" not in views[0]["policies"]["kv"]
    assert views[0] == views[1] == views[2]


@pytest.mark.parametrize("transport", ["memory", "inproc"])
def test_an_overflowing_event_buffer_is_a_gap_repaired_by_a_snapshot(transport: str) -> None:
    """Each worker's event manager keeps 3 events between publishes: most batches lose
    events. Without the gap and the snapshot the index would keep evicted blocks and miss
    stored ones; with them it ends equal to every worker's cache."""
    reqs = synthetic_workload("shared-prompts", seed=4, spec=SMALL)
    cfg = _config(event_buffer=3, transport=transport, device_blocks=256)
    fields = simulate(reqs, "kv_overlap", cfg).as_dict()
    assert fields["overflowed_events"] > 0
    assert fields["index_mismatch_blocks"] == 0
    assert fields["completed"] == 120
    if transport != "memory":
        assert fields["gaps"] > 0 and fields["resyncs"] > 0


def test_a_restarted_worker_is_forgotten_and_rebuilt() -> None:
    reqs = synthetic_workload("shared-prompts", seed=4, spec=SMALL)
    fields = simulate(reqs, "kv_overlap", _config(restarts=[Restart(1, 1500.0)])).as_dict()
    assert fields["restarts"] == 1
    assert fields["index_mismatch_blocks"] == 0
    assert fields["completed"] == 120


@pytest.mark.parametrize("worker", [3, -1])
def test_a_restart_of_a_worker_outside_the_fleet_is_refused(worker: int) -> None:
    with pytest.raises(ValueError, match=f"worker {worker} but the workers are 0..2"):
        _config(restarts=[Restart(worker, 10.0)])


def test_a_simulation_that_fails_to_start_stops_its_publishers() -> None:
    def publishers() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name.startswith("kv-events-publisher")}

    before = publishers()
    with pytest.raises(TypeError, match="bogus"):  # the workers exist by then
        Simulation(
            "kv_overlap",
            _config(transport="inproc", policy_options={"kv_overlap": {"bogus": 1}}),
        )
    assert publishers() == before


def _same_report(reqs: list[Request], policy: str, **kw: object) -> dict[str, object]:
    """The deterministic report, less the subscriber's own counters: a ZeroMQ subscriber that
    attaches may fetch its first frames through replay (slow joiner), which the memory
    transport never needs; nothing the router saw differs."""
    run = simulate(reqs, policy, _config(**kw))
    run.wire.replayed = run.wire.gaps = 0
    if run.wire.bytes is not None:  # ZeroMQ: what was sent; memory: nothing is written
        assert run.wire.bytes > 0
        run.wire.bytes = None
    return deterministic_view(
        build_report({"name": "t"}, compulsory_bound(reqs, 16), {policy: run}, {})
    )


@pytest.mark.parametrize("policy", ["kv_overlap", "predicted_ttft"])
def test_memory_inproc_and_tcp_transports_give_the_same_report(policy: str) -> None:
    """The memory transport hands the router the workers' batches without writing them; the
    ZeroMQ ones write, send and decode every batch: the same report, but for the wire bytes
    that only the ZeroMQ transports count."""
    reqs = synthetic_workload("mixed", seed=6, spec=SyntheticSpec(num_requests=40))
    memory = _same_report(reqs, policy, transport="memory")
    assert memory == _same_report(reqs, policy, transport="inproc")
    assert memory == _same_report(reqs, policy, transport="tcp")
    assert simulate(reqs, policy, _config(transport="memory")).wire.bytes is None


def test_a_restart_gives_the_same_report_in_memory_and_over_zeromq() -> None:
    reqs = synthetic_workload("shared-prompts", seed=4, spec=SMALL)
    faults = [Restart(1, 1500.0), Restart(0, 2500.0)]
    memory = _same_report(reqs, "kv_overlap", transport="memory", restarts=faults)
    assert memory == _same_report(reqs, "kv_overlap", transport="inproc", restarts=faults)
    assert memory["policies"]["kv_overlap"]["restarts"] == 2  # type: ignore[index]


def test_auto_transport_is_memory_unless_frames_are_dropped() -> None:
    assert _config().resolved_transport == "memory"
    assert _config(drop_rate=0.1).resolved_transport == "inproc"
    with pytest.raises(ValueError, match="drop_rate needs a ZeroMQ transport"):
        _config(transport="memory", drop_rate=0.1)
    with pytest.raises(ValueError, match="transport must be"):
        _config(transport="carrier-pigeon")


def test_small_device_tier_offloads_to_host_and_preempts() -> None:
    reqs = synthetic_workload("shared-prompts", seed=2, spec=SMALL)
    sim = Simulation("kv_overlap", _config(device_blocks=160, host_blocks=1024))
    fields = sim.run(reqs).as_dict()
    assert fields["completed"] == 120
    assert fields["index_mismatch_blocks"] == 0
    big = simulate(reqs, "kv_overlap", _config()).as_dict()
    assert fields["wire_events"] > big["wire_events"]  # moves travel as Removed + Stored


def test_oracle_and_cache_blind_policies_bracket_kv_overlap() -> None:
    reqs = synthetic_workload("multi-turn", seed=8, spec=SMALL)
    bound = compulsory_bound(reqs, 16).token_hit_rate
    rates = {
        p: simulate(reqs, p, _config(workers=4)).as_dict()["hit_rate"]
        for p in ("round_robin", "kv_overlap", "oracle")
    }
    assert rates["round_robin"] < rates["kv_overlap"] <= bound + 1e-9
    assert rates["oracle"] <= bound + 1e-9


def _trace_requests(n: int) -> list[Request]:
    from router_sim.sim.trace import load_trace

    return load_trace("mooncake", max_requests=n)


@pytest.mark.parametrize(
    ("workload", "policy", "extra"),
    [
        ("mixed", "kv_overlap", {}),
        ("multi-turn", "predicted_ttft", {}),
        ("shared-prompts", "kv_overlap", {"device_blocks": 160, "host_blocks": 1024}),
        ("mooncake", "predicted_ttft", {"tokens_per_block": 512, "device_blocks": 600}),
    ],
)
def test_fast_forward_gives_the_step_by_step_report(
    workload: str, policy: str, extra: dict[str, object]
) -> None:
    """Decode stretches taken in one go change nothing but float rounding of the clock: the
    same worker for every request, the same reuse and preemptions, times within 1e-9."""
    reqs = (
        _trace_requests(150)
        if workload == "mooncake"
        else synthetic_workload(workload, seed=11, spec=SMALL)
    )
    fast = simulate(reqs, policy, _config(fast_forward=True, **extra))
    slow = simulate(reqs, policy, _config(fast_forward=False, **extra))
    assert len(fast.records) == len(slow.records) == len(reqs)
    for f, s in zip(fast.records, slow.records, strict=True):
        assert (f.request_id, f.worker, f.reused_tokens, f.preemptions) == (
            s.request_id,
            s.worker,
            s.reused_tokens,
            s.preemptions,
        )
        assert f.first_token_ms == pytest.approx(s.first_token_ms, rel=1e-9)
        assert f.finish_ms == pytest.approx(s.finish_ms, rel=1e-9)
    assert fast.busy_ms == pytest.approx(slow.busy_ms, rel=1e-9)
    assert (fast.wire.batches, fast.wire.events, fast.wire.bytes) == (
        slow.wire.batches,
        slow.wire.events,
        slow.wire.bytes,
    )
    if workload == "shared-prompts":
        assert sum(r.preemptions for r in slow.records) > 0  # the tiny tier really preempts


@pytest.mark.parametrize("seed", [1, 4, 8])
def test_a_lost_last_frame_is_recovered_at_the_end_of_a_run(seed: int) -> None:
    """With these seeds some worker's last frame of the run is lost (found by hand: without
    the end-of-run heartbeats each ended with a stale index). Nothing follows it on the live
    stream, so only the workers' idle heartbeats show the router the gap."""
    reqs = synthetic_workload("shared-prompts", seed=4, spec=SMALL)
    fields = simulate(reqs, "kv_overlap", _config(drop_rate=0.1, seed=seed)).as_dict()
    assert fields["dropped_frames"] > 0
    assert fields["index_mismatch_blocks"] == 0
    assert fields["completed"] == 120


def test_a_workers_publisher_answers_replays_as_fast_as_the_simulator_asks() -> None:
    """The simulator runs faster than the clock and can fill gap after gap within a few
    milliseconds; a publisher's per-second request limit (500/s after a burst of 8 by
    default) would leave such a request unanswered, and the run would resync after a wait
    that depends on the host's speed. The workers' publishers take them all."""
    import zmq

    from events.stream.publisher import END_SEQ, SEQ

    sim = Simulation("round_robin", _config(transport="inproc", workers=1))
    try:
        publisher = sim.workers[0].publisher
        assert publisher is not None and publisher.replay_endpoint is not None
        dealer = sim._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(publisher.replay_endpoint)
        try:
            answered = 0
            for _ in range(200):  # one at a time, each after the last one's end marker
                dealer.send_multipart([b"", SEQ.pack(0)])
                while dealer.poll(2000):
                    if dealer.recv_multipart()[-2] == END_SEQ:
                        answered += 1
                        break
                else:
                    break  # unanswered: refused
        finally:
            dealer.close(linger=0)
        assert answered == 200
        assert publisher.stats.replay_refused == 0
    finally:
        sim.close()

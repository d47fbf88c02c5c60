"""The worker's per-step bookkeeping: what it keeps instead of recomputing every step.

A simulated worker keeps, per sequence, whether it decodes and how many tokens its pages hold
(``_Seq.decoding``, ``_Seq.cap``) instead of asking the cache on every step; and ends each
step with one call to the event manager (``end_step``) instead of three. These tests hold the
kept values to what they replace, after every step of runs that admit, preempt, offload,
restart and lose events, and ``end_step`` to the three calls it stands for.
"""

from __future__ import annotations

from typing import Any

import pytest

import router_sim.sim.simulator
from events.manager import KVCacheEventManager
from events.wire.model import KVCacheEvent
from router_sim.sim.simulator import Restart, SimConfig, simulate
from router_sim.sim.worker import SimWorker
from router_sim.sim.workloads import SyntheticSpec, synthetic_workload


def _checked_worker(counts: dict[str, int]) -> type[SimWorker]:
    class Checked(SimWorker):
        def _step(self, t_ms: float) -> bool:
            stepped = super()._step(t_ms)
            for s in self.running:
                cache = s.cache
                assert cache is not None
                # the definitions the kept values stand for
                assert s.cap == cache.capacity
                assert s.decoding == (s.computed >= s.target and s.generated > 0)
                counts["decoding"] += s.decoding
                counts["prefilling"] += not s.decoding
            for s in self.waiting:
                assert s.cache is None and not s.decoding
            counts["steps"] += 1
            return stepped

    return Checked


@pytest.mark.pure
@pytest.mark.parametrize(
    "extra",
    [
        {"device_blocks": 220},
        {"device_blocks": 120, "host_blocks": 400, "fast_forward": False},
        {"device_blocks": 220, "restarts": [Restart(0, 1500.0), Restart(1, 4000.0)]},
        {"device_blocks": 400, "event_buffer": 3},
    ],
)
def test_kept_decoding_state_and_capacity_match_the_cache_after_every_step(
    monkeypatch: pytest.MonkeyPatch, extra: dict[str, Any]
) -> None:
    counts = {"steps": 0, "decoding": 0, "prefilling": 0}
    monkeypatch.setattr(router_sim.sim.simulator, "SimWorker", _checked_worker(counts))
    reqs = synthetic_workload("mixed", seed=5, spec=SyntheticSpec(num_requests=120, rate_per_s=60))
    # a small step budget: prompts take several steps (chunked prefill)
    config = SimConfig(workers=2, tokens_per_block=32, max_batch_tokens=256, **extra)
    run = simulate(reqs, "kv_overlap", config)
    # the runs reach the states the checks are about
    assert counts["steps"] > 200
    assert counts["decoding"] > 100 and counts["prefilling"] > 100
    if extra["device_blocks"] < 300:
        assert sum(r.preemptions for r in run.records) > 5


def _feed(mgr: KVCacheEventManager, rounds: list[int]) -> None:
    """``n`` events in a round (cleared announcements: each one is its own event)."""
    for n in rounds:
        for _ in range(n):
            mgr.on_cleared()


@pytest.mark.parametrize("rounds", [[0], [1], [3, 0, 2], [5, 1, 0, 0, 7, 2], [4, 4, 4]])
def test_end_step_is_flush_take_dropped_and_drain(rounds: list[int]) -> None:
    """Round by round, ``end_step`` gives the events and the drop count that flush,
    take_dropped and get_latest_events give on a twin manager, through buffer overflows."""
    one = KVCacheEventManager(max_entries=3)
    three = KVCacheEventManager(max_entries=3)
    got: list[tuple[list[int], int]] = []
    want: list[tuple[list[int], int]] = []

    def ids(events: list[KVCacheEvent]) -> list[int]:
        return [e.event_id for e in events]

    for n in rounds:
        _feed(one, [n])
        _feed(three, [n])
        events, dropped = one.end_step()
        got.append((ids(events), dropped))
        three.flush()
        lost = three.take_dropped()
        want.append((ids(three.get_latest_events()), lost))
    assert got == want
    assert one.dropped_events == three.dropped_events
    assert one.end_step() == ([], 0)


def test_end_step_hands_over_what_an_earlier_flush_buffered() -> None:
    mgr = KVCacheEventManager(max_entries=2)
    _feed(mgr, [3])
    assert mgr.flush() == 3  # one dropped, two buffered
    events, dropped = mgr.end_step()  # nothing pending now: the buffer and the count remain
    assert ([e.event_id for e in events], dropped) == ([1, 2], 1)
    assert mgr.end_step() == ([], 0)

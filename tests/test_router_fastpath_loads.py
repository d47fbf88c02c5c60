"""Loads read on demand (router_sim.router.routing.LazyLoads) for policies that pick by worker id:
the same decisions as with every load read up front, and no load read that is not asked for."""

from __future__ import annotations

from array import array

import pytest

from router_sim import Router, WorkerLoad, make_policy
from router_sim.router.policies import RouteRequest
from router_sim.router.policies.base import PolicyChoice
from router_sim.router.routing import LazyLoads
from router_sim.sim.simulator import SimConfig, simulate
from router_sim.sim.workloads import SyntheticSpec, synthetic_workload


class CountingSource:
    """A load source that counts each load it is asked for."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids
        self.asked: list[int] = []

    def workers(self) -> list[int]:
        return list(self.ids)

    def load(self, worker: int) -> WorkerLoad:
        self.asked.append(worker)
        return WorkerLoad(active_requests=worker % 3, pending_prefill_tokens=10 * worker)


def test_lazy_loads_read_each_load_once_and_only_when_asked() -> None:
    source = CountingSource([4, 1, 7])
    loads = LazyLoads(source, source.workers())
    assert list(loads) == [4, 1, 7] and len(loads) == 3
    stranger: object = "x"
    assert 1 in loads and 2 not in loads and stranger not in loads
    assert sorted(loads) == [1, 4, 7]
    assert source.asked == []  # keys, order, membership: no load read
    assert loads[7] == WorkerLoad(1, 70)
    assert loads[7] is loads[7]
    assert source.asked == [7]
    with pytest.raises(KeyError):
        loads[2]
    assert loads.get(2) is None
    assert dict(loads) == {w: source.load(w) for w in (4, 1, 7)}
    assert source.asked.count(7) == 2  # once by the mapping, once by the comparison above


@pytest.mark.parametrize("name", ["round_robin", "random"])
def test_cache_blind_policies_read_no_load(name: str) -> None:
    source = CountingSource([0, 1, 2, 3])
    router = Router(4, name, source)
    picks = [router.route(array("i", range(i, i + 9))).worker for i in range(12)]
    assert source.asked == []
    assert set(picks) <= {0, 1, 2, 3}


class RecordingPolicy:
    """Picks the least loaded worker; records the kind of mapping it was given."""

    name = "recording"

    def __init__(self, reads_loads: bool) -> None:
        self.reads_loads = reads_loads
        self.seen: list[type] = []

    def choose(self, request: RouteRequest) -> PolicyChoice:
        self.seen.append(type(request.loads))
        loads = request.loads
        w = min(loads, key=lambda w: (loads[w].pending_prefill_tokens, w))
        return PolicyChoice(w, "least prefill")


def test_a_policy_that_says_it_reads_no_load_still_gets_the_loads_it_asks_for() -> None:
    lazy, eager = RecordingPolicy(False), RecordingPolicy(True)
    got = []
    for policy in (lazy, eager):
        source = CountingSource([5, 2, 9])
        got.append(Router(4, policy, source).route(array("i", range(8))).worker)
        assert sorted(source.asked) == [2, 5, 9]
    assert got == [2, 2]
    assert lazy.seen == [LazyLoads] and eager.seen == [dict]


def test_default_policies_without_the_flag_get_every_load() -> None:
    policy = make_policy("least_loaded")
    assert getattr(policy, "reads_loads", True)
    source = CountingSource([0, 1])
    Router(4, policy, source).route(array("i", range(8)))
    assert sorted(source.asked) == [0, 1]


@pytest.mark.parametrize("name", ["round_robin", "random"])
def test_a_run_routes_as_with_every_load_read(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    reqs = synthetic_workload("mixed", seed=2, spec=SyntheticSpec(num_requests=50))
    config = SimConfig(workers=3, tokens_per_block=16, device_blocks=300)
    lazy = simulate(reqs, name, config)
    cls = type(make_policy(name))
    monkeypatch.setattr(cls, "reads_loads", True)  # the eager path, as before
    eager = simulate(reqs, name, config)
    fields = ("request_id", "worker", "first_token_ms", "finish_ms", "best_overlap_tokens")
    rows = [[tuple(getattr(r, f) for f in fields) for r in s.records] for s in (lazy, eager)]
    assert rows[0] == rows[1]

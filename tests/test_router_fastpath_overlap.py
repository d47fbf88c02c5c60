"""The simulator's true overlaps (``leading_held`` in router_sim.sim.worker, what
SimWorker.true_overlap and the simulator's per-request overlaps count) against an independent
reference."""

from __future__ import annotations

from itertools import takewhile
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router_sim.sim.simulator import Restart, SimConfig, Simulation, simulate
from router_sim.sim.worker import leading_held
from router_sim.sim.workloads import SyntheticSpec, synthetic_workload


def held_prefixes(sets: list[set[Any]], keys: list[Any]) -> list[int]:
    return [leading_held(s, keys) for s in sets]


def _reference(sets: list[set[int]], keys: list[int]) -> list[int]:
    """Leading keys each set holds, written independently of the loop under test."""
    return [sum(1 for _ in takewhile(s.__contains__, keys)) for s in sets]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sets(st.integers(0, 12)), max_size=6),
    st.lists(st.integers(0, 12), max_size=20),
)
def test_held_prefixes_counts_each_sets_leading_keys(sets: list[set[int]], keys: list[int]) -> None:
    assert held_prefixes(sets, keys) == _reference(sets, keys)


def test_held_prefixes_by_hand() -> None:
    # hand-derived: {1,2,3} holds 1,2,3 then misses 4; {2} misses the first key
    assert held_prefixes([{1, 2, 3}, {2}, set(), {1, 2, 4}], [1, 2, 3, 4]) == [3, 0, 0, 2]
    assert held_prefixes([{1, 2}], []) == [0]
    assert held_prefixes([], [1, 2]) == []
    big = 1 << 63  # hashes are uint64s: the keys are compared as ints, not truncated
    assert held_prefixes([{big, big + 1}], [big, big + 1, 0]) == [2]
    assert held_prefixes([{big}], [big - (1 << 64)]) == [0]


def test_huge_key_lists_are_read_up_to_the_first_miss() -> None:
    keys = list(range(200_000))
    assert held_prefixes([set(keys), set(keys[:1000]), set()], keys) == [200_000, 1000, 0]


def test_many_sets_and_keys_of_both_hash_types() -> None:
    sets = [set(range(i)) for i in range(200)]  # set i holds keys 0..i-1
    assert held_prefixes(sets, list(range(300))) == list(range(200))
    mixed: list[int | str] = [1, "a", "ab" * 32, 1 << 70, -5]  # ints and hex digests
    assert held_prefixes([set(mixed), set(mixed[:3]), set(mixed[:1])], mixed) == [5, 3, 1]


SPEC = SyntheticSpec(num_requests=60, rate_per_s=60.0)


def _checked(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make every run compare the simulator's overlaps with the independent reference."""
    seen: list[int] = []
    native = Simulation._true_overlaps

    def both(self: Simulation, hashes: list[Any]) -> list[int]:
        got = native(self, hashes)
        assert got == _reference([w.held for w in self.workers], hashes)
        seen.append(max(got, default=0))
        return got

    monkeypatch.setattr(Simulation, "_true_overlaps", both)
    return seen


@pytest.mark.pure
@pytest.mark.parametrize("workload", ["shared-prompts", "multi-turn", "mixed"])
def test_a_runs_overlaps_equal_the_reference(
    monkeypatch: pytest.MonkeyPatch, workload: str
) -> None:
    seen = _checked(monkeypatch)
    reqs = synthetic_workload(workload, seed=3, spec=SPEC)
    config = SimConfig(
        workers=3, tokens_per_block=16, device_blocks=300, restarts=[Restart(1, 1500.0)]
    )
    # the oracle's workers keep the held sets that _true_overlaps reads (the other policies
    # read their trees, see tests/test_cached_prefix.py)
    simulate(reqs, "oracle", config)
    assert len(seen) == len(reqs)
    assert any(seen)  # some requests were held somewhere: the comparison saw real overlaps

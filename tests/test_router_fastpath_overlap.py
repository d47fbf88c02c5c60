"""The simulator's true overlaps in one native call (router_sim.router._match.held_prefixes) against
the per-worker loop they replace (SimWorker.true_overlap), and against hostile arguments."""

from __future__ import annotations

from itertools import takewhile
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router_sim.router import _match
from router_sim.sim.simulator import Restart, SimConfig, Simulation, simulate
from router_sim.sim.workloads import SyntheticSpec, synthetic_workload

held_prefixes = _match.held_prefixes


def _reference(sets: list[set[int]], keys: list[int]) -> list[int]:
    """Leading keys each set holds, written independently of both paths under test."""
    return [sum(1 for _ in takewhile(s.__contains__, keys)) for s in sets]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sets(st.integers(0, 12)), max_size=6),
    st.lists(st.integers(0, 12), max_size=20),
)
def test_held_prefixes_counts_each_sets_leading_keys(sets: list[set[int]], keys: list[int]) -> None:
    assert held_prefixes(sets, keys) == _reference(sets, keys)
    assert held_prefixes([frozenset(s) for s in sets], tuple(keys)) == _reference(sets, keys)


def test_held_prefixes_by_hand() -> None:
    # hand-derived: {1,2,3} holds 1,2,3 then misses 4; {2} misses the first key
    assert held_prefixes([{1, 2, 3}, {2}, set(), {1, 2, 4}], [1, 2, 3, 4]) == [3, 0, 0, 2]
    assert held_prefixes([{1, 2}], []) == [0]
    assert held_prefixes([], [1, 2]) == []
    big = 1 << 63  # hashes are uint64s: the keys are compared as ints, not truncated
    assert held_prefixes([{big, big + 1}], [big, big + 1, 0]) == [2]
    assert held_prefixes([{big}], [big - (1 << 64)]) == [0]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((1, [1]), "sequence of sets"),
        (([1], [1]), r"sets\[0\] is int"),
        (([{1}, {1: 2}], [1]), r"sets\[1\] is dict"),
        (([{1}], 5), "keys must be a sequence"),
        (([{1}],), "held_prefixes"),
        (([{1}], [1], 3), "held_prefixes"),
    ],
)
def test_held_prefixes_refuses_what_it_cannot_read(args: tuple[Any, ...], message: str) -> None:
    with pytest.raises(TypeError, match=message):
        held_prefixes(*args)


def test_an_unhashable_key_raises_as_the_set_lookup_does() -> None:
    with pytest.raises(TypeError, match="unhashable"):
        held_prefixes([{1}], [1, [2]])
    with pytest.raises(TypeError, match="unhashable"):
        held_prefixes([set()], [[2]])


class _Shrinker:
    """A key equal to 1 whose comparison empties the lists the call reads."""

    def __init__(self, victims: list[list[Any]]) -> None:
        self.victims = victims

    def __hash__(self) -> int:
        return hash(1)

    def __eq__(self, other: object) -> bool:
        for v in self.victims:
            v.clear()
        return other == 1


def test_keys_and_sets_changed_during_the_call_neither_crash_nor_read_freed_items() -> None:
    keys: list[Any] = []
    sets: list[Any] = [{1, 2}, {1, 2}, {1, 2}]
    keys += [_Shrinker([keys, sets]), 2, 3]
    got = held_prefixes(sets, keys)
    # the sets are taken as they were at the call; the first key, compared with 1 (equal) in
    # each of them, emptied the key list: the call stops at its new end
    assert got == [1, 1, 1]
    assert keys == [] and sets == []


class _OwnSet(set[int]):
    def __contains__(self, item: object) -> bool:
        return True


def test_a_set_subclass_is_refused_since_its_membership_may_be_its_own() -> None:
    with pytest.raises(TypeError, match=r"sets\[0\] is _OwnSet"):
        held_prefixes([_OwnSet()], [1])


def test_huge_key_lists_are_read_up_to_the_first_miss() -> None:
    keys = list(range(200_000))
    assert held_prefixes([set(keys), set(keys[:1000]), set()], keys) == [200_000, 1000, 0]


def test_more_sets_than_the_stack_holds_and_keys_of_any_type() -> None:
    sets = [set(range(i)) for i in range(200)]  # set i holds keys 0..i-1
    assert held_prefixes(sets, list(range(300))) == list(range(200))
    mixed: list[object] = [1, "a", (2, 3), 1 << 70, -5]
    assert held_prefixes([set(mixed), set(mixed[:3]), frozenset(mixed[:1])], mixed) == [5, 3, 1]


SPEC = SyntheticSpec(num_requests=60, rate_per_s=60.0)


def _checked(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make every run compare the native overlaps with the per-worker reference loop."""
    seen: list[int] = []
    native = Simulation._true_overlaps

    def both(self: Simulation, hashes: list[Any]) -> list[int]:
        got = native(self, hashes)
        assert got == [w.true_overlap(hashes) for w in self.workers]
        seen.append(max(got, default=0))
        return got

    monkeypatch.setattr(Simulation, "_true_overlaps", both)
    return seen


@pytest.mark.pure
@pytest.mark.parametrize("workload", ["shared-prompts", "multi-turn", "mixed"])
def test_a_runs_native_overlaps_equal_the_loop_over_workers(
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

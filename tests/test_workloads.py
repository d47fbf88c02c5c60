"""Synthetic workloads and Mooncake hash-id expansion: seeded, scoped, shaped as documented."""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Callable
from typing import Any

import pytest
from _reference import expand_hash_ids as expand_hash_ids_ref
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.scope import ReuseScope, cache_salt_id
from router_sim.sim import workloads
from router_sim.sim.workloads import (
    WORKLOADS,
    Request,
    SyntheticSpec,
    expand_hash_ids,
    identical_prompts_for_tenants,
    synthetic_workload,
)


def _fingerprint(reqs: list[Request]) -> list[tuple[object, ...]]:
    return [
        (r.arrival_ms, r.lora_id, r.cache_salt, tuple(r.tokens()), r.output_length) for r in reqs
    ]


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_equal_seeds_give_equal_workloads(name: str) -> None:
    spec = SyntheticSpec(num_requests=60)
    a = synthetic_workload(name, seed=3, spec=spec)
    b = synthetic_workload(name, seed=3, spec=spec)
    c = synthetic_workload(name, seed=4, spec=spec)
    assert _fingerprint(a) == _fingerprint(b)
    assert _fingerprint(a) != _fingerprint(c)
    assert len(a) == 60
    assert [r.request_id for r in a] == list(range(60))


def test_poisson_arrivals_have_the_requested_rate() -> None:
    reqs = synthetic_workload("shared-prompts", seed=1, spec=SyntheticSpec(num_requests=2000))
    times = [r.arrival_ms for r in reqs]
    assert times == sorted(times)
    mean_gap_s = times[-1] / 1000.0 / (len(times) - 1)
    assert mean_gap_s == pytest.approx(1 / 20.0, rel=0.1)


def test_tenants_and_adapters_get_their_own_scopes() -> None:
    tenants = synthetic_workload("tenants", seed=0, spec=SyntheticSpec(num_requests=80))
    salts = {r.cache_salt for r in tenants}
    assert salts <= {f"tenant-{i}" for i in range(4)} and len(salts) > 1
    for r in tenants:
        assert r.cache_salt is not None
        assert r.scope == ReuseScope(salt=cache_salt_id(r.cache_salt))
    lora = synthetic_workload("lora", seed=0, spec=SyntheticSpec(num_requests=80))
    assert {r.lora_id for r in lora} == {1, 2, 3}
    assert all(r.scope == ReuseScope(lora_id=r.lora_id) for r in lora)


def test_a_sessions_next_turn_extends_prompt_and_answer_after_think_time() -> None:
    reqs = synthetic_workload("multi-turn", seed=2, spec=SyntheticSpec(num_requests=150))
    by_session: dict[int, list[Request]] = {}
    for r in reqs:
        assert r.session_id is not None
        by_session.setdefault(r.session_id, []).append(r)
    followed = 0
    for turns in by_session.values():
        for prev, nxt in itertools.pairwise(turns):
            history = prev.tokens() + prev.output_tokens()
            assert nxt.tokens()[: len(history)] == history
            assert len(nxt.tokens()) > len(history)
            assert nxt.arrival_ms >= prev.arrival_ms + 2000.0
            followed += 1
    assert followed > 20


def test_identical_prompts_differ_only_by_salt() -> None:
    reqs = identical_prompts_for_tenants(tenants=2, prompts=3, repeats=2)
    assert len(reqs) == 12
    a = [tuple(r.tokens()) for r in reqs if r.cache_salt == "tenant-0"]
    b = [tuple(r.tokens()) for r in reqs if r.cache_salt == "tenant-1"]
    assert a == b


def test_hash_ids_expand_to_their_own_tokens() -> None:
    one = expand_hash_ids((7, 8, 9), 1100)
    two = expand_hash_ids((7, 8, 5), 1030)
    assert len(one) == 1100 and len(two) == 1030
    assert one[:1024] == two[:1024]  # equal ids, equal tokens
    assert set(one[1024:]).isdisjoint(two[1024:])  # distinct ids, disjoint tokens
    assert expand_hash_ids((9,), 76) == one[1024:1100]  # an id's tokens do not depend on position
    assert all(0 <= t < 2**31 for t in one)
    assert len(set(expand_hash_ids(tuple(range(50)), 50 * 512))) == 50 * 512


def test_hash_ids_must_cover_the_prompt() -> None:
    with pytest.raises(ValueError, match="hash ids"):
        expand_hash_ids((1, 2), 1025)


def test_request_validation_and_generated_answers() -> None:
    with pytest.raises(ValueError, match="prompt or hash_ids"):
        Request(0, 0.0, 10, 5)
    with pytest.raises(ValueError, match="prompt has 2 tokens"):
        Request(0, 0.0, 10, 5, prompt=array("i", [1, 2]))
    with pytest.raises(ValueError, match="output_length"):
        Request(0, 0.0, 2, 0, prompt=array("i", [1, 2]))
    r = Request(3, 0.0, 2, 40, prompt=array("i", [1, 2]))
    out = r.output_tokens()
    assert len(out) == 40 and min(out) >= 2**30 and max(out) < 2**31
    assert out == Request(3, 5.0, 2, 40, prompt=array("i", [9, 9])).output_tokens()


def test_unknown_workload_is_rejected_with_the_choices() -> None:
    with pytest.raises(ValueError, match="multi-turn"):
        synthetic_workload("nope")


@pytest.mark.parametrize("expand", [expand_hash_ids, expand_hash_ids_ref])
@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from([1, 2, 16, 100, 512, 4096]),
    st.lists(st.integers(0, 2**40), min_size=1, max_size=5),
    st.data(),
)
def test_expansion_matches_the_per_token_formula(
    expand: Callable[[tuple[int, ...], int, int], array[int]],
    n: int,
    ids: list[int],
    data: st.DataObject,
) -> None:
    length = data.draw(st.integers(1, n * len(ids)))
    pos_bits = max(1, (n - 1).bit_length())
    b = 30 - pos_bits  # token j of id h is j << b | (h mod 2**b), as the docstring says
    naive = [j << b | (h % 2**b) for h in ids for j in range(n)][:length]
    out = expand(tuple(ids), length, n)
    assert out.typecode == "i" and out.tolist() == naive
    assert max(out) < 2**30  # below every generated answer token


def test_native_expansion_refuses_what_it_cannot_write() -> None:

    def expand(ids: Any, count: int, *layout: int) -> array[int]:
        return workloads.expand_array(array("i", [0]) * count, ids, count, *layout)

    assert bytes(expand((), 0, 512, 22, 2**22 - 1)) == b""
    # a block size near the int limit: the ids-needed count must not overflow
    assert expand((5,), 2, 2**63 - 1, 22, 2**22 - 1) == array("i", [5, 1 << 22 | 5])
    with pytest.raises(ValueError):
        expand((1, 2), 1025, 512, 22, 2**22 - 1)  # more tokens than the ids cover
    with pytest.raises(ValueError):
        expand((1,), 4, 0, 22, 2**22 - 1)
    with pytest.raises(ValueError):
        expand((1,), 4, 4, 32, 1)
    with pytest.raises(TypeError):
        expand((1, "2"), 8, 4, 22, 2**22 - 1)
    with pytest.raises(TypeError):
        expand([1], 1, 4, 22, 2**22 - 1)


def test_expansion_is_the_reference_and_too_few_ids_are_refused() -> None:
    ids = (5, 2**23 + 7, 2**40 + 1, -3)
    for length in (1, 511, 512, 1300, 4 * 512):
        assert expand_hash_ids(ids, length) == expand_hash_ids_ref(ids, length, 512)
    for expand in (expand_hash_ids, lambda i, n: expand_hash_ids_ref(i, n, 512)):
        with pytest.raises(ValueError, match="hash ids"):
            expand(ids, 4 * 512 + 1)


def test_answers_are_a_run_of_consecutive_ids() -> None:
    for rid, length in ((0, 1), (3, 40), (2**40 + 5, 700), (12345, 2**16 + 3)):
        out = Request(rid, 0.0, 1, length, prompt=array("i", [1])).output_tokens()
        base = 2**30 + (rid * 4099) % (2**30 - length)  # the formula, by hand
        assert out.typecode == "i" and out.tolist() == list(range(base, base + length))
        assert max(out) < 2**31

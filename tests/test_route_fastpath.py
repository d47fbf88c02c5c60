"""The routing path's shortcuts decide exactly as the plain forms they replace.

kv_overlap scores candidates in one loop instead of through ``cached`` + ``choose_by_cost``;
a request's tie rank is made only when a tie needs it (``lowest_cost(rank_of=...)``); the
router hands the policy the prompt instead of its content key. Each is checked against the
plain form, which stays in the code as the readable reference.
"""

from __future__ import annotations

import functools
import random
from array import array
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router_sim.router.indexer import MatchDetail
from router_sim.router.load import WorkerLoad
from router_sim.router.policies.base import (
    BoundedLoad,
    RouteRequest,
    content_key,
    lowest_cost,
    tie_rank,
)
from router_sim.router.policies.overlap import KvOverlapPolicy, choose_by_cost
from router_sim.router.policies.ttft import PredictedTtftPolicy

_detail = st.builds(
    lambda run, dev, slow_share: MatchDetail(run, min(dev, run), run - slow_share, slow_share),
    st.integers(0, 12),
    st.integers(0, 12),
    st.integers(0, 3),
).filter(lambda d: d.slower_blocks <= d.matched_blocks)

_load = st.builds(
    WorkerLoad,
    active_requests=st.integers(0, 4),
    pending_prefill_tokens=st.sampled_from([0, 0, 100, 512, 2048, 9000]),
    decode_blocks=st.sampled_from([0, 0, 3, 20]),
)


@st.composite
def _requests(draw: st.DrawFn) -> RouteRequest:
    workers = draw(st.lists(st.integers(0, 9), min_size=1, max_size=8, unique=True))
    loads = {w: draw(_load) for w in workers}
    matches = {w: draw(_detail) for w in workers if draw(st.booleans())}
    tokens = array("i", draw(st.lists(st.integers(0, 1000), min_size=1, max_size=40)))
    n = draw(st.integers(1, 14)) * 16 - draw(st.integers(0, 15))
    return RouteRequest([], n, 16, matches, loads, 0.0, None, tokens)


def _reference(
    policy: KvOverlapPolicy, request: RouteRequest
) -> tuple[int, dict[int, float], dict[int, float]]:
    """kv_overlap's decision as ``cached`` + ``choose_by_cost`` make it (the plain form)."""
    cached = policy.cached(request)
    excess = policy.bounded.excess(list(cached))
    choice = choose_by_cost(
        policy.seed,
        request,
        cached,
        policy.overlap_weight,
        0.0,
        policy.recompute_weight,
        prefer=policy.bounded.prefer(),
        extra={w: policy.overlap_weight * x for w, x in excess.items() if x > 0},
    )
    policy.bounded.record(choice.worker)
    return choice.worker, choice.costs, choice.predicted_overlap


@settings(max_examples=150, deadline=None)
@given(st.lists(_requests(), min_size=1, max_size=12), st.sampled_from([None, 0.1, 0.5]))
def test_kv_overlap_decides_as_its_plain_form(
    requests: list[RouteRequest], balance: float | None
) -> None:
    fast = KvOverlapPolicy(balance=balance, seed=7, slower_credit=0.5)
    plain = KvOverlapPolicy(balance=balance, seed=7, slower_credit=0.5)
    for request in requests:  # a sequence, so the balance's counts evolve alike
        choice = fast.choose(request)
        worker, costs, cached = _reference(plain, request)
        assert choice.worker == worker
        assert choice.costs == costs  # the same floats, not merely close ones
        assert list(choice.costs) == list(costs)
        assert choice.predicted_overlap == cached
    assert fast.bounded.sent == plain.bounded.sent


def test_rank_is_made_only_for_a_tie() -> None:
    idle = WorkerLoad()
    made: list[int] = []

    def rank_of() -> Callable[[int], int]:
        made.append(1)
        return lambda w: {0: 5, 1: 3, 2: 9}[w]

    assert (
        lowest_cost({0: 1.0, 1: 2.0, 2: 3.0}, dict.fromkeys(range(3), idle), rank_of=rank_of) == 0
    )
    assert made == []
    tied = {0: 1.0, 1: 1.0, 2: 1.0}
    assert lowest_cost(tied, dict.fromkeys(range(3), idle), rank_of=rank_of) == 1
    assert made == [1]
    # a tie the load settles needs no rank either
    loads = {0: WorkerLoad(active_requests=1), 1: idle, 2: WorkerLoad(active_requests=2)}
    assert lowest_cost(tied, loads, rank_of=rank_of) == 1
    assert made == [1]


def test_lazy_rank_picks_as_the_eager_one() -> None:
    rng = random.Random(3)
    idle = WorkerLoad()
    for _ in range(300):
        costs = {w: float(rng.randint(0, 2)) for w in range(rng.randint(1, 8))}
        loads = {
            w: WorkerLoad(active_requests=rng.randint(0, 1)) if rng.random() < 0.3 else idle
            for w in costs
        }
        key = rng.getrandbits(64)
        eager = lowest_cost(costs, loads, tie_rank(key))
        assert lowest_cost(costs, loads, rank_of=functools.partial(tie_rank, key)) == eager


@given(st.lists(st.integers(0, 2**31 - 1), max_size=70), st.integers(0, 2**32))
def test_prompt_gives_the_tie_key_of_its_content_key(ids: list[int], seed: int) -> None:
    for prompt in (ids, array("i", ids), array("i", ids).tobytes()):
        lazy = RouteRequest([5], max(1, len(ids)), 16, {}, {}, prompt=prompt)
        eager = RouteRequest([5], max(1, len(ids)), 16, {}, {}, content_key=content_key(prompt))
        assert lazy.tie_key(seed) == eager.tie_key(seed)
    # a content key the caller gives wins over the prompt
    both = RouteRequest([5], 1, 16, {}, {}, content_key=11, prompt=ids)
    assert both.tie_key(seed) == RouteRequest([5], 1, 16, {}, {}, content_key=11).tie_key(seed)


@given(
    st.dictionaries(st.integers(0, 12), st.integers(0, 40), max_size=12),
    st.lists(st.integers(0, 12), max_size=10, unique=True),
    st.sampled_from([None, 0.05, 0.1, 1.0]),
    st.integers(0, 3),
)
def test_eligible_counts_are_eligible_and_excess(
    sent: dict[int, int], workers: list[int], epsilon: float | None, slack: int
) -> None:
    bounded = BoundedLoad(epsilon, slack)
    bounded.sent.update(sent)
    eligible, counts, mean = bounded.eligible_counts(workers)
    assert eligible == bounded.eligible(workers)
    assert counts == [sent.get(w, 0) for w in eligible] or epsilon is None
    excess = bounded.excess(eligible)
    if mean is None:
        assert epsilon is None or not workers
        assert not any(excess.values())
    else:
        assert {w: max(0.0, c - mean) for w, c in zip(eligible, counts, strict=True)} == excess


@settings(max_examples=150, deadline=None)
@given(_requests(), st.sampled_from([1, 16, 64]), st.sampled_from([0.0, 1.0, 0.5]))
def test_predicted_ttft_figures_are_its_per_worker_terms(
    request: RouteRequest, chunk_tokens: int, recompute_weight: float
) -> None:
    policy = PredictedTtftPolicy(
        chunk_tokens=chunk_tokens, recompute_weight=recompute_weight, slower_credit=0.5
    )
    workers = sorted(request.loads)
    costs, predicted, overlap = policy._figures(request, workers)
    for w in workers:
        cost, ms, cached, _ = policy._worker(request, w, None)
        assert (costs[w], predicted[w], overlap[w]) == (cost, ms, cached)
    assert list(costs) == workers


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 2**31 - 1), max_size=80),
    st.sampled_from([None, 7]),
    st.sampled_from([None, "tenant"]),
)
def test_route_hashes_a_packed_prompt_as_hash_request(
    ids: list[int], lora: int | None, salt: str | None
) -> None:
    from kvcache.scope import ReuseScope
    from router_sim.router.load import StaticLoadSource
    from router_sim.router.routing import Router

    router = Router(8, "kv_overlap", StaticLoadSource({0: WorkerLoad(), 1: WorkerLoad()}))
    scope = ReuseScope.for_request(lora_id=lora, cache_salt=salt)
    packed = array("i", ids)
    decision = router.route(packed, scope)
    assert decision.block_hashes == router.hash_request(ids, scope)
    assert decision.block_hashes == router.route(list(ids), scope).block_hashes
    assert decision.best_overlap == 0 == decision.chosen_overlap


def test_route_refuses_a_negative_packed_id_as_hash_request() -> None:
    from kvcache.scope import ReuseScope
    from router_sim.router.load import StaticLoadSource
    from router_sim.router.routing import Router

    router = Router(4, "kv_overlap", StaticLoadSource({0: WorkerLoad()}))
    bad = array("i", [1, 2, -3, 4, 5])
    with pytest.raises(ValueError) as by_hash:  # the general path, from a list
        router.hash_request(list(bad), ReuseScope.for_request())
    with pytest.raises(ValueError) as by_route:
        router.route(bad, ReuseScope.for_request())
    assert str(by_route.value) == str(by_hash.value)

"""Routing policies: exact choices on constructed states, seeded sampling, TTL expiry."""

from __future__ import annotations

import math
from array import array
from collections import Counter
from collections.abc import Sequence

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from events.wire.model import BlockHash
from router_sim.router.indexer import MatchDetail
from router_sim.router.load import WorkerLoad
from router_sim.router.policies import (
    DEFAULT_OVERLAP_WEIGHT,
    ApproximatePolicy,
    CacheAwarePolicy,
    KvOverlapPolicy,
    NoWorkersError,
    OraclePolicy,
    PredictedTtftPolicy,
    RouteRequest,
    RoutingError,
    make_policy,
    without_history,
)
from router_sim.router.policies.base import CONTENT_TAIL, content_key, lowest_cost, mix64, tie_rank
from router_sim.sim.timing_model import PolynomialTiming

TPB = 4
HASHES: list[BlockHash] = list(range(100, 108))  # an 8-block, 32-token prompt


def req(
    loads: dict[int, WorkerLoad],
    matches: dict[int, MatchDetail] | None = None,
    now_ms: float = 0.0,
    hashes: list[BlockHash] | None = None,
) -> RouteRequest:
    hs = HASHES if hashes is None else hashes
    return RouteRequest(hs, len(hs) * TPB, TPB, matches or {}, loads, now_ms)


def on_device(n: int) -> MatchDetail:
    return MatchDetail(n, n, n, 0)


IDLE = WorkerLoad()


def test_round_robin_cycles_and_survives_membership_changes() -> None:
    p = make_policy("round_robin")
    loads = {2: IDLE, 0: IDLE, 1: IDLE}
    assert [p.choose(req(loads)).worker for _ in range(4)] == [0, 1, 2, 0]
    del loads[1]
    assert p.choose(req(loads)).worker == 2  # next id after 0 still present


def test_random_is_seeded_and_covers_workers() -> None:
    loads = {0: IDLE, 1: IDLE, 2: IDLE}
    a = [make_policy("random", seed=7).choose(req(loads)).worker for _ in range(1)]
    pa, pb = make_policy("random", seed=7), make_policy("random", seed=7)
    seq_a = [pa.choose(req(loads)).worker for _ in range(50)]
    seq_b = [pb.choose(req(loads)).worker for _ in range(50)]
    assert seq_a == seq_b and seq_a[0] == a[0]
    assert set(seq_a) == {0, 1, 2}


def test_least_loaded_by_either_metric() -> None:
    loads = {0: WorkerLoad(3, 10), 1: WorkerLoad(1, 5000), 2: WorkerLoad(2, 0)}
    assert make_policy("least_loaded").choose(req(loads)).worker == 1
    by_tokens = make_policy("least_loaded", metric="pending_prefill_tokens")
    assert by_tokens.choose(req(loads)).worker == 2
    with pytest.raises(ValueError, match="metric"):
        make_policy("least_loaded", metric="vibes")


def test_kv_overlap_prefers_the_cache_when_loads_are_equal() -> None:
    loads = {0: WorkerLoad(decode_blocks=10), 1: WorkerLoad(decode_blocks=10)}
    choice = make_policy("kv_overlap").choose(req(loads, {0: on_device(8)}))
    assert choice.worker == 0
    # cost = weight * (queued + 2 x uncached blocks) + decode blocks (held + the request's 8)
    w = DEFAULT_OVERLAP_WEIGHT
    assert choice.costs == {0: w * 0 + 10 + 8, 1: w * (2 * 8) + 10 + 8}
    # Dynamo's plain form: weight 1, uncached blocks counted once
    plain = make_policy("kv_overlap", overlap_weight=1.0, recompute_weight=0.0)
    assert plain.choose(req(loads, {0: on_device(8)})).costs == {0: 18.0, 1: 8 + 10 + 8}


def test_kv_overlap_most_cached_worker_loses_to_lower_load() -> None:
    loads = {0: WorkerLoad(active_requests=9, decode_blocks=300), 1: WorkerLoad(decode_blocks=10)}
    choice = make_policy("kv_overlap").choose(req(loads, {0: on_device(8)}))
    w = DEFAULT_OVERLAP_WEIGHT
    assert choice.costs == {0: 308.0, 1: w * 16 + 18}
    assert choice.worker == 1
    # a heavier overlap weight flips it back: recomputing 8 blocks now costs 20 * 16
    heavy = make_policy("kv_overlap", overlap_weight=20.0).choose(req(loads, {0: on_device(8)}))
    assert heavy.worker == 0


def test_kv_overlap_queued_prefill_counts_as_blocks_to_prefill() -> None:
    policy = make_policy("kv_overlap", overlap_weight=1.0, recompute_weight=0.0)
    loads = {0: WorkerLoad(pending_prefill_tokens=40), 1: IDLE}
    choice = policy.choose(req(loads, {0: on_device(8)}))
    assert choice.costs == {0: 40 / TPB + 0 + 8, 1: 8 + 8}
    assert choice.worker == 1


def test_kv_overlap_counts_recomputation_as_work_added_to_the_fleet() -> None:
    # A burst: worker 0 holds the whole 8-block prompt but already queues 10 blocks of
    # prefill. Counting uncached blocks once (a pure wait estimate) sends the request to the
    # idle worker 1, which recomputes all 8 blocks; counted twice (the request's wait plus
    # the capacity they take), 10 queued blocks are cheaper than 2 x 8 recomputed ones.
    loads = {0: WorkerLoad(active_requests=1, pending_prefill_tokens=10 * TPB), 1: IDLE}
    matches = {0: on_device(8)}
    wait_only = make_policy("kv_overlap", recompute_weight=0.0).choose(req(loads, matches))
    assert wait_only.worker == 1
    choice = make_policy("kv_overlap").choose(req(loads, matches))
    w = DEFAULT_OVERLAP_WEIGHT
    assert choice.costs == {0: w * 10 + 8, 1: w * 16 + 8}
    assert choice.worker == 0
    # a queue longer than twice the recomputation moves it after all
    loads[0] = WorkerLoad(active_requests=2, pending_prefill_tokens=17 * TPB)
    assert make_policy("kv_overlap").choose(req(loads, matches)).worker == 1


def test_kv_overlap_credits_slower_tier_blocks_partly() -> None:
    loads = {0: IDLE, 1: IDLE}
    matches = {0: MatchDetail(8, 4, 4, 4), 1: on_device(6)}
    choice = make_policy("kv_overlap").choose(req(loads, matches))
    assert choice.predicted_overlap == {0: 4 + 0.75 * 4, 1: 6.0}
    assert choice.worker == 0  # 7 credited blocks beat 6
    stingy = make_policy("kv_overlap", slower_credit=0.25).choose(req(loads, matches))
    assert stingy.worker == 1  # 5 credited blocks lose to 6


def test_kv_overlap_ties_go_to_the_least_loaded() -> None:
    loads = {0: WorkerLoad(active_requests=3), 1: WorkerLoad(active_requests=1)}
    choice = make_policy("kv_overlap").choose(req(loads))
    assert choice.costs[0] == choice.costs[1]
    assert choice.worker == 1


def test_kv_overlap_temperature_samples_softmax_of_normalized_costs() -> None:
    # costs 16 (worker 0: all cached) and 24 (worker 1): normalized 2/3 and 1
    loads = {0: WorkerLoad(decode_blocks=8), 1: WorkerLoad(decode_blocks=8)}
    matches = {0: on_device(8)}
    t = 0.2
    w0, w1 = math.exp(-(16 / 24) / t), math.exp(-1.0 / t)
    expected_p0 = w0 / (w0 + w1)
    plain = {"overlap_weight": 1.0, "recompute_weight": 0.0, "balance": None}
    policy = make_policy("kv_overlap", temperature=t, seed=123, **plain)
    n = 4000
    picks = Counter(policy.choose(req(loads, matches)).worker for _ in range(n))
    assert abs(picks[0] / n - expected_p0) < 0.03
    assert picks[1] > 0  # sampling, not argmin
    again = make_policy("kv_overlap", temperature=t, seed=123, **plain)
    first = [again.choose(req(loads, matches)).worker for _ in range(50)]
    replay = make_policy("kv_overlap", temperature=t, seed=123, **plain)
    assert first == [replay.choose(req(loads, matches)).worker for _ in range(50)]


def test_cache_aware_follows_the_prefix_when_balanced() -> None:
    policy = CacheAwarePolicy(cache_threshold=0.5, balance_abs_threshold=4, balance_rel_threshold=2)
    loads = {0: WorkerLoad(active_requests=5), 1: WorkerLoad(active_requests=2)}
    choice = policy.choose(req(loads, {0: on_device(6)}))
    assert (choice.worker, choice.reason.startswith("best prefix match")) == (0, True)


def test_cache_aware_switches_to_balance_when_both_thresholds_exceeded() -> None:
    policy = CacheAwarePolicy(cache_threshold=0.5, balance_abs_threshold=4, balance_rel_threshold=2)
    matches = {0: on_device(8)}
    # 7 - 2 = 5 > 4 and 7 > 2 * 2: imbalanced, the cache is ignored
    loads = {0: WorkerLoad(active_requests=7), 1: WorkerLoad(active_requests=2)}
    assert policy.choose(req(loads, matches)).worker == 1
    # absolute gap large but relative gap small (30 <= 2 * 20): balanced, cache wins
    loads = {0: WorkerLoad(active_requests=30), 1: WorkerLoad(active_requests=20)}
    assert policy.choose(req(loads, matches)).worker == 0


def test_cache_aware_low_match_goes_to_most_free_cache() -> None:
    policy = CacheAwarePolicy(cache_threshold=0.5)
    loads = {0: WorkerLoad(kv_usage=0.9), 1: WorkerLoad(kv_usage=0.2), 2: WorkerLoad(kv_usage=0.5)}
    choice = policy.choose(req(loads, {0: on_device(3)}))  # ratio 3/8 < 0.5
    assert choice.worker == 1


def test_approximate_remembers_its_decisions_until_the_ttl() -> None:
    policy = ApproximatePolicy(ttl_ms=5000)
    loads = {0: WorkerLoad(decode_blocks=2), 1: IDLE}
    first = policy.choose(req(loads, now_ms=0))
    assert first.worker == 1  # nothing predicted anywhere: the least decode load
    loads = {0: IDLE, 1: WorkerLoad(decode_blocks=2)}
    second = policy.choose(req(loads, now_ms=4000))  # remembered on 1, expiry now 9000
    assert second.predicted_overlap == {0: 0.0, 1: 8.0}
    assert second.worker == 1
    third = policy.choose(req(loads, now_ms=9000))  # expired exactly at 9000
    assert third.predicted_overlap == {0: 0.0, 1: 0.0}
    assert third.worker == 0


def test_approximate_caps_remembered_blocks_per_worker() -> None:
    policy = ApproximatePolicy(ttl_ms=1e9, max_blocks_per_worker=5)
    loads = {0: IDLE}
    policy.choose(req(loads))
    assert policy.remembered(0) == 5
    # the oldest were forgotten first: the request's first blocks are gone
    assert policy.choose(req(loads, now_ms=1)).predicted_overlap == {0: 0.0}


class TableOracle:
    def __init__(self, table: dict[int, int]) -> None:
        self.table = table

    def true_overlap(self, worker: int, block_hashes: Sequence[BlockHash]) -> int:
        return min(self.table.get(worker, 0), len(block_hashes))


def test_oracle_uses_true_state_not_the_index() -> None:
    loads = {0: IDLE, 1: IDLE}
    stale_index = {0: on_device(8)}
    policy = make_policy("oracle", oracle=TableOracle({1: 8}))
    assert policy.choose(req(loads, stale_index)).worker == 1
    assert isinstance(policy, OraclePolicy)
    with pytest.raises(RoutingError, match="CacheOracle"):
        OraclePolicy().choose(req(loads))


def test_predicted_ttft_adds_queue_and_uncached_prefill() -> None:
    timing = PolynomialTiming()
    policy = PredictedTtftPolicy(timing, recompute_weight=0.0)
    loads = {
        0: WorkerLoad(
            active_requests=4, pending_prefill_tokens=4000, kv_usage=0.5, decode_blocks=9
        ),
        1: WorkerLoad(active_requests=1, kv_usage=0.1, decode_blocks=3),
    }
    request = req(loads, {0: on_device(8)})
    choice = policy.choose(request)
    # one chunk each, with one decode iteration at the worker's KV usage
    assert choice.costs[0] == pytest.approx(timing.prefill_ms(4000) + timing.decode_ms(0.5))
    assert choice.costs[1] == pytest.approx(timing.prefill_ms(32) + timing.decode_ms(0.1))
    assert choice.worker == 1  # worker 0 holds the prompt but its queue is long
    loads[0] = WorkerLoad(active_requests=4, pending_prefill_tokens=0, kv_usage=0.5)
    assert policy.choose(req(loads, {0: on_device(8)})).worker == 0


def test_predicted_ttft_prices_a_long_queue_in_chunks() -> None:
    timing = PolynomialTiming()
    policy = PredictedTtftPolicy(timing, chunk_tokens=8192, recompute_weight=0.0)
    queued = WorkerLoad(active_requests=3, pending_prefill_tokens=3 * 8192)
    request = req({0: queued, 1: IDLE}, {0: on_device(8)})
    # three full steps, not one 24k-token batch (whose quadratic term would overprice it)
    assert policy.predict_ms(request, 0) == pytest.approx(3 * timing.prefill_ms(8192))
    assert policy.predict_ms(request, 0) < 0.8 * timing.prefill_ms(3 * 8192)
    decoding = WorkerLoad(pending_prefill_tokens=8192 + 100, decode_blocks=5, kv_usage=0.2)
    assert policy.predict_ms(req({0: decoding}), 0) == pytest.approx(
        timing.prefill_ms(8192) + timing.prefill_ms(132) + 2 * timing.decode_ms(0.2)
    )


def test_predicted_ttft_counts_the_recomputation_a_choice_adds() -> None:
    timing = PolynomialTiming()
    # a 1024-token prompt of 128-token blocks, all cached on worker 0, which already queues
    # 1200 tokens; worker 1 is idle. Its own TTFT alone favours recomputing on worker 1.
    hashes: list[BlockHash] = list(range(8))
    loads = {0: WorkerLoad(active_requests=1, pending_prefill_tokens=1200), 1: IDLE}
    request = RouteRequest(hashes, 1024, 128, {0: on_device(8)}, loads)
    greedy = PredictedTtftPolicy(timing, recompute_weight=0.0).choose(request)
    assert greedy.worker == 1
    choice = PredictedTtftPolicy(timing).choose(request)
    assert choice.costs[0] == pytest.approx(timing.prefill_ms(1200))
    assert choice.costs[1] == pytest.approx(2 * timing.prefill_ms(1024))
    assert choice.worker == 0
    with pytest.raises(ValueError, match="chunk_tokens"):
        PredictedTtftPolicy(chunk_tokens=0)


def test_lowest_cost_breaks_ties_by_load_then_by_the_rank() -> None:
    costs = {0: 5.0, 1: 5.0, 2: 5.0, 3: 4.0 + 1.0}
    loads = {0: WorkerLoad(active_requests=1), 1: IDLE, 2: IDLE, 3: IDLE}
    assert lowest_cost(costs, loads) == 1  # no rank: lowest id among the least loaded
    assert lowest_cost(costs, loads, lambda w: {1: 9, 2: 3, 3: 5}[w]) == 2
    assert lowest_cost(costs, loads, lambda w: {1: 9, 2: 7, 3: 5}[w]) == 3
    # worker 0 ranks first but is busier: load decides before the rank
    assert lowest_cost(costs, loads, lambda w: 0 if w == 0 else 1) == 1
    ranked: list[int] = []

    def rank(w: int) -> int:
        ranked.append(w)
        return 0

    assert lowest_cost({0: 1.0, 1: 2.0}, loads, rank) == 0
    assert ranked == []  # no tie, no ranking


def test_mix64_is_splitmix64s_finalizer() -> None:
    # SplitMix64's first outputs for seed 0 (state += 0x9E3779B97F4A7C15, then the
    # finalizer), as published with the reference C code and reproduced by many ports
    golden = 0x9E3779B97F4A7C15
    assert mix64(golden) == 0xE220A8397B1DCDAF
    assert mix64(2 * golden) == 0x6E789E6AA1B965F4
    assert mix64(0) == 0


def test_tie_rank_depends_on_the_request_content_only() -> None:
    a = req({0: IDLE}, hashes=[1, 2, 3])
    assert a.tie_key() == req({5: IDLE}, hashes=[9, 8, 3]).tie_key()  # the last chain hash
    assert a.tie_key() != req({0: IDLE}, hashes=[1, 2, 4]).tie_key()
    assert a.tie_key() != a.tie_key(seed=1)
    short = RouteRequest([], 3, TPB, {}, {0: IDLE})  # no full block: the length decides
    assert short.tie_key() != RouteRequest([], 2, TPB, {}, {0: IDLE}).tie_key()
    text = RouteRequest(["0xab", "0xcd"], 8, TPB, {}, {0: IDLE})  # engine hashes as text
    assert text.tie_key() == RouteRequest(["0x12", "0xcd"], 8, TPB, {}, {1: IDLE}).tie_key()
    assert text.tie_key() != RouteRequest(["0xab", "0xce"], 8, TPB, {}, {0: IDLE}).tie_key()
    rank = tie_rank(a.tie_key())
    firsts = Counter(min(range(8), key=tie_rank(k)) for k in range(4000))
    assert set(firsts) == set(range(8)) and max(firsts.values()) < 600  # ~500 each
    assert len({rank(w) for w in range(64)}) == 64


def test_content_key_reads_the_prompts_tail_and_length_in_any_form() -> None:
    prompt = list(range(1000, 1100))
    tail = prompt[-CONTENT_TAIL:]
    le = b"".join(t.to_bytes(4, "little") for t in tail)
    assert content_key(prompt) == xxhash.xxh64_intdigest(le, seed=len(prompt))
    packed = array("i", prompt)
    assert content_key(packed) == content_key(prompt) == content_key(packed.tobytes())
    assert content_key(memoryview(packed.tobytes())) == content_key(prompt)
    assert content_key([7, *prompt[1:]]) == content_key(prompt)  # only the tail is read
    assert content_key(prompt[:-1]) != content_key(prompt)
    assert content_key([5, *prompt]) != content_key(prompt)  # same tail, other length
    assert content_key([3]) == xxhash.xxh64_intdigest((3).to_bytes(4, "little"), seed=1)
    # with a content key the tie-break ignores the block hashes (engines name blocks apart)
    a = RouteRequest([1, 2], 8, TPB, {}, {0: IDLE}, content_key=99)
    assert a.tie_key() == RouteRequest([3, 4], 8, TPB, {}, {0: IDLE}, content_key=99).tie_key()
    assert a.tie_key() != RouteRequest([1, 2], 8, TPB, {}, {0: IDLE}, content_key=98).tie_key()


@pytest.mark.parametrize("name", ["kv_overlap", "predicted_ttft", "approximate", "oracle"])
def test_ties_spread_over_idle_workers_and_are_seeded(name: str) -> None:
    loads = {w: IDLE for w in range(8)}
    extra = {"oracle": TableOracle({})} if name == "oracle" else {}

    def picks(seed: int) -> list[int]:
        policy = make_policy(name, seed=seed, **extra)
        # every worker idle and none holding the prompt: all tied (the approximate policy
        # remembers its picks, so give it a new prompt each time)
        return [
            policy.choose(req(loads, hashes=[1000 * i + k for k in range(8)])).worker
            for i in range(80)
        ]

    first = picks(seed=3)
    assert len(set(first)) == 8  # not every tie to worker 0
    assert max(Counter(first).values()) <= 20
    assert first == picks(seed=3)
    assert first != picks(seed=4)


@pytest.mark.parametrize("name", ["kv_overlap", "predicted_ttft", "approximate", "oracle"])
def test_replicas_break_ties_alike_whatever_they_routed_before(name: str) -> None:
    loads = {w: IDLE for w in range(8)}
    extra = {"oracle": TableOracle({})} if name == "oracle" else {}
    requests = [req(loads, hashes=[7000 + 10 * i + k for k in range(5)]) for i in range(60)]
    # replicas leave balance off (its counts are each router's own decisions)
    options = without_history(name, extra)
    one, two = make_policy(name, **options), make_policy(name, **options)
    # the second replica routed other requests first (a load balancer splits traffic), and
    # sees the tied requests in another order: with a per-router random draw these differ
    for i in range(37):
        two.choose(req(loads, hashes=[900_000 + 10 * i + k for k in range(5)]))
    a = {id(r): one.choose(r).worker for r in requests}
    b = {id(r): two.choose(r).worker for r in reversed(requests)}
    assert a == b
    assert len(set(a.values())) == 8


def test_tie_breaks_survive_a_worker_leaving() -> None:
    # rendezvous ranks: a request whose tie went to a remaining worker still goes there
    policy = KvOverlapPolicy(balance=None)
    requests = [req({}, hashes=[5000 + i]) for i in range(200)]
    full = {w: IDLE for w in range(6)}
    without_3 = {w: IDLE for w in range(6) if w != 3}
    before = [
        policy.choose(RouteRequest(r.block_hashes, 4, TPB, {}, full)).worker for r in requests
    ]
    after = [
        policy.choose(RouteRequest(r.block_hashes, 4, TPB, {}, without_3)).worker for r in requests
    ]
    moved = [b for a, b in zip(after, before, strict=True) if a != b]
    assert moved and set(moved) == {3}
    assert len(moved) == before.count(3)


def test_polynomial_timing_defaults() -> None:
    timing = PolynomialTiming()
    assert timing.prefill_ms(0) == 0.0
    assert timing.prefill_ms(1000) == pytest.approx(4.21e-7 * 1e6 + 15.18 + 16.5)
    assert timing.decode_ms(0.0) == pytest.approx(5.74)
    assert PolynomialTiming(speedup=2.0).prefill_ms(1000) == pytest.approx(
        timing.prefill_ms(1000) / 2
    )


def test_errors_name_what_was_wrong() -> None:
    with pytest.raises(ValueError, match="unknown routing policy 'nope'"):
        make_policy("nope")
    with pytest.raises(TypeError, match="kv_overlap"):
        make_policy("kv_overlap", overlap_wieght=2.0)
    with pytest.raises(NoWorkersError):
        KvOverlapPolicy().choose(req({}))
    with pytest.raises(ValueError, match="credit"):
        KvOverlapPolicy(slower_credit=1.5)


def test_bounded_load_caps_a_worker_at_one_plus_epsilon_of_the_mean() -> None:
    from router_sim.router.policies.base import BoundedLoad

    b = BoundedLoad(0.5, slack=0)
    for _ in range(3):
        b.record(0)
    # 3 sent to 2 workers: cap ceil(1.5 * (3 + 1) / 2) = 3, and worker 0 has 3
    assert b.eligible([0, 1]) == [1]
    b.record(1)
    # 4 sent: cap ceil(1.5 * 5 / 2) = 4
    assert b.eligible([0, 1]) == [0, 1]
    assert BoundedLoad(None).eligible([0, 1]) == [0, 1]
    b.forget(0)
    assert b.sent == {1: 1}
    loose = BoundedLoad(0.5)  # slack 2: three decisions may follow the first one's cache
    for _ in range(3):
        loose.record(0)
    assert loose.eligible([0, 1]) == [0, 1]  # cap ceil(1.5 * 4 / 2) + 2 = 5
    with pytest.raises(ValueError, match="balance"):
        BoundedLoad(0.0)


@pytest.mark.parametrize("name", ["kv_overlap", "predicted_ttft"])
def test_balance_sends_a_popular_prefix_to_a_second_worker(name: str) -> None:
    """Without the cap every request goes to the holder; with balance=0.5 over 2 workers the
    holder may take decision m + 1 only while it was sent fewer than ceil(1.5 (m + 1) / 2) + 2
    (the whole prompt cached outweighs the soft price of at most 7 excess requests here)."""
    loads = {0: IDLE, 1: IDLE}
    sticky = make_policy(name, seed=1, balance=None)
    assert {sticky.choose(req(loads, {0: on_device(8)})).worker for _ in range(6)} == {0}
    balanced = make_policy(name, seed=1, balance=0.5)
    picks = [balanced.choose(req(loads, {0: on_device(8)})).worker for _ in range(20)]
    expected, held = [], 0
    for m in range(20):  # the documented rule, decision by decision
        to_holder = held < math.ceil(1.5 * (m + 1) / 2) + 2
        expected.append(0 if to_holder else 1)
        held += to_holder
    assert picks == expected and 1 in picks
    fresh = make_policy(name, seed=1, balance=0.5)
    spread = [fresh.choose(req(loads)).worker for _ in range(4)]
    assert sorted(spread[:2]) == [0, 1] and sorted(spread[2:]) == [0, 1]


def test_balance_prices_requests_beyond_the_mean_so_short_overlaps_move_first() -> None:
    policy = make_policy("kv_overlap", balance=1.0)  # a loose cap: only the price acts
    for _ in range(6):
        policy.bounded.record(0)
    loads = {0: IDLE, 1: IDLE}
    # worker 0 was sent 3 requests beyond the mean of 3: 16 x 3 = 48 on its cost
    short = policy.choose(req(loads, {0: on_device(1)}))
    w = DEFAULT_OVERLAP_WEIGHT
    assert short.costs == {0: w * (2 * 7) + 8 + 48, 1: w * (2 * 8) + 8}
    assert short.worker == 1  # 1 cached block does not outweigh 3 excess requests
    # now 7 sent, mean 3.5, worker 0 is 2.5 beyond it: the whole prompt cached outweighs that
    full = policy.choose(req(loads, {0: on_device(8)}))
    assert full.costs == {0: 0 + 8 + w * 2.5, 1: w * (2 * 8) + 8}
    assert full.worker == 0
    ttft = make_policy("predicted_ttft", balance=1.0)
    for _ in range(6):
        ttft.bounded.record(0)
    assert ttft.choose(req(loads, {0: on_device(1)})).worker == 1
    assert ttft.choose(req(loads, {0: on_device(8)})).worker == 0


def test_replica_options_turn_balance_off_unless_asked() -> None:
    assert KvOverlapPolicy().bounded.epsilon == 0.1  # on by default where one router decides
    assert without_history("kv_overlap", {}) == {"balance": None}
    assert without_history("predicted_ttft", {"seed": 2}) == {"seed": 2, "balance": None}
    assert without_history("oracle", {}) == {"balance": None}
    assert without_history("kv_overlap", {"balance": 0.2}) == {"balance": 0.2}
    assert without_history("round_robin", {}) == {}  # takes no balance
    assert without_history("nope", {"x": 1}) == {"x": 1}  # make_policy reports the name


def test_the_oracle_balances_as_kv_overlap_does() -> None:
    """Same cost, same cap: with every request cached on worker 0 of two, the oracle and
    kv_overlap (fed the same overlap) make the same balanced decisions."""
    loads = {0: IDLE, 1: IDLE}
    oracle = make_policy("oracle", oracle=TableOracle({0: 8}), seed=1)
    overlap = make_policy("kv_overlap", seed=1)
    a = [oracle.choose(req(loads, {0: on_device(8)})).worker for _ in range(30)]
    b = [overlap.choose(req(loads, {0: on_device(8)})).worker for _ in range(30)]
    assert a == b and 1 in a


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 64),  # matched blocks
            st.integers(0, 64),  # of which on a slower tier
            st.integers(0, 50_000),  # pending prefill tokens
            st.integers(0, 40),  # decode blocks
            st.floats(0.0, 1.0),  # kv usage
        ),
        min_size=1,
        max_size=8,
    ),
    st.integers(1, 70 * 16),
    st.sampled_from([512, 2048, 8192]),
    st.sampled_from([0.0, 0.5, 1.0]),
)
def test_predicted_ttft_figures_follow_the_model(
    workers: list[tuple[int, int, int, int, float]], tokens: int, chunk: int, recompute: float
) -> None:
    """The figures a decision weighs (one pass over the fleet) and cost_ms()/predict_ms()
    are the model's, written out here term by term: queued plus uncached prompt tokens in
    chunks of the polynomial prefill time, one decode iteration per chunk where requests
    decode, plus recompute_weight x the uncached tokens' chunked prefill time."""
    timing = PolynomialTiming()
    policy = PredictedTtftPolicy(timing, chunk_tokens=chunk, recompute_weight=recompute)

    def chunked(n: int) -> float:
        if n <= 0:
            return 0.0
        return n // chunk * timing.prefill_ms(chunk) + timing.prefill_ms(n % chunk)

    model_cost: dict[int, float] = {}
    model_predict: dict[int, float] = {}
    for w, (m, s, p, d, u) in enumerate(workers):
        slower = min(s, m)
        cached = (m - slower) * 1.0 + slower * 0.75  # default device / slower-tier credits
        uncached = max(0, tokens - round(cached * TPB))
        queue = p + uncached
        ms = chunked(queue)
        if d > 0 and queue > 0:
            ms += -(-queue // chunk) * timing.decode_ms(u)
        model_predict[w] = ms
        model_cost[w] = ms + recompute * chunked(uncached)
    matches = {
        w: MatchDetail(m, m - min(s, m), m - min(s, m), min(s, m))
        for w, (m, s, _, _, _) in enumerate(workers)
    }
    loads = {
        w: WorkerLoad(pending_prefill_tokens=p, decode_blocks=d, kv_usage=u)
        for w, (_, _, p, d, u) in enumerate(workers)
    }
    request = RouteRequest([], tokens, TPB, matches, loads)
    costs, predicted, overlap = policy._figures(request, sorted(loads))
    assert costs == model_cost == {w: policy.cost_ms(request, w) for w in loads}
    assert predicted == model_predict == {w: policy.predict_ms(request, w) for w in loads}
    assert set(overlap) == set(loads)

"""Router: request hashing under scopes, explained decisions, counters, event polling."""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import pytest

from events.stream.subscriber import BatchDelivery, ResyncRequired, SubscriberMessage
from events.wire.model import (
    AllBlocksCleared,
    BlockHash,
    DecodedBatch,
    KVCacheEvent,
    Removed,
    Stored,
    StoredBlock,
)
from kvcache.hashing import chain_hashes
from kvcache.scope import DEFAULT_SCOPE, ReuseScope
from router_sim import KvIndexer, Router, StaticLoadSource, WorkerLoad, make_policy
from router_sim.router import routing as router_module
from router_sim.router.policies import DEFAULT_OVERLAP_WEIGHT, NoWorkersError

TPB = 4
PROMPT = list(range(1000, 1018))  # 4 full blocks and a partial one


def stored_batch(
    tokens: list[int], scope: ReuseScope = DEFAULT_SCOPE, algo: str = "v1_block_key"
) -> DecodedBatch:
    """What a worker announces after caching ``tokens``' full blocks under ``scope``."""
    hashes = chain_hashes(tokens, TPB, scope, algo)
    blocks = [
        StoredBlock(h, tokens[i * TPB : (i + 1) * TPB], scope.lora_id, 0, 35, scope.salt)
        for i, h in enumerate(hashes)
    ]
    return DecodedBatch(0.0, [KVCacheEvent(0, Stored(None, blocks, TPB))])


def loads(n: int = 3) -> StaticLoadSource:
    return StaticLoadSource({w: WorkerLoad() for w in range(n)})


def test_request_hashes_are_the_workers_hashes_under_the_request_scope() -> None:
    router = Router(TPB, "kv_overlap", loads())
    scope = ReuseScope.for_request(lora_id=3, cache_salt="tenant-a")
    assert router.hash_request(PROMPT, lora_id=3, cache_salt="tenant-a") == chain_hashes(
        PROMPT, TPB, scope
    )
    assert router.hash_request(PROMPT, scope) == chain_hashes(PROMPT, TPB, scope)
    assert len(router.hash_request(PROMPT)) == 4  # the partial block is not announced
    with pytest.raises(ValueError, match="either a ReuseScope or lora_id"):
        router.route(PROMPT, scope, cache_salt="tenant-a")


def test_decision_explains_overlaps_costs_and_best() -> None:
    router = Router(TPB, "kv_overlap", loads())
    router.apply(1, stored_batch(PROMPT[:16]))
    router.apply(2, stored_batch(PROMPT[:8]))
    d = router.route(PROMPT)
    assert d.worker == 1
    assert d.overlaps == {0: 0, 1: 4, 2: 2}
    assert d.device_overlaps == {0: 0, 1: 4, 2: 2}
    assert (d.best_overlap, d.chosen_overlap, d.locality_given_up) == (4, 4, 0)
    # 18 tokens = 5 blocks: weight x 2 x (5 - cached) blocks to prefill (nothing queued; the
    # recomputed ones count twice), decode load 0 + 5
    w = DEFAULT_OVERLAP_WEIGHT
    assert d.costs == {0: w * 2 * 5 + 5, 1: w * 2 * 1 + 5, 2: w * 2 * 3 + 5}
    assert d.policy == "kv_overlap" and d.num_tokens == 18 and len(d.block_hashes) == 4


def test_prefix_cached_under_one_salt_earns_overlap_only_under_that_salt() -> None:
    router = Router(TPB, "kv_overlap", loads(2))
    router.apply(1, stored_batch(PROMPT, ReuseScope.for_request(cache_salt="tenant-a")))
    assert router.route(PROMPT, cache_salt="tenant-a").overlaps == {0: 0, 1: 4}
    assert router.route(PROMPT, cache_salt="tenant-b").overlaps == {0: 0, 1: 0}
    assert router.route(PROMPT).overlaps == {0: 0, 1: 0}
    assert router.route(PROMPT, lora_id=0, cache_salt="tenant-a").overlaps == {0: 0, 1: 0}


def test_v2_hash_algorithm_end_to_end() -> None:
    router = Router(TPB, "kv_overlap", loads(2), hash_algo="v2_sha256")
    router.apply(0, stored_batch(PROMPT, algo="v2_sha256"))
    d = router.route(PROMPT)
    assert d.worker == 0 and d.overlaps[0] == 4
    assert all(isinstance(h, str) and len(h) == 64 for h in d.block_hashes)


def test_counters_record_locality_given_up(monkeypatch: pytest.MonkeyPatch) -> None:
    ticks = iter(range(1000))
    step = 2.0**-17  # seconds per read of the fake perf_counter: exact in binary
    monkeypatch.setattr(
        router_module, "time", SimpleNamespace(perf_counter=lambda: next(ticks) * step)
    )
    router = Router(TPB, "round_robin", loads(3))
    router.apply(2, stored_batch(PROMPT))
    chosen = [router.route(PROMPT).worker for _ in range(3)]
    assert chosen == [0, 1, 2]
    s = router.stats
    assert s.decisions == 3
    assert s.decisions_below_best == 2
    assert s.locality_given_up_blocks == 8  # 4 blocks given up, twice
    assert dict(s.chosen) == {0: 1, 1: 1, 2: 1}
    # a decision reads the clock twice: each one took one step of the fake clock
    assert list(s.recent_decision_us) == [step * 1e6] * 3
    assert s.decision_us_p50() == step * 1e6 and s.decision_us_mean() == step * 1e6


def test_only_the_load_sources_workers_are_candidates() -> None:
    source = loads(2)
    router = Router(TPB, "kv_overlap", source)
    router.apply(7, stored_batch(PROMPT))  # known to the index, not routable
    d = router.route(PROMPT)
    assert d.worker in (0, 1) and 7 not in d.overlaps
    source.remove(0)
    source.remove(1)
    with pytest.raises(NoWorkersError):
        router.route(PROMPT)


class ScriptedSubscriber:
    """Hands out prepared messages, in order, one list per poll."""

    def __init__(self, rounds: list[list[SubscriberMessage]]) -> None:
        self.rounds = rounds
        self.timeouts: list[int] = []

    def poll(self, timeout_ms: int = 0) -> list[SubscriberMessage]:
        self.timeouts.append(timeout_ms)
        return self.rounds.pop(0) if self.rounds else []


def test_poll_events_applies_deliveries_and_resets_on_resync() -> None:
    cleared = DecodedBatch(0.0, [KVCacheEvent(1, AllBlocksCleared())])
    sub = ScriptedSubscriber(
        [
            [BatchDelivery(0, 0, stored_batch(PROMPT)), BatchDelivery(1, 0, stored_batch(PROMPT))],
            [ResyncRequired(0, "gap not covered by the replay buffer")],
            [BatchDelivery(0, 5, stored_batch(PROMPT[:8])), BatchDelivery(1, 1, cleared)],
        ]
    )
    router = Router(TPB, "kv_overlap", loads(2), subscriber=sub)
    assert router.poll_events(timeout_ms=5) == 2
    assert router.route(PROMPT).overlaps == {0: 4, 1: 4}
    assert router.poll_events() == 1
    assert router.route(PROMPT).overlaps == {0: 0, 1: 4}
    assert router.stats.resyncs == 1 and router.stats.resyncs_by_worker[0] == 1
    assert router.poll_events() == 2  # worker 0 rebuilt, worker 1 cleared
    assert router.route(PROMPT).overlaps == {0: 2, 1: 0}
    assert router.poll_events() == 0
    assert sub.timeouts == [5, 0, 0, 0]
    assert router.stats.batches_applied == 4


def test_eviction_events_update_the_view() -> None:
    router = Router(TPB, "kv_overlap", loads(2))
    router.apply(0, stored_batch(PROMPT))
    tail: list[BlockHash] = router.hash_request(PROMPT)[2:]
    router.apply(0, DecodedBatch(0.0, [KVCacheEvent(1, Removed(tail))]))
    assert router.route(PROMPT).overlaps[0] == 2


def test_injected_clock_drives_ttl_policies() -> None:
    now = [0.0]
    router = Router(TPB, make_policy("approximate", ttl_ms=100.0), loads(2), clock=lambda: now[0])
    first = router.route(PROMPT).worker
    now[0] = 50.0
    assert router.route(PROMPT).predicted_overlap[first] == 4.0
    now[0] = 1000.0
    third = router.route(PROMPT)  # everything expired; remembered again on the chosen one
    assert third.predicted_overlap == {0: 0.0, 1: 0.0}
    assert router.route(PROMPT).predicted_overlap[third.worker] == 4.0
    # an explicit now_ms wins over the clock (still at 1000)
    assert router.route(PROMPT, now_ms=5000.0).predicted_overlap == {0: 0.0, 1: 0.0}


def test_mismatched_indexer_and_block_size_are_reported() -> None:
    with pytest.raises(ValueError, match="same tokens_per_block"):
        Router(TPB, "kv_overlap", loads(), indexer=KvIndexer(16))
    router = Router(TPB, "kv_overlap", loads())
    block = StoredBlock(1, list(range(16)))
    router.apply(2, DecodedBatch(0.0, [KVCacheEvent(0, Stored(None, [block], 16))]))
    assert router.indexer.flagged_workers == {2: 16}


def test_bad_token_ids_are_rejected_with_a_clear_error() -> None:
    router = Router(TPB, "kv_overlap", loads())
    with pytest.raises(ValueError, match=r"\[0, 2\*\*31\)"):
        router.route([1, 2, 3, 2**31])
    with pytest.raises(ValueError, match="negative"):
        router.route([1, 2, -3, 4])
    assert router.stats.decisions == 0


def test_packed_and_list_prompts_hash_alike() -> None:
    router = Router(TPB, "kv_overlap", loads())
    assert router.hash_request(array("i", PROMPT)) == router.hash_request(PROMPT)
    assert router.hash_request(tuple(PROMPT)) == chain_hashes(PROMPT, TPB, DEFAULT_SCOPE)


def test_remove_worker_forgets_index_and_approximate_memory() -> None:
    policy = make_policy("approximate")
    router = Router(TPB, policy, loads(1))
    router.apply(0, stored_batch(PROMPT))
    router.route(PROMPT)
    router.remove_worker(0)
    assert router.indexer.block_count(0) == 0
    assert router.route(PROMPT).predicted_overlap == {0: 0.0}

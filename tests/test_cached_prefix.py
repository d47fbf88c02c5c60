"""``KVCacheManager.cached_prefix_blocks`` (the cache's held prefix by block keys, any tier)
and ``block_moves`` (the eviction counters' sum), which the simulator reads when its
workers run without an event manager."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kv_helpers import manager, run

from kvcache import ReuseScope
from kvcache.hashing import blockchain_keys
from router_sim.sim.simulator import SimConfig, Simulation
from router_sim.sim.worker import WorkerConfig

TENANT = ReuseScope(lora_id=None, salt=7)


def _keys(tokens: list[int], scope: ReuseScope | None = None, tpb: int = 2) -> list[bytes]:
    full = len(tokens) // tpb
    return blockchain_keys(scope or ReuseScope(), tokens, tpb)[:full]


def test_the_held_prefix_by_keys_follows_stores_scopes_tiers_and_drops() -> None:
    m, _ = manager(2, 4, 8)  # 4 device pages, 8 host pages
    a = [1, 2, 3, 4, 5, 6]
    run(m, a)  # three full blocks
    assert m.cached_prefix_blocks(_keys(a)) == 3
    assert m.cached_prefix_blocks(_keys([1, 2, 3, 4, 9, 9])) == 2  # diverges in block 3
    assert m.cached_prefix_blocks(_keys([9, 9, 1, 2])) == 0
    assert m.cached_prefix_blocks([]) == 0
    assert m.cached_prefix_blocks(_keys(a, TENANT), TENANT) == 0  # another scope holds none
    run(m, a, TENANT)
    assert m.cached_prefix_blocks(_keys(a, TENANT), TENANT) == 3
    # a's blocks go to the host tier to make room: still held
    run(m, [7, 8, 9, 10, 11, 12, 13, 14])
    assert m.stats.tiers["host"].used > 0
    assert m.cached_prefix_blocks(_keys(a)) == 3
    m.clear_reusable_blocks()
    assert m.cached_prefix_blocks(_keys(a)) == 0
    assert m.cached_prefix_blocks(_keys(a, TENANT), TENANT) == 0


@settings(max_examples=60, deadline=None)
@given(
    prompts=st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=8), min_size=1, max_size=12),
    probe=st.lists(st.integers(0, 3), min_size=0, max_size=12),
)
def test_the_held_prefix_is_the_full_blocks_a_request_would_reuse(
    prompts: list[list[int]], probe: list[int]
) -> None:
    """Against the token path: the full blocks ``probe_reuse`` finds for the probe plus one
    more token (so that the whole probe may be reused), under evictions to a host tier and
    out of it."""
    m, _ = manager(2, 6, 4)  # room for a whole 4-block prompt and a copy-on-write page
    for p in prompts:
        if p:
            run(m, p, stop=True)
        want = m.probe_reuse([*probe, 0]) // 2 if probe else 0
        full = len(probe) // 2
        assert m.cached_prefix_blocks(_keys(probe)) == min(want, full)
        assert m.tree.prefix_blocks(ReuseScope(), _keys(probe)) == min(want, full)
    m.verify()


def test_block_moves_is_the_sum_of_the_eviction_counters() -> None:
    m, _ = manager(2, 2, 2)
    assert m.block_moves == 0
    for start in range(0, 40, 4):
        run(m, [start, start + 1, start + 2, start + 3])
        s = m.stats
        assert m.block_moves == s.evictions + s.offloads + s.onboards + s.drops
    assert m.stats.offloads > 0 and m.stats.drops > 0
    before = m.block_moves
    run(m, [0, 1, 2, 3])  # long gone: computed again, evicting again
    assert m.block_moves > before


def test_only_the_oracle_s_workers_keep_held_sets_and_only_theirs_an_unpublished_manager() -> None:
    cfg = SimConfig(workers=2, tokens_per_block=16, device_blocks=256)
    rr = Simulation("round_robin", cfg)
    oracle = Simulation("oracle", cfg)
    kv = Simulation("kv_overlap", cfg)
    try:
        assert all(w.events is None and w.config.events == "none" for w in rr.workers)
        assert all(w.events is not None and w.config.events == "track" for w in oracle.workers)
        assert all(w.config.events == "publish" for w in kv.workers)
        # only the oracle reads the held sets; the others' true overlaps come from the trees
        assert all(w.config.held for w in oracle.workers)
        assert not any(w.config.held for w in rr.workers + kv.workers)
    finally:
        rr.close()
        oracle.close()
        kv.close()


def test_a_worker_without_events_takes_no_socket() -> None:
    with pytest.raises(ValueError, match="events must be one of"):
        WorkerConfig(tokens_per_block=16, device_blocks=8, events="some")
    with pytest.raises(ValueError, match="publishes no events has no inproc transport"):
        WorkerConfig(
            tokens_per_block=16, device_blocks=8, events="none", held=False, transport="inproc"
        )
    with pytest.raises(ValueError, match="no event manager to keep the held set from"):
        WorkerConfig(tokens_per_block=16, device_blocks=8, events="none")
    with pytest.raises(ValueError, match="it needs held=True"):
        WorkerConfig(tokens_per_block=16, device_blocks=8, events="track", held=False)


@pytest.mark.parametrize("events", ["on", "auto"])
def test_the_tree_and_the_held_set_agree_on_every_worker_s_true_overlap(events: str) -> None:
    """The two readings of a worker's true cache: its held set (the hashes its events
    announced, kept from its batches) and its tree (by the prompt's block keys), after a run
    that evicted and offloaded."""
    from router_sim.sim.workloads import SyntheticSpec, synthetic_workload

    reqs = synthetic_workload(
        "multi-turn",
        seed=4,
        spec=SyntheticSpec(num_requests=150, system_prompt_len=(300, 700), rate_per_s=30.0),
    )
    cfg = SimConfig(
        workers=3, tokens_per_block=16, device_blocks=160, host_blocks=400, events=events
    )
    sim = Simulation("oracle", cfg)  # its workers keep held sets
    sim.run(reqs)
    assert sim.events == (events == "on") and all(w.config.held for w in sim.workers)
    some = 0
    for req in reqs:
        prompt = req.tokens()
        hashes = sim.router.hash_request(prompt, req.scope)
        keys = _keys(list(prompt), req.scope, 16)
        for w in sim.workers:
            held = w.true_overlap(hashes)
            assert w.prefix_blocks(keys, req.scope) == held
            some += held
    assert some > 0

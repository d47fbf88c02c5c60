"""KvIndexer's native paths (router_sim.router._match) against the pure-Python ones.

The native table holds masks as wide as the fleet needs, and runs the device-tier store and
eviction loops; every test here compares what they leave behind with the pure loops
(``native=False``) or with answers derived by hand.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from events.wire.model import (
    AllBlocksCleared,
    BlockHash,
    DecodedBatch,
    EventDiff,
    KVCacheEvent,
    Removed,
    Stored,
    StoredBlock,
    Updated,
)
from router_sim.router.indexer import RECENT_KEYS, KvIndexer, MatchDetail

try:
    from router_sim.router import _match as native
except ImportError:  # the pure loops alone: nothing to compare
    native = None  # type: ignore[assignment]
pytestmark = pytest.mark.skipif(native is None, reason="native match loop not built")

TPB = 4


def batch(*events: KVCacheEvent) -> DecodedBatch:
    return DecodedBatch(0.0, list(events))


def store(
    hashes: list[BlockHash],
    parent: BlockHash | None = None,
    level: int = 0,
    group: int | None = None,
    tokens: int | None = 1,
) -> KVCacheEvent:
    """A chain; ``tokens``: every block's token id (None: no token ids, a placeholder)."""
    ids = [] if tokens is None else [tokens] * TPB
    blocks = [StoredBlock(h, ids, cache_level=level) for h in hashes]
    return KVCacheEvent(0, Stored(parent, blocks, TPB, group=group))


def remove(
    hashes: list[BlockHash], level: int | None = None, group: int | None = None
) -> KVCacheEvent:
    return KVCacheEvent(0, Removed(hashes, level, group))


def state(ix: KvIndexer) -> dict[str, Any]:
    """Everything an update may change (the recent-key memory in its order: it is trimmed
    oldest first)."""
    t = ix._table
    if t is not None:  # the native table is the only store of ints' device masks
        assert not [h for h in ix._device if isinstance(h, int) and 0 <= h < 2**64]
    everything = {h for held in ix._held.values() for h in held} | set(ix._device)
    device = {h: t.device_get(h) if t else ix._device.get(h, 0) for h in everything}
    return {
        "held": ix._held,
        "device": {h: m for h, m in device.items() if m},
        "slower": ix._slower,
        "keys": ix._keys,
        "recent": {w: list(r.items()) for w, r in ix._recent.items()},
        "refs": ix._refs,
        "keying": ix._keying,
        "bits": ix._bit_of,
        "anomalies": ix.anomalies,
        "per_worker": ix._worker_anomalies,
        "entries": ix.total_entries(),
    }


def test_200_workers_match_natively() -> None:
    """Worker w holds the first 1 + w % 3 blocks of one chain: past 64 workers the table's
    masks widen (4 words for 200 bits) and the native loop answers, before and after half the
    fleet leaves and new workers take the freed bits."""
    ix = KvIndexer(TPB)
    assert ix._table is not None
    chain: list[BlockHash] = [11, 12, 13]
    for w in range(200):
        ix.apply_batch(w, batch(store(chain[: 1 + w % 3])))
    assert ix._table.words == 4
    expected = {w: 1 + w % 3 for w in range(200)}
    assert ix._table.runs(chain, ix._worker_of_bit) == expected
    assert ix.find_matches(chain) == expected == ix.find_matches_py(chain)
    assert ix.find_matches([11, 12]) == {w: min(2, 1 + w % 3) for w in range(200)}
    for w in range(0, 200, 2):
        ix.remove_worker(w)
    for w in range(1000, 1040):  # bits recycled: no new width
        ix.apply_batch(w, batch(store(chain)))
    assert ix._table.words == 4
    expected = {w: 1 + w % 3 for w in range(1, 200, 2)} | dict.fromkeys(range(1000, 1040), 3)
    assert ix._table.runs(chain, ix._worker_of_bit) == expected
    assert ix.find_matches(chain) == expected == ix.find_matches_py(chain)
    # worker 199 (bit 199, the last word) evicts its middle block: its run ends at 1
    ix.apply_batch(199, batch(remove([12])))
    assert ix.find_matches(chain)[199] == 1 == ix.find_matches_py(chain)[199]


@settings(max_examples=40, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.integers(0, 299), st.lists(st.integers(0, 400), max_size=60), st.booleans()),
        max_size=30,
    )
)
def test_wide_table_equals_a_dict_model(ops: list[tuple[int, list[int], bool]]) -> None:
    """Bits up to 299 (5 words): widening while keys are held, deletions, shrinking."""
    assert native is not None
    table = native.MaskTable()
    model: dict[int, int] = {}
    for bit, keys, hold in ops:
        table.sync(keys, bit, dict.fromkeys(keys, 1) if hold else {})
        for k in keys:
            m = model.get(k, 0) | 1 << bit if hold else model.get(k, 0) & ~(1 << bit)
            if m:
                model[k] = m
            else:
                model.pop(k, None)
    assert len(table) == len(model)
    workers = {b: b + 1000 for b in range(300)}
    for k in range(401):
        assert table.runs([k], workers) == {
            workers[b]: 1 for b in range(300) if model.get(k, 0) >> b & 1
        }


def test_bits_out_of_range_are_refused() -> None:
    assert native is not None
    table = native.MaskTable()
    for bit in (-1, 1 << 20):
        with pytest.raises(ValueError, match="bit must lie"):
            table.set_bit([1], bit)
    table.set_bit([1, 2], 0)
    table.set_bit([1], 4095)
    assert table.words == 64
    assert table.runs([1, 2], {0: 6, 4095: 7}) == {6: 2, 7: 1}


# ------------------------------------------- native update loops == pure update loops

KEYS = st.sampled_from([0, 1, 2, 3, 5, 8, 2**63, 2**64 - 1, -4, "ab"])
FLEET = st.integers(0, 150)
LEVEL = st.sampled_from([0, 0, 0, 1, 2, -1, 5000])
GROUP = st.sampled_from([None, None, 0, 1])
fleet_op = st.one_of(
    st.tuples(
        st.just("stored"),
        FLEET,
        st.lists(KEYS, min_size=1, max_size=6),
        st.one_of(st.none(), KEYS),
        LEVEL,
        GROUP,
        st.sampled_from([1, 2, None]),  # token ids (None: a placeholder store)
    ),
    st.tuples(
        st.just("removed"),
        FLEET,
        st.lists(KEYS, min_size=1, max_size=6),
        st.sampled_from([None, None, 0, 1, 2, 5000]),
        GROUP,
    ),
    st.tuples(st.just("updated"), FLEET, KEYS, LEVEL, LEVEL),
    st.tuples(st.just("cleared"), FLEET),
    st.tuples(st.just("reset"), FLEET),
    st.tuples(st.just("remove_worker"), FLEET),
)


def apply(ix: KvIndexer, o: tuple[Any, ...]) -> None:
    kind, w = o[0], o[1]
    if kind == "stored":
        ix.apply_batch(w, batch(store(o[2], o[3], o[4], o[5], o[6])))
    elif kind == "removed":
        ix.apply_batch(w, batch(remove(o[2], o[3], o[4])))
    elif kind == "updated":
        ix.apply_batch(w, batch(KVCacheEvent(0, Updated(o[2], EventDiff(o[3], o[4])))))
    elif kind == "cleared":
        ix.apply_batch(w, batch(KVCacheEvent(0, AllBlocksCleared())))
    elif kind == "reset":
        ix.reset_worker(w)
    else:
        ix.remove_worker(w)


@settings(max_examples=250, deadline=None)
@given(
    fleet=st.integers(0, 130),
    ops=st.lists(fleet_op, max_size=40),
    queries=st.lists(st.lists(KEYS, max_size=6), max_size=5),
    key_by_tokens=st.booleans(),
)
def test_native_updates_and_matches_equal_the_pure_ones(
    fleet: int, ops: list[tuple[Any, ...]], queries: list[list[BlockHash]], key_by_tokens: bool
) -> None:
    """Random streams over up to 151 workers (``fleet`` of them announced first, so later
    ones take bits past 63, then workers leave and come back): the native store / eviction
    loops leave exactly the pure loops' state, and the native match loop answers as the
    reference, keyed by tokens or by hashes."""
    fast = KvIndexer(TPB, key_by_tokens=key_by_tokens)
    pure = KvIndexer(TPB, key_by_tokens=key_by_tokens, native=False)
    assert fast._table is not None and pure._table is None
    for w in range(fleet):
        for ix in (fast, pure):
            ix.apply_batch(w, batch(store([w % 4, 100 + w], tokens=1 + w % 2)))
    for o in ops:
        apply(fast, o)
        apply(pure, o)
        assert state(fast) == state(pure)
    if key_by_tokens:  # requests are keyed by the router's own hashes of their tokens
        keyed = [fast.key_of(w, h) for w in fast.workers for h in (0, 1, 2, 3)]
        queries = [*queries, keyed[:6], keyed[-6:]]
    for q in [*queries, [0, 1, 2, 3, 5, 8], [2**63, 2**64 - 1]]:
        expected = pure.find_matches_py(q)
        assert fast.find_matches(q) == expected == fast.find_matches_py(q)
        detail = pure.find_matches_detailed(q)
        assert fast.find_matches_detailed(q) == detail == fast.find_matches_detailed_py(q)
        ints = [h for h in q if isinstance(h, int) and 0 <= h < 2**64]
        assert fast._table is not None
        assert fast._table.runs(ints, fast._worker_of_bit) == pure.find_matches_py(ints)


def test_recent_key_memory_trimmed_as_the_pure_loop_trims_it() -> None:
    """A keyed worker evicts 20,000 blocks (one in 50 also on a slower tier, so the native
    loop stops and resumes): the bounded memory of dropped blocks' keys is trimmed at the
    same points and keeps the same newest mappings, and the last block's key comes back
    with a placeholder store naming only its hash."""
    fast, pure = (
        KvIndexer(TPB, key_by_tokens=True),
        KvIndexer(TPB, key_by_tokens=True, native=False),
    )
    for start in range(0, 20_000, 50):
        hashes: list[BlockHash] = list(range(start + 1, start + 51))
        for ix in (fast, pure):
            ix.apply_batch(
                0,
                batch(
                    store(hashes, tokens=start % 7 + 1),
                    store(hashes[7:8], parent=hashes[6], level=1, tokens=start % 7 + 1),
                    remove(hashes),
                ),
            )
        assert len(fast._recent[0]) <= 2 * RECENT_KEYS
    assert state(fast) == state(pure)
    assert fast.total_entries() == 0 and sum(fast.anomalies.values()) == 0
    last_key = fast._recent[0][20_000]
    assert len(fast._recent[0]) >= RECENT_KEYS
    for ix in (fast, pure):
        ix.apply_batch(0, batch(store([20_000], tokens=None)))
        assert ix.find_matches([last_key]) == {0: 1}
    assert state(fast) == state(pure)


def test_tiers_of_a_worker_past_bit_64() -> None:
    """Hand-derived details for workers on the second mask word: worker 170 holds blocks
    11 (device), 12 (slower tier only), 13 (both), 14 (device); worker 171 holds 11 and 12 on
    the device tier; 70 fillers hold block 99 only."""
    for native_loops in (True, False):
        ix = KvIndexer(TPB, native=native_loops)
        for w in range(70):
            ix.apply_batch(w, batch(store([99])))
        ix.apply_batch(170, batch(store([11]), store([12, 13], parent=11, level=1)))
        ix.apply_batch(170, batch(store([13, 14], parent=12)))
        ix.apply_batch(171, batch(store([11, 12])))
        assert ix._bit_of[170] == 70 and ix._bit_of[171] == 71
        chain: list[BlockHash] = [11, 12, 13, 14, 15]
        expected = {170: MatchDetail(4, 1, 3, 1), 171: MatchDetail(2, 2, 2, 0)}
        assert ix.find_matches_detailed(chain) == expected
        assert list(ix.find_matches_detailed(chain)) == [171, 170]  # in the order runs end
        assert ix.find_matches(chain) == {170: 4, 171: 2}


def test_a_removal_naming_a_block_twice_and_a_block_kept_elsewhere() -> None:
    """Hand-derived: the native eviction stops at a block held on two tiers, the general
    path drops both copies, and the second mention of an evicted block is unknown."""
    for native_loops in (True, False):
        ix = KvIndexer(TPB, native=native_loops)
        ix.apply_batch(3, batch(store([1, 2, 3]), store([2], parent=1, level=1)))
        ix.apply_batch(4, batch(store([1, 2])))
        ix.apply_batch(3, batch(remove([1, 2, 1, 3])))
        assert ix.block_count(3) == 0
        assert ix.anomalies["unknown_removal"] == 1
        assert ix.find_matches([1, 2, 3]) == {4: 2}
        assert state(ix)["device"] == {1: 1 << 1, 2: 1 << 1} and ix._slower == {}

"""KvIndexer's native paths (router_sim.router._match) against the plain model of who holds
what (``_reference.ModelIndex``) and answers derived by hand.

The native table holds masks as wide as the fleet needs, and runs the device-tier store and
eviction loops; every test here checks what they leave behind: the holdings against the
model or by hand, and the table and tier masks against the holdings (``check_mirror``).
"""

from __future__ import annotations

from typing import Any

import pytest
from _reference import ModelIndex, v1_block_hash
from hypothesis import given, settings
from hypothesis import strategies as st
from index_helpers import check_mirror, holdings, model_details, model_of

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
from router_sim.router import _match as native
from router_sim.router.indexer import RECENT_KEYS, KvIndexer, MatchDetail

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


def test_200_workers_match_natively() -> None:
    """Worker w holds the first 1 + w % 3 blocks of one chain: past 64 workers the table's
    masks widen (4 words for 200 bits) and the native loop answers, before and after half the
    fleet leaves and new workers take the freed bits."""
    ix = KvIndexer(TPB)
    chain: list[BlockHash] = [11, 12, 13]
    for w in range(200):
        ix.apply_batch(w, batch(store(chain[: 1 + w % 3])))
    assert ix._table.words == 4
    expected = {w: 1 + w % 3 for w in range(200)}
    assert ix._table.runs(chain, ix._worker_of_bit) == expected
    assert ix.find_matches(chain) == expected == model_of(ix).find_matches(chain)
    assert ix.find_matches([11, 12]) == {w: min(2, 1 + w % 3) for w in range(200)}
    for w in range(0, 200, 2):
        ix.remove_worker(w)
    for w in range(1000, 1040):  # bits recycled: no new width
        ix.apply_batch(w, batch(store(chain)))
    assert ix._table.words == 4
    expected = {w: 1 + w % 3 for w in range(1, 200, 2)} | dict.fromkeys(range(1000, 1040), 3)
    assert ix._table.runs(chain, ix._worker_of_bit) == expected
    assert ix.find_matches(chain) == expected == model_of(ix).find_matches(chain)
    check_mirror(ix)
    # worker 199 (bit 199, the last word) evicts its middle block: its run ends at 1
    ix.apply_batch(199, batch(remove([12])))
    assert ix.find_matches(chain)[199] == 1 == model_of(ix).find_matches(chain)[199]


@settings(max_examples=40, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.integers(0, 299), st.lists(st.integers(0, 400), max_size=60), st.booleans()),
        max_size=30,
    )
)
def test_wide_table_equals_a_dict_model(ops: list[tuple[int, list[int], bool]]) -> None:
    """Bits up to 299 (5 words): widening while keys are held, deletions, shrinking."""
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
    table = native.MaskTable()
    for bit in (-1, 1 << 20):
        with pytest.raises(ValueError, match="bit must lie"):
            table.set_bit([1], bit)
    table.set_bit([1, 2], 0)
    table.set_bit([1], 4095)
    assert table.words == 64
    assert table.runs([1, 2], {0: 6, 4095: 7}) == {6: 2, 7: 1}


# ------------------------------------------------ native update loops against the model

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


def apply(ix: KvIndexer, o: tuple[Any, ...], model: ModelIndex | None = None) -> None:
    """Apply ``o`` to ``ix``, and to ``model`` (an index not keyed by tokens) when given."""
    kind, w = o[0], o[1]
    event = None
    if kind == "stored":
        event = store(o[2], o[3], o[4], o[5], o[6])
    elif kind == "removed":
        event = remove(o[2], o[3], o[4])
    elif kind == "updated":
        event = KVCacheEvent(0, Updated(o[2], EventDiff(o[3], o[4])))
    elif kind == "cleared":
        event = KVCacheEvent(0, AllBlocksCleared())
    if event is not None:
        ix.apply_batch(w, batch(event))
        if model is not None:
            model.apply_by_hash(w, event.data)
    elif kind == "reset":
        ix.reset_worker(w)
        if model is not None:
            model.clear(w)
    else:
        ix.remove_worker(w)
        if model is not None:
            model.remove_worker(w)


@settings(max_examples=250, deadline=None)
@given(
    fleet=st.integers(0, 130),
    ops=st.lists(fleet_op, max_size=40),
    queries=st.lists(st.lists(KEYS, max_size=6), max_size=5),
    key_by_tokens=st.booleans(),
)
def test_native_updates_and_matches_equal_the_model(
    fleet: int, ops: list[tuple[Any, ...]], queries: list[list[BlockHash]], key_by_tokens: bool
) -> None:
    """Random streams over up to 151 workers (``fleet`` of them announced first, so later
    ones take bits past 63, then workers leave and come back): after each event the native
    table and tier masks say what the holdings say; not keyed by tokens, the holdings and
    anomaly counts are the model's, which follows the same events; the native match loop (and
    the general one, for requests naming keys the table does not hold) answers as the model
    of the holdings."""
    ix = KvIndexer(TPB, key_by_tokens=key_by_tokens)
    model = None if key_by_tokens else ModelIndex()
    for w in range(fleet):
        apply(ix, ("stored", w, [w % 4, 100 + w], None, 0, None, 1 + w % 2), model)
    for o in ops:
        apply(ix, o, model)
        check_mirror(ix)
        if model is not None:
            assert holdings(model_of(ix)) == holdings(model)
    if model is None:
        model = model_of(ix)
    else:
        for kind, count in model.anomalies.items():
            assert ix.anomalies[kind] == count, kind
    if key_by_tokens:  # requests are keyed by the router's own hashes of their tokens
        keyed = [ix.key_of(w, h) for w in ix.workers for h in (0, 1, 2, 3)]
        queries = [*queries, keyed[:6], keyed[-6:]]
    for q in [*queries, [0, 1, 2, 3, 5, 8], [2**63, 2**64 - 1]]:
        assert ix.find_matches(q) == model.find_matches(q)
        assert ix.find_matches_detailed(q) == model_details(model, q)
        ints = [h for h in q if isinstance(h, int) and 0 <= h < 2**64]
        assert ix._table.runs(ints, ix._worker_of_bit) == model.find_matches(ints)


def _remember_keys(expected: dict[BlockHash, int], hashes: list[BlockHash], t: int) -> None:
    """The documented memory of dropped blocks' keys after ``hashes`` (blocks of token ``t``,
    keyed by the V1 chain of their tokens) are dropped in order: past 2 * RECENT_KEYS
    mappings, all but the newest RECENT_KEYS go."""
    key = 0
    for h in hashes:
        key = v1_block_hash([t] * TPB, key)
        expected[h] = key
        if len(expected) > 2 * RECENT_KEYS:
            for old in list(expected)[:-RECENT_KEYS]:
                del expected[old]


def test_recent_key_memory_is_trimmed_to_the_newest_mappings() -> None:
    """A keyed worker evicts 20,000 blocks (one in 50 also on a slower tier, so the native
    loop stops and the general one takes it): the bounded memory of dropped blocks' keys is
    trimmed as documented (past 2 * RECENT_KEYS mappings, all but the newest RECENT_KEYS go)
    at the same points whichever loop inserts, and the last block's key comes back with a
    placeholder store naming only its hash."""
    ix = KvIndexer(TPB, key_by_tokens=True)
    expected: dict[BlockHash, int] = {}  # the documented memory, in insertion order
    for start in range(0, 20_000, 50):
        hashes: list[BlockHash] = list(range(start + 1, start + 51))
        t = start % 7 + 1
        ix.apply_batch(
            0,
            batch(
                store(hashes, tokens=t),
                store(hashes[7:8], parent=hashes[6], level=1, tokens=t),
                remove(hashes),
            ),
        )
        _remember_keys(expected, hashes, t)
        assert list(ix._recent[0].items()) == list(expected.items())
    check_mirror(ix)
    assert ix.total_entries() == 0 and sum(ix.anomalies.values()) == 0
    assert ix._keys[0] == {} and ix._refs[0] == {}
    last_key = expected[20_000]
    assert RECENT_KEYS <= len(ix._recent[0]) <= 2 * RECENT_KEYS
    ix.apply_batch(0, batch(store([20_000], tokens=None)))
    assert ix.find_matches([last_key]) == {0: 1}
    assert ix._keys[0] == {20_000: last_key} and 20_000 not in ix._recent[0]
    assert ix.holds(0, last_key) == (0,)
    check_mirror(ix)


def test_recent_key_memory_is_trimmed_where_a_whole_removal_is_the_common_eviction() -> None:
    """A keyed worker evicts 20,000 blocks in removals of 50, each block held on the device
    tier only (the batched eviction, the memory passing its bound inside a removal): the
    memory of dropped blocks' keys is trimmed as documented, at the same points as one
    insertion at a time (past 2 * RECENT_KEYS mappings, all but the newest RECENT_KEYS go)."""
    ix = KvIndexer(TPB, key_by_tokens=True)
    expected: dict[BlockHash, int] = {}  # the documented memory, in insertion order
    for start in range(0, 20_000, 50):
        hashes: list[BlockHash] = list(range(start + 1, start + 51))
        t = start % 7 + 1
        ix.apply_batch(0, batch(store(hashes, tokens=t), remove(hashes)))
        _remember_keys(expected, hashes, t)
        assert list(ix._recent[0].items()) == list(expected.items())
    check_mirror(ix)
    assert ix.total_entries() == 0 and sum(ix.anomalies.values()) == 0
    assert ix._keys[0] == {} and len(ix._table) == 0


def test_a_store_with_a_slower_block_inside_a_device_run() -> None:
    """Hand-derived: a store whose middle block lands on the slower tier 1 (levels 0, 1, 0)
    and whose last names a block the worker already held on tier 1: the device run around
    the slower block, the held block keeping its copy there."""
    ix = KvIndexer(TPB)
    ix.apply_batch(5, batch(store([40], level=1)))
    ids = [1] * TPB
    blocks = [StoredBlock(41, ids), StoredBlock(42, ids, cache_level=1)]
    blocks += [StoredBlock(43, ids), StoredBlock(40, ids)]
    ix.apply_batch(5, batch(KVCacheEvent(0, Stored(None, blocks, TPB))))
    assert [ix.holds(5, h) for h in (40, 41, 42, 43)] == [(0, 1), (0,), (1,), (0,)]
    bit = 1 << ix._bit_of[5]
    assert [ix._table.device_get(h) for h in (40, 41, 42, 43)] == [bit, bit, 0, bit]
    assert ix._slower == {40: bit, 42: bit}
    assert ix.find_matches([41, 42, 43]) == {5: 3}
    check_mirror(ix)


def test_tiers_of_a_worker_past_bit_64() -> None:
    """Hand-derived details for workers on the second mask word: worker 170 holds blocks
    11 (device), 12 (slower tier only), 13 (both), 14 (device); worker 171 holds 11 and 12 on
    the device tier; 70 fillers hold block 99 only."""
    ix = KvIndexer(TPB)
    for w in range(70):
        ix.apply_batch(w, batch(store([99])))
    ix.apply_batch(170, batch(store([11]), store([12, 13], parent=11, level=1)))
    ix.apply_batch(170, batch(store([13, 14], parent=12)))
    ix.apply_batch(171, batch(store([11, 12])))
    assert ix._bit_of[170] == 70 and ix._bit_of[171] == 71
    assert [ix.holds(170, h) for h in (11, 12, 13, 14)] == [(0,), (1,), (0, 1), (0,)]
    check_mirror(ix)
    chain: list[BlockHash] = [11, 12, 13, 14, 15]
    expected = {170: MatchDetail(4, 1, 3, 1), 171: MatchDetail(2, 2, 2, 0)}
    assert ix.find_matches_detailed(chain) == expected
    assert list(ix.find_matches_detailed(chain)) == [171, 170]  # in the order runs end
    assert ix.find_matches(chain) == {170: 4, 171: 2}


def test_a_removal_naming_a_block_twice_and_a_block_kept_elsewhere() -> None:
    """Hand-derived: the native eviction stops at a block held on two tiers, the general
    path drops both copies, and the second mention of an evicted block is unknown."""
    ix = KvIndexer(TPB)
    ix.apply_batch(3, batch(store([1, 2, 3]), store([2], parent=1, level=1)))
    ix.apply_batch(4, batch(store([1, 2])))
    ix.apply_batch(3, batch(remove([1, 2, 1, 3])))
    assert ix.block_count(3) == 0
    assert ix.anomalies["unknown_removal"] == 1
    assert ix.find_matches([1, 2, 3]) == {4: 2}
    bit4 = 1 << ix._bit_of[4]
    assert [ix._table.device_get(h) for h in (1, 2, 3)] == [bit4, bit4, 0]
    assert ix._slower == {} and len(ix._table) == 2
    check_mirror(ix)

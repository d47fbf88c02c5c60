"""KvIndexer: scenarios with exact expectations, and property tests against the plain model of
who holds what (``_reference.ModelIndex``)."""

from __future__ import annotations

import logging

import pytest
from _reference import ModelIndex
from hypothesis import given, settings
from hypothesis import strategies as st
from index_helpers import check_mirror, holdings, model_details, model_of

from events.wire.model import (
    AllBlocksCleared,
    BlockHash,
    Created,
    DecodedBatch,
    EventDiff,
    KVCacheEvent,
    Removed,
    Stored,
    StoredBlock,
    Updated,
)
from router_sim.router import _match as native
from router_sim.router.indexer import KvIndexer, MatchDetail

TPB = 4


def stored(
    hashes: list[BlockHash],
    parent: BlockHash | None = None,
    level: int = 0,
    block_size: int | None = TPB,
) -> KVCacheEvent:
    blocks = [StoredBlock(h, [1] * TPB, cache_level=level) for h in hashes]
    return KVCacheEvent(0, Stored(parent, blocks, block_size))


def removed(hashes: list[BlockHash], level: int | None = None) -> KVCacheEvent:
    return KVCacheEvent(0, Removed(hashes, level))


def moved(h: BlockHash, old: int, new: int) -> KVCacheEvent:
    return KVCacheEvent(0, Updated(h, cache_level=EventDiff(old, new)))


def batch(*events: KVCacheEvent) -> DecodedBatch:
    return DecodedBatch(0.0, list(events))


def test_longest_run_from_first_block_per_worker() -> None:
    ix = KvIndexer(TPB)
    ix.apply_batch(0, batch(stored([1, 2, 3, 4])))
    ix.apply_batch(1, batch(stored([1, 2]), stored([4], parent=3)))  # hole at block 3
    ix.apply_batch(2, batch(stored([2, 3, 4], parent=1)))  # lacks the first block
    assert ix.find_matches([1, 2, 3, 4, 5]) == {0: 4, 1: 2}
    assert ix.find_matches([1, 2]) == {0: 2, 1: 2}
    assert ix.find_matches([9, 1]) == {}
    assert ix.find_matches([]) == {}
    assert ix.block_count(0) == 4 and ix.block_count(1) == 3 and ix.block_count(2) == 3


def test_offload_as_removed_then_stored_keeps_match_on_slower_tier() -> None:
    ix = KvIndexer(TPB)
    ix.apply_batch(0, batch(stored([1, 2, 3, 4])))
    # GPU -> CPU move of the two tail blocks, as the wire carries it
    ix.apply_batch(0, batch(removed([3, 4], level=0), stored([3, 4], parent=2, level=1)))
    assert ix.find_matches([1, 2, 3, 4]) == {0: 4}
    assert ix.find_matches_detailed([1, 2, 3, 4]) == {0: MatchDetail(4, 2, 2, 2)}
    assert ix.holds(0, 3) == (1,)
    assert ix.anomalies["unknown_removal"] == 0
    # the slower copy dropped too: the run stops at block 2
    ix.apply_batch(0, batch(removed([3], level=1)))
    assert ix.find_matches([1, 2, 3, 4]) == {0: 2}


def test_detailed_counts_device_copies_past_the_device_run() -> None:
    ix = KvIndexer(TPB)
    ix.apply_batch(0, batch(stored([1]), stored([2], parent=1, level=1), stored([3], parent=2)))
    ix.apply_batch(1, batch(stored([1, 2, 3])))
    detail = ix.find_matches_detailed([1, 2, 3])
    assert detail[0] == MatchDetail(3, device_run=1, device_blocks=2, slower_blocks=1)
    assert detail[1] == MatchDetail(3, 3, 3, 0)


def test_updated_moves_between_tiers() -> None:
    ix = KvIndexer(TPB)
    ix.apply_batch(0, batch(stored([1, 2])))
    ix.apply_batch(0, batch(moved(2, 0, 1)))
    assert ix.holds(0, 2) == (1,)
    assert ix.find_matches_detailed([1, 2])[0] == MatchDetail(2, 1, 1, 1)
    ix.apply_batch(0, batch(moved(2, 1, 0)))
    assert ix.find_matches_detailed([1, 2])[0] == MatchDetail(2, 2, 2, 0)
    ix.apply_batch(0, batch(moved(99, 0, 1)))
    assert ix.worker_anomalies(0)["unknown_update"] == 1
    assert ix.holds(0, 99) == ()


def test_removal_without_level_drops_every_copy() -> None:
    ix = KvIndexer(TPB)
    ix.apply_batch(0, batch(stored([1]), stored([1], level=1)))
    assert ix.holds(0, 1) == (0, 1)
    ix.apply_batch(0, batch(removed([1])))
    assert ix.holds(0, 1) == () and ix.block_count(0) == 0
    assert ix.find_matches([1]) == {}


def test_cleared_and_reset_touch_one_worker_only() -> None:
    ix = KvIndexer(TPB)
    ix.apply_batch(0, batch(stored([1, 2])))
    ix.apply_batch(1, batch(stored([1, 2, 3])))
    ix.apply_batch(0, batch(KVCacheEvent(0, AllBlocksCleared())))
    assert ix.find_matches([1, 2, 3]) == {1: 3}
    ix.reset_worker(1)
    assert ix.find_matches([1, 2, 3]) == {}
    assert ix.total_entries() == 0
    # both still known; events after the reset rebuild the view
    assert sorted(ix.workers) == [0, 1]
    ix.apply_batch(1, batch(stored([1])))
    assert ix.find_matches([1, 2]) == {1: 1}


def test_removed_worker_bit_is_recycled_without_leaking_its_blocks() -> None:
    ix = KvIndexer(TPB)
    ix.apply_batch(5, batch(stored([1, 2])))
    ix.apply_batch(6, batch(stored([1])))
    ix.remove_worker(5)
    assert ix.workers == [6]
    ix.apply_batch(7, batch(stored([3])))  # takes worker 5's old bit
    assert ix.find_matches([1, 2]) == {6: 1}
    assert ix.find_matches([3]) == {7: 1}
    assert ix.block_count(5) == 0


def test_anomalies_are_counted_and_never_abort_the_batch(caplog: pytest.LogCaptureFixture) -> None:
    ix = KvIndexer(TPB)
    with caplog.at_level(logging.WARNING, logger="router_sim.router.indexer"):
        ix.apply_batch(
            3,
            batch(
                removed([42, 43]),  # unknown
                stored([1], parent=77),  # unknown parent
                stored([8], block_size=16),  # another block size
                stored([9], block_size=16),
                KVCacheEvent(0, Created([10, 10])),
                stored([2], parent=1),  # still applied after all of the above
            ),
        )
    assert ix.anomalies == {
        "unknown_removal": 2,
        "block_size_mismatch": 2,
        "unknown_parent": 1,
        "unknown_update": 0,
        "unkeyed_block": 0,
        "level_out_of_range": 0,
    }
    assert ix.worker_anomalies(3)["unknown_removal"] == 2
    assert ix.worker_anomalies(4)["unknown_removal"] == 0
    assert ix.flagged_workers == {3: 16}
    warnings = [r for r in caplog.records if "blocks of 16 tokens" in r.getMessage()]
    assert len(warnings) == 1  # loud, but once per worker
    assert ix.find_matches([1, 2]) == {3: 2}
    assert ix.events_applied == 6 and ix.batches_applied == 1


def test_block_size_inferred_from_tokens_when_not_announced() -> None:
    ix = KvIndexer(TPB)
    blocks = [StoredBlock(h, [0] * 8) for h in (1, 2)]
    ix.apply_batch(0, batch(KVCacheEvent(0, Stored(None, blocks, None))))
    assert ix.flagged_workers == {0: 8}
    # a lone partial trailing block is not a mismatch
    ix.apply_batch(1, batch(KVCacheEvent(0, Stored(None, [StoredBlock(5, [0, 1])], None))))
    assert 1 not in ix.flagged_workers


def test_string_hashes_of_v2_sha256() -> None:
    ix = KvIndexer(TPB)
    a, b = "ab" * 32, "cd" * 32
    ix.apply_batch(0, batch(stored([a, b])))
    assert ix.find_matches([a, b]) == {0: 2}


# --------------------------------------------------------------------- property test

WORKERS = [0, 1, 2, 3]
HASHES = st.integers(0, 11)
LEVELS = st.integers(0, 1)

op = st.one_of(
    st.tuples(
        st.just("stored"),
        st.sampled_from(WORKERS),
        st.lists(HASHES, min_size=1, max_size=5),
        st.one_of(st.none(), HASHES),
        LEVELS,
    ),
    st.tuples(
        st.just("removed"),
        st.sampled_from(WORKERS),
        st.lists(HASHES, min_size=1, max_size=5),
        st.one_of(st.none(), LEVELS),
    ),
    st.tuples(st.just("updated"), st.sampled_from(WORKERS), HASHES, LEVELS, LEVELS),
    st.tuples(st.just("cleared"), st.sampled_from(WORKERS)),
    st.tuples(st.just("reset"), st.sampled_from(WORKERS)),
    st.tuples(st.just("remove_worker"), st.sampled_from(WORKERS)),
)


def op_event(o: tuple[object, ...]) -> KVCacheEvent | None:
    """The event of an op (None: a reset or removal of the worker, not an event)."""
    kind = o[0]
    if kind == "stored":
        hashes, parent, level = o[2], o[3], o[4]
        assert isinstance(hashes, list) and isinstance(level, int)
        assert parent is None or isinstance(parent, int)
        return stored(hashes, parent=parent, level=level)
    if kind == "removed":
        hashes, level = o[2], o[3]
        assert isinstance(hashes, list) and (level is None or isinstance(level, int))
        return removed(hashes, level)
    if kind == "updated":
        h, old, new = o[2], o[3], o[4]
        assert isinstance(h, int) and isinstance(old, int) and isinstance(new, int)
        return moved(h, old, new)
    if kind == "cleared":
        return KVCacheEvent(0, AllBlocksCleared())
    return None


def apply_op(ix: KvIndexer, o: tuple[object, ...], model: ModelIndex | None = None) -> None:
    """Apply ``o`` to ``ix``, and to ``model`` (the index not keyed by tokens) when given."""
    w = o[1]
    assert isinstance(w, int)
    event = op_event(o)
    if event is not None:
        ix.apply_batch(w, batch(event))
        if model is not None:
            model.apply_by_hash(w, event.data)
    elif o[0] == "reset":
        ix.reset_worker(w)
        if model is not None:
            model.clear(w)
    else:
        ix.remove_worker(w)
        if model is not None:
            model.remove_worker(w)


@settings(max_examples=300, deadline=None)
@given(
    ops=st.lists(op, max_size=40),
    queries=st.lists(st.lists(HASHES, min_size=1, max_size=8), min_size=1, max_size=6),
)
def test_indexer_agrees_with_the_model(
    ops: list[tuple[object, ...]], queries: list[list[int]]
) -> None:
    ix = KvIndexer(TPB)
    model = ModelIndex()
    for o in ops:
        apply_op(ix, o, model)
        check_mirror(ix)
    for q in [*queries, list(range(12))]:
        assert ix.find_matches_detailed(q) == model_details(model, q)
        assert ix.find_matches(q) == model.find_matches(q)
    for w in WORKERS:
        assert ix.block_count(w) == model.block_count(w)
        assert {h: ix.holds(w, h) for h in range(12) if ix.holds(w, h)} == {
            h: model.holds(w, h) for h in model.held.get(w, {})
        }
    for kind, count in model.anomalies.items():
        assert ix.anomalies[kind] == count, kind
    assert ix.total_entries() == model.total_entries()


# ------------------------------------------------- native match loop against the model

# keys the native table mirrors (ints in [0, 2**64)), and ones it leaves to the general path
WIDE_HASHES = st.sampled_from([0, 1, 5, 2**63, 2**64 - 1, -3, 2**64, "ab12"])
wide_op = st.one_of(
    st.tuples(
        st.just("stored"),
        st.integers(0, 5),
        st.lists(WIDE_HASHES, min_size=1, max_size=5),
        st.none(),
        st.sampled_from([0, 1, 5000]),  # 5000: past MAX_CACHE_LEVEL, skipped
    ),
    st.tuples(
        st.just("removed"),
        st.integers(0, 5),
        st.lists(WIDE_HASHES, min_size=1, max_size=5),
        st.one_of(st.none(), LEVELS),
    ),
    st.tuples(
        st.just("updated"), st.integers(0, 5), st.sampled_from([1, 2**63, -3]), LEVELS, LEVELS
    ),
    st.tuples(st.just("cleared"), st.integers(0, 5)),
    st.tuples(st.just("reset"), st.integers(0, 5)),
    st.tuples(st.just("remove_worker"), st.integers(0, 5)),
)


@settings(max_examples=300, deadline=None)
@given(
    ops=st.lists(st.one_of(op, wide_op), max_size=40),
    queries=st.lists(st.lists(st.one_of(HASHES, WIDE_HASHES), max_size=8), max_size=6),
    key_by_tokens=st.booleans(),
)
def test_native_match_loop_equals_the_model(
    ops: list[tuple[object, ...]], queries: list[list[BlockHash]], key_by_tokens: bool
) -> None:
    """Keys the table holds answer natively, requests naming others through the general
    path; both as the model. Not keyed by tokens, the model follows the events itself; keyed
    by tokens (keys the index computes), it holds what the index says its workers hold."""
    ix = KvIndexer(TPB, key_by_tokens=key_by_tokens)
    model = ModelIndex()
    for o in ops:
        apply_op(ix, o, None if key_by_tokens else model)
        check_mirror(ix)
    if key_by_tokens:
        model = model_of(ix)
    else:
        assert holdings(model_of(ix)) == holdings(model)
    fixed: list[list[BlockHash]] = [list(range(12)), [0, 1, 5, 2**63, 2**64 - 1]]
    for q in [*queries, *fixed]:
        assert ix.find_matches(q) == model.find_matches(q)
        assert ix.find_matches_detailed(q) == model_details(model, q)
        # what the table holds for ints in range is exactly who holds them (any tier)
        ints = [h for h in q if isinstance(h, int) and 0 <= h < 2**64]
        assert ix._table.runs(ints, ix._worker_of_bit) == model.find_matches(ints)


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.integers(0, 63), st.lists(st.integers(0, 3000), max_size=400), st.booleans()),
        max_size=12,
    )
)
def test_native_table_grows_shrinks_and_deletes_like_a_dict(
    ops: list[tuple[int, list[int], bool]],
) -> None:
    """Thousands of keys: resizes both ways and backward-shift deletions in long probe runs."""
    table = native.MaskTable()
    model: dict[int, int] = {}
    workers = {b: b + 100 for b in range(64)}
    for bit, keys, hold in ops:
        table.sync(keys, bit, dict.fromkeys(keys, 1) if hold else {})
        for k in keys:
            m = model.get(k, 0) | 1 << bit if hold else model.get(k, 0) & ~(1 << bit)
            if m:
                model[k] = m
            else:
                model.pop(k, None)
    assert len(table) == len(model)
    for k in range(3001):
        expected = {workers[b]: 1 for b in range(64) if model.get(k, 0) >> b & 1}
        assert table.runs([k], workers) == expected


def test_keys_the_table_does_not_hold_take_the_general_path() -> None:
    """Hand-derived: worker 0 holds 1, "ab", 2**64 (slower tier only), -3; worker 1 holds 1
    and "ab" on the slower tier; worker 2 holds 1, 7 and 8. A request naming a key the table
    does not hold answers as one that does, the device masks of those keys kept in
    ``_device``."""
    ix = KvIndexer(TPB)
    ix.apply_batch(0, batch(stored([1, "ab"]), stored([2**64], parent="ab", level=1)))
    ix.apply_batch(0, batch(stored([-3], parent=2**64)))
    ix.apply_batch(1, batch(stored([1]), stored(["ab"], parent=1, level=1)))
    ix.apply_batch(2, batch(stored([1, 7, 8])))
    check_mirror(ix)
    assert ix._device == {"ab": 1, -3: 1}
    chain: list[BlockHash] = [1, "ab", 2**64, -3, 5]
    assert ix.find_matches(chain) == {0: 4, 1: 2, 2: 1}
    assert ix.find_matches_detailed(chain) == {
        0: MatchDetail(4, 2, 3, 1),
        1: MatchDetail(2, 1, 1, 1),
        2: MatchDetail(1, 1, 1, 0),
    }
    assert ix.find_matches([1, 7, 8, "x"]) == {2: 3, 0: 1, 1: 1}
    assert ix.find_matches(["ab", 1]) == {0: 2, 1: 2}
    ix.apply_batch(0, batch(removed(["ab"]), removed([-3], level=0)))
    check_mirror(ix)
    assert ix._device == {}
    assert ix.find_matches(chain) == {0: 1, 1: 2, 2: 1}


def test_native_table_finds_every_key_left_after_deletions_inside_probe_runs() -> None:
    """3,000 keys in 4,096 slots (load 0.73: long probe runs); deleting every other key must
    leave each remaining key reachable (entries shift back into the holes)."""
    table = native.MaskTable()
    keys = list(range(3000))
    table.sync(keys, 0, dict.fromkeys(keys, 1))
    table.sync(keys[::2], 0, {})
    assert len(table) == 1500
    worker = {0: 7}
    assert [k for k in keys if table.runs([k], worker) == {7: 1}] == keys[1::2]
    table.sync(keys[::2], 1, dict.fromkeys(keys, 1))  # re-inserted, not duplicated
    assert len(table) == 3000
    assert all(table.runs([k], {0: 7, 1: 8}) == ({8: 1} if k % 2 == 0 else {7: 1}) for k in keys)

"""Reuse: scope isolation, the last-token cap, copy-on-write, dedup on commit, partial rules."""

from __future__ import annotations

import itertools
from array import array

import pytest
from kv_helpers import manager, run, seen

from kvcache import ReuseScope

SCOPES = [
    ReuseScope(),
    ReuseScope(lora_id=1),
    ReuseScope(salt=1),
    ReuseScope(lora_id=1, salt=1),
    ReuseScope(lora_id=1, salt=2),  # same lora, different salt
    ReuseScope(lora_id=2, salt=1),  # same salt, different lora
]
PROMPT = [1, 2, 3, 4, 5, 6, 7]


@pytest.mark.parametrize(
    ("stored", "asked"), list(itertools.permutations(SCOPES, 2)), ids=lambda s: repr(s)
)
def test_a_prefix_is_reused_only_in_its_own_scope(stored: ReuseScope, asked: ReuseScope) -> None:
    m, sink = manager(2, 16)
    run(m, PROMPT, stored, stop=True)
    assert m.probe_reuse([*PROMPT, 9], asked) == 0
    with m.create_kv_cache([*PROMPT, 9], asked) as seq:
        assert seq.num_reused_tokens == 0
    assert m.probe_reuse([*PROMPT, 9], stored) == 7
    with m.create_kv_cache([*PROMPT, 9], stored) as seq:
        assert seq.num_reused_tokens == 7
    assert {s for r in sink.records for s in r.scopes} == {stored}


def test_everything_cached_still_leaves_the_last_token_to_compute() -> None:
    m, _ = manager(2, 8)
    run(m, [1, 2, 3, 4])
    # the last block is reused partially (copy-on-write of its first token)
    assert m.probe_reuse([1, 2, 3, 4]) == 3
    with m.create_kv_cache([1, 2, 3, 4]) as seq:
        assert seq.num_reused_tokens == 3 and seq.num_tokens == 3
    m2, _ = manager(2, 8, partial=False)
    run(m2, [1, 2, 3, 4])
    assert m2.probe_reuse([1, 2, 3, 4]) == 2  # without partial reuse the last block is dropped
    assert m2.probe_reuse([1, 2, 3, 4, 5]) == 4
    assert m2.probe_reuse([1]) == 0 and m2.probe_reuse([]) == 0


def test_partial_match_is_copy_on_write() -> None:
    m, sink = manager(2, 8)
    run(m, [1, 2, 3, 4])
    sink.clear()
    src = m.create_kv_cache([1, 2, 3, 4, 0])
    src_pages = src.page_indices()
    cow = m.create_kv_cache([1, 2, 3, 9])
    assert cow.num_reused_tokens == 3  # block [1, 2] plus token 3 of block [3, 4]
    pages = cow.page_indices()
    assert pages[0] == src_pages[0]  # the full block is shared
    assert pages[1] not in src_pages  # the partially matched one got its own page
    cow.commit([9])  # [3, 9] is a new full block beside [3, 4]
    assert seen(sink) == [("stored", [[3, 9]], [0])]
    src.close()
    cow.close()
    assert m.probe_reuse([1, 2, 3, 4, 0]) == 4 and m.probe_reuse([1, 2, 3, 9, 0]) == 4


def test_identical_commit_switches_to_the_cached_block_without_an_event() -> None:
    m, sink = manager(2, 8)
    a = m.create_kv_cache([])
    b = m.create_kv_cache([])
    a.commit([5, 6, 7])
    free_before = m.stats.tiers["device"].free
    b.commit([5, 6, 7])
    assert b.page_indices()[0] == a.page_indices()[0]
    assert b.page_indices()[1] != a.page_indices()[1]  # partial blocks stay private
    assert m.stats.tiers["device"].free == free_before - 1  # only b's partial page is new
    assert seen(sink) == [("stored", [[5, 6]], [0])]
    a.close()
    b.close()
    m.verify()


def test_stop_committing_partial_rules() -> None:
    m, sink = manager(2, 8)
    run(m, [1, 2, 3], stop=True)  # partial [3] joins the tree
    run(m, [1, 2, 3], stop=True)  # identical: useless, not inserted
    run(m, [1, 2, 3, 4, 5], stop=True)  # full [3, 4] extends partial [3]: replaces it
    run(m, [1, 2, 3, 4, 5], stop=True)
    run(m, [1, 2, 3, 4, 5, 6], stop=True)  # full [5, 6] replaces partial [5]
    assert seen(sink) == [
        ("stored", [[1, 2]], [0]),
        ("stored", [[3]], [0]),
        ("removed", [[3]], [0]),
        ("stored", [[3, 4]], [0]),
        ("stored", [[5]], [0]),
        ("removed", [[5]], [0]),
        ("stored", [[5, 6]], [0]),
    ]
    assert m.num_cached_blocks == 3
    m.verify()


def test_partial_prefix_of_a_sibling_is_not_inserted() -> None:
    m, sink = manager(2, 8)
    run(m, [1, 2, 3, 4])
    sink.clear()
    run(m, [1, 2, 3], stop=True)  # [3] is a prefix of the full sibling [3, 4]
    assert seen(sink) == []
    assert m.stats.tiers["device"].used == 2


def test_replacing_a_partial_still_held_keeps_its_page_until_close() -> None:
    m, sink = manager(2, 8)
    holder = m.create_kv_cache([])
    holder.commit([1])
    holder.stop_committing()
    run(m, [1, 2])  # extends [1]: it leaves the tree, its holder still has the page
    assert [r.kind for r in sink.records] == ["stored", "removed", "stored"]
    assert m.stats.tiers["device"].used == 2
    m.verify()
    holder.close()
    assert m.stats.tiers["device"].used == 1
    m.verify()


def test_probe_changes_nothing() -> None:
    m, sink = manager(2, 3)
    run(m, [1, 2])  # older
    run(m, [3, 4])
    run(m, [5, 6])
    before = (m.stats, list(sink.records))
    assert m.probe_reuse([1, 2, 0]) == 2
    assert (m.stats, list(sink.records)) == before
    run(m, [7, 8])  # still evicts [1, 2] first: probing did not touch it
    assert seen(sink)[-2] == ("removed", [[1, 2]], [0])


def test_reuse_keeps_the_stored_priority() -> None:
    m, sink = manager(2, 8)
    run(m, [1, 2, 3], priority=10)
    run(m, [1, 2, 3, 4], priority=90)
    assert [r.priorities for r in sink.records] == [(10,), (90,)]


def test_stats_count_queries_and_hits() -> None:
    m, _ = manager(2, 8)
    run(m, [1, 2, 3, 4, 5])
    run(m, [1, 2, 3, 4, 6])
    s = m.stats
    assert (s.queries, s.query_tokens, s.hit_tokens) == (2, 10, 4)
    assert s.hit_rate == pytest.approx(0.4)
    # the partial blocks [5] and [6] were never stop_committing()-ed: freed on close
    assert s.tiers["device"].used == 2 and s.tiers["device"].pinned == 0


def test_resize_reserves_pages_and_stop_gives_the_spare_ones_back() -> None:
    m, _ = manager(2, 8)
    seq = m.create_kv_cache([])
    seq.resize(7)
    assert seq.capacity == 8 and len(seq.page_indices()) == 4
    seq.commit([1, 2, 3])
    assert seq.capacity == 8
    seq.stop_committing()
    assert seq.capacity == 4
    assert m.stats.tiers["device"].used == 2
    seq.close()
    assert m.kv_usage() == 0.0 and m.num_available_pages() == 8


def test_one_commit_that_replaces_a_partial_midway_announces_in_order() -> None:
    m, sink = manager(2, 8)
    run(m, [1, 2, 3], stop=True)  # partial [3] under [1, 2]
    sink.clear()
    seq = m.create_kv_cache([])
    seq.commit([1, 2, 3, 4, 5, 6])  # [1, 2] is cached; [3, 4] replaces [3]; [5, 6] is new
    assert seen(sink) == [
        ("removed", [[3]], [0]),
        ("stored", [[3, 4], [5, 6]], [0, 0]),
    ]
    seq.close()
    sink.clear()
    other = m.create_kv_cache([])
    other.commit([7, 8, 9])
    other.stop_committing()
    other.close()
    seq = m.create_kv_cache([])
    seq.commit([7, 8, 9, 1, 2, 3])  # [7, 8] is cached; [9, 1] replaces [9]; [2, 3] is new
    assert [r.kind for r in sink.records] == ["stored", "stored", "removed", "stored"]
    seq.close()
    assert m.num_cached_blocks == 6
    m.verify()


def test_the_sequence_keeps_its_own_record_of_every_token() -> None:
    """A copy-on-write prefix, commits that split blocks every way, the caller's arrays changed
    afterwards: ``tokens`` and ``num_tokens`` still say what was committed, the blocks that
    joined the tree hold their own tokens, and the trailing partial block holds the tail."""
    m, sink = manager(3, 32)
    run(m, [1, 2, 3, 4, 5], stop=True)  # [1 2 3] full, [4 5] partial
    sink.clear()
    prompt = array("i", [1, 2, 3, 4, 5, 6, 7])
    seq = m.create_kv_cache(prompt)
    assert seq.num_reused_tokens == 5 and seq.tokens == [1, 2, 3, 4, 5]  # 2 by copy-on-write
    prompt[3] = 99  # the caller's array is not the sequence's
    pieces = [array("i", [6]), array("i", [7, 8, 9, 10, 11]), array("i", [12, 13])]
    for piece in pieces:
        seq.commit(piece)
        piece[0] = -1
    assert seq.num_tokens == 13 and seq.tokens == list(range(1, 14))
    seq.stop_committing()
    seq.close()
    assert seq.tokens == list(range(1, 14))  # still readable once closed
    assert seen(sink) == [
        ("removed", [[4, 5]], [0]),  # [4 5 6] extends the cached partial block
        ("stored", [[4, 5, 6]], [0]),
        ("stored", [[7, 8, 9]], [0]),  # [10 11] waits for the next commit
        ("stored", [[10, 11, 12]], [0]),
        ("stored", [[13]], [0]),
    ]
    assert m.probe_reuse([*range(1, 14), 0]) == 13

"""Eviction order, tier moves, drops and onboarding, with the exact sink sequences.

Tokens per block 2; a block is named by its tokens. The order documented in
kvcache.eviction: lowest priority, then least recently released, then oldest block; only
leaves on their tier are candidates.
"""

from __future__ import annotations

from kv_helpers import manager, run, seen


def test_lowest_priority_goes_first() -> None:
    m, sink = manager(2, 3)
    run(m, [1, 2], priority=50)
    run(m, [3, 4], priority=10)
    run(m, [5, 6], priority=35)
    sink.clear()
    run(m, [7, 8])
    run(m, [9, 10])
    run(m, [11, 12])
    assert [e for e in seen(sink) if e[0] == "removed"] == [
        ("removed", [[3, 4]], [0]),
        ("removed", [[5, 6]], [0]),
        ("removed", [[7, 8]], [0]),
    ]
    assert m.stats.evictions == 3 and m.stats.drops == 3 and m.stats.offloads == 0


def test_least_recently_released_goes_first_within_a_priority() -> None:
    m, sink = manager(2, 4)
    run(m, [1, 2])
    run(m, [3, 4])
    run(m, [5, 6])
    run(m, [1, 2, 0])  # reuses [1, 2]: its last use is now the newest
    sink.clear()
    run(m, [7, 8])  # the free page
    run(m, [9, 10])
    run(m, [11, 12])
    assert seen(sink) == [
        ("stored", [[7, 8]], [0]),
        ("removed", [[3, 4]], [0]),
        ("stored", [[9, 10]], [0]),
        ("removed", [[5, 6]], [0]),
        ("stored", [[11, 12]], [0]),
    ]


def test_leaves_go_before_their_parents_whatever_the_priority() -> None:
    m, sink = manager(2, 4)
    run(m, [1, 2], priority=0)
    run(m, [1, 2, 3, 4], priority=100)  # child of a priority-0 block
    run(m, [1, 2, 5, 6], priority=100)  # a second branch
    run(m, [9, 9], priority=50)
    sink.clear()
    run(m, [7, 7], priority=100)  # [1, 2] is no candidate while its children are on the tier
    run(m, [8, 8], priority=100)
    run(m, [6, 6], priority=100)
    assert [e for e in seen(sink) if e[0] == "removed"] == [
        ("removed", [[9, 9]], [0]),
        ("removed", [[3, 4]], [0]),  # older branch first (same priority, same release order)
        ("removed", [[5, 6]], [0]),
    ]
    sink.clear()
    run(m, [4, 4], priority=100)  # now [1, 2] is a leaf and has the lowest priority
    assert seen(sink)[0] == ("removed", [[1, 2]], [0])


def test_eviction_moves_to_the_next_tier_and_reuse_brings_blocks_back() -> None:
    m, sink = manager(2, 2, 4)
    run(m, [1, 2, 3, 4])
    run(m, [5, 6, 7, 8])  # pushes [1, 2, 3, 4] to the host, leaf first, in one call
    assert seen(sink) == [
        ("stored", [[1, 2], [3, 4]], [0, 0]),
        ("moved", [[3, 4], [1, 2]], 0, 1),
        ("stored", [[5, 6], [7, 8]], [0, 0]),
    ]
    assert m.stats.tiers["host"].used == 2
    sink.clear()
    assert m.probe_reuse([1, 2, 3, 4, 0]) == 4  # blocks on the host are still matchable
    seq = m.create_kv_cache([1, 2, 3, 4, 0])
    assert seq.num_reused_tokens == 4
    assert seen(sink) == [
        ("moved", [[7, 8], [5, 6]], 0, 1),
        ("moved", [[1, 2], [3, 4]], 1, 0),
    ]
    assert sorted(seq.page_indices()) == [0, 1]
    s = m.stats
    assert (s.evictions, s.offloads, s.onboards, s.drops) == (4, 4, 2, 0)
    seq.close()
    m.verify()


def test_the_last_tier_drops() -> None:
    m, sink = manager(2, 1, 1)
    run(m, [1, 2])
    run(m, [3, 4])
    run(m, [5, 6])
    assert seen(sink) == [
        ("stored", [[1, 2]], [0]),
        ("moved", [[1, 2]], 0, 1),
        ("stored", [[3, 4]], [0]),
        ("removed", [[1, 2]], [1]),  # room is made on the host before [3, 4] lands there
        ("moved", [[3, 4]], 0, 1),
        ("stored", [[5, 6]], [0]),
    ]
    assert m.probe_reuse([1, 2, 0]) == 0 and m.probe_reuse([3, 4, 0]) == 2


def test_a_dropped_block_takes_its_subtree_on_slower_tiers_with_it() -> None:
    m, sink = manager(2, 2, 1, 1)
    run(m, [1, 2], priority=100)  # A
    run(m, [1, 2, 3, 4], priority=0)  # B, child of A
    run(m, [9, 9], priority=0)  # X: B goes to the host
    filler = m.create_kv_cache([])
    filler.resize(2)  # X to the host, B on to the disk
    assert m.probe_reuse([1, 2, 3, 4, 0]) == 4
    sink.clear()
    # Reusing X pins it on the host; the device page it needs comes from A, which cannot move
    # down (the host holds only the pinned X), so A is dropped with B below it.
    seq = m.create_kv_cache([9, 9, 0])
    assert seq.num_reused_tokens == 2
    assert seen(sink) == [
        ("removed", [[3, 4], [1, 2]], [2, 0]),
        ("moved", [[9, 9]], 1, 0),
    ]
    assert m.stats.drops == 2
    assert m.probe_reuse([1, 2, 3, 4, 0]) == 0
    seq.close()
    filler.close()
    m.verify()


def test_clear_reusable_blocks() -> None:
    m, sink = manager(2, 8)
    run(m, [1, 2, 3, 4])
    run(m, [5, 6, 7])
    sink.clear()
    m.clear_reusable_blocks()
    assert seen(sink) == [("cleared",)]
    assert m.num_cached_blocks == 0 and m.stats.tiers["device"].free == 8
    m.clear_reusable_blocks()
    assert seen(sink) == [("cleared",)]  # nothing left: nothing said

    run(m, [1, 2, 3, 4])
    live = m.create_kv_cache([1, 2, 5])
    sink.clear()
    m.clear_reusable_blocks()  # [1, 2] is held: only [3, 4] goes
    assert seen(sink) == [("removed", [[3, 4]], [0])]
    live.close()
    m.verify()

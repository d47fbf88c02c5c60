"""Out of pages, suspend/resume, and the batched page copies a storage sees."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from kv_helpers import manager, run, seen

from kvcache import (
    CacheStateError,
    KVCacheManager,
    KVCacheManagerConfig,
    OutOfPagesError,
    TierConfig,
)


def books(m: KVCacheManager) -> object:
    return (
        sorted((b.key, b.tier, b.page, b.refs, b.susp) for b in m._tree.iter_blocks()),
        m.stats,
    )


def test_out_of_pages_changes_nothing() -> None:
    m, sink = manager(2, 3)
    run(m, [1, 2, 3, 4])
    live = m.create_kv_cache([1, 2, 3, 4, 5])  # pins both cached blocks
    live.commit([5])  # and a third page
    other = m.create_kv_cache([])
    before, records = books(m), list(sink.records)
    with pytest.raises(OutOfPagesError, match="needs 1 more device pages but only 0"):
        other.commit([7])
    with pytest.raises(OutOfPagesError):
        other.resize(1)
    assert other.num_tokens == 0 and other.capacity == 0
    assert books(m) == before and sink.records == records
    live.close()
    other.commit([7])  # now the page of [5] (private, freed on close) is there
    other.close()
    m.verify()


def test_out_of_pages_on_reuse_keeps_the_cached_blocks() -> None:
    m, sink = manager(2, 2, 2)
    run(m, [1, 2, 3, 4])
    hog = m.create_kv_cache([])
    hog.resize(4)  # both device pages: [1, 2, 3, 4] goes to the host
    before, records = books(m), list(sink.records)
    assert m.probe_reuse([1, 2, 3, 4, 0]) == 4
    with pytest.raises(OutOfPagesError, match="needs 2 device pages but only 0"):
        m.create_kv_cache([1, 2, 3, 4, 0])
    assert books(m) == before and sink.records == records
    hog.close()
    with m.create_kv_cache([1, 2, 3, 4, 0]) as seq:
        assert seq.num_reused_tokens == 4
    m.verify()


def test_suspended_pages_move_down_but_are_never_dropped() -> None:
    m, sink = manager(2, 2, 1)
    seq = m.create_kv_cache([])
    seq.commit([1, 2, 3, 4])
    seq.suspend()
    with pytest.raises(CacheStateError, match="suspended"):
        seq.commit([5])
    with pytest.raises(CacheStateError, match="suspended"):
        seq.page_indices()
    assert m.num_available_pages() == 1  # only one of the two pages can go (host: 1 page)
    other = m.create_kv_cache([])
    with pytest.raises(OutOfPagesError):
        other.resize(4)
    sink.clear()
    other.resize(2)
    assert seen(sink) == [("moved", [[3, 4]], 0, 1)]
    with pytest.raises(OutOfPagesError, match="resume"):
        seq.resume()
    assert seq.suspended
    other.close()
    sink.clear()
    seq.resume()
    assert seen(sink) == [("moved", [[3, 4]], 1, 0)]
    assert len(seq.page_indices()) == 2 and m.kv_usage() == 1.0
    with pytest.raises(OutOfPagesError):
        seq.commit([5])  # usable again, but a third page is more than the device tier has
    m.verify()


def test_one_tier_suspension_keeps_pages() -> None:
    m, _ = manager(2, 2)
    seq = m.create_kv_cache([])
    seq.commit([1, 2, 3])
    seq.suspend()
    assert m.num_available_pages() == 0 and m.kv_usage() == 0.0
    with pytest.raises(OutOfPagesError):
        m.create_kv_cache([]).resize(1)
    seq.resume()
    seq.commit([4])
    assert seq.num_tokens == 4
    seq.close()
    assert m.num_available_pages() == 2


class CopySpy:
    """Records the copies the manager asks for (stands in for a torch storage)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, list[int], int, list[int], list[int] | None]] = []

    def copy_pages(
        self,
        src_tier: int,
        src_pages: Sequence[int],
        dst_tier: int,
        dst_pages: Sequence[int],
        num_tokens: Sequence[int] | None = None,
    ) -> None:
        counts = None if num_tokens is None else list(num_tokens)
        self.calls.append((src_tier, list(src_pages), dst_tier, list(dst_pages), counts))

    def page_nbytes(self) -> int:
        return 100

    def synchronize(self) -> None:
        pass


def spied(*sizes: int) -> tuple[KVCacheManager, CopySpy]:
    tiers = [TierConfig(name=f"tier{i}", num_blocks=n) for i, n in enumerate(sizes)]
    spy = CopySpy()
    m = KVCacheManager(KVCacheManagerConfig(tokens_per_block=2, tiers=tiers), storage=spy)
    assert m.storage is spy
    return m, spy


def test_copies_are_batched_per_tier_pair_and_ordered_safely() -> None:
    m, spy = spied(2, 4)
    run(m, [1, 2, 3, 4])  # device pages 0, 1
    run(m, [5, 6, 7, 8])  # [3, 4] -> host, [1, 2] -> host
    assert spy.calls == [(0, [1, 0], 1, [0, 1], None)]
    spy.calls.clear()
    seq = m.create_kv_cache([1, 2, 3, 4, 0])
    # evictions copied out first, then the onboarding writes into the pages they freed
    assert spy.calls == [
        (0, [0, 1], 1, [2, 3], None),
        (1, [1, 0], 0, [0, 1], None),
    ]
    assert seq.page_indices() == [0, 1]
    seq.close()
    assert m.stats.tiers["tier0"].bytes_used == 200


def test_copy_on_write_copies_only_the_matched_tokens() -> None:
    m, spy = spied(3, 4)
    run(m, [1, 2, 3, 4])
    with m.create_kv_cache([1, 2, 3, 9]) as cow:  # one token of [3, 4]
        assert spy.calls == [(0, [1], 0, [2], [1])]
        assert cow.page_indices() == [0, 2]


def test_suspend_resume_copies_private_pages_too() -> None:
    m, spy = spied(2, 2)
    seq = m.create_kv_cache([])
    seq.commit([1, 2, 3])  # [3] is a private, uncommitted block
    seq.suspend()
    hog = m.create_kv_cache([])
    hog.resize(4)
    assert spy.calls == [(0, [0, 1], 1, [0, 1], None)]
    hog.close()
    spy.calls.clear()
    seq.resume()
    assert spy.calls == [(1, [0, 1], 0, [1, 0], None)]
    seq.commit([4])
    assert m.probe_reuse([1, 2, 3, 4, 5]) == 4
    seq.close()
    m.verify()


def test_commit_of_a_block_cached_on_the_host_takes_it_back_over() -> None:
    m, sink = manager(2, 2, 2)
    run(m, [1, 2, 3, 4])
    hog = m.create_kv_cache([])
    hog.resize(4)  # [1, 2, 3, 4] to the host
    hog.close()
    seq = m.create_kv_cache([])  # computes the same tokens again instead of reusing them
    sink.clear()
    seq.commit([1, 2, 3, 4])
    # no new block: the cached ones take the freshly written device pages, nothing is copied
    assert seen(sink) == [("moved", [[1, 2], [3, 4]], 1, 0)]
    assert m.stats.tiers["host"].used == 0 and m.stats.onboards == 0
    seq.close()
    m.verify()


def test_a_replaced_partial_held_by_a_suspended_sequence_still_moves_and_returns() -> None:
    m, _ = manager(2, 3, 2)
    holder = m.create_kv_cache([])
    holder.commit([1, 2, 3])
    holder.stop_committing()  # [3] joins the tree
    holder.suspend()
    run(m, [1, 2, 3, 4])  # extends [3]: it leaves the tree, the suspended holder keeps it
    m.verify()
    hog = m.create_kv_cache([])
    hog.resize(6)  # everything else leaves the device
    m.verify()
    hog.close()
    holder.resume()
    assert len(holder.page_indices()) == 2
    holder.close()
    m.verify()
    # [3, 4] was cached, not held: it made room for the suspended pages on the host
    assert m.probe_reuse([1, 2, 3, 4, 5]) == 2

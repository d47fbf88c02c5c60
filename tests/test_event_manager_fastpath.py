"""The event manager's event builder (``_build_events``) and ``end_step``.

At the end of an iteration ``KVCacheEventManager`` turns its pending items into numbered events:
every mix of pending Stored and Removed chains and other event data, for any first id (past
the 64-bit range too), block size, window, hash algorithm and rank, gives the events spelled
out here. ``end_step``, which hands the events out without the buffer when nothing is buffered
or overflows, must give exactly what flush, take_dropped and a drain give.
"""

from __future__ import annotations

from array import array
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import events.manager as manager_module
from events.manager import (
    KVCacheEventManager,
    _PendingRemoved,
    _PendingStored,
)
from events.wire.model import (
    AllBlocksCleared,
    Created,
    EventDiff,
    Removed,
    Stored,
    StoredBlock,
    Updated,
)
from kvcache.scope import ReuseScope

SCOPES = [ReuseScope(), ReuseScope(lora_id=3), ReuseScope(salt=7), ReuseScope(lora_id=1, salt=2)]


class FakeBlock:
    """A BlockView with settable fields (the tree's node has the same slots)."""

    __slots__ = ("is_full", "key", "parent", "priority", "scope", "tier", "tokens")

    def __init__(
        self,
        key: bytes,
        tokens: Any,
        parent: FakeBlock | None,
        scope: ReuseScope,
        tier: int = 0,
        priority: int = 35,
        is_full: bool = True,
    ) -> None:
        self.key = key
        self.tokens = tokens
        self.parent = parent
        self.scope = scope
        self.tier = tier
        self.priority = priority
        self.is_full = is_full


def _chain(n: int, scope: ReuseScope = SCOPES[0], tpb: int = 4) -> list[FakeBlock]:
    blocks: list[FakeBlock] = []
    for i in range(n):
        tokens = array("i", range(10 * i, 10 * i + tpb))
        blocks.append(FakeBlock(bytes([i]) * 4, tokens, blocks[-1] if blocks else None, scope))
    return blocks


# ----------------------------------------------------------------------------- events


def _pending_item(kind: int, n: int) -> Any:
    sb = StoredBlock(n, array("i", [n, n + 1]), None, 0, 35, None)
    if kind == 0:
        return _PendingStored(None if n % 2 else n * 7, [sb] * (n % 3 + 1))
    if kind == 1:
        return _PendingRemoved([n, n + 1], n % 2)
    if kind == 2:
        return AllBlocksCleared()
    if kind == 3:
        return Created([n, 2 * n])
    return Updated(n, cache_level=EventDiff(0, 1))


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 4), st.integers(0, 50)), max_size=8),
    st.sampled_from([0, 1, 254, 255, 256, 2**63 - 2, 2**70]),
    st.sampled_from([None, 4, 512]),
    st.sampled_from([0, 128]),
    st.sampled_from(["v1_block_key", "v2_sha256"]),
    st.sampled_from([None, 0, 3]),
)
def test_the_event_builder_numbers_and_wraps_each_pending_item(
    items: list[tuple[int, int]],
    first_id: int,
    block_size: int | None,
    window: int,
    algo: str,
    dp_rank: int | None,
) -> None:
    pending = [_pending_item(kind, n) for kind, n in items]
    args = (first_id, block_size, window, algo, dp_rank)
    got = manager_module._build_events(list(pending), *args)
    assert [e.event_id for e in got] == list(range(first_id, first_id + len(pending)))
    assert all(
        (e.window_size, e.hash_algo, e.attention_dp_rank) == (window, algo, dp_rank) for e in got
    )
    for e, item in zip(got, pending, strict=True):
        if isinstance(item, _PendingStored):
            assert e.data.blocks is item.blocks  # type: ignore[union-attr]
            assert e.data == Stored(item.parent_hash, item.blocks, block_size)
        elif isinstance(item, _PendingRemoved):
            assert e.data == Removed(item.block_hashes, item.cache_level)
        else:
            assert e.data is item


def _twin_events(mgr: KVCacheEventManager, step: int) -> None:
    blocks: list[Any] = _chain(3, SCOPES[step % 4])
    for i, b in enumerate(blocks):
        b.key = bytes([step, i])
    mgr.on_stored(blocks)
    if step % 2:
        mgr.on_removed(blocks[2:])
    if step % 3 == 2:
        mgr.on_cleared()


@pytest.mark.parametrize("max_entries", [1, 2, 3, 100])
def test_end_step_gives_what_flush_and_drain_give(max_entries: int) -> None:
    """Step by step, through the path that skips the buffer and the one that overflows it."""
    one = KVCacheEventManager(max_entries=max_entries, tokens_per_block=4)
    twin = KVCacheEventManager(max_entries=max_entries, tokens_per_block=4)
    for step in range(8):
        _twin_events(one, step)
        _twin_events(twin, step)
        got = one.end_step()
        twin.flush()
        lost = twin.take_dropped()
        assert got == (twin.get_latest_events(), lost)
    assert one.dropped_events == twin.dropped_events
    assert one.next_event_id == twin.next_event_id
    if max_entries < 3:
        assert one.dropped_events > 0

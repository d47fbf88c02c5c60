"""Eviction candidates of one tier: a prioritized LRU heap.

Order (what goes first): lowest ``priority``, then oldest ``tick`` (the pool's counter at the
block's last release), then lowest ``uid`` (oldest block). Only *leaves on their tier* are
candidates: a block with an unpinned child on the same tier is not offered until that child
has left the tier, so a chain is evicted from its end, and an inner block never leaves a tier
before its descendants there. The block pool pushes a block when it becomes a candidate and
bumps ``block.gen`` whenever its state changes, which turns older heap entries stale (lazy
deletion).

Each tier has two queues: cached blocks, and pages of suspended sequences. The victim is the
first of the two heads in the order above, except that a suspended page is taken only when the
slower tiers can take it in (it is never dropped); otherwise the cached head goes. The victim
moves one tier down when that tier has a free page or can make one (recursively), else it is
dropped with its subtree.
"""

from __future__ import annotations

import heapq
from typing import TypeAlias

from kvcache.tree import Block

_Entry: TypeAlias = tuple[int, int, int, int, Block]


class EvictionQueue:
    """Candidates of one tier and one kind (plain cached blocks, or suspended-held pages)."""

    __slots__ = ("_heap", "_limit")

    def __init__(self, capacity: int) -> None:
        self._heap: list[_Entry] = []
        # A block has at most one live entry; past this many the stale ones are swept.
        self._limit = 2 * capacity + 64

    def push(self, block: Block) -> None:
        """Offer ``block`` with its current priority, tick and generation."""
        heapq.heappush(self._heap, (block.priority, block.tick, block.uid, block.gen, block))
        if len(self._heap) > self._limit:
            self._heap = [e for e in self._heap if e[3] == e[4].gen]
            heapq.heapify(self._heap)

    def peek(self) -> Block | None:
        """The first candidate, or None; stale entries on top are discarded."""
        heap = self._heap
        while heap:
            entry = heap[0]
            if entry[3] == entry[4].gen:
                return entry[4]
            heapq.heappop(heap)
        return None

    def __len__(self) -> int:
        """Entries held, stale ones included (for tests of the sweep)."""
        return len(self._heap)


def eviction_key(block: Block) -> tuple[int, int, int]:
    """The sort key of the eviction order: (priority, tick, uid), smallest first."""
    return (block.priority, block.tick, block.uid)

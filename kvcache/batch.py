"""What one operation of the block pool moved, told and copied once, at the operation's end.

Page data moves are not copied one by one: the batch records where each moved block's data was
when the operation began and the copy-on-write requests, and :meth:`Batch.finish` issues one
``copy_pages`` per (source tier, destination tier). Downward copies run first, slowest source
tier first, so a page is read before the operation's later writes land on it; upward copies
(onboarding, resume) and copy-on-write run last, into pages whose old data has already been
copied out. The sink hears of moves the same way: one ``on_moved`` per tier pair, from the tier
it last heard of to where the block is now (a block that went down and back says nothing).
"""

from __future__ import annotations

from kvcache.sink import EventSink
from kvcache.storage_protocol import PageStorage
from kvcache.tree import Block


class Batch:
    """Pending sink moves and page copies of the current operation."""

    __slots__ = ("_copy_from", "_cow", "_sink_tier", "sink", "storage", "tokens_per_block")

    def __init__(
        self, sink: EventSink | None, storage: PageStorage | None, tokens_per_block: int
    ) -> None:
        self.sink = sink
        self.storage = storage
        self.tokens_per_block = tokens_per_block
        self._sink_tier: dict[Block, int] = {}  # moved blocks -> tier the sink last heard of
        self._copy_from: dict[Block, tuple[int, int]] = {}  # moved blocks -> (tier, page) at start
        self._cow: list[tuple[int, int, int, int]] = []  # src tier, src page, dst page, tokens

    def moved(self, b: Block, old_tier: int, old_page: int, copy: bool) -> None:
        """``b`` is leaving ``old_page`` of ``old_tier``; with ``copy`` its data must follow
        (without, its new page already holds the same data)."""
        if b.in_tree:
            self._sink_tier.setdefault(b, old_tier)
        if self.storage is not None:
            if copy:
                self._copy_from.setdefault(b, (old_tier, old_page))
            else:
                self._copy_from.pop(b, None)

    def freed(self, b: Block) -> None:
        """``b``'s page is gone: nothing to copy into it."""
        self._copy_from.pop(b, None)

    def copy_on_write(self, src: Block, dst_page: int, num_tokens: int) -> None:
        """Copy the first ``num_tokens`` of ``src``'s page into device page ``dst_page``."""
        if self.storage is not None:
            self._cow.append((src.tier, src.page, dst_page, num_tokens))

    def flush_moves(self) -> None:
        """Tell the sink about the moves so far, one call per tier pair."""
        if not self._sink_tier:
            return
        groups: dict[tuple[int, int], list[Block]] = {}
        for b, old in self._sink_tier.items():
            if b.in_tree and b.tier != old:
                groups.setdefault((old, b.tier), []).append(b)
        self._sink_tier.clear()
        if self.sink is not None:
            for (old, new), blocks in sorted(groups.items(), key=_pair_order):
                self.sink.on_moved(blocks, old, new)

    def finish(self) -> None:
        """End of an operation: flush sink moves and issue the batched page copies."""
        self.flush_moves()
        storage = self.storage
        if storage is None or not (self._copy_from or self._cow):
            return
        tpb = self.tokens_per_block
        groups: dict[tuple[int, int], tuple[list[int], list[int], list[int]]] = {}
        for b, (tier, page) in self._copy_from.items():
            if b.page >= 0 and (tier, page) != (b.tier, b.page):
                src, dst, counts = groups.setdefault((tier, b.tier), ([], [], []))
                src.append(page)
                dst.append(b.page)
                counts.append(tpb)
        for tier, page, dst_page, n in self._cow:
            src, dst, counts = groups.setdefault((tier, 0), ([], [], []))
            src.append(page)
            dst.append(dst_page)
            counts.append(n)
        self._copy_from.clear()
        self._cow.clear()
        for (s, d), (src, dst, counts) in sorted(groups.items(), key=_pair_order):
            partial = any(c != tpb for c in counts)
            storage.copy_pages(s, src, d, dst, counts if partial else None)


def _pair_order(item: tuple[tuple[int, int], object]) -> tuple[int, int]:
    # Downward first, slowest source first; then upward and same-tier copies.
    src, dst = item[0]
    return (0, -src) if dst > src else (1, src)

"""Tiered page book-keeping: who holds which page, eviction, moves, drops, batched copies.

Every block (tree node or page a sequence holds privately) is in exactly one class on its tier:

- *pinned*: ``refs > 0``, held by a live (not suspended) sequence; never evicted;
- *cached*: ``refs == 0`` and ``susp == 0``; evictable: moved to the next tier or dropped;
- *suspended*: ``refs == 0`` and ``susp > 0``; may move to a slower tier, is never dropped.

Holding is prefix-closed (a sequence holds its whole chain), so a cached block's subtree is
all cached and can be dropped whole. Evicting a leaf before its parent keeps the invariant that
a child is never on a faster tier than its parent.

Page data moves are not copied one by one: an operation records where each moved block's data
was when the operation began and the copy-on-write requests, and :meth:`TieredPages.finish`
issues one ``copy_pages`` per (source tier, destination tier). Downward copies run first,
slowest source tier first, so a page is read before the operation's later writes land on it;
upward copies (onboarding, resume) and copy-on-write run last, into pages whose old data has
already been copied out.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvcache.eviction import EvictionQueue, eviction_key
from kvcache.pool import PagePool
from kvcache.sink import EventSink
from kvcache.storage_protocol import PageStorage
from kvcache.tree import Block, RadixTree


@dataclass(slots=True)
class Counters:
    """Cumulative counts of what the eviction machinery did."""

    evictions: int = 0
    offloads: int = 0
    onboards: int = 0
    drops: int = 0


class TieredPages:
    """Pools, per-tier classes and eviction queues of all tiers, plus per-operation batching."""

    def __init__(
        self,
        tree: RadixTree,
        pools: list[PagePool],
        sink: EventSink | None,
        storage: PageStorage | None,
        tokens_per_block: int,
    ) -> None:
        self.tree = tree
        self.pools = pools
        self.sink = sink
        self.storage = storage
        self.tokens_per_block = tokens_per_block
        n = len(pools)
        self.num_tiers = n
        self.pinned = [0] * n
        self.cached = [0] * n
        self.suspended = [0] * n
        self.queues = [(EvictionQueue(p.num_blocks), EvictionQueue(p.num_blocks)) for p in pools]
        self.counters = Counters()
        self.uid = 0
        self.tick = 0
        self._sink_tier: dict[Block, int] = {}  # moved blocks -> tier the sink last heard of
        self._copy_from: dict[Block, tuple[int, int]] = {}  # moved blocks -> (tier, page) at start
        self._cow: list[tuple[int, int, int, int]] = []  # src tier, src page, dst page, tokens

    # ----------------------------------------------------------------- classes and candidacy

    def _count(self, b: Block, sign: int) -> None:
        if b.refs:
            self.pinned[b.tier] += sign
        elif b.susp:
            self.suspended[b.tier] += sign
        else:
            self.cached[b.tier] += sign

    def refresh(self, b: Block) -> None:
        """Invalidate ``b``'s heap entries and offer it again if it is a candidate now."""
        b.gen += 1
        if b.refs == 0 and b.here == 0 and b.page >= 0:
            self.queues[b.tier][1 if b.susp else 0].push(b)

    def pin(self, b: Block) -> None:
        """One more live sequence holds ``b``."""
        if b.refs == 0:
            self._count(b, -1)
            b.refs = 1
            self._count(b, 1)
            b.gen += 1
        else:
            b.refs += 1

    def unpin(self, b: Block, tick: int) -> None:
        """One live sequence less holds ``b``; ``tick`` becomes its last use if now unpinned."""
        if b.refs == 1:
            self._count(b, -1)
            b.refs = 0
            self._count(b, 1)
            b.tick = tick
            self.refresh(b)
        else:
            b.refs -= 1

    def release_suspended(self, b: Block, tick: int) -> None:
        """A suspended holder lets go of ``b`` (its sequence is closed)."""
        self._count(b, -1)
        b.susp -= 1
        self._count(b, 1)
        if b.refs == 0:
            b.tick = tick
        self.refresh(b)

    def forget(self, b: Block) -> None:
        """Discard a private block whose page another block has taken over."""
        self._count(b, -1)
        b.page = -1
        b.gen += 1

    def hold(self, b: Block, live: bool, tick: int) -> None:
        """Turn one suspended holder into a live one (``live``) or the other way round."""
        self._count(b, -1)
        if live:
            b.susp -= 1
            b.refs += 1
        else:
            b.refs -= 1
            b.susp += 1
            b.tick = tick
        self._count(b, 1)
        self.refresh(b)

    # ------------------------------------------------------------------------------ capacity

    def room(self, tier: int) -> int:
        """Pages ``tier`` can provide now: free, plus cached ones that can leave, plus
        suspended ones the slower tiers can take."""
        below = 0
        for t in range(self.num_tiers - 1, tier - 1, -1):
            below = self.pools[t].num_free + self.cached[t] + min(self.suspended[t], below)
        return below

    def allocate(self, tier: int) -> int:
        """A free page of ``tier``, evicting first if needed (the caller checked ``room``)."""
        pool = self.pools[tier]
        while pool.num_free == 0:
            if not self.evict_one(tier):
                raise AssertionError(f"tier {tier}: room was checked but nothing can be evicted")
        return pool.allocate()

    def evict_one(self, tier: int) -> bool:
        """Make one page of ``tier`` free by moving or dropping the first candidate."""
        q_cached, q_susp = self.queues[tier]
        c = q_cached.peek()
        s = q_susp.peek()
        below = self.room(tier + 1) if tier + 1 < self.num_tiers else 0
        if s is not None and below > 0 and (c is None or eviction_key(s) < eviction_key(c)):
            victim = s
        elif c is not None:
            victim = c
        else:
            return False
        self.counters.evictions += 1
        if below > 0:
            self.move(victim, tier + 1, self.allocate(tier + 1), copy=True)
            self.counters.offloads += 1
        else:
            self.drop(victim)
        return True

    # --------------------------------------------------------------------- moves and drops

    def move(self, b: Block, tier: int, page: int, copy: bool) -> None:
        """Put ``b`` on ``page`` of ``tier`` and free its old page. With ``copy`` the data
        follows (batched at :meth:`finish`); without, ``page`` already holds it."""
        old_tier, old_page = b.tier, b.page
        if self.storage is not None:
            if copy:
                self._copy_from.setdefault(b, (old_tier, old_page))
            else:
                self._copy_from.pop(b, None)
        self.pools[old_tier].release(old_page)
        self._count(b, -1)
        b.tier, b.page = tier, page
        self._count(b, 1)
        # A block taken out of the tree (a replaced partial its sequence still holds) keeps its
        # parent pointer for the sink's sake but no longer counts among the parent's children.
        parent = b.parent if b.in_tree else None
        if parent is not None:
            if parent.tier == old_tier:
                parent.here -= 1
                if parent.here == 0:
                    self.refresh(parent)
            elif parent.tier == tier:
                parent.here += 1
                parent.gen += 1  # no longer a leaf on its tier
        b.here = sum(1 for c in b.iter_children() if c.tier == tier)
        self.refresh(b)
        if b.in_tree:
            self._sink_tier.setdefault(b, old_tier)

    def free(self, b: Block) -> None:
        """Release ``b``'s page (the block is gone: dropped, or a private page given back)."""
        self._count(b, -1)
        self.pools[b.tier].release(b.page)
        b.page = -1
        b.gen += 1
        self._copy_from.pop(b, None)

    def unlink(self, b: Block) -> None:
        """Take a tree block out of the tree, keeping its parent's leaf count right."""
        parent = b.parent
        self.tree.detach(b)
        if parent is not None and parent.tier == b.tier and parent.page >= 0:
            parent.here -= 1
            if parent.here == 0:
                self.refresh(parent)

    def link(self, b: Block, node: Block | object) -> None:
        """Insert a keyed block under ``node`` (a Block or a ScopeRoot)."""
        self.tree.attach(b, node)  # type: ignore[arg-type]
        parent = b.parent
        if parent is not None and parent.tier == b.tier:
            parent.here += 1
            parent.gen += 1

    def drop(self, victim: Block) -> None:
        """Remove a cached block and its subtree from the tree and free their pages."""
        gone = self.tree.subtree(victim)
        self.flush_moves()
        for b in gone:
            self.unlink(b)
            self.free(b)
        self.counters.drops += len(gone)
        if self.sink is not None:
            self.sink.on_removed(gone)

    def remove_blocks(self, gone: Iterable[Block]) -> None:
        """Unlink and free the given cached blocks (descendants first), without telling."""
        for b in gone:
            self.unlink(b)
            self.free(b)

    # ------------------------------------------------------------------ operation batching

    def copy_on_write(self, src: Block, dst_page: int, num_tokens: int) -> None:
        """Copy the first ``num_tokens`` of ``src``'s page into device page ``dst_page``."""
        if self.storage is not None:
            self._cow.append((src.tier, src.page, dst_page, num_tokens))

    def flush_moves(self) -> None:
        """Tell the sink about the moves of the current operation, one call per tier pair."""
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

    def next_uid(self) -> int:
        """A fresh block id (creation order)."""
        self.uid += 1
        return self.uid

    def next_tick(self) -> int:
        """A fresh value of the manager's use counter."""
        self.tick += 1
        return self.tick


def _pair_order(item: tuple[tuple[int, int], object]) -> tuple[int, int]:
    # Downward first, slowest source first; then upward and same-tier copies.
    src, dst = item[0]
    return (0, -src) if dst > src else (1, src)

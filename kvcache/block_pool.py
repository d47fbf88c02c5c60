"""The block pool: every page of every tier, who holds it, and which page leaves a tier first.

Every block (tree node or page a sequence holds privately) is in exactly one class on its tier:

- *pinned*: ``refs > 0``, held by a live (not suspended) sequence; never evicted;
- *cached*: ``refs == 0`` and ``susp == 0``; evictable: moved to the next tier or dropped;
- *suspended*: ``refs == 0`` and ``susp > 0``; may move to a slower tier, is never dropped.

Holding is prefix-closed (a sequence holds its whole chain), so a cached block's subtree is
all cached and can be dropped whole. Evicting a leaf before its parent keeps the invariant that
a child is never on a faster tier than its parent.

This module is the only writer of a block's page state (``tier``, ``page``, ``priority``,
``refs``, ``susp``, ``tick``, ``here``, ``gen``, ``uid``); the tree writes the structure through
``attach``/``detach``, which only this pool calls. Sequences and the manager use the named
operations: ``acquire``/``grow``/``free`` (pages for a sequence), ``store_full``/
``store_partial`` (blocks join the tree), ``suspend``/``resume``/``release``, ``clear``, and
``finish`` at the end of each operation (:mod:`kvcache.batch` then copies and tells the moves).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from kvcache.batch import Batch
from kvcache.errors import OutOfPagesError
from kvcache.eviction import EvictionQueue, eviction_key
from kvcache.hashing import BlockKey
from kvcache.pool import PagePool
from kvcache.scope import ReuseScope
from kvcache.sink import EventSink
from kvcache.storage_protocol import PageStorage
from kvcache.tokens import tokens_to_bytes
from kvcache.tree import Block, Node, RadixTree, full_children, new_blocks


@dataclass(slots=True)
class Counters:
    """Cumulative counts of what the eviction machinery did."""

    evictions: int = 0
    offloads: int = 0
    onboards: int = 0
    drops: int = 0


class BlockPool:
    """Pools, per-tier classes and eviction queues of all tiers."""

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
        self.tokens_per_block = tokens_per_block
        n = len(pools)
        self.num_tiers = n
        self.pinned, self.suspended, self.cached = [0] * n, [0] * n, [0] * n  # pages per tier
        self._classes = (self.pinned, self.suspended, self.cached)
        self.queues = [(EvictionQueue(p.num_blocks), EvictionQueue(p.num_blocks)) for p in pools]
        self.counters = Counters()
        self._uid = 0
        self._tick = 0
        self.batch = Batch(sink, storage, tokens_per_block)

    # ----------------------------------------------------------------- classes and candidacy

    def _count(self, b: Block, sign: int) -> None:
        self._classes[0 if b.refs else 1 if b.susp else 2][b.tier] += sign

    def _refresh(self, b: Block) -> None:
        """Invalidate ``b``'s heap entries and offer it again if it is a candidate now."""
        b.gen += 1
        if b.refs == 0 and b.here == 0 and b.page >= 0:
            self.queues[b.tier][1 if b.susp else 0].push(b)

    def _holders(self, b: Block, refs: int, susp: int, tick: int | None = None) -> None:
        """Set ``b``'s live (``refs``) and suspended holders, and its last release."""
        t = b.tier  # _count(b, -1) and _count(b, 1), inlined: this runs for every reused block
        self._classes[0 if b.refs else 1 if b.susp else 2][t] -= 1
        self._classes[0 if refs else 1 if susp else 2][t] += 1
        b.refs = refs
        b.susp = susp
        if tick is not None:
            b.tick = tick
        b.gen += 1  # and _refresh
        if refs == 0 and b.here == 0 and b.page >= 0:
            self.queues[b.tier][1 if susp else 0].push(b)

    # ------------------------------------------------------------------------------ capacity

    def room(self, tier: int) -> int:
        """Pages ``tier`` can provide now: free, plus cached ones that can leave, plus
        suspended ones the slower tiers can take."""
        below = 0
        for t in range(self.num_tiers - 1, tier - 1, -1):
            below = self.pools[t].num_free + self.cached[t] + min(self.suspended[t], below)
        return below

    def _check_room(self, need: int, what: str) -> None:
        room = self.room(0)
        if room < need:
            free = self.pools[0].num_free
            raise OutOfPagesError(
                f"{what} device pages but only {room} can be had ({free} free + "
                f"{room - free} evictable); close or suspend sequences, or give the device "
                "tier more blocks"
            )

    def _allocate(self, tier: int) -> int:
        """A free page of ``tier``, evicting first if needed (the caller checked ``room``)."""
        pool = self.pools[tier]
        while pool.num_free == 0:
            if not self._evict_one(tier):
                raise AssertionError(f"tier {tier}: room was checked but nothing can be evicted")
        return pool.allocate()

    def _evict_one(self, tier: int) -> bool:
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
            self._move(victim, tier + 1, self._allocate(tier + 1), copy=True)
            self.counters.offloads += 1
        else:
            self._drop([victim])
        return True

    # ------------------------------------------------------------------- pages of sequences

    def grow(self, count: int, scope: ReuseScope, priority: int) -> list[Block]:
        """``count`` device pages a sequence holds privately; ``OutOfPagesError`` (nothing
        changed) when the device tier cannot provide them."""
        if count > self.pools[0].num_free:  # else room() is at least count: skip its sum
            self._check_room(count, f"the sequence needs {count} more")
        return self._privates(count, scope, priority)

    def _privates(self, count: int, scope: ReuseScope, priority: int) -> list[Block]:
        pool = self.pools[0]
        if pool.num_free >= count:
            slots = pool.allocate_many(count)
        else:
            slots = [self._allocate(0) for _ in range(count)]
        uid = self._uid
        self._uid += count
        self.pinned[0] += count
        return new_blocks(uid + 1, scope, 0, slots, priority)

    def acquire(
        self, full: list[Block], src: Block | None, num_src: int, scope: ReuseScope, priority: int
    ) -> list[Block]:
        """Pin reused ``full`` blocks (onboarding those on slower tiers) and, with a
        copy-on-write ``src``, add a private page holding its first ``num_src`` tokens."""
        pinned = [*full, src] if src is not None else full  # src stays put for this operation
        classes = self._classes
        pinned_count = self.pinned
        for b in pinned:
            # _holders(b, b.refs + 1, b.susp), inlined: once per reused block. A pinned block
            # is never a candidate, so nothing is pushed.
            classes[0 if b.refs else 1 if b.susp else 2][b.tier] -= 1
            pinned_count[b.tier] += 1
            b.refs += 1
            b.gen += 1
        away = [b for b in full if b.tier != 0]
        need = len(away) + (src is not None)
        if not need:
            return list(full)
        try:
            cow = " + 1 copy-on-write" if src else ""
            self._check_room(need, f"reusing {len(full)} blocks{cow} needs {need}")
        except OutOfPagesError:
            for b in pinned:
                self._holders(b, b.refs - 1, b.susp)
            raise
        # Every device page is had before anything moves up, so the evictions (downward
        # copies) are issued before the onboarding copies read the slower tiers.
        dev = [self._allocate(0) for _ in away]
        blocks = full + self._privates(len(pinned) - len(full), scope, priority)
        self._onboard(away, dev)
        if src is not None:
            self.batch.copy_on_write(src, blocks[-1].page, num_src)
            self._holders(src, src.refs - 1, src.susp)
        return blocks

    def _onboard(self, away: list[Block], pages: list[int]) -> None:
        for b, page in zip(away, pages, strict=True):
            self._move(b, 0, page, copy=True)
        self.counters.onboards += len(away)

    def free(self, b: Block) -> None:
        """Release ``b``'s page (the block is gone: dropped, or a private page given back)."""
        self._count(b, -1)
        self.pools[b.tier].release(b.page)
        b.page = -1
        b.gen += 1
        self.batch.freed(b)

    def suspend(self, blocks: Sequence[Block]) -> None:
        """A sequence stops pinning ``blocks``: they may move down, never be dropped."""
        tick = self.next_tick()
        for b in blocks:
            self._holders(b, b.refs - 1, b.susp + 1, tick)

    def resume(self, blocks: Sequence[Block]) -> None:
        """Pin ``blocks`` again, bringing them back to the device tier (``OutOfPagesError``
        with nothing changed when it cannot hold them)."""
        ticks = [b.tick for b in blocks]
        for b in blocks:
            self._holders(b, b.refs + 1, b.susp - 1)
        away = [b for b in blocks if b.tier != 0]
        try:
            self._check_room(len(away), f"resume() needs {len(away)}")
        except OutOfPagesError:
            for b, t in zip(blocks, ticks, strict=True):
                self._holders(b, b.refs - 1, b.susp + 1, t)
            raise
        self._onboard(away, [self._allocate(0) for _ in away])

    def release(self, blocks: Sequence[Block], suspended: bool) -> None:
        """A sequence lets go of ``blocks``: tree blocks stay cached, private pages are freed;
        a block no live sequence holds any more was last used now."""
        tick = self.next_tick()
        if suspended:
            holders = self._holders
            for b in blocks:
                if not b.in_tree:
                    self.free(b)
                    continue
                refs = b.refs
                holders(b, refs, b.susp - 1, None if refs else tick)
            return
        classes = self._classes
        queues = self.queues
        for b in blocks:
            if not b.in_tree:
                self.free(b)
                continue
            # _holders(b, b.refs - 1, b.susp, None if refs else tick), inlined: once per block
            # of every finished sequence. ``b`` was pinned (this sequence held it live).
            refs = b.refs - 1
            b.refs = refs
            b.gen += 1
            if not refs:
                t = b.tier
                susp = b.susp
                classes[0][t] -= 1
                classes[1 if susp else 2][t] += 1
                b.tick = tick
                if b.here == 0 and b.page >= 0:
                    queues[t][1 if susp else 0].push(b)

    # --------------------------------------------------------------------------- tree edits

    def store_full(
        self,
        scope: ReuseScope,
        blocks: list[Block],
        first: int,
        last: int,
        tokens: array[int],
        data: bytes | None = None,
        keys: Sequence[BlockKey] | None = None,
        hashes: Sequence[int] | None = None,
    ) -> None:
        """Blocks ``first..last-1`` of a sequence (private pages) join the tree, holding
        ``tokens``'s blocks: ``tokens[0]`` is the first token of block ``first`` (it may run
        past block ``last - 1``); ``data``, when the caller has it, is their 4-byte LE
        encoding; ``keys``, when it has them, the keys of the sequence's blocks ``0..len - 1``
        (those of blocks in this range are not computed again; when they cover it, no token
        is packed, compared or hashed), ``hashes`` the sink's hashes of
        the same blocks (handed to it with those stored). Where the same block is
        cached already the sequence switches to it (its own page is given back, or handed to
        the cached block when that one sits on a slower tier: the page holds the same KV).
        After the first block that is not cached, none is (a new block has no children), so
        the rest joins as one chain."""
        tpb = self.tokens_per_block
        step = 4 * tpb
        node = self._parent_node(scope, blocks, first)
        i = first
        next_key: BlockKey | None = None
        if keys is not None and last <= len(keys):
            # every block's key is known: looked up by key, nothing packed or hashed
            found = self.tree.match_keys(node, keys[first:last], last - first)
        else:
            if data is None:
                data = tokens_to_bytes(tokens[: (last - first) * tpb])
            found, next_key = self.tree.match_full_key(node, data, last - first, step)
        for cached in found:
            self._holders(cached, cached.refs + 1, cached.susp)
            b = blocks[i]
            if cached.tier == 0:
                self.free(b)
            else:
                page = b.page
                self._count(b, -1)
                b.page = -1
                b.gen += 1
                self._move(cached, 0, page, copy=False)
            blocks[i] = node = cached
            i += 1
        if i == last:
            return
        at = (i - first) * tpb  # where block i's tokens begin
        if node.partials:
            old = self.tree.extended_partial(node, tokens[at : at + tpb])
            if old is not None:
                self._replace_partial(old)
                node = self._parent_node(scope, blocks, i)  # the root may have gone with it
        new = blocks[i:last]
        # next_key chains from node's key: a root that went with the partial comes back with
        # the same key (the scope's)
        rest = data if i == first or data is None else data[4 * at :]
        known = keys[i:last] if keys is not None and i < len(keys) else None
        self.tree.attach_chain(
            node, new, tokens, tpb, start=at, data=rest, first_key=next_key, keys=known
        )
        self._linked(new[0])
        for j in range(i, last - 1):  # each one's child is on its tier (the device tier, pinned)
            b = blocks[j]
            b.here = 1
            b.gen += 1
        self._emit_stored(new, hashes[i:last] if hashes is not None and i < len(hashes) else None)

    def store_partial(self, scope: ReuseScope, blocks: list[Block], tokens: array[int]) -> None:
        """The sequence's last block, holding ``tokens`` (fewer than a block), joins the tree
        unless a sibling already covers them; a partial sibling it extends is replaced."""
        i = len(blocks) - 1
        node = self._parent_node(scope, blocks, i)
        if self.tree.is_useless_partial(node, tokens):
            return
        old = self.tree.extended_partial(node, tokens)
        if old is not None:
            self._replace_partial(old)
            node = self._parent_node(scope, blocks, i)  # the root may have gone with it
        self.tree.attach_partial(blocks[i], node, tokens)
        self._linked(blocks[i])
        self._emit_stored([blocks[i]])

    def _parent_node(self, scope: ReuseScope, blocks: list[Block], index: int) -> Node:
        if index:
            return blocks[index - 1]
        root = self.tree.root(scope, create=True)
        assert root is not None
        return root

    def _linked(self, b: Block) -> None:
        """``b`` just joined the tree: its parent is no longer a leaf on ``b``'s tier."""
        parent = b.parent
        if parent is not None and parent.tier == b.tier:
            parent.here += 1
            parent.gen += 1

    def _unlink(self, b: Block) -> None:
        parent = b.parent
        self.tree.detach(b)
        if parent is not None and parent.tier == b.tier and parent.page >= 0:
            parent.here -= 1
            if parent.here == 0:
                self._refresh(parent)

    def _replace_partial(self, old: Block) -> None:
        """Take a partial block out of the tree because a new block extends it."""
        self.batch.flush_moves()
        self._unlink(old)
        if old.refs == 0 and old.susp == 0:
            self.free(old)
        # else: its sequence still holds the page privately and frees it on close
        if self.sink is not None:
            self.sink.on_removed([old])

    def _emit_stored(self, blocks: list[Block], hashes: Sequence[int] | None = None) -> None:
        if blocks and self.sink is not None:
            self.batch.flush_moves()
            if hashes:
                self.sink.on_stored(blocks, hashes)
            else:
                self.sink.on_stored(blocks)

    # --------------------------------------------------------------------- moves and drops

    def _move(self, b: Block, tier: int, page: int, copy: bool) -> None:
        """Put ``b`` on ``page`` of ``tier`` and free its old page. With ``copy`` the data
        follows (batched at :meth:`finish`); without, ``page`` already holds it."""
        old_tier, old_page = b.tier, b.page
        self.batch.moved(b, old_tier, old_page, copy)
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
                    self._refresh(parent)
            elif parent.tier == tier:
                parent.here += 1
                parent.gen += 1  # no longer a leaf on its tier
        here = 0
        for c in full_children(b):
            if c.tier == tier:
                here += 1
        if b.partials:
            for c in b.partials.values():
                if c.tier == tier:
                    here += 1
        b.here = here
        self._refresh(b)

    def _drop(self, victims: list[Block], evicted: bool = True) -> None:
        """Remove cached blocks and their subtrees from the tree and free their pages. The
        sink hears ``on_removed`` with every block gone, descendants first, or ``on_cleared``
        when a ``clear`` emptied the tree."""
        subtree = self.tree.subtree
        gone = (
            subtree(victims[0]) if len(victims) == 1 else [b for v in victims for b in subtree(v)]
        )
        everything = not evicted and len(gone) == self.tree.num_blocks
        self.batch.flush_moves()
        for b in gone:
            self._unlink(b)
            self.free(b)
        if evicted:
            self.counters.drops += len(gone)
        if self.sink is not None:
            if everything:
                self.sink.on_cleared()
            else:
                self.sink.on_removed(gone)

    def clear(self) -> None:
        """Drop every cached block that no sequence (live or suspended) holds."""
        victims: list[Block] = []
        for root in list(self.tree.roots.values()):
            stack = [*full_children(root), *(root.partials or {}).values()]
            while stack:
                b = stack.pop()
                if b.refs == 0 and b.susp == 0:
                    victims.append(b)
                else:
                    stack.extend(b.iter_children())
        if victims:
            self._drop(victims, evicted=False)

    def finish(self) -> None:
        """End of an operation: the sink hears of its moves, the storage copies the pages."""
        self.batch.finish()

    def next_tick(self) -> int:
        """A fresh value of the use counter (release order)."""
        self._tick += 1
        return self._tick

"""``KVCache``: one sequence's view of the cache (its block table and what it committed).

Block ``i`` of a sequence covers token positions ``[i * tpb, (i + 1) * tpb)``. The sequence
holds a list of blocks: the leading full ones are tree blocks (reused or committed), the rest
are private pages (the partially filled block, a copy-on-write page, pages reserved ahead by
``resize``). A full block joins the tree on ``commit``; the trailing partial one on
``stop_committing``.

States: active -> (stop_committing) -> stopped; active/stopped <-> suspended; any -> closed.
``close()`` twice is a no-op; every other call on a closed cache raises ``ClosedCacheError``.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from hashlib import sha256
from types import TracebackType
from typing import TYPE_CHECKING

from kvcache.errors import CacheStateError, ClosedCacheError, OutOfPagesError
from kvcache.keys import BlockKey, token_array, tokens_to_bytes
from kvcache.scope import ReuseScope
from kvcache.tree import Block, ScopeRoot

if TYPE_CHECKING:
    from kvcache.manager import KVCacheManager


class KVCache:
    """The per-sequence cache returned by :meth:`KVCacheManager.create_kv_cache`."""

    __slots__ = (
        "_blocks",
        "_closed",
        "_mgr",
        "_stopped",
        "_suspended",
        "_tokens",
        "num_reused_tokens",
        "priority",
        "scope",
    )

    def __init__(
        self,
        manager: KVCacheManager,
        scope: ReuseScope,
        priority: int,
        tokens: array[int],
        blocks: list[Block],
    ) -> None:
        self._mgr = manager
        self.scope = scope
        self.priority = priority
        self._tokens = tokens
        self._blocks = blocks
        self.num_reused_tokens = len(tokens)
        self._closed = False
        self._stopped = False
        self._suspended = False

    # ------------------------------------------------------------------------- properties

    @property
    def num_tokens(self) -> int:
        """Tokens whose KV is in the cache: the reused prefix plus everything committed."""
        return len(self._tokens)

    @property
    def capacity(self) -> int:
        """Tokens the sequence's allocated pages can hold."""
        return len(self._blocks) * self._mgr.tokens_per_block

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called."""
        return self._closed

    @property
    def suspended(self) -> bool:
        """Whether the sequence is suspended (its pages may sit on slower tiers)."""
        return self._suspended

    @property
    def tokens(self) -> list[int]:
        """Every token in the cache, in order."""
        return self._tokens.tolist()

    def page_indices(self) -> list[int]:
        """Device-tier block table: the page of block ``i``, for every allocated block."""
        self._check_open("page_indices")
        if self._suspended:
            raise CacheStateError("page_indices(): the sequence is suspended; resume() it first")
        return [b.page for b in self._blocks]

    # ------------------------------------------------------------------------- operations

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise ClosedCacheError(f"{what}: this KVCache was closed; create a new one")

    def _check_writable(self, what: str) -> None:
        self._check_open(what)
        if self._suspended:
            raise CacheStateError(f"{what}: the sequence is suspended; resume() it first")
        if self._stopped:
            raise CacheStateError(
                f"{what}: stop_committing() was called; nothing more can be added"
            )

    def resize(self, capacity_tokens: int) -> None:
        """Hold device pages for ``capacity_tokens`` tokens (pages are taken ahead so an engine
        can write KV before committing). Shrinking gives back reserved pages no token uses.

        Raises ``OutOfPagesError`` with nothing changed when the device tier cannot provide them.
        """
        self._check_writable("resize")
        if isinstance(capacity_tokens, bool) or not isinstance(capacity_tokens, int):
            raise TypeError(f"capacity_tokens must be an int, got {type(capacity_tokens).__name__}")
        if capacity_tokens < 0:
            raise ValueError(f"capacity_tokens must be >= 0, got {capacity_tokens}")
        tpb = self._mgr.tokens_per_block
        want = -(-max(capacity_tokens, len(self._tokens)) // tpb)
        pages = self._mgr._pages
        if want > len(self._blocks):
            self._grow(want - len(self._blocks))
        else:
            while len(self._blocks) > want:
                pages.free(self._blocks.pop())
        pages.finish()

    def _grow(self, extra: int) -> None:
        mgr = self._mgr
        pages = mgr._pages
        room = pages.room(0)
        if room < extra:
            raise OutOfPagesError(
                f"the sequence needs {extra} more device pages but only {room} can be had "
                f"({pages.pools[0].num_free} free + {room - pages.pools[0].num_free} evictable); "
                "close or suspend other sequences, or give the device tier more blocks"
            )
        self._blocks.extend(mgr._new_privates(extra, self.scope, self.priority))

    def commit(self, tokens: Iterable[int]) -> None:
        """Append tokens whose KV is now computed (after every token already in the cache).

        Each block that becomes full joins the tree and is announced to the sink; when an
        identical block is already cached the sequence switches to it instead (its own page is
        given back, nothing is announced). Raises ``OutOfPagesError`` with nothing changed if
        the pages cannot be had.
        """
        self._check_writable("commit")
        arr = token_array(tokens)
        if not arr:
            return
        mgr = self._mgr
        pages = mgr._pages
        tpb = mgr.tokens_per_block
        old_n = len(self._tokens)
        new_n = old_n + len(arr)
        extra = -(-new_n // tpb) - len(self._blocks)
        if extra > 0:
            self._grow(extra)
        self._tokens.extend(arr)
        first, last = old_n // tpb, new_n // tpb
        if last > first:
            self._insert_full(first, last)
        pages.finish()

    def _node(self, index: int) -> Block | ScopeRoot:
        """The parent node of block ``index``."""
        if index:
            return self._blocks[index - 1]
        root = self._mgr._tree.root(self.scope, create=True)
        assert root is not None
        return root

    def _insert_full(self, first: int, last: int) -> None:
        mgr = self._mgr
        pages = mgr._pages
        tpb = mgr.tokens_per_block
        step = 4 * tpb
        blocks = self._blocks
        toks = self._tokens
        data = tokens_to_bytes(toks[first * tpb : last * tpb])
        node = self._node(first)
        key: bytes = node.key
        stored: list[Block] = []
        inserted = 0
        for i in range(first, last):
            off = (i - first) * step
            key = sha256(key + data[off : off + step]).digest()
            existing = node.children.get(key) if node.children else None
            b = blocks[i]
            if existing is not None:
                pages.pin(existing)
                if existing.tier == 0:
                    pages.free(b)
                else:  # our page already holds the same KV: the cached block takes it over
                    page = b.page
                    pages.forget(b)
                    pages.move(existing, 0, page, copy=False)
                blocks[i] = existing
                node = existing
                continue
            b.key = BlockKey(key)
            b.tokens = toks[i * tpb : (i + 1) * tpb]
            b.is_full = True
            if node.partials:
                old = mgr._tree.extended_partial(node, b.tokens)
                if old is not None:
                    mgr._emit_stored(stored)
                    stored = []
                    mgr._replace_partial(old)
                    if not i:  # the scope root went with its last child: fetch it anew
                        node = self._node(0)
            # RadixTree.attach + TieredPages.link, inlined: this loop is the commit hot path.
            # The parent is pinned by this sequence, so it has no heap entry to invalidate.
            b.owner = node
            if node.children is None:
                node.children = {}
            node.children[key] = b
            b.in_tree = True
            if i:
                b.parent = node  # type: ignore[assignment]
                if node.tier == 0:
                    node.here += 1  # type: ignore[union-attr]
            stored.append(b)
            inserted += 1
            node = b
        mgr._tree.num_blocks += inserted
        mgr._emit_stored(stored)

    def stop_committing(self) -> None:
        """No more tokens: the trailing partial block joins the tree (unless a sibling already
        covers its tokens), reserved pages beyond it are given back. A second call is a no-op."""
        self._check_open("stop_committing")
        if self._stopped:
            return
        if self._suspended:
            raise CacheStateError("stop_committing(): the sequence is suspended; resume() it first")
        mgr = self._mgr
        pages = mgr._pages
        tpb = mgr.tokens_per_block
        n = len(self._tokens)
        keep = -(-n // tpb)
        while len(self._blocks) > keep:
            pages.free(self._blocks.pop())
        rest = n % tpb
        if rest:
            b = self._blocks[-1]
            node = self._node(len(self._blocks) - 1)
            tokens = self._tokens[n - rest :]
            if not mgr._tree.is_useless_partial(node, tokens):
                old = mgr._tree.extended_partial(node, tokens)
                if old is not None:
                    mgr._replace_partial(old)
                    node = self._node(len(self._blocks) - 1)  # the root may have gone with it
                b.key = BlockKey(sha256(node.key + tokens_to_bytes(tokens)).digest())
                b.tokens = tokens
                pages.link(b, node)
                mgr._emit_stored([b])
        self._stopped = True
        pages.finish()

    def suspend(self) -> None:
        """Stop pinning the sequence's pages: under pressure they may move to slower tiers, but
        they are never dropped. ``commit``/``resize``/``page_indices`` need ``resume()``."""
        self._check_open("suspend")
        if self._suspended:
            raise CacheStateError("suspend(): the sequence is already suspended")
        pages = self._mgr._pages
        tick = pages.next_tick()
        for b in self._blocks:
            pages.hold(b, live=False, tick=tick)
        self._suspended = True

    def resume(self) -> None:
        """Bring every page back to the device tier and pin it again.

        Raises ``OutOfPagesError`` (and stays suspended, nothing moved) when the device tier
        cannot hold them.
        """
        self._check_open("resume")
        if not self._suspended:
            raise CacheStateError("resume(): the sequence is not suspended")
        pages = self._mgr._pages
        ticks = [b.tick for b in self._blocks]
        for b in self._blocks:
            pages.hold(b, live=True, tick=0)
        away = [b for b in self._blocks if b.tier != 0]
        room = pages.room(0)
        if room < len(away):
            for b, t in zip(self._blocks, ticks, strict=True):
                pages.hold(b, live=False, tick=t)
            raise OutOfPagesError(
                f"resume() needs {len(away)} device pages but only {room} can be had; "
                "close or suspend other sequences first"
            )
        self._mgr._onboard(away)
        self._suspended = False
        pages.finish()

    def close(self) -> None:
        """Release the sequence: committed blocks stay cached (evictable), private pages are
        freed. Closing twice is a no-op."""
        if self._closed:
            return
        pages = self._mgr._pages
        tick = pages.next_tick()
        for b in self._blocks:
            if not b.in_tree:
                pages.free(b)
            elif self._suspended:
                pages.release_suspended(b, tick)
            else:
                pages.unpin(b, tick)
        self._blocks = []
        self._closed = True
        self._mgr._live.discard(self)
        pages.finish()

    def __enter__(self) -> KVCache:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "suspended" if self._suspended else "live"
        return (
            f"KVCache({state}, scope={self.scope}, tokens={self.num_tokens}, "
            f"reused={self.num_reused_tokens}, blocks={len(self._blocks)})"
        )

"""``KVCacheManager``: scoped prefix reuse over a block radix tree with tiered pages.

Decisions (TensorRT-LLM's KVCacheManagerV2 is the reference for the semantics):

- **Matching** walks full blocks by chained key under the request's scope, then, with
  ``enable_partial_reuse``, scans at most ``max_partial_scan`` children of the last matched
  node for the longest common token prefix (copy-on-write: the sequence gets its own device
  page and the matched tokens are copied into it).
- **Never everything**: at most ``len(input_tokens) - 1`` tokens are reused, so an engine
  always computes the last token. Full blocks are matched only while they lie entirely in the
  first ``len - 1`` tokens; the block holding the last input token can then still be reused
  partially (its first tokens, by copy-on-write).
- **Priorities**: a block keeps the priority of the sequence that stored it; reuse by another
  sequence does not change it (the sink has no way to announce a priority change).
- **LRU**: a block's last use is the manager's tick when the last sequence holding it let go
  (``close``/``suspend``). A copy-on-write source is not touched.
- **Out of pages**: every operation computes the device pages it needs and those it can have
  (free + evictable, see :meth:`num_available_pages`) before changing anything, and raises
  ``OutOfPagesError`` with both numbers when short.
- **clear_reusable_blocks** drops every cached block that no sequence (live or suspended)
  holds; the sink hears ``on_cleared`` when that emptied the tree, else ``on_removed`` with the
  dropped blocks, descendants first (nothing when nothing was dropped).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Any

from kvcache.config import KVCacheManagerConfig
from kvcache.errors import KVCacheError, OutOfPagesError
from kvcache.keys import token_array, tokens_to_bytes
from kvcache.pool import PagePool
from kvcache.scope import DEFAULT_SCOPE, ReuseScope
from kvcache.sequence import KVCache
from kvcache.sink import EventSink
from kvcache.stats import KVCacheStats, TierUsage
from kvcache.storage_protocol import PageStorage
from kvcache.tiers import TieredPages
from kvcache.tree import Block, RadixTree

DEFAULT_PRIORITY = 35


def _check_priority(priority: object) -> int:
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise TypeError(f"priority must be an int in [0, 100], got {type(priority).__name__}")
    if not 0 <= priority <= 100:
        raise ValueError(f"priority must be in [0, 100], got {priority}")
    return priority


def _check_scope(scope: object) -> ReuseScope:
    if scope is None:
        return DEFAULT_SCOPE
    if not isinstance(scope, ReuseScope):
        raise TypeError(
            f"reuse_scope must be a ReuseScope or None, got {type(scope).__name__}; "
            "build one with ReuseScope.for_request(lora_id=..., cache_salt=...)"
        )
    return scope


class KVCacheManager:
    """Owns the radix tree, the page pools of every tier and the eviction policy.

    Not thread-safe: drive it from one thread (an engine's scheduler loop).
    """

    def __init__(
        self,
        config: KVCacheManagerConfig,
        event_sink: EventSink | None = None,
        *,
        storage: PageStorage | None = None,
    ) -> None:
        """``storage`` replaces the ``TorchPageStorage`` a ``kv_layout`` would create (another
        backend, or a test double); without either, the pools keep books only."""
        if not isinstance(config, KVCacheManagerConfig):
            raise TypeError(f"config must be a KVCacheManagerConfig, got {type(config).__name__}")
        self.config = config
        self.tokens_per_block = config.tokens_per_block
        self._step = 4 * config.tokens_per_block
        self._tree = RadixTree()
        self._storage: PageStorage | None = storage
        if storage is None and config.kv_layout is not None:
            # Imported here so that kvcache without a layout never imports torch.
            module: Any = importlib.import_module("kvcache.storage")
            self._storage = module.TorchPageStorage(config)
        pools = [PagePool(t.name, t.num_blocks) for t in config.tiers]
        self._pages = TieredPages(
            self._tree, pools, event_sink, self._storage, config.tokens_per_block
        )
        self._live: set[KVCache] = set()  # open sequences, for verify()
        self._queries = 0
        self._query_tokens = 0
        self._hit_tokens = 0

    # ---------------------------------------------------------------------------- matching

    def _match(self, tokens: Any, scope: ReuseScope) -> tuple[list[Block], Block | None, int]:
        """(full blocks reused, copy-on-write source, tokens reused from it)."""
        n = len(tokens)
        root = self._tree.root(scope)
        if root is None or n < 2:
            return [], None, 0
        tpb = self.tokens_per_block
        max_full = (n - 1) // tpb
        full = self._tree.match_full(
            root, tokens_to_bytes(tokens[: max_full * tpb]), max_full, self._step
        )
        cfg = self.config
        if not cfg.enable_partial_reuse:
            return full, None, 0
        start = len(full) * tpb
        limit = min(tpb, n - 1 - start)
        node = full[-1] if full else root
        src, m = self._tree.match_partial(
            node, tokens[start : start + limit], limit, cfg.max_partial_scan
        )
        return full, src, m

    def probe_reuse(
        self, input_tokens: Iterable[int], reuse_scope: ReuseScope | None = None
    ) -> int:
        """Tokens ``create_kv_cache`` would reuse now; changes nothing (no LRU, stats, events)."""
        scope = _check_scope(reuse_scope)
        tokens = token_array(input_tokens)
        full, _, m = self._match(tokens, scope)
        return len(full) * self.tokens_per_block + m

    def create_kv_cache(
        self,
        input_tokens: Iterable[int],
        reuse_scope: ReuseScope | None = None,
        priority: int = DEFAULT_PRIORITY,
    ) -> KVCache:
        """Match the longest reusable prefix of ``input_tokens`` in ``reuse_scope``, pin it
        (bringing blocks on slower tiers back to the device tier) and return the sequence.

        ``num_reused_tokens`` tells the engine where to start computing. Raises
        ``OutOfPagesError`` with nothing changed when the device tier cannot hold the reuse.
        """
        scope = _check_scope(reuse_scope)
        priority = _check_priority(priority)
        tokens = token_array(input_tokens)
        full, src, m = self._match(tokens, scope)
        pages = self._pages
        for b in full:
            pages.pin(b)
        away = [b for b in full if b.tier != 0]
        need = len(away) + (1 if src is not None else 0)
        if need:
            if src is not None:
                pages.pin(src)  # keep the copy-on-write source where it is for this operation
            room = pages.room(0)
            if room < need:
                for b in full:
                    pages.unpin(b, b.tick)
                if src is not None:
                    pages.unpin(src, src.tick)
                raise OutOfPagesError(
                    f"reusing {len(full)} blocks{' + 1 copy-on-write' if src else ''} needs "
                    f"{need} device pages but only {room} can be had "
                    f"({pages.pools[0].num_free} free + {room - pages.pools[0].num_free} "
                    "evictable); close or suspend sequences, or give the device tier more blocks"
                )
        blocks = list(full)
        reused = len(full) * self.tokens_per_block
        if need:
            cow = self._onboard(away, 1 if src is not None else 0, scope, priority)
            if src is not None:
                private = cow[0]
                pages.copy_on_write(src, private.page, m)
                pages.unpin(src, src.tick)
                blocks.append(private)
                reused += m
        self._queries += 1
        self._query_tokens += len(tokens)
        self._hit_tokens += reused
        seq = KVCache(self, scope, priority, tokens[:reused], blocks)
        self._live.add(seq)
        pages.finish()
        return seq

    def _new_privates(self, count: int, scope: ReuseScope, priority: int) -> list[Block]:
        """Device pages held privately by a sequence (the caller checked room)."""
        pages = self._pages
        pool = pages.pools[0]
        if pool.num_free >= count:
            slots = pool.allocate_many(count)
        else:
            slots = [pages.allocate(0) for _ in range(count)]
        uid = pages.uid
        pages.uid += count
        pages.pinned[0] += count
        return [Block(uid + i, scope, 0, page, priority) for i, page in enumerate(slots, 1)]

    def _onboard(
        self,
        away: list[Block],
        extra: int = 0,
        scope: ReuseScope = DEFAULT_SCOPE,
        priority: int = DEFAULT_PRIORITY,
    ) -> list[Block]:
        """Move pinned ``away`` blocks to the device tier and make ``extra`` private pages.

        Every device page is allocated before anything moves, so the evictions (downward
        copies) complete before the onboarding copies read the slower tiers.
        """
        pages = self._pages
        dev = [pages.allocate(0) for _ in range(len(away))]
        privates = self._new_privates(extra, scope, priority)
        for b, page in zip(away, dev, strict=True):
            pages.move(b, 0, page, copy=True)
        pages.counters.onboards += len(away)
        return privates

    # --------------------------------------------------------------------------- tree edits

    def _emit_stored(self, blocks: list[Block]) -> None:
        if blocks and self._pages.sink is not None:
            self._pages.flush_moves()
            self._pages.sink.on_stored(blocks)

    def _replace_partial(self, old: Block) -> None:
        """Take a partial block out of the tree because a new block extends it."""
        pages = self._pages
        pages.flush_moves()
        pages.unlink(old)
        if old.refs == 0 and old.susp == 0:
            pages.free(old)
        # else: its sequence still holds the page privately and frees it on close
        if pages.sink is not None:
            pages.sink.on_removed([old])

    def clear_reusable_blocks(self) -> None:
        """Drop every cached block no sequence holds (see the module docstring for events)."""
        gone: list[Block] = []
        for root in list(self._tree.roots.values()):
            stack: list[Block] = []
            if root.children:
                stack.extend(root.children.values())
            if root.partials:
                stack.extend(root.partials.values())
            while stack:
                b = stack.pop()
                if b.refs == 0 and b.susp == 0:
                    gone.extend(self._tree.subtree(b))
                else:
                    stack.extend(b.iter_children())
        if not gone:
            return
        pages = self._pages
        pages.flush_moves()
        everything = len(gone) == self._tree.num_blocks
        pages.remove_blocks(gone)
        if pages.sink is not None:
            if everything:
                pages.sink.on_cleared()
            else:
                pages.sink.on_removed(gone)

    # ------------------------------------------------------------------------- observation

    def _tier(self, tier: int) -> int:
        if isinstance(tier, bool) or not isinstance(tier, int):
            raise TypeError(f"tier must be an int index, got {type(tier).__name__}")
        if not 0 <= tier < self._pages.num_tiers:
            raise ValueError(f"tier must be in [0, {self._pages.num_tiers}), got {tier}")
        return tier

    def num_available_pages(self, tier: int = 0) -> int:
        """Pages an allocation on ``tier`` can get now: free + evictable."""
        return self._pages.room(self._tier(tier))

    def kv_usage(self, tier: int = 0) -> float:
        """Fraction of the tier's pages pinned by live (not suspended) sequences."""
        t = self._tier(tier)
        return self._pages.pinned[t] / self._pages.pools[t].num_blocks

    @property
    def storage(self) -> PageStorage | None:
        """The page storage (``TorchPageStorage`` with a ``kv_layout``), else None."""
        return self._storage

    @property
    def page_tensors(self) -> list[Any]:
        """The per-tier page tensors (needs a ``kv_layout``)."""
        if self._storage is None:
            raise KVCacheError(
                "page_tensors needs a kv_layout in the config; this manager has none"
            )
        return list(self._storage.tensors)  # type: ignore[attr-defined]

    def verify(self) -> None:
        """Recheck every internal invariant from scratch (linear cost; a debugging aid).

        Raises ``kvcache.verify.InconsistentStateError`` naming the first broken one.
        """
        from kvcache.verify import verify

        verify(self)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks in the tree (every scope, every tier)."""
        return self._tree.num_blocks

    @property
    def stats(self) -> KVCacheStats:
        """A snapshot of the counters and the per-tier usage."""
        pages = self._pages
        nbytes = self._storage.page_nbytes() if self._storage is not None else 0
        tiers: dict[str, TierUsage] = {}
        for t, pool in enumerate(pages.pools):
            free = pool.num_free
            evictable = pages.room(t) - free
            tiers[pool.name] = TierUsage(
                num_blocks=pool.num_blocks,
                used=pool.num_used,
                free=free,
                evictable=evictable,
                pinned=pages.pinned[t],
                bytes_used=pool.num_used * nbytes,
                bytes_free=free * nbytes,
                bytes_evictable=evictable * nbytes,
            )
        c = pages.counters
        return KVCacheStats(
            queries=self._queries,
            query_tokens=self._query_tokens,
            hit_tokens=self._hit_tokens,
            evictions=c.evictions,
            offloads=c.offloads,
            onboards=c.onboards,
            drops=c.drops,
            tiers=tiers,
        )

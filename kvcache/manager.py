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
from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from kvcache.block_pool import BlockPool
from kvcache.config import KVCacheManagerConfig
from kvcache.errors import KVCacheError
from kvcache.hashing import BlockKey
from kvcache.owner import ThreadOwner
from kvcache.pool import PagePool
from kvcache.scope import DEFAULT_SCOPE, ReuseScope
from kvcache.sequence import KVCache
from kvcache.sink import BlockView, EventSink
from kvcache.stats import KVCacheStats, TierUsage
from kvcache.storage_protocol import PageStorage
from kvcache.tokens import checked_token_array
from kvcache.tree import Block, RadixTree
from kvcache.verify import verify

DEFAULT_PRIORITY = 35
# The first window of a prompt packed for matching (RadixTree.match_prefix): a few blocks of
# a common block size, about what most prompts share with the tree.
_FIRST_WINDOW_TOKENS = 1024


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

    Not thread-safe: drive it and its sequences from one thread (an engine's scheduler loop).
    The first thread that uses it owns it; a call from any other thread raises
    ``WrongThreadError`` and changes nothing (:mod:`kvcache.owner`); :meth:`hand_over` passes
    it on.
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
        self._tree = RadixTree()
        self._storage: PageStorage | None = storage
        if storage is None and config.kv_layout is not None:
            # Imported here so that kvcache without a layout never imports torch.
            module: Any = importlib.import_module("kvcache.storage")
            self._storage = module.TorchPageStorage(config)
        pools = [PagePool(t.name, t.num_blocks) for t in config.tiers]
        self._pool = BlockPool(self._tree, pools, event_sink, self._storage, self.tokens_per_block)
        self._live: set[KVCache] = set()  # open sequences, for verify()
        self._owner = ThreadOwner()
        self._queries = 0
        self._query_tokens = 0
        self._hit_tokens = 0

    # ---------------------------------------------------------------------------- matching

    def _match(
        self, tokens: array[int], scope: ReuseScope, keys: Sequence[BlockKey] | None = None
    ) -> tuple[list[Block], Block | None, int]:
        """(full blocks reused, copy-on-write source, tokens reused from it): see
        :meth:`RadixTree.match_prefix` (``keys``: the tokens' block keys, when known)."""
        cfg = self.config
        return self._tree.match_prefix(
            tokens,
            scope,
            self.tokens_per_block,
            cfg.enable_partial_reuse,
            cfg.max_partial_scan,
            _FIRST_WINDOW_TOKENS,
            keys,
        )

    def probe_reuse(
        self, input_tokens: Iterable[int], reuse_scope: ReuseScope | None = None
    ) -> int:
        """Tokens ``create_kv_cache`` would reuse now; changes nothing (no LRU, stats, events)."""
        self._owner.check("probe_reuse")
        scope = _check_scope(reuse_scope)
        full, _, m = self._match(checked_token_array(input_tokens), scope)
        return len(full) * self.tokens_per_block + m

    def create_kv_cache(
        self,
        input_tokens: Iterable[int],
        reuse_scope: ReuseScope | None = None,
        priority: int = DEFAULT_PRIORITY,
        *,
        block_keys: Sequence[BlockKey] | None = None,
        sink_hashes: Sequence[int] | None = None,
    ) -> KVCache:
        """Match the longest reusable prefix of ``input_tokens`` in ``reuse_scope``, pin it
        (bringing blocks on slower tiers back to the device tier) and return the sequence.

        ``num_reused_tokens`` tells the engine where to start computing. Raises
        ``OutOfPagesError`` with nothing changed when the device tier cannot hold the reuse.

        ``block_keys``: the keys of the input's first full blocks when the caller computed
        them already, as ``kvcache.hashing.blockchain_keys(reuse_scope, input_tokens,
        tokens_per_block)`` gives them for its full blocks (an engine hashing each request
        once on arrival, as vLLM does): committing those blocks then hashes nothing again.
        They are trusted: keys of other tokens would file the blocks under the wrong content.
        So are the ids they cover, which ``blockchain_keys`` checked when it made them (their
        types are checked again, their sign not). At most one per full block, each 32 bytes
        (``ValueError`` otherwise).

        ``sink_hashes``: the hashes the event sink announces the same blocks under, when the
        caller made them already (``events.KVCacheEventManager`` takes V1 hashes, those of
        ``kvcache.hashing.v1_block_hash`` chained over the blocks in ``reuse_scope``): they are
        handed to the sink with the blocks when these are stored, and trusted as the keys
        are. At most one per full block, each an int in [0, 2**64) (``ValueError``
        otherwise).
        """
        self._owner.check("create_kv_cache")
        scope = _check_scope(reuse_scope)
        priority = _check_priority(priority)
        keyed = 0 if block_keys is None else len(block_keys) * self.tokens_per_block
        tokens = checked_token_array(input_tokens, keyed)
        if block_keys is not None:
            _check_keys(block_keys, len(tokens) // self.tokens_per_block)
        if sink_hashes is not None:
            _check_hashes(sink_hashes, len(tokens) // self.tokens_per_block)
        full, src, m = self._match(tokens, scope, block_keys)
        blocks = self._pool.acquire(full, src, m, scope, priority)
        reused = len(full) * self.tokens_per_block + (m if src is not None else 0)
        self._queries += 1
        self._query_tokens += len(tokens)
        self._hit_tokens += reused
        seq = KVCache(
            self._pool,
            scope,
            priority,
            tokens,
            blocks,
            self._live.discard,
            self._owner,
            reused,
            block_keys,
            sink_hashes,
        )
        self._live.add(seq)
        self._pool.finish()
        return seq

    def clear_reusable_blocks(self) -> None:
        """Drop every cached block no sequence holds (see the module docstring for events)."""
        self._owner.check("clear_reusable_blocks")
        self._pool.clear()

    def hand_over(self) -> None:
        """Called from the owning thread: the next thread to use the manager owns it."""
        self._owner.hand_over()

    # ------------------------------------------------------------------------- observation

    def _tier(self, tier: int) -> int:
        if isinstance(tier, bool) or not isinstance(tier, int):
            raise TypeError(f"tier must be an int index, got {type(tier).__name__}")
        if not 0 <= tier < self._pool.num_tiers:
            raise ValueError(f"tier must be in [0, {self._pool.num_tiers}), got {tier}")
        return tier

    def num_available_pages(self, tier: int = 0) -> int:
        """Pages an allocation on ``tier`` can get now: free + evictable."""
        return self._pool.room(self._tier(tier))

    def kv_usage(self, tier: int = 0) -> float:
        """Fraction of the tier's pages pinned by live (not suspended) sequences."""
        pool = self._pool
        # checked by _tier only when not a plain in-range int (asked once per engine step)
        t = tier if type(tier) is int and 0 <= tier < pool.num_tiers else self._tier(tier)
        return pool.pinned[t] / pool.pools[t].num_blocks

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
        self._owner.check("verify")
        verify(self._tree, self._pool, [(s.held_blocks(), s.suspended) for s in self._live])

    def cached_prefix_blocks(
        self, block_keys: Sequence[BlockKey], reuse_scope: ReuseScope | None = None
    ) -> int:
        """Leading blocks of ``block_keys`` (keys of full blocks, as
        ``kvcache.hashing.blockchain_keys`` gives them) the cache holds now in ``reuse_scope``,
        on any tier; changes nothing (no LRU, stats or events)."""
        self._owner.check("cached_prefix_blocks")
        return self._tree.prefix_blocks(_check_scope(reuse_scope), block_keys)

    @property
    def tree(self) -> RadixTree:
        """The cache's radix tree, for read-only lookups such as
        ``tree.prefix_blocks(scope, keys)`` (:meth:`cached_prefix_blocks` without the
        checks, for a caller that makes many). Changing it corrupts the manager."""
        return self._tree

    @property
    def block_moves(self) -> int:
        """Blocks evicted, offloaded, onboarded or dropped by eviction so far (the sum of the
        ``stats`` counters, read without building the snapshot): a caller that sees it
        unchanged across some calls knows no cached block changed tier or left meanwhile
        because of them."""
        c = self._pool.counters
        return c.evictions + c.offloads + c.onboards + c.drops

    @property
    def num_cached_blocks(self) -> int:
        """Blocks in the tree (every scope, every tier)."""
        return self._tree.num_blocks

    def iter_blocks(self) -> Iterator[BlockView]:
        """Every block in the tree (every scope, every tier), each after its parent: the cache's
        contents as an event sink sees them, for a consumer's snapshot of the whole state.
        Do not change the cache while iterating."""
        self._owner.check("iter_blocks")
        return iter(self._tree.iter_blocks())

    @property
    def stats(self) -> KVCacheStats:
        """A snapshot of the counters and the per-tier usage."""
        bp = self._pool
        nbytes = self._storage.page_nbytes() if self._storage is not None else 0
        tiers: dict[str, TierUsage] = {}
        for t, pool in enumerate(bp.pools):
            free = pool.num_free
            evictable = bp.room(t) - free
            tiers[pool.name] = TierUsage(
                num_blocks=pool.num_blocks,
                used=pool.num_used,
                free=free,
                evictable=evictable,
                pinned=bp.pinned[t],
                bytes_used=pool.num_used * nbytes,
                bytes_free=free * nbytes,
                bytes_evictable=evictable * nbytes,
            )
        c = bp.counters
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


def _check_hashes(hashes: Sequence[int], full_blocks: int) -> None:
    if len(hashes) > full_blocks:
        raise ValueError(
            f"sink_hashes: at most one hash per full block of the input ({full_blocks}), "
            f"got {len(hashes)}"
        )
    if isinstance(hashes, (bytes, str)) or not set(map(type, hashes)) <= {int}:
        raise ValueError("sink_hashes: each hash is an int")
    if hashes and (min(hashes) < 0 or max(hashes) >= _HASH_LIMIT):
        raise ValueError("sink_hashes: each hash is in [0, 2**64)")


_HASH_LIMIT = 1 << 64


def _check_keys(keys: Sequence[BlockKey], full_blocks: int) -> None:
    if isinstance(keys, (bytes, str)):
        raise ValueError("block_keys must be a sequence of keys, not one")
    if len(keys) > full_blocks:
        raise ValueError(
            f"block_keys: at most one key per full block of the input ({full_blocks}), "
            f"got {len(keys)}"
        )
    if not set(map(type, keys)) <= {bytes} or not set(map(len, keys)) <= {32}:
        bad = next(k for k in keys if type(k) is not bytes or len(k) != 32)
        raise ValueError(f"block_keys: each key is 32 bytes, got {bad!r:.60}")

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
from collections.abc import Callable, Iterable, Sequence
from types import TracebackType

from kvcache.block_pool import BlockPool
from kvcache.errors import CacheStateError, ClosedCacheError
from kvcache.hashing import BlockKey
from kvcache.owner import ThreadOwner
from kvcache.scope import ReuseScope
from kvcache.tokens import checked_token_array, int32_array, token_array_bytes
from kvcache.tree import Block


class KVCache:
    """The per-sequence cache returned by :meth:`KVCacheManager.create_kv_cache`."""

    __slots__ = (
        "_blocks",
        "_closed",
        "_kept",
        "_keys",
        "_n",
        "_on_close",
        "_owner",
        "_pool",
        "_sink_hashes",
        "_stopped",
        "_suspended",
        "_tail",
        "num_reused_tokens",
        "priority",
        "scope",
    )

    def __init__(
        self,
        pool: BlockPool,
        scope: ReuseScope,
        priority: int,
        tokens: array[int],
        blocks: list[Block],
        on_close: Callable[[KVCache], None],
        owner: ThreadOwner | None = None,
        num_tokens: int | None = None,
        keys: Sequence[BlockKey] | None = None,
        sink_hashes: Sequence[int] | None = None,
    ) -> None:
        """``tokens``: the reused prefix, or with ``num_tokens`` a longer array whose first
        ``num_tokens`` are (the manager's prompt: nothing is copied out of it but the last
        partial block); ``keys``, when the caller has them, the keys of the sequence's first
        full blocks (``blockchain_keys`` of its prompt): blocks they cover are not packed or
        hashed again when committed; ``sink_hashes``, the event sink's hashes of the same
        blocks (handed to it when they are stored)."""
        self._owner = owner  # the manager's thread check (kvcache.owner)
        self._pool = pool
        self._on_close = on_close
        self.scope = scope
        self.priority = priority
        # The tokens as committed are the full blocks' own (a tree block's tokens never change)
        # and ``_tail``, those after the last full block (``_n % tokens_per_block``): nothing
        # is kept twice, and ``tokens`` (rarely read) joins them. ``_kept``: the full blocks'
        # tokens once closed (the blocks are let go).
        n = len(tokens) if num_tokens is None else num_tokens
        self._n = n
        self._tail: array[int] = tokens[n - n % pool.tokens_per_block : n]
        self._kept: list[array[int]] | None = None
        self._blocks = blocks
        self._keys = keys
        self._sink_hashes = sink_hashes
        self.num_reused_tokens = n
        self._closed = False
        self._stopped = False
        self._suspended = False

    # ------------------------------------------------------------------------- properties

    @property
    def num_tokens(self) -> int:
        """Tokens whose KV is in the cache: the reused prefix plus everything committed."""
        return self._n

    @property
    def capacity(self) -> int:
        """Tokens the sequence's allocated pages can hold."""
        return len(self._blocks) * self._pool.tokens_per_block

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
        out: array[int] = array("i")
        for part in self._full_tokens():
            out += part
        out += self._tail
        return out.tolist()

    def _full_tokens(self) -> list[array[int]]:
        if self._kept is not None:
            return self._kept
        return [b.tokens for b in self._blocks[: self._n // self._pool.tokens_per_block]]

    def page_indices(self) -> list[int]:
        """Device-tier block table: the page of block ``i``, for every allocated block."""
        self._check_open("page_indices")
        if self._suspended:
            raise CacheStateError("page_indices(): the sequence is suspended; resume() it first")
        return [b.page for b in self._blocks]

    def held_blocks(self) -> list[Block]:
        """The blocks this sequence holds, in order (for consistency checks)."""
        return list(self._blocks)

    # ------------------------------------------------------------------------- operations

    def _check_open(self, what: str) -> None:
        if self._owner is not None:
            self._owner.check(what)
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
        tpb = self._pool.tokens_per_block
        want = -(-max(capacity_tokens, self._n) // tpb)
        pool = self._pool
        if want > len(self._blocks):
            self._blocks += pool.grow(want - len(self._blocks), self.scope, self.priority)
        else:
            while len(self._blocks) > want:
                pool.free(self._blocks.pop())
        pool.finish()

    def commit(self, tokens: Iterable[int]) -> None:
        """Append tokens whose KV is now computed (after every token already in the cache).

        Each block that becomes full joins the tree and is announced to the sink; when an
        identical block is already cached the sequence switches to it instead (its own page is
        given back, nothing is announced). Raises ``OutOfPagesError`` with nothing changed if
        the pages cannot be had.
        """
        self._check_writable("commit")
        arr = int32_array(tokens)
        if not arr:
            return
        pool = self._pool
        tpb = pool.tokens_per_block
        old_n = self._n
        new_n = old_n + len(arr)
        first, last = old_n // tpb, new_n // tpb
        keys = self._keys
        # From block ``first`` on: the tokens of the block being filled, then the new ones.
        # Where a block joins the tree without its key known, they are packed and
        # sign-checked in one go (the tail is checked already) for the hashing; else only
        # checked (the blocks take their tokens from the array).
        tail = self._tail
        seg_data: bytes | None = None
        if last == first or (keys is not None and last <= len(keys)):
            checked_token_array(arr)
            seg = tail + arr if tail else arr
        else:
            seg, seg_data = token_array_bytes(tail + arr if tail else arr)
        extra = -(-new_n // tpb) - len(self._blocks)
        if extra > 0:
            self._blocks += pool.grow(extra, self.scope, self.priority)
        self._n = new_n
        self._tail = seg[(last - first) * tpb :]  # a copy: ``seg`` may be the caller's array
        if last > first:
            pool.store_full(
                self.scope, self._blocks, first, last, seg, seg_data, keys, self._sink_hashes
            )
        pool.finish()

    def stop_committing(self) -> None:
        """No more tokens: the trailing partial block joins the tree (unless a sibling already
        covers its tokens), reserved pages beyond it are given back. A second call is a no-op."""
        self._check_open("stop_committing")
        if self._stopped:
            return
        if self._suspended:
            raise CacheStateError("stop_committing(): the sequence is suspended; resume() it first")
        pool = self._pool
        tpb = pool.tokens_per_block
        n = self._n
        keep = -(-n // tpb)
        while len(self._blocks) > keep:
            pool.free(self._blocks.pop())
        if n % tpb:
            pool.store_partial(self.scope, self._blocks, self._tail)  # never changed in place
        self._stopped = True
        pool.finish()

    def suspend(self) -> None:
        """Stop pinning the sequence's pages: under pressure they may move to slower tiers, but
        they are never dropped. ``commit``/``resize``/``page_indices`` need ``resume()``."""
        self._check_open("suspend")
        if self._suspended:
            raise CacheStateError("suspend(): the sequence is already suspended")
        self._pool.suspend(self._blocks)
        self._suspended = True

    def resume(self) -> None:
        """Bring every page back to the device tier and pin it again.

        Raises ``OutOfPagesError`` (and stays suspended, nothing moved) when the device tier
        cannot hold them.
        """
        self._check_open("resume")
        if not self._suspended:
            raise CacheStateError("resume(): the sequence is not suspended")
        self._pool.resume(self._blocks)
        self._suspended = False
        self._pool.finish()

    def close(self) -> None:
        """Release the sequence: committed blocks stay cached (evictable), private pages are
        freed. Closing twice is a no-op."""
        if self._owner is not None:
            self._owner.check("close")
        if self._closed:
            return
        self._kept = self._full_tokens()
        self._pool.release(self._blocks, self._suspended)
        self._blocks = []
        self._closed = True
        self._on_close(self)
        self._pool.finish()

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

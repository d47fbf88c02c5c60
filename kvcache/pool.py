"""Page pools: one per tier, a free list of integer slots.

A page is an int in ``[0, num_blocks)``. The pool only knows which slots are free; who holds a
used page (a cached block, a live sequence) is the manager's book-keeping.
"""

from __future__ import annotations

from kvcache.errors import KVCacheError


class PagePool:
    """The free list of one tier. ``allocate`` and ``release`` are O(1)."""

    __slots__ = ("_free", "_is_free", "name", "num_blocks")

    def __init__(self, name: str, num_blocks: int) -> None:
        self.name = name
        self.num_blocks = num_blocks
        # Popped from the end: the lowest slots come out first, which keeps tests readable.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._is_free = bytearray(b"\x01") * num_blocks

    @property
    def num_free(self) -> int:
        """Pages not held by anything."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Pages held by a cached block or a live sequence."""
        return self.num_blocks - len(self._free)

    def allocate(self) -> int:
        """Take a free page; the caller must have made room first."""
        if not self._free:
            raise KVCacheError(f"tier {self.name!r} has no free page (internal: make room first)")
        page = self._free.pop()
        self._is_free[page] = 0
        return page

    def allocate_many(self, count: int) -> list[int]:
        """Take ``count`` free pages at once (the caller checked ``num_free``)."""
        if count > len(self._free):
            raise KVCacheError(
                f"tier {self.name!r} has {len(self._free)} free pages, {count} asked"
            )
        pages = self._free[len(self._free) - count :]
        del self._free[len(self._free) - count :]
        pages.reverse()
        is_free = self._is_free
        for page in pages:
            is_free[page] = 0
        return pages

    def release(self, page: int) -> None:
        """Give a page back to the free list."""
        if self._is_free[page]:
            raise KVCacheError(f"page {page} of tier {self.name!r} released twice")
        self._is_free[page] = 1
        self._free.append(page)

    def is_free(self, page: int) -> bool:
        """Whether ``page`` is on the free list."""
        return bool(self._is_free[page])

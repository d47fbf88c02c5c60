"""The page storage protocol: what the manager asks of whatever holds the pages' data.

Without a ``KVLayout`` the manager keeps books only (no storage object). With one,
``kvcache.storage.TorchPageStorage`` holds one tensor per tier and the manager calls
``copy_pages`` for every page move, once per (source tier, destination tier) per operation,
with all the pages of that operation (batched: never one call per page).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class PageStorage(Protocol):
    """Holds the KV data of every page of every tier."""

    def copy_pages(
        self,
        src_tier: int,
        src_pages: Sequence[int],
        dst_tier: int,
        dst_pages: Sequence[int],
        num_tokens: Sequence[int] | None = None,
    ) -> None:
        """Copy page ``src_pages[i]`` of ``src_tier`` into ``dst_pages[i]`` of ``dst_tier``.

        ``num_tokens[i]``, when given, limits the copy to the first tokens of the page (the
        copy-on-write of a partially matched block copies only the matched tokens).
        """

    def page_nbytes(self) -> int:
        """Bytes of KV data held by one page."""
        ...

    def synchronize(self) -> None:
        """Wait until every copy issued so far is complete (a no-op on the CPU)."""

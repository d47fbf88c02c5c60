"""Type stub of kvcache.tree's optional native block making and linking (built from _tree.c)."""

from typing import Any

class Layout:
    """The offsets of the named writable slots of ``cls``."""

    def __init__(self, cls: type, names: tuple[str, ...]) -> None: ...
    def new(self, first: int, pages: list[Any], values: tuple[Any, ...], /) -> list[Any]:
        """``len(pages)`` new instances: names[0] = first + i, names[1] = pages[i], the rest
        ``values``."""
    def link(
        self, blocks: list[Any], keys: list[Any], tokens: Any, start: int, tpb: int, parent: Any, /
    ) -> int:
        """Set each block's key, tokens, is_full, parent, in_tree and link it as its
        predecessor's only child; how many blocks it did."""

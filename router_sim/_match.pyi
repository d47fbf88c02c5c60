"""Type stub of the native match loop of router_sim.indexer (built from _match.c)."""

from collections.abc import Sequence
from typing import Any

class MaskTable:
    """Key -> 64-bit mask of the workers holding the block on any tier."""

    def __init__(self) -> None: ...
    def sync(self, keys: Sequence[object], bit: int, held: dict[Any, int]) -> None:
        """For each int key in [0, 2**64): set bit ``bit`` if the key is in ``held``, else
        clear it; keys of other types are ignored."""

    def set_bit(self, keys: Sequence[object], bit: int) -> None:
        """``sync`` where every key is held."""

    def clear_bit(self, keys: Sequence[object], bit: int) -> None:
        """``sync`` where no key is held."""

    def runs(self, keys: Sequence[object], worker_of_bit: dict[int, int]) -> dict[int, int] | None:
        """{worker: run length} as ``KvIndexer.find_matches``, or None when a key is not an
        int in [0, 2**64) (the caller takes the reference path)."""

    def __len__(self) -> int: ...

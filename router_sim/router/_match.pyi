"""Type stub of the native match loop of router_sim.router.indexer (built from _match.c)."""

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")

class MaskTable:
    """Key -> masks of the workers holding the block on any tier and on the device tier (as
    many 64-bit words each as the highest bit in use needs)."""

    def __init__(self, other: dict[Any, int] = ..., /) -> None:
        """``other``: where device masks of keys that are not ints in [0, 2**64) live."""

    def device_get(self, key: object, /) -> int:
        """The mask of the workers holding ``key`` on the device tier (0: none)."""

    def device_bit(self, keys: Sequence[object], bit: int, on: bool) -> None:
        """Set (``on``) or clear bit ``bit`` of each key's device mask."""

    @property
    def words(self) -> int:
        """64-bit words per worker mask (the table widens as bits past it are set)."""

    @property
    def probes(self) -> int:
        """Slots examined past keys' home slots over the table's life (finds, inserts, moves):
        the table's work beyond one slot per key. Placement is keyed by a random value drawn
        when the module loads, so it stays linear in the keys whatever keys a worker picks."""

    def sync(self, keys: Sequence[object], bit: int, held: dict[Any, int]) -> None:
        """For each int key in [0, 2**64): set bit ``bit`` if the key is in ``held``, else
        clear it; keys of other types are ignored."""

    def set_bit(self, keys: Sequence[object], bit: int) -> None:
        """``sync`` where every key is held."""

    def clear_bit(self, keys: Sequence[object], bit: int) -> None:
        """``sync`` where no key is held."""

    def runs(self, keys: Sequence[object], worker_of_bit: dict[int, int]) -> dict[int, int] | None:
        """{worker: run length} as ``KvIndexer.find_matches``, or None when a key is not an
        int in [0, 2**64) (the caller takes its general path)."""

    def detailed(
        self,
        keys: Sequence[object],
        worker_of_bit: dict[int, int],
        make: Callable[[int, int, int, int], T],
        fields: tuple[Any, Any, Any, Any] | None = None,
        /,
    ) -> dict[int, T] | None:
        """{worker: make(run, device run, device copies, slower copies)} as
        ``KvIndexer.find_matches_detailed``, or None when a key is not an int in [0, 2**64).
        ``fields``: ``make``'s four data descriptors (``make`` a class whose ``__init__`` only
        sets them, in this order): each value is set through them, without calling ``make``."""

    def __len__(self) -> int: ...

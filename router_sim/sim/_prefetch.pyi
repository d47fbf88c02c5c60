"""Type stub of the simulator's prompt thread (built from _prefetch.c; see
router_sim.sim.prefetch)."""

from array import array
from collections.abc import Sequence

from kvcache.hashing import BlockKey

KEYS: int
"""1 on a little-endian CPU: jobs with a root key get their cache keys made (OpenSSL)."""

class Prefetch:
    """Block keys of a replay's prompts, made ahead on a native thread, taken in order."""

    def __init__(
        self,
        jobs: Sequence[
            tuple[tuple[int, ...], int, int | None, int | None, bool, bytes | None] | None
        ],
        per_id: int,
        shift: int,
        mask: int,
        tokens_per_block: int,
        ahead: int,
    ) -> None: ...
    def take(self) -> tuple[list[int] | None, list[BlockKey] | None] | None:
        """The next job's (V1 hashes or None, cache keys or None), or None for a None job."""

    def close(self) -> None:
        """Stop the thread and wait for it."""

    def __len__(self) -> int:
        """Jobs not taken yet."""

def expand_array(
    out: array[int], ids: tuple[int, ...], count: int, per_id: int, shift: int, mask: int, /
) -> array[int]:
    """``out`` (an ``array('i')`` of ``count`` items) filled with the prompt's tokens: token
    ``j`` of the block of id ``h`` is ``(j << shift) | (h & mask)``, blocks in id order (the
    last one cut short)."""

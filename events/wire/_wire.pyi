"""Type stub of the native msgpack wire codec extension (built from _wire.c)."""

from array import array
from collections.abc import Sequence
from typing import Any

def tokens_from_msgpack(data: Any, limit: int) -> array[int] | None:
    """The token ids of one msgpack array of at most ``limit`` ints in ``[0, 2**31)`` that is
    the whole of ``data`` (a buffer), as an ``array('i')``; None for anything else."""

def pack_tokens(tokens: object) -> bytes | None:
    """The msgpack array of an ``array('i')`` or a list of ints in ``[-2**63, 2**64)``, byte for
    byte as msgspec writes the same ints as a list; None for anything else."""

def decode_events(kit: tuple[Any, ...], payload: Any) -> Any:
    """The DecodedBatch of a common map-form payload (``events.wire.fast.decode_native``), its
    records built from ``kit``; None for anything else."""

def encode_events(
    kinds: tuple[type[Any], type[Any], type[Any]],
    events: list[Any],
    ts: float,
    dp_rank: int | None,
) -> bytes | None:
    """The map-form payload ``events.wire.codec.encode_batch_msgspec`` writes for a list of Stored /
    Removed / AllBlocksCleared events (``kinds``: those classes), a Stored event's blocks split
    into wire events as :func:`wire_runs` says; None for anything else."""

def wire_runs(blocks: Sequence[Any], block_size: int) -> list[int]:
    """The end of each BlockStored wire event's blocks among a Stored event's blocks
    (``events.wire.fast.wire_runs``)."""

def simd(on: bool | None = None, /) -> bool:
    """Whether token ids are read and written with the SSSE3 loops (False without them);
    ``on`` turns them on (where the CPU has them) or off, so both ways can be compared."""

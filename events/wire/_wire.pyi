"""Type stub of the native msgpack wire codec extension (built from _wire.c)."""

from array import array
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

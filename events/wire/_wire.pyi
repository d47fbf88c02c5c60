"""Type stub of the native msgpack wire reader extension (built from _wire.c)."""

from typing import Any

def decode_events(kit: tuple[Any, ...], payload: Any) -> Any:
    """The DecodedBatch of a common map-form payload (``events.wire.fast.decode_native``), its
    records built from ``kit``; None for anything else."""

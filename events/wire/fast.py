"""The wire codec's native entry points (``events.wire._wire``), the one place it is loaded.

- :func:`decode_native`: the common batch (map-form ``BlockStored`` with int hashes and token
  ids that fill the named blocks, ``BlockRemoved`` with int hashes, ``AllBlocksCleared``; known
  fields each once, no ``extra_keys`` list, ``ts`` a float64: what this project's workers and V1
  engines send) read in one pass over the payload straight into model records, or None for any
  other payload, which the event Structs then read (``events.wire.decode``). It takes a strict
  subset of what the strict Structs take, and its batches equal theirs (tested).
"""

from __future__ import annotations

from typing import Final

# the one import of the native codec
from events.wire import _wire
from events.wire._records import record_setters
from events.wire.model import (
    AllBlocksCleared,
    DecodedBatch,
    KVCacheEvent,
    Removed,
    Stored,
    StoredBlock,
    cache_level_of,
)

# what the native reader builds its records with: each record type and its slot descriptors,
# in field order (the way events.wire._records builds StoredBlock records), and the medium rule
_NATIVE_KIT: Final = (
    StoredBlock,
    record_setters(StoredBlock),
    Stored,
    record_setters(Stored),
    Removed,
    record_setters(Removed),
    AllBlocksCleared,
    KVCacheEvent,
    record_setters(KVCacheEvent),
    DecodedBatch,
    record_setters(DecodedBatch),
    cache_level_of,
)


def decode_native(payload: bytes | bytearray | memoryview) -> DecodedBatch | None:
    """The batch, when the native reader takes all of ``payload``; None otherwise (see the
    module docstring)."""
    batch: DecodedBatch | None = _wire.decode_events(_NATIVE_KIT, payload)
    return batch

"""The wire codec's native entry points (``events.wire._wire``), the one place it is loaded.

- :func:`decode_native`: the common batch (map-form ``BlockStored`` with int hashes and token
  ids that fill the named blocks, ``BlockRemoved`` with int hashes, ``AllBlocksCleared``; known
  fields each once, no ``extra_keys`` list, ``ts`` a float64: what this project's workers and V1
  engines send) read in one pass over the payload straight into model records, or None for any
  other payload, which the event Structs then read (``events.wire.decode``). It takes a strict
  subset of what the strict Structs take, and its batches equal theirs (tested).
- :func:`packed_tokens`: a store's token ids read from their msgpack bytes into an
  ``array('i')``, no Python int per token (the Structs hand them over undecoded).
- :func:`pack_tokens`: packed token ids written as msgpack for ``events.wire.codec``.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from typing import Final

from msgspec import Raw

# the one import of the native codec
from events.wire import _wire
from events.wire._records import record_setters
from events.wire.limits import DEFAULT_LIMITS
from events.wire.model import (
    AllBlocksCleared,
    DecodedBatch,
    KVCacheEvent,
    Removed,
    Stored,
    StoredBlock,
    cache_level_of,
)

#: the most token ids one event may carry under the default limits
MAX_TOKENS: Final = DEFAULT_LIMITS.max_tokens_per_event


def packed_tokens(data: Raw | bytes, limit: int = MAX_TOKENS) -> array[int] | None:
    """The token ids of ``data``, one msgpack array of at most ``limit`` ints in
    ``[0, 2**31)``, as an ``array('i')``; None for anything else."""
    tokens: array[int] | None = _wire.tokens_from_msgpack(data, limit)
    return tokens


pack_tokens: Callable[[object], bytes | None] = _wire.pack_tokens
"""The msgpack array of an ``array('i')`` or a list of ints, byte for byte what msgspec writes
for the same ints as a list; None for anything else (``events.wire.codec.wire_tokens``)."""

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

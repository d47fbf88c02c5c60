"""events: scope-derived block hashes, KV cache events, wire codecs and ZeroMQ transport."""

from events.model import (
    AllBlocksCleared,
    BlockHash,
    Created,
    DecodedBatch,
    EventDiff,
    KVCacheEvent,
    Removed,
    Stored,
    StoredBlock,
    Updated,
)

__all__ = [
    "AllBlocksCleared",
    "BlockHash",
    "Created",
    "DecodedBatch",
    "EventDiff",
    "KVCacheEvent",
    "Removed",
    "Stored",
    "StoredBlock",
    "Updated",
]

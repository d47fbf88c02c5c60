"""events: scope-derived block hashes, KV cache events, wire codecs and ZeroMQ transport.

Importing the package does not import ZeroMQ; the publisher and subscriber modules do.
"""

from events.manager import KVCacheEventManager
from events.wire.model import (
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
    "KVCacheEventManager",
    "Removed",
    "Stored",
    "StoredBlock",
    "Updated",
]

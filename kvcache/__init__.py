"""kvcache: a scoped block radix-tree KV cache manager with tiered pages and prioritized LRU."""

from kvcache.config import KVCacheManagerConfig, KVLayout, TierConfig
from kvcache.errors import (
    CacheStateError,
    ClosedCacheError,
    KVCacheError,
    OutOfPagesError,
    WrongThreadError,
)
from kvcache.hashing import BlockKey, block_key, blockchain_keys, root_key
from kvcache.manager import KVCacheManager
from kvcache.scope import DEFAULT_SCOPE, ReuseScope, cache_salt_id
from kvcache.sequence import KVCache
from kvcache.sink import BlockView, EventSink, RecordingSink, SinkRecord
from kvcache.stats import KVCacheStats, TierUsage

__all__ = [
    "DEFAULT_SCOPE",
    "BlockKey",
    "BlockView",
    "CacheStateError",
    "ClosedCacheError",
    "EventSink",
    "KVCache",
    "KVCacheError",
    "KVCacheManager",
    "KVCacheManagerConfig",
    "KVCacheStats",
    "KVLayout",
    "OutOfPagesError",
    "RecordingSink",
    "ReuseScope",
    "SinkRecord",
    "TierConfig",
    "TierUsage",
    "WrongThreadError",
    "block_key",
    "blockchain_keys",
    "cache_salt_id",
    "root_key",
]

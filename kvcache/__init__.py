"""kvcache: a scoped block radix-tree KV cache manager with tiered pages and prioritized LRU."""

from kvcache.errors import CacheStateError, ClosedCacheError, KVCacheError, OutOfPagesError
from kvcache.keys import BlockKey, block_key, blockchain_keys, root_key
from kvcache.scope import DEFAULT_SCOPE, ReuseScope, cache_salt_id
from kvcache.sink import BlockView, EventSink, RecordingSink, SinkRecord

__all__ = [
    "DEFAULT_SCOPE",
    "BlockKey",
    "BlockView",
    "CacheStateError",
    "ClosedCacheError",
    "EventSink",
    "KVCacheError",
    "OutOfPagesError",
    "RecordingSink",
    "ReuseScope",
    "SinkRecord",
    "block_key",
    "blockchain_keys",
    "cache_salt_id",
    "root_key",
]

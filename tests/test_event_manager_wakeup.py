"""A consumer blocked in ``get_latest_events`` is woken by the flush that gives it events (the
manager notifies only while someone waits, so this is the case that must not be missed), and
a flush with nobody waiting leaves the events for the next drain."""

from __future__ import annotations

import threading
import time

from events.manager import KVCacheEventManager
from events.wire.model import KVCacheEvent, Stored
from kvcache import KVCacheManager, KVCacheManagerConfig, TierConfig


def cache_with(events: KVCacheEventManager) -> KVCacheManager:
    cfg = KVCacheManagerConfig(tokens_per_block=2, tiers=[TierConfig(name="device", num_blocks=8)])
    return KVCacheManager(cfg, events)


def test_a_flush_wakes_a_blocked_consumer_at_once() -> None:
    events = KVCacheEventManager()
    cache = cache_with(events)
    got: list[KVCacheEvent] = []
    waited: list[float] = []

    def consumer() -> None:
        start = time.monotonic()
        got.extend(events.get_latest_events(timeout_ms=30_000))
        waited.append(time.monotonic() - start)

    thread = threading.Thread(target=consumer)
    thread.start()
    deadline = time.monotonic() + 10
    while events._waiters == 0:  # the consumer is inside its wait (polled, bounded)
        assert time.monotonic() < deadline, "the consumer never started waiting"
        time.sleep(0.001)
    seq = cache.create_kv_cache([1, 2, 3])
    seq.commit([1, 2, 3])
    events.flush()
    thread.join(20)
    assert not thread.is_alive()
    assert waited[0] < 10  # woken by the flush, not by its 30 s timeout
    assert len(got) == 1 and isinstance(got[0].data, Stored)
    assert [list(b.tokens) for b in got[0].data.blocks] == [[1, 2]]
    assert events._waiters == 0


def test_events_flushed_with_nobody_waiting_wait_for_the_next_drain() -> None:
    events = KVCacheEventManager()
    cache = cache_with(events)
    seq = cache.create_kv_cache([5, 6, 7])
    seq.commit([5, 6, 7])
    assert events.flush() == 1
    drained = events.get_latest_events(timeout_ms=10_000)  # returns at once: they are there
    assert [e.event_id for e in drained] == [0]
    assert events.get_latest_events(timeout_ms=1) == []

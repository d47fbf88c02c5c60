"""Snapshots: the event manager's state from the cache tree, the wire parts, and recovery end to
end (an overflowing event buffer becomes a visible gap, the gap a snapshot, the view exact)."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import zmq
from zmq_helpers import DEADLINE_S, StateModel, poll_until, tcp_any, zmq_context

from events.manager import KVCacheEventManager
from events.stream.publisher import ZmqEventPublisher
from events.stream.snapshot import (
    PublisherInfo,
    Snapshot,
    SnapshotAssembler,
    SnapshotError,
    SnapshotHeader,
    pack_header,
    pack_info,
    parse_info,
    split_parts,
)
from events.stream.subscriber import ZmqEventSubscriber
from events.wire.codec import decode_batch, encode_batch
from events.wire.model import KVCacheEvent, Removed, Stored, StoredBlock
from kvcache.config import KVCacheManagerConfig, TierConfig
from kvcache.manager import KVCacheManager
from kvcache.scope import ReuseScope

pytestmark = pytest.mark.timeout(60)
Ctx = zmq.Context[zmq.Socket[bytes]]
TPB = 4


@pytest.fixture
def ctx() -> Iterator[Ctx]:
    yield from zmq_context()


class Engine:
    """A cache, its event manager and a publisher that answers snapshots: an engine's loop."""

    def __init__(self, ctx: Ctx, max_entries: int = 10000, device: int = 12, host: int = 12):
        self.events = KVCacheEventManager(max_entries=max_entries, moves_as="removed_stored")
        tiers = [TierConfig(name="device", num_blocks=device)]
        tiers.append(TierConfig(name="host", num_blocks=host))
        config = KVCacheManagerConfig(tokens_per_block=TPB, tiers=tiers)
        self.cache = KVCacheManager(config, event_sink=self.events)
        self.pub = ZmqEventPublisher(
            tcp_any(),
            tcp_any(),
            context=ctx,
            snapshot_provider=lambda: self.events.snapshot(self.cache.iter_blocks()),
        )

    def request(self, tokens: list[int], scope: ReuseScope | None = None) -> None:
        with self.cache.create_kv_cache(tokens, reuse_scope=scope) as seq:
            seq.commit(tokens[seq.num_tokens :])
        self.events.flush()

    def step(self) -> None:
        """End of an iteration: make any loss visible, publish what was drained."""
        self.pub.publish_drained(self.events, empty=True)

    def truth(self) -> set[int | str]:
        return {h for b in self.cache.iter_blocks() if (h := self.events.hash_of(b)) is not None}


def test_iter_blocks_lists_each_block_after_its_parent() -> None:
    config = KVCacheManagerConfig(tokens_per_block=TPB, tiers=[TierConfig(name="d", num_blocks=9)])
    cache = KVCacheManager(config)
    for tokens in (list(range(12)), [0, 1, 2, 3, 9, 9, 9, 9]):
        with cache.create_kv_cache(tokens) as seq:
            seq.commit(tokens[seq.num_tokens :])
    seen: set[bytes] = set()
    blocks = list(cache.iter_blocks())
    for b in blocks:
        assert b.parent is None or b.parent.key in seen
        seen.add(b.key)
    # 0..3 shared, then 4..7, 8..11 on one branch and 9,9,9,9 on the other
    assert sorted(tuple(b.tokens) for b in blocks) == [
        (0, 1, 2, 3),
        (4, 5, 6, 7),
        (8, 9, 10, 11),
        (9, 9, 9, 9),
    ]
    assert len(blocks) == cache.num_cached_blocks


def test_manager_snapshot_is_the_tree_with_announced_hashes_and_tiers() -> None:
    events = KVCacheEventManager(moves_as="removed_stored")
    config = KVCacheManagerConfig(
        tokens_per_block=TPB,
        tiers=[TierConfig(name="device", num_blocks=2), TierConfig(name="host", num_blocks=4)],
    )
    cache = KVCacheManager(config, event_sink=events)
    for tokens in (list(range(8)), list(range(100, 108))):  # two blocks each, 4 in all
        with cache.create_kv_cache(tokens) as seq:
            seq.commit(tokens[seq.num_tokens :])
    assert events.snapshot(cache.iter_blocks()) is None  # events pending: not consistent
    events.flush()
    assert events.snapshot(cache.iter_blocks()) is None  # buffered, not yet drained
    drained = events.get_latest_events()
    snap = events.snapshot(cache.iter_blocks())
    assert snap is not None
    # the same state as replaying every event handed out: 2 blocks offloaded to host
    model = StateModel()
    model.apply_events(0, drained)
    tiers: dict[int | str, int] = {}
    for e in drained:
        if isinstance(e.data, Stored):
            tiers.update((b.block_hash, b.cache_level) for b in e.data.blocks)
    got = {b.block_hash: b.cache_level for e in snap for b in e.data.blocks}  # type: ignore[union-attr]
    assert set(got) == model.blocks[0]
    assert got == {h: tiers[h] for h in got}
    assert sorted(got.values()) == [0, 0, 1, 1]
    # every parent is stored before its children
    stored: set[int | str] = set()
    for e in snap:
        assert isinstance(e.data, Stored)
        assert e.data.parent_hash is None or e.data.parent_hash in stored
        stored.update(b.block_hash for b in e.data.blocks)


def test_publish_drained_burns_a_seq_for_what_the_buffer_dropped(ctx: Ctx) -> None:
    events = KVCacheEventManager(max_entries=2)
    cache = KVCacheManager(
        KVCacheManagerConfig(tokens_per_block=TPB, tiers=[TierConfig(name="d", num_blocks=9)]),
        event_sink=events,
    )
    with ZmqEventPublisher("inproc://drained", context=ctx) as pub:
        assert pub.publish_drained(events) is None  # nothing drained: no seq consumed
        assert pub.next_seq == 0
        for first in (0, 100, 200):  # three unrelated chains: three events, the buffer holds 2
            tokens = [first, 1, 2, 3, 4]
            with cache.create_kv_cache(tokens) as seq:
                seq.commit(tokens[seq.num_tokens :])
            events.flush()
        batch = pub.publish_drained(events)
        assert batch is not None and len(batch) == 2
        assert (pub.stats.skipped, pub.next_seq) == (1, 2)  # seq 0 burned for the loss
        assert pub.publish_drained(events, empty=True) == []  # a heartbeat
        assert pub.next_seq == 3


def test_split_parts_cuts_long_chains_and_keeps_parents() -> None:
    blocks = [StoredBlock(i + 1, [i, 0, 0, 0]) for i in range(10)]
    events = [KVCacheEvent(0, Stored(None, blocks, 4)), KVCacheEvent(1, Stored(3, blocks[:1], 4))]
    parts = split_parts(events, part_blocks=4)
    sizes = [[len(e.data.blocks) for e in p] for p in parts]  # type: ignore[union-attr]
    assert sizes == [[4], [4], [2, 1]]
    parents = [e.data.parent_hash for p in parts for e in p]  # type: ignore[union-attr]
    assert parents == [None, 4, 8, 3]


def test_info_and_header_round_trip_and_engines_empty_frame() -> None:
    info = PublisherInfo(2**64 - 1, 12345, True)
    assert parse_info(pack_info(info)) == info
    assert parse_info(b"") is None  # what engines send in the end marker
    assert parse_info(b"kvx1" + b"\x00" * 3) is None
    header = SnapshotHeader(7, 9, 1, 3)
    assembler = SnapshotAssembler(max_parts=4, max_bytes=10)
    assert assembler.add(pack_header(SnapshotHeader(7, 9, 0, 2)), b"ab") is None
    assert assembler.add(pack_header(SnapshotHeader(7, 9, 1, 2)), b"cd") == Snapshot(
        7, 9, (b"ab", b"cd")
    )
    with pytest.raises(SnapshotError):
        assembler.add(pack_header(header), b"")  # starts at part 1
    with pytest.raises(SnapshotError):
        assembler.add(pack_header(SnapshotHeader(7, 9, 0, 5)), b"")  # too many parts
    with pytest.raises(SnapshotError):
        assembler.add(pack_header(SnapshotHeader(7, 9, 0, 2)), b"x" * 11)  # too large
    refused = assembler.add(pack_header(SnapshotHeader(7, 0, 0, 0)), b"")
    assert refused is not None and refused.refused


def test_overflow_is_a_visible_gap_and_a_snapshot_makes_the_view_exact(ctx: Ctx) -> None:
    engine = Engine(ctx, max_entries=3)
    model = StateModel()
    rng = random.Random(5)
    try:
        with ZmqEventSubscriber(context=ctx, replay_timeout_ms=2000) as sub:
            sub.add_worker(0, engine.pub.endpoint, engine.pub.replay_endpoint)
            assert sub.wait_connected(DEADLINE_S)
            assert engine.pub.wait_for_subscribers(1, DEADLINE_S)
            for _ in range(3):
                engine.request([rng.randrange(50) for _ in range(9)])
                engine.step()
            poll_until(sub, model, lambda: model.blocks.get(0) == engine.truth())
            assert sub.status(0).state == "ok"
            # many iterations without a drain: the buffer of 3 events overflows, evicted blocks'
            # removals among the dropped events
            for _ in range(30):
                engine.request([rng.randrange(50) for _ in range(9)])
            assert engine.events.dropped_events > 0
            engine.step()

            def exact() -> bool:
                engine.pub.serve_snapshots()  # an idle engine answers between iterations
                status = sub.status(0)
                return (
                    status.state == "ok"
                    and status.snapshots >= 1
                    and model.blocks.get(0) == engine.truth()
                )

            poll_until(sub, model, exact)
            assert "snapshot" in " ".join(model.resyncs[0])
            assert engine.pub.stats.skipped == 1 and engine.pub.stats.snapshots_sent == 1
            # and the stream goes on from the snapshot's seq (recovering again if this
            # iteration overflows the small buffer too)
            engine.request(list(range(200, 209)))
            engine.step()
            poll_until(sub, model, exact)
    finally:
        engine.pub.close()


def test_snapshot_payloads_decode_as_ordinary_batches(ctx: Ctx) -> None:
    """What a snapshot carries is plain ``BlockStored`` events: any decoder of the wire reads
    them, and the blocks survive the trip."""
    engine = Engine(ctx)
    try:
        engine.request(list(range(13)))
        engine.step()
        snap = engine.events.snapshot(engine.cache.iter_blocks())
        assert snap is not None
        batch = decode_batch(encode_batch(split_parts(snap)[0], 1.0))
        got = {b.block_hash for e in batch.events for b in e.data.blocks}  # type: ignore[union-attr]
        assert got == engine.truth() and len(got) == 3
        assert not any(isinstance(e.data, Removed) for e in batch.events)
    finally:
        engine.pub.close()

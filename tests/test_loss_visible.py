"""Events the event manager's full buffer dropped are visible on every path they can take.

A worker may publish the natural way (``pub.publish(manager.get_latest_events())``), the
blessed way (``pub.publish_drained(manager)``) or encode the events itself: in each case a
router ends with the exact state or a worker it knows to be degraded, never an "ok" stream
whose view is wrong (blocks whose removal was dropped still indexed).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st
from zmq_helpers import DEADLINE_S, SEQ, StateModel, poll_until, tcp_any, zmq_context

from events.loss import EventsLost, leading_loss, loss_marker, lost_events
from events.manager import KVCacheEventManager
from events.stream.publisher import ZmqEventPublisher
from events.stream.subscriber import ZmqEventSubscriber
from events.wire.codec import decode_batch, encode_batch
from events.wire.model import AllBlocksCleared, KVCacheEvent
from kvcache.config import KVCacheManagerConfig, TierConfig
from kvcache.manager import KVCacheManager

pytestmark = pytest.mark.timeout(60)
Ctx = zmq.Context[zmq.Socket[bytes]]
TPB = 4


@pytest.fixture
def ctx() -> Iterator[Ctx]:
    yield from zmq_context()


def _data(event: KVCacheEvent) -> object:
    """An item's data, a marker's included (typed as what it may be)."""
    return event.data


def _cleared(mgr: KVCacheEventManager, n: int) -> None:
    """``n`` one-event iterations (AllBlocksCleared needs no cache)."""
    for _ in range(n):
        mgr.on_cleared()
        mgr.flush()


# ------------------------------------------------------------------ the manager's marker


def test_overflow_puts_a_marker_of_the_dropped_ids_first() -> None:
    mgr = KVCacheEventManager(max_entries=3)
    _cleared(mgr, 7)  # ids 0..6; the buffer keeps 4, 5, 6
    events = mgr.get_latest_events()
    assert [e.event_id for e in events] == [0, 4, 5, 6]
    marker = events[0]
    assert _data(marker) == EventsLost(first_event_id=0, count=4)
    assert lost_events(marker) == 4 and leading_loss(events) == 4
    assert [lost_events(e) for e in events[1:]] == [0, 0, 0]
    # the loss was handed out once: the next drain is whole
    _cleared(mgr, 2)
    assert [e.event_id for e in mgr.get_latest_events()] == [7, 8]
    # a second loss is marked from where the first drain left off
    _cleared(mgr, 5)  # ids 9..13, keeps 11..13
    events = mgr.get_latest_events()
    assert _data(events[0]) == EventsLost(9, 2) and [e.event_id for e in events[1:]] == [11, 12, 13]
    assert mgr.dropped_events == 6


def test_taking_the_count_first_leaves_no_marker() -> None:
    mgr = KVCacheEventManager(max_entries=2)
    _cleared(mgr, 5)
    assert mgr.take_dropped() == 3
    assert [e.event_id for e in mgr.get_latest_events()] == [3, 4]
    _cleared(mgr, 4)  # 5..8, keeps 7, 8
    assert mgr.take_dropped() == 2
    assert [e.event_id for e in mgr.get_latest_events()] == [7, 8]


def test_end_step_reports_the_count_and_never_a_marker() -> None:
    mgr = KVCacheEventManager(max_entries=2)
    _cleared(mgr, 4)  # 0..3, keeps 2, 3
    events, dropped = mgr.end_step()
    assert ([e.event_id for e in events], dropped) == ([2, 3], 2)
    assert not any(lost_events(e) for e in events)
    assert mgr.get_latest_events() == []


@settings(max_examples=60, deadline=None)
@given(
    max_entries=st.integers(1, 6),
    steps=st.lists(
        st.tuples(st.integers(0, 5), st.sampled_from(["drain", "take", "end_step", "none"])),
        max_size=25,
    ),
)
def test_every_event_id_is_delivered_or_inside_a_marker_or_counted(
    max_entries: int, steps: list[tuple[int, str]]
) -> None:
    """Whatever the mix of drains, each flushed id is handed out exactly once: as an event,
    inside a marker's range, or in a count returned by take_dropped / end_step."""
    mgr = KVCacheEventManager(max_entries=max_entries)
    delivered: list[int] = []
    marked: list[int] = []
    counted = 0
    for n, how in steps:
        _cleared(mgr, n)
        if how == "drain":
            for e in mgr.get_latest_events():
                if lost_events(e):
                    assert _data(e) == EventsLost(e.event_id, lost_events(e))
                    marked.extend(range(e.event_id, e.event_id + lost_events(e)))
                else:
                    delivered.append(e.event_id)
        elif how == "take":
            counted += mgr.take_dropped()
        elif how == "end_step":
            events, dropped = mgr.end_step()
            counted += dropped
            delivered.extend(e.event_id for e in events)
    events = mgr.get_latest_events()
    for e in events:
        if lost_events(e):
            marked.extend(range(e.event_id, e.event_id + lost_events(e)))
        else:
            delivered.append(e.event_id)
    counted += mgr.take_dropped()
    assert delivered == sorted(delivered) and len(set(delivered)) == len(delivered)
    assert not set(marked) & set(delivered)
    assert len(delivered) + len(marked) + counted == mgr.next_event_id
    assert len(marked) + counted == mgr.dropped_events


def test_the_marker_has_no_wire_form() -> None:
    marker = loss_marker(0, 3)
    with pytest.raises(TypeError, match="not an event payload"):
        encode_batch([marker, KVCacheEvent(3, AllBlocksCleared())], 1.0)
    with pytest.raises(ValueError):
        loss_marker(0, 0)


# ---------------------------------------------------------------------- the publisher


def test_publish_turns_a_leading_marker_into_a_burned_seq(ctx: Ctx) -> None:
    with ZmqEventPublisher("inproc://loss-marker", context=ctx) as pub:
        sub = ctx.socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.setsockopt(zmq.RCVTIMEO, int(DEADLINE_S * 1000))
            sub.connect(pub.endpoint)
            assert pub.wait_for_subscribers(1, DEADLINE_S)
            events = [loss_marker(0, 2), KVCacheEvent(2, AllBlocksCleared())]
            assert pub.publish(events) == 1  # seq 0 burned for the loss
            assert (pub.stats.skipped, pub.stats.published, pub.next_seq) == (1, 1, 2)
            _topic, seq, data = sub.recv_multipart()
            assert SEQ.unpack(seq)[0] == 1
            assert decode_batch(data).events == [KVCacheEvent(2, AllBlocksCleared())]
            assert pub.stats.encode_errors == 0
        finally:
            sub.close(linger=0)


def test_a_marker_inside_a_batch_makes_the_batch_a_gap_logged_as_a_loss(
    ctx: Ctx, caplog: pytest.LogCaptureFixture
) -> None:
    """Drained batches joined together: the second one's marker is not at the head. The
    whole batch is then a gap (its seq never sent), logged as a loss in one line."""
    with ZmqEventPublisher("inproc://loss-inside", context=ctx) as pub:
        events = [KVCacheEvent(0, AllBlocksCleared()), loss_marker(1, 3)]
        events.append(KVCacheEvent(4, AllBlocksCleared()))
        assert pub.publish(events) == 0
        assert pub.flush(DEADLINE_S)
        assert (pub.stats.encode_errors, pub.stats.sent, pub.next_seq) == (1, 0, 1)
    lines = [r for r in caplog.records if "loss marker" in r.getMessage()]
    assert len(lines) == 1 and lines[0].exc_info is None
    assert "3 events dropped upstream" in lines[0].getMessage()


# ------------------------------------------------------------------------- end to end


class _Engine:
    """A cache, its event manager (a small buffer) and a publisher: a worker's loop."""

    def __init__(self, ctx: Ctx, *, snapshots: bool, max_entries: int = 8) -> None:
        self.events = KVCacheEventManager(max_entries=max_entries, moves_as="removed_stored")
        tiers = [TierConfig(name="device", num_blocks=12)]
        config = KVCacheManagerConfig(tokens_per_block=TPB, tiers=tiers)
        self.cache = KVCacheManager(config, event_sink=self.events)
        provider = (lambda: self.events.snapshot(self.cache.iter_blocks())) if snapshots else None
        self.pub = ZmqEventPublisher(tcp_any(), tcp_any(), context=ctx, snapshot_provider=provider)

    def request(self, tokens: list[int]) -> None:
        with self.cache.create_kv_cache(tokens) as seq:
            seq.commit(tokens[seq.num_tokens :])
        self.events.flush()

    def truth(self) -> set[int | str]:
        return {h for b in self.cache.iter_blocks() if (h := self.events.hash_of(b)) is not None}


def _plain(engine: _Engine) -> list[KVCacheEvent]:
    events = engine.events.get_latest_events()
    engine.pub.publish(events)
    return events


def _drained(engine: _Engine) -> list[KVCacheEvent]:
    return engine.pub.publish_drained(engine.events, empty=True) or []


@pytest.mark.parametrize("snapshots", [True, False], ids=["snapshots", "no-snapshots"])
@pytest.mark.parametrize("loop", [_plain, _drained], ids=["plain", "drained"])
def test_an_overflow_ends_exact_or_degraded_never_ok_and_wrong(
    ctx: Ctx, loop: Callable[[_Engine], list[KVCacheEvent]], snapshots: bool
) -> None:
    engine = _Engine(ctx, snapshots=snapshots)
    model = StateModel()
    rng = random.Random(7)
    try:
        with ZmqEventSubscriber(context=ctx, replay_timeout_ms=1000) as sub:
            sub.add_worker(0, engine.pub.endpoint, engine.pub.replay_endpoint)
            assert sub.wait_connected(DEADLINE_S)
            assert engine.pub.wait_for_subscribers(1, DEADLINE_S)
            for _ in range(2):
                engine.request([rng.randrange(40) for _ in range(9)])
                loop(engine)
            poll_until(sub, model, lambda: model.blocks.get(0) == engine.truth())
            seen = set(model.blocks[0])
            # many iterations without a drain: the buffer of 8 overflows, the removals of
            # blocks the router saw stored among the dropped events
            for _ in range(25):
                engine.request([rng.randrange(40) for _ in range(9)])
            assert engine.events.dropped_events > 0
            published = loop(engine)
            # the scenario loses something: what was published, applied without the loss,
            # leaves blocks indexed that the worker no longer holds
            naive = StateModel()
            naive.blocks[0] = set(seen)
            naive.apply_events(0, [e for e in published if not lost_events(e)])
            assert naive.blocks[0] - engine.truth(), "the overflow dropped no removal"
            assert engine.pub.stats.skipped == 1

            def settled() -> bool:
                if snapshots:
                    engine.pub.serve_snapshots()  # an idle engine answers between iterations
                status = sub.status(0)
                if status.state == "degraded":
                    return True
                return status.last_seq == engine.pub.next_seq - 1 and not status.replaying

            poll_until(sub, model, settled)
            status = sub.status(0)
            view = model.blocks.get(0, set())
            assert status.state == "degraded" or view == engine.truth(), (status, view)
            assert view <= engine.truth()  # whatever the router holds, the worker holds
            if snapshots:  # a snapshot makes it exact

                def exact() -> bool:
                    engine.pub.serve_snapshots()
                    return sub.status(0).state == "ok" and model.blocks.get(0) == engine.truth()

                poll_until(sub, model, exact)
            else:
                assert status.state == "degraded"
                assert not view - engine.truth()
    finally:
        engine.pub.close()

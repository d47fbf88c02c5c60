"""ZmqEventSubscriber scenarios: ordered delivery per worker, gap replay, duplicates, reordering,
the no-resurrection rule, undecodable payloads, late joiners and status. Frames are injected by
a fake publisher (an XPUB and a ROUTER the test drives) or come from the real publisher."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq
from zmq_helpers import (
    END,
    SEQ,
    FakePublisher,
    StateModel,
    cleared,
    free_tcp_port,
    payload,
    poll_until,
    removed,
    stored,
    tcp_any,
    zmq_context,
)

from events.stream.publisher import ZmqEventPublisher
from events.stream.subscriber import (
    SubscriberError,
    ZmqEventSubscriber,
)
from events.wire.codec import DecodeLimits

pytestmark = pytest.mark.timeout(60)
Ctx = zmq.Context[zmq.Socket[bytes]]


@pytest.fixture
def ctx() -> Iterator[Ctx]:
    yield from zmq_context()


@pytest.fixture
def fake(ctx: Ctx) -> Iterator[FakePublisher]:
    f = FakePublisher(ctx)
    yield f
    f.close()


@pytest.fixture
def sub(ctx: Ctx) -> Iterator[ZmqEventSubscriber]:
    # no probes and no join: these scenarios script every replay request and answer themselves
    s = ZmqEventSubscriber(context=ctx, replay_timeout_ms=2000, probe_interval_ms=None, join=False)
    yield s
    s.close()


def _seqs(model: StateModel, worker: int) -> list[int]:
    return model.seqs.get(worker, [])


@pytest.mark.parametrize("transport", ["inproc", "tcp"])
def test_two_workers_same_topic_are_told_apart(ctx: Ctx, transport: str) -> None:
    def ep(name: str) -> str:
        return f"inproc://{name}" if transport == "inproc" else tcp_any()

    model = StateModel()
    with (
        ZmqEventPublisher(ep("w1"), ep("w1r"), topic="kv", context=ctx) as p1,
        ZmqEventPublisher(ep("w2"), ep("w2r"), topic="kv", context=ctx) as p2,
        ZmqEventSubscriber(topic="kv", context=ctx) as sub,
    ):
        sub.add_worker(1, p1.endpoint, p1.replay_endpoint)
        sub.add_worker(2, p2.endpoint, p2.replay_endpoint)
        assert sub.wait_connected(5)
        assert p1.wait_for_subscribers(1, 5) and p2.wait_for_subscribers(1, 5)
        # each worker's join (its history asked from seq 0) answered first: what is published
        # next arrives live, not in a join reply that crossed it
        poll_until(sub, model, lambda: not (sub.status(1).replaying or sub.status(2).replaying))
        p1.publish([stored(1, 100, 101)])
        p2.publish([stored(1, 200)])
        p1.publish([removed(2, 101)])
        poll_until(sub, model, lambda: len(_seqs(model, 1)) == 2 and len(_seqs(model, 2)) == 1)
        assert model.blocks == {1: {100}, 2: {200}}
        assert sub.status(1).state == "ok" and sub.status(1).last_seq == 1
        assert sub.status(2).received == 1 and sub.status(2).connected


def test_duplicates_are_dropped(sub: ZmqEventSubscriber, fake: FakePublisher) -> None:
    sub.add_worker(0, fake.endpoint, fake.replay_endpoint)
    fake.wait_subscribed()
    bodies = [payload([stored(i, 10 + i)], ts=i) for i in range(3)]
    for seq in (0, 1, 1, 0, 2, 2):
        fake.send(seq, bodies[seq])
    model = StateModel()
    poll_until(sub, model, lambda: sub.status(0).received == 6)
    assert _seqs(model, 0) == [0, 1, 2]
    assert sub.status(0).duplicates == 3
    assert sub.status(0).restarts == 0 and sub.status(0).resyncs == 0


def test_reordered_frames_replayed_in_order(sub: ZmqEventSubscriber, fake: FakePublisher) -> None:
    sub.add_worker(0, fake.endpoint, fake.replay_endpoint)
    fake.wait_subscribed()
    bodies = [payload([stored(i, 10 + i)], ts=i) for i in range(4)]
    model = StateModel()
    fake.send(0, bodies[0])
    fake.send(2, bodies[2])
    poll_until(sub, model, lambda: sub.status(0).replaying)
    ident, start = fake.next_request()
    assert start == 1
    # the late frame arrives while the replay is in flight: it is the next seq, so it is
    # applied at once and the held seq 2 after it; the replay's copies are duplicates
    fake.send(1, bodies[1])
    fake.send(3, bodies[3])
    poll_until(sub, model, lambda: sub.status(0).received == 4)
    assert _seqs(model, 0) == [0, 1, 2, 3]
    fake.answer(ident, [(1, bodies[1]), (2, bodies[2])])
    poll_until(sub, model, lambda: not sub.status(0).replaying)
    assert _seqs(model, 0) == [0, 1, 2, 3]
    assert model.blocks[0] == {10, 11, 12, 13}
    status = sub.status(0)
    assert (status.gaps, status.duplicates, status.resyncs, status.state) == (1, 2, 0, "ok")


def test_held_frames_bridge_a_gap_the_replay_cannot(
    sub: ZmqEventSubscriber, fake: FakePublisher
) -> None:
    sub.add_worker(0, fake.endpoint, fake.replay_endpoint)
    fake.wait_subscribed()
    bodies = [payload([stored(i, 10 + i)], ts=i) for i in range(3)]
    model = StateModel()
    fake.send(0, bodies[0])
    fake.send(2, bodies[2])
    poll_until(sub, model, lambda: sub.status(0).replaying)
    fake.send(1, bodies[1])
    poll_until(sub, model, lambda: sub.status(0).received == 3)
    ident, _ = fake.next_request()
    fake.answer(ident, [])  # nothing buffered, but the held-back frame 1 closes the gap
    poll_until(sub, model, lambda: len(_seqs(model, 0)) == 3)
    assert model.resyncs == {}
    assert sub.status(0).state == "ok"


def test_no_resurrection_after_live_removal(sub: ZmqEventSubscriber, fake: FakePublisher) -> None:
    # seq 1 stores A and is lost live; seq 2 removes A. Applying 2 then a replayed 1 would
    # bring A back; the subscriber must apply 1 before 2.
    sub.add_worker(0, fake.endpoint, fake.replay_endpoint)
    fake.wait_subscribed()
    a = 0xA
    bodies = [
        payload([stored(0, 1)], ts=0),
        payload([stored(1, a)], ts=1),
        payload([removed(2, a)], ts=2),
    ]
    model = StateModel()
    fake.send(0, bodies[0])
    fake.send(2, bodies[2])
    poll_until(sub, model, lambda: sub.status(0).replaying)
    ident, start = fake.next_request()
    assert start == 1
    fake.answer(ident, [(1, bodies[1]), (2, bodies[2])])
    poll_until(sub, model, lambda: len(_seqs(model, 0)) == 3)
    assert _seqs(model, 0) == [0, 1, 2]
    assert model.blocks[0] == {1}


def test_undecodable_live_payload_is_replayed(sub: ZmqEventSubscriber, fake: FakePublisher) -> None:
    sub.add_worker(0, fake.endpoint, fake.replay_endpoint)
    fake.wait_subscribed()
    good = [payload([stored(i, 10 + i)], ts=i) for i in range(2)]
    model = StateModel()
    fake.send(0, good[0])
    fake.send(1, b"\xc1 not msgpack")
    poll_until(sub, model, lambda: sub.status(0).replaying)
    ident, start = fake.next_request()
    assert start == 1
    fake.answer(ident, [(1, good[1])])
    poll_until(sub, model, lambda: len(_seqs(model, 0)) == 2)
    assert model.blocks[0] == {10, 11}
    assert sub.status(0).decode_errors == 1 and sub.status(0).resyncs == 0


def test_undecodable_replayed_payload_forces_a_resync(
    sub: ZmqEventSubscriber, fake: FakePublisher
) -> None:
    sub.add_worker(0, fake.endpoint, fake.replay_endpoint)
    fake.wait_subscribed()
    model = StateModel()
    fake.send(0, payload([stored(0, 10)]))
    fake.send(1, b"\x92\x01")
    poll_until(sub, model, lambda: sub.status(0).replaying)
    ident, _ = fake.next_request()
    fake.answer(ident, [(1, b"\x92\x01")])
    fake.send(2, payload([stored(2, 12)]))
    poll_until(sub, model, lambda: _seqs(model, 0)[-1:] == [2])
    assert [s for s in model.resyncs[0] if "cannot be decoded" in s]
    assert model.blocks[0] == {12}
    assert sub.status(0).state == "degraded" and sub.status(0).decode_errors == 2


def test_malformed_live_messages_are_counted_and_skipped(
    sub: ZmqEventSubscriber, fake: FakePublisher
) -> None:
    sub.add_worker(0, fake.endpoint, fake.replay_endpoint)
    fake.wait_subscribed()
    fake.pub.send_multipart([b"", b"\x00"])  # two frames, short seq
    fake.send(0, payload([stored(0, 10)]))
    model = StateModel()
    poll_until(sub, model, lambda: _seqs(model, 0) == [0])
    assert sub.status(0).decode_errors == 1


def test_late_joiner_replays_from_zero(ctx: Ctx) -> None:
    model = StateModel()
    with ZmqEventPublisher("inproc://late", "inproc://late-r", context=ctx) as pub:
        pub.publish([stored(0, 1)])
        pub.publish([stored(1, 2)])
        assert pub.flush(5)
        with ZmqEventSubscriber(context=ctx) as sub:
            sub.add_worker(3, pub.endpoint, pub.replay_endpoint)
            assert pub.wait_for_subscribers(1, 5)
            pub.publish([removed(2, 1)])
            poll_until(sub, model, lambda: len(_seqs(model, 3)) == 3)
            assert _seqs(model, 3) == [0, 1, 2]
            assert model.blocks[3] == {2}
            assert sub.status(3).state == "ok"


def test_late_joiner_without_replay_resyncs(ctx: Ctx) -> None:
    model = StateModel()
    with ZmqEventPublisher("inproc://late2", context=ctx) as pub:
        pub.publish([stored(0, 1)])
        assert pub.flush(5)
        with ZmqEventSubscriber(context=ctx) as sub:
            sub.add_worker(3, pub.endpoint)
            assert pub.wait_for_subscribers(1, 5)
            pub.publish([stored(1, 2)])
            poll_until(sub, model, lambda: _seqs(model, 3) == [1])
            assert "no replay endpoint" in model.resyncs[3][0]
            assert sub.status(3).state == "degraded"
            pub.publish([cleared(2), stored(3, 5)])
            poll_until(sub, model, lambda: _seqs(model, 3) == [1, 2])
            assert model.blocks[3] == {5}
            assert sub.status(3).state == "ok"  # AllBlocksCleared made the view exact again


def test_worker_management_errors(sub: ZmqEventSubscriber) -> None:
    sub.add_worker(1, "inproc://nobody")
    with pytest.raises(SubscriberError, match="already added"):
        sub.add_worker(1, "inproc://nobody")
    with pytest.raises(SubscriberError, match="not subscribed"):
        sub.status(9)
    sub.remove_worker(1)
    with pytest.raises(SubscriberError, match="not subscribed"):
        sub.remove_worker(1)
    assert sub.workers == []
    assert sub.poll(0) == []


def test_restart_is_told_apart_from_a_duplicate(
    sub: ZmqEventSubscriber, fake: FakePublisher
) -> None:
    sub.add_worker(0, fake.endpoint, fake.replay_endpoint)
    fake.wait_subscribed()
    old = [payload([stored(i, 10 + i)], ts=i) for i in range(3)]
    new = [payload([stored(i, 50 + i)], ts=100 + i) for i in range(2)]
    model = StateModel()
    for seq, body in enumerate(old):
        fake.send(seq, body)
    fake.send(0, old[0])  # the same bytes again: a duplicate, not a restart
    poll_until(sub, model, lambda: sub.status(0).received == 4)
    assert sub.status(0).restarts == 0 and sub.status(0).duplicates == 1
    fake.send(1, new[1])  # seq 1 with other bytes: a new publisher (its seq 0 was missed)
    poll_until(sub, model, lambda: sub.status(0).replaying)
    ident, start = fake.next_request()
    assert start == 0  # the new stream is replayed from its beginning
    fake.answer(ident, [(0, new[0]), (1, new[1])])
    poll_until(sub, model, lambda: _seqs(model, 0)[-2:] == [0, 1] and len(_seqs(model, 0)) == 5)
    assert "publisher restarted" in model.resyncs[0][0]
    assert model.blocks[0] == {50, 51}
    status = sub.status(0)
    assert (status.restarts, status.state, status.last_seq) == (1, "ok", 1)


def test_restart_seen_at_seq_zero_needs_no_replay(
    sub: ZmqEventSubscriber, fake: FakePublisher
) -> None:
    sub.add_worker(0, fake.endpoint)  # no replay endpoint: seq 0 alone rebuilds the state
    fake.wait_subscribed()
    model = StateModel()
    fake.send(0, payload([stored(0, 1)], ts=0))
    fake.send(1, payload([stored(1, 2)], ts=1))
    fake.send(0, payload([stored(0, 9)], ts=5))
    poll_until(sub, model, lambda: len(_seqs(model, 0)) == 3)
    assert model.blocks[0] == {9}
    assert sub.status(0).restarts == 1 and sub.status(0).state == "ok"


def test_subscriber_binds_when_the_publisher_connects(ctx: Ctx) -> None:
    live, replay = f"tcp://127.0.0.1:{free_tcp_port()}", f"tcp://127.0.0.1:{free_tcp_port()}"
    model = StateModel()
    # the DEALER connects before the publisher binds its replay endpoint: ZeroMQ's reconnect
    # takes a moment, which a 150 ms replay timeout would not always leave
    with ZmqEventSubscriber(context=ctx, replay_timeout_ms=2000) as sub:
        sub.add_worker(0, live, replay, bind=True)
        # tcp://127.0.0.1:PORT is connect mode for the publisher (WIRE.md 4)
        with ZmqEventPublisher(live, replay, context=ctx, drop_live=lambda s: s == 1) as pub:
            assert pub.endpoint == live
            poll_until(sub, model, lambda: pub.stats.subscribers == 1)
            for i in range(3):
                pub.publish([stored(i, 10 + i)])
            poll_until(sub, model, lambda: _seqs(model, 0) == [0, 1, 2])
            assert model.blocks[0] == {10, 11, 12} and sub.status(0).replayed >= 1


def test_bind_mode_abandoned_replay_does_not_poison_later_replays(ctx: Ctx) -> None:
    """A bind-mode subscriber connects its DEALER to the publisher's bound replay endpoint (as
    engines bind it). A request given up on is abandoned with its DEALER: the late answer
    goes nowhere, and the next request's genuine answer is accepted."""
    live = f"tcp://127.0.0.1:{free_tcp_port()}"
    model = StateModel()
    pub = ctx.socket(zmq.XPUB)
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("tcp://127.0.0.1:*")
    replay = router.getsockopt_string(zmq.LAST_ENDPOINT)
    with ZmqEventSubscriber(
        context=ctx, replay_timeout_ms=100, probe_interval_ms=None, join=False
    ) as sub:
        try:
            sub.add_worker(0, live, replay, bind=True)
            pub.connect(live)
            poll_until(sub, model, lambda: bool(pub.poll(0)))
            pub.recv()
            body = [payload([stored(i, 10 + i)], ts=i) for i in range(5)]
            for seq in (0, 2):  # 1 is missing: a replay request that nobody answers in time
                pub.send_multipart([b"", SEQ.pack(seq), body[seq]])
            poll_until(sub, model, lambda: bool(model.resyncs.get(0)))
            assert "silent" in model.resyncs[0][0]
            old_ident, _, start = router.recv_multipart()
            assert SEQ.unpack(start)[0] == 1
            pub.send_multipart([b"", SEQ.pack(4), body[4]])  # 3 is missing: a new request
            poll_until(sub, model, lambda: bool(router.poll(0)))
            ident, _, start = router.recv_multipart()
            assert SEQ.unpack(start)[0] == 3 and ident != old_ident
            # the late answer to the abandoned request (claiming seq 3) reaches nobody
            with pytest.raises(zmq.ZMQError):
                router.setsockopt(zmq.ROUTER_MANDATORY, 1)
                router.send_multipart([old_ident, b"", b"", SEQ.pack(3), payload([stored(3, 6)])])
            router.send_multipart([ident, b"", b"", SEQ.pack(3), body[3]])
            router.send_multipart([ident, b"", b"", END, b""])
            poll_until(sub, model, lambda: _seqs(model, 0)[-1:] == [4])
            assert _seqs(model, 0) == [0, 2, 3, 4]
            assert model.blocks[0] == {12, 13, 14}
        finally:
            pub.close(linger=0)
            router.close(linger=0)


def test_wait_connected_is_false_until_a_publisher_listens(ctx: Ctx) -> None:
    port = free_tcp_port()
    with ZmqEventSubscriber(context=ctx) as sub:
        sub.add_worker(0, f"tcp://127.0.0.1:{port}")
        assert sub.wait_connected(0.2) is False
        assert sub.status(0).connected is False
        with ZmqEventPublisher(f"tcp://127.0.0.1:{port}", context=ctx, bind=True):
            assert sub.wait_connected(5)
            assert sub.status(0).connected


def test_decode_limits_apply_to_live_and_replayed_batches(ctx: Ctx, fake: FakePublisher) -> None:
    model = StateModel()
    with ZmqEventSubscriber(context=ctx, limits=DecodeLimits(max_events=1), join=False) as sub:
        sub.add_worker(0, fake.endpoint, fake.replay_endpoint)
        fake.wait_subscribed()
        too_big = payload([stored(0, 1), stored(1, 2)])
        fake.send(0, too_big)
        poll_until(sub, model, lambda: sub.status(0).replaying)
        ident, start = fake.next_request()
        assert start == 0
        fake.answer(ident, [(0, too_big)])
        fake.send(1, payload([stored(2, 3)]))
        poll_until(sub, model, lambda: _seqs(model, 0) == [1])
        assert "DecodeLimits.max_events" in model.resyncs[0][0]
        assert sub.status(0).decode_errors == 2

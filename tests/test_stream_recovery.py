"""The router's view is never silently wrong: each scenario with real sockets, bounded in time.

* a restarted publisher whose first frame seen has a higher seq is found by its incarnation and
  the view is made exact by a snapshot;
* a replay flood does not starve live traffic;
* a replay endpoint that trickles garbage cannot extend a replay past its timeout;
* a replay client that stops reading is dropped; request floods are refused;
* a dead sender thread makes ``publish()`` fail loudly;
* replies in vLLM <= 0.25.1's layout (no topic frame) fill gaps, and an engine without
  snapshots keeps the drop-and-rebuild behaviour.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from collections.abc import Iterator

import msgpack
import pytest
import zmq
from zmq_helpers import (
    DEADLINE_S,
    END,
    SEQ,
    FakePublisher,
    StateModel,
    free_tcp_port,
    payload,
    poll_until,
    stored,
    tcp_any,
    wait_until,
    zmq_context,
)

from events.stream.publisher import PublisherError, ZmqEventPublisher
from events.stream.snapshot import SNAPSHOT_TAG
from events.stream.subscriber import ZmqEventSubscriber

Ctx = zmq.Context[zmq.Socket[bytes]]
pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def ctx() -> Iterator[Ctx]:
    yield from zmq_context()


class State:
    """A worker's true state (block ids) and a publisher that answers snapshots of it."""

    def __init__(self) -> None:
        self.blocks: set[int] = set()
        self.next_id = 1

    def batch(self, rng: random.Random) -> list[object]:
        events = []
        if self.blocks and rng.random() < 0.5:
            gone = rng.sample(sorted(self.blocks), k=min(2, len(self.blocks)))
            self.blocks.difference_update(gone)
            events.append(("r", gone))
        new = list(range(self.next_id, self.next_id + rng.randint(1, 3)))
        self.next_id += len(new)
        self.blocks.update(new)
        events.append(("s", new))
        return events

    def encode(self, ops: list[object], event_id: int) -> list[object]:
        from zmq_helpers import removed

        out = []
        for kind, ids in ops:  # type: ignore[misc]
            out.append(stored(event_id, *ids) if kind == "s" else removed(event_id, *ids))
        return out

    def snapshot(self) -> list[object]:
        return [stored(0, b) for b in sorted(self.blocks)]


def _publisher(ctx: Ctx, live: str, replay: str, state: State) -> ZmqEventPublisher:
    deadline = time.monotonic() + DEADLINE_S
    while True:  # the ports a closed publisher released are freed asynchronously
        try:
            return ZmqEventPublisher(
                live,
                replay,
                context=ctx,
                bind=True,
                snapshot_provider=state.snapshot,  # type: ignore[arg-type]
            )
        except PublisherError:
            if time.monotonic() > deadline:
                raise
            threading.Event().wait(0.02)


def test_restart_with_a_higher_seq_is_detected_and_made_exact_by_snapshot(ctx: Ctx) -> None:
    live = f"tcp://127.0.0.1:{free_tcp_port()}"
    replay = f"tcp://127.0.0.1:{free_tcp_port()}"
    rng = random.Random(3)
    old = State()
    model = StateModel()
    with ZmqEventSubscriber(context=ctx, replay_timeout_ms=1000, probe_interval_ms=200) as sub:
        pub = _publisher(ctx, live, replay, old)
        try:
            sub.add_worker(0, live, replay)
            assert sub.wait_connected(DEADLINE_S) and pub.wait_for_subscribers(1, DEADLINE_S)
            for i in range(5):
                pub.publish(old.encode(old.batch(rng), i))  # type: ignore[arg-type]
            poll_until(sub, model, lambda: model.blocks.get(0) == old.blocks)
            poll_until(sub, model, lambda: sub.status(0).incarnation == pub.incarnation)
        finally:
            pub.close()
        # the replacement worker has another cache, and published more batches than the old
        # one before any frame of it reaches the subscriber: its seqs look like a continuation
        new = State()
        new.next_id = 1000
        pub = _publisher(ctx, live, replay, new)
        try:
            for i in range(8):
                pub.publish(new.encode(new.batch(rng), i))  # type: ignore[arg-type]

            def exact() -> bool:
                pub.serve_snapshots()
                return sub.status(0).state == "ok" and model.blocks.get(0) == new.blocks

            poll_until(sub, model, exact, timeout_s=20)
            status = sub.status(0)
            assert status.restarts >= 1 and status.incarnation == pub.incarnation
            assert not (model.blocks[0] & old.blocks)  # none of the dead worker's blocks
            # and the stream goes on
            pub.publish(new.encode(new.batch(rng), 99))  # type: ignore[arg-type]
            poll_until(sub, model, exact)
        finally:
            pub.close()


def test_replay_flood_does_not_starve_live_delivery(ctx: Ctx) -> None:
    body = b"x" * 2000
    with ZmqEventPublisher(tcp_any(), tcp_any(), context=ctx, buffer_steps=5000) as pub:
        assert pub.replay_endpoint is not None
        for _ in range(3000):  # a full ring: each replay is 3,000 messages
            pub.publish_payload(body)
        assert pub.flush(DEADLINE_S)
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub.endpoint)
        assert pub.wait_for_subscribers(1, DEADLINE_S)
        stop = threading.Event()

        def flood() -> None:
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(pub.replay_endpoint or "")
            try:
                while not stop.is_set():
                    try:
                        for _ in range(50):
                            dealer.send_multipart([b"", SEQ.pack(0)], zmq.NOBLOCK)
                    except zmq.Again:
                        # not connected yet (a busy machine is slow to), or the pipe is
                        # full: wait a little for what comes back, then go on flooding
                        dealer.poll(1)
                    while dealer.poll(0):  # read (and drop) what comes back
                        dealer.recv_multipart()
            finally:
                dealer.close(linger=0)

        flooder = threading.Thread(target=flood, daemon=True)
        flooder.start()
        latencies: list[float] = []
        sent = 0
        try:
            start = time.monotonic()
            while time.monotonic() - start < 2.0:
                pub.publish_payload(msgpack.packb([time.time(), [], None]))
                sent += 1
                while sub.poll(0):
                    _, _, p = sub.recv_multipart()
                    if len(p) < 100:
                        latencies.append(time.time() - msgpack.unpackb(p)[0])
                threading.Event().wait(0.002)
            end = time.monotonic() + 1.0
            while len(latencies) < sent and time.monotonic() < end:
                if sub.poll(50):
                    _, _, p = sub.recv_multipart()
                    if len(p) < 100:
                        latencies.append(time.time() - msgpack.unpackb(p)[0])
        finally:
            stop.set()
            flooder.join(DEADLINE_S)
            sub.close(linger=0)
        assert pub.stats.replay_requests > 0 and pub.stats.replay_refused > 0
        assert len(latencies) >= 0.9 * sent
        p99 = statistics.quantiles(latencies, n=100)[98]
        assert p99 <= 0.5, f"live p99 latency {p99:.3f} s during a replay flood"


def test_a_replay_endpoint_trickling_garbage_cannot_extend_the_replay(ctx: Ctx) -> None:
    fake = FakePublisher(ctx, transport="tcp")
    model = StateModel()
    stop = threading.Event()
    thread: threading.Thread | None = None
    try:
        with ZmqEventSubscriber(
            context=ctx, replay_timeout_ms=300, probe_interval_ms=None, join=False
        ) as sub:
            sub.add_worker(0, fake.endpoint, fake.replay_endpoint)
            fake.wait_subscribed()
            fake.send(0, payload([stored(0, 1)]))
            fake.send(2, payload([stored(2, 3)]))  # seq 1 missing: a replay request
            poll_until(sub, model, lambda: sub.status(0).replaying)
            ident, start = fake.next_request()
            assert start == 1
            began = time.monotonic()

            def trickle() -> None:  # one malformed reply every 100 ms, forever
                while not stop.wait(0.1):
                    fake.router.send_multipart([ident, b"", b"junk"])

            thread = threading.Thread(target=trickle, daemon=True)
            thread.start()
            poll_until(sub, model, lambda: bool(model.resyncs.get(0)))
            took = time.monotonic() - began
            assert "silent for 300 ms" in model.resyncs[0][0]
            assert took < 1.5, f"the replay lasted {took:.2f} s despite a 300 ms timeout"
            assert sub.status(0).decode_errors >= 1
            assert model.seqs[0] == [0, 2]  # the stream went on
    finally:
        stop.set()
        if thread is not None:
            thread.join(timeout=DEADLINE_S)  # its socket is closed next: never mid-send
        fake.close()


def test_a_client_that_stops_reading_its_replay_is_dropped(ctx: Ctx) -> None:
    with ZmqEventPublisher(tcp_any(), tcp_any(), context=ctx, replay_client_timeout_s=0.2) as pub:
        for _ in range(3000):
            pub.publish_payload(b"y" * 4000)
        assert pub.flush(DEADLINE_S)
        lazy = ctx.socket(zmq.DEALER)
        lazy.setsockopt(zmq.LINGER, 0)
        lazy.setsockopt(zmq.RCVHWM, 10)
        lazy.connect(pub.replay_endpoint or "")
        try:
            lazy.send_multipart([b"", SEQ.pack(0)])  # and never reads
            wait_until(lambda: pub.stats.replay_clients_dropped == 1)
            # others are still served
            other = ctx.socket(zmq.DEALER)
            other.setsockopt(zmq.LINGER, 0)
            other.connect(pub.replay_endpoint or "")
            other.send_multipart([b"", SEQ.pack(2999)])
            assert other.poll(int(DEADLINE_S * 1000))
            assert other.recv_multipart()[2] == SEQ.pack(2999)
            other.close(linger=0)
        finally:
            lazy.close(linger=0)


def test_request_floods_are_refused_beyond_the_per_client_rate(ctx: Ctx) -> None:
    """A request on top of an unfinished replay, or past the client's rate, is refused."""
    with ZmqEventPublisher(tcp_any(), tcp_any(), context=ctx, replay_rate=1.0) as pub:
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(pub.replay_endpoint or "")
        try:
            for _ in range(30):
                dealer.send_multipart([b"", SEQ.pack(0)])
            wait_until(lambda: pub.stats.replay_requests + pub.stats.replay_refused == 30)
            # at most a burst of 8 (then about one a second), and never a request on top of
            # a replay still being sent
            assert 1 <= pub.stats.replay_requests <= 10
            assert pub.stats.replay_refused >= 20
        finally:
            dealer.close(linger=0)


def test_a_dead_sender_thread_makes_publish_fail_loudly(ctx: Ctx) -> None:
    def broken(seq: int) -> bool:
        raise RuntimeError("injected failure")

    pub = ZmqEventPublisher(tcp_any(), context=ctx, drop_live=broken)
    try:
        pub.publish_payload(b"x")  # accepted; the sender thread dies handling it
        wait_until(lambda: not pub.health().sender_alive)
        with pytest.raises(PublisherError, match="sender thread died"):
            pub.publish_payload(b"y")
        with pytest.raises(PublisherError):
            pub.skip()
    finally:
        pub.close()


@pytest.mark.parametrize("layout", ["vllm-0.25", "vllm-0.26"])
def test_engine_replay_layouts_fill_gaps_and_engines_get_no_snapshot_requests(
    ctx: Ctx, layout: str
) -> None:
    fake = FakePublisher(ctx)
    model = StateModel()
    try:
        with ZmqEventSubscriber(context=ctx, replay_timeout_ms=2000) as sub:
            sub.add_worker(0, fake.endpoint, fake.replay_endpoint)
            fake.wait_subscribed()
            bodies = [payload([stored(i, 10 + i)], ts=i) for i in range(6)]

            def answer(ident: bytes, batches: list[tuple[int, bytes]]) -> None:
                topic = [] if layout == "vllm-0.25" else [b""]
                for seq, body in batches:
                    fake.router.send_multipart([ident, b"", *topic, SEQ.pack(seq), body])
                fake.router.send_multipart([ident, b"", *topic, END, b""])

            # joining: the history from seq 0, asked first in this project's extended form,
            # which an engine reads as a seq beyond its ring (the end marker alone), then in
            # the engines' own form; the engine's ring is empty yet
            ident, start = fake.next_request()
            assert start == 0 and fake.extended
            answer(ident, [])
            poll_until(sub, model, lambda: bool(fake.router.poll(0)))
            ident, start = fake.next_request()
            assert start == 0 and not fake.extended
            answer(ident, [])
            poll_until(sub, model, lambda: not sub.status(0).replaying)
            fake.send(0, bodies[0])
            poll_until(sub, model, lambda: model.seqs.get(0) == [0])
            assert not fake.router.poll(0)  # no hello: the engine is known not to answer it
            fake.send(2, bodies[2])
            poll_until(sub, model, lambda: sub.status(0).replaying)
            ident, start = fake.next_request()
            assert start == 1 and not fake.extended  # engines are asked in their own form
            answer(ident, [(1, bodies[1]), (2, bodies[2])])
            poll_until(sub, model, lambda: model.seqs.get(0) == [0, 1, 2])
            assert sub.status(0).state == "ok"
            # a gap the engine's ring no longer covers: dropped and rebuilt, no snapshot asked
            fake.send(5, bodies[5])
            poll_until(sub, model, lambda: sub.status(0).replaying)
            ident, start = fake.next_request()
            assert start == 3
            answer(ident, [(4, bodies[4]), (5, bodies[5])])
            poll_until(sub, model, lambda: model.seqs.get(0, [])[-1:] == [5])
            assert "3..3" in model.resyncs[0][0]
            assert sub.status(0).state == "degraded"
            poll_until(sub, model, lambda: not sub.status(0).replaying)
            assert not fake.router.poll(300)  # no snapshot request (nor anything else) follows
            assert model.blocks[0] == {14, 15}
    finally:
        fake.close()


def test_snapshot_request_is_harmless_to_an_engine_publisher(ctx: Ctx) -> None:
    """Engines read any request frame as a start seq: ``kv-snapshot`` is a huge one, so they
    answer with the end marker alone. This project's publisher without a provider refuses."""
    assert int.from_bytes(SNAPSHOT_TAG, "big") > 2**64
    with ZmqEventPublisher(tcp_any(), tcp_any(), context=ctx) as pub:
        pub.publish_payload(b"x")
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(pub.replay_endpoint or "")
        try:
            dealer.send_multipart([b"", SNAPSHOT_TAG])
            assert dealer.poll(int(DEADLINE_S * 1000))
            frames = dealer.recv_multipart()
            assert frames[:2] == [b"", SNAPSHOT_TAG] and frames[2][-4:] == b"\x00" * 4
        finally:
            dealer.close(linger=0)


def test_a_consumer_behind_by_more_than_the_ring_loses_nothing(ctx: Ctx) -> None:
    """A router that falls behind holds the frames on its live socket: a replay (the hello, a
    gap's) that finds the ring moved on must not call them lost, nor their late arrival a
    restart."""
    with (
        ZmqEventPublisher(
            "inproc://behind", "inproc://behind-r", context=ctx, buffer_steps=50
        ) as pub,
        ZmqEventSubscriber(context=ctx) as sub,
    ):
        sub.add_worker(0, pub.endpoint, pub.replay_endpoint)
        assert pub.wait_for_subscribers(1, DEADLINE_S)
        for i in range(600):  # twelve rings' worth before the subscriber reads anything
            pub.publish([stored(i, i + 1)])
        assert pub.flush(DEADLINE_S)
        model = StateModel()
        poll_until(sub, model, lambda: len(model.seqs.get(0, [])) == 600)
        status = sub.status(0)
        assert model.seqs[0] == list(range(600))
        assert (status.resyncs, status.restarts, status.state) == (0, 0, "ok")
        assert model.blocks[0] == set(range(1, 601))


def test_listener_fills_a_gap_from_a_replay_without_topic_frames(ctx: Ctx) -> None:
    """``kv-events listen`` against vLLM <= 0.25.1: replies ``[b"", seq, payload]``."""
    from events.tools.listener import listen

    fake = FakePublisher(ctx, transport="tcp")
    got: list[tuple[int, bool]] = []
    result: list[int] = []
    bodies = [payload([stored(i, 10 + i)], ts=i) for i in range(4)]
    thread = threading.Thread(
        target=lambda: result.append(
            listen(
                [fake.endpoint],
                lambda w, frames, replayed: got.append((SEQ.unpack(frames[1])[0], replayed)),
                replay_endpoints=[fake.replay_endpoint],
                count=2,
                timeout_s=30,
            )
        )
    )
    thread.start()
    try:
        fake.wait_subscribed()
        fake.send(0, bodies[0])
        fake.send(3, bodies[3])  # 1 and 2 lost on the way
        ident, start = fake.next_request()
        assert start == 1
        for seq in (1, 2, 3):
            fake.router.send_multipart([ident, b"", SEQ.pack(seq), bodies[seq]])
        fake.router.send_multipart([ident, b"", END, b""])
        thread.join(DEADLINE_S * 2)
        assert not thread.is_alive()
    finally:
        fake.close()
    assert result == [2]
    assert got == [(0, False), (1, True), (2, True), (3, False)]

"""ZmqEventPublisher against raw ZeroMQ sockets: frames exactly as WIRE.md 4, the replay
protocol of WIRE.md 5, the non-blocking queue, the subscription handshake and close()."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import msgpack
import pytest
import zmq
from zmq_helpers import END, SEQ, removed, stored, tcp_any, wait_until, zmq_context

from events.stream.publisher import PublisherError, ZmqEventPublisher
from events.stream.snapshot import PublisherInfo, parse_info, replay_request
from events.wire.codec import decode_batch, encode_batch

pytestmark = pytest.mark.timeout(60)
Ctx = zmq.Context[zmq.Socket[bytes]]
#: [2.0, [], None] packed by hand: publish_payload must pass bytes through untouched
RAW = b"\x93\xcb@\x00\x00\x00\x00\x00\x00\x00\x90\xc0"


@pytest.fixture
def ctx() -> Iterator[Ctx]:
    yield from zmq_context()


def _endpoints(transport: str, name: str) -> tuple[str, str]:
    if transport == "inproc":
        return f"inproc://{name}", f"inproc://{name}-replay"
    return tcp_any(), tcp_any()


def _sub(ctx: Ctx, endpoint: str, topic: bytes = b"") -> zmq.Socket[bytes]:
    s = ctx.socket(zmq.SUB)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SUBSCRIBE, topic)
    s.connect(endpoint)
    return s


def _recv(sock: zmq.Socket[bytes]) -> list[bytes]:
    assert sock.poll(5000), "nothing arrived before the deadline"
    return sock.recv_multipart()


def _dealer(ctx: Ctx, endpoint: str) -> zmq.Socket[bytes]:
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(endpoint)
    return d


@pytest.mark.parametrize("transport", ["inproc", "tcp"])
def test_live_frames_are_topic_seq_payload(ctx: Ctx, transport: str) -> None:
    live, _ = _endpoints(transport, "frames")
    with ZmqEventPublisher(live, topic="kv@w1", context=ctx, dp_rank=0) as pub:
        sub = _sub(ctx, pub.endpoint)
        assert pub.wait_for_subscribers(1, timeout_s=5)
        events = [stored(1, 11, 12), removed(2, 11)]
        assert pub.publish(events, ts=1234.5) == 0
        assert pub.publish_payload(RAW) == 1
        first, second = _recv(sub), _recv(sub)
        sub.close()
    assert len(first) == 3
    assert first[:2] == [b"kv@w1", b"\x00" * 8]
    assert first[2] == encode_batch(events, 1234.5, 0)
    envelope = msgpack.unpackb(first[2])
    assert envelope[0] == 1234.5 and envelope[2] == 0
    assert [e["type"] for e in envelope[1]] == ["BlockStored", "BlockRemoved"]
    assert [e.data for e in decode_batch(first[2]).events] == [e.data for e in events]
    assert second == [b"kv@w1", b"\x00" * 7 + b"\x01", RAW]


def test_dp_rank_offsets_the_bound_endpoint_and_enters_the_payload(ctx: Ctx) -> None:
    with ZmqEventPublisher("inproc://dp", context=ctx, dp_rank=2) as pub:
        assert pub.endpoint == "inproc://dp_dp2"
        sub = _sub(ctx, "inproc://dp_dp2")
        assert pub.wait_for_subscribers(1, timeout_s=5)
        pub.publish([stored(1, 5)], ts=1.0)
        assert decode_batch(_recv(sub)[2]).dp_rank == 2
        sub.close()


def test_wait_for_subscribers_counts_matching_subscriptions(ctx: Ctx) -> None:
    with ZmqEventPublisher("inproc://subs", topic="kv", context=ctx) as pub:
        assert pub.wait_for_subscribers(1, timeout_s=0.05) is False
        other = _sub(ctx, pub.endpoint, b"zz")  # cannot receive topic "kv": not counted
        a = _sub(ctx, pub.endpoint, b"k")
        b = _sub(ctx, pub.endpoint, b"")
        assert pub.wait_for_subscribers(2, timeout_s=5)
        assert pub.stats.subscribers == 2
        a.close()
        wait_until(lambda: pub.stats.subscribers == 1)
        b.close()
        other.close()


@pytest.mark.parametrize("transport", ["inproc", "tcp"])
def test_replay_sends_buffered_batches_then_the_end_marker(ctx: Ctx, transport: str) -> None:
    live, replay = _endpoints(transport, "replay")
    with ZmqEventPublisher(live, replay, topic="t", buffer_steps=3, context=ctx) as pub:
        assert pub.replay_endpoint is not None
        for i in range(6):
            pub.publish_payload(b"p%d" % i)
        assert pub.flush(5)
        dealer = _dealer(ctx, pub.replay_endpoint)
        # start 4 is still buffered: 4 and 5, then the end marker
        dealer.send_multipart([b"", SEQ.pack(4)])
        assert _recv(dealer) == [b"", b"t", SEQ.pack(4), b"p4"]
        assert _recv(dealer) == [b"", b"t", SEQ.pack(5), b"p5"]
        # the end marker is the engines' exactly: its payload empty (WIRE.md 5)
        assert _recv(dealer) == [b"", b"", END, b""]
        # asked in this project's extended form, its last frame names this publisher's
        # incarnation and the seqs it has handled
        dealer.send_multipart([b"", replay_request(5, extended=True)])
        assert _recv(dealer) == [b"", b"t", SEQ.pack(5), b"p5"]
        end = _recv(dealer)
        assert end[:3] == [b"", b"", END]
        assert parse_info(end[3]) == PublisherInfo(pub.incarnation, 6, snapshots=False)
        # start 0 is older than the buffer (3 steps): the reply starts at the oldest kept, 3
        dealer.send_multipart([b"", SEQ.pack(0)])
        assert [_recv(dealer)[2] for _ in range(4)] == [SEQ.pack(3), SEQ.pack(4), SEQ.pack(5), END]
        # start above everything published: only the end marker
        dealer.send_multipart([b"", SEQ.pack(99)])
        assert _recv(dealer)[:3] == [b"", b"", END]
        dealer.close()
        assert pub.stats.replay_requests == 4
        assert pub.stats.replayed_batches == 6


def test_malformed_replay_requests_are_ignored_with_a_warning(
    ctx: Ctx, caplog: pytest.LogCaptureFixture
) -> None:
    with ZmqEventPublisher("inproc://mal", "inproc://mal-r", context=ctx) as pub:
        pub.publish_payload(b"x")
        assert pub.flush(5)  # in the ring before the replay thread reads the requests
        assert pub.replay_endpoint is not None
        dealer = _dealer(ctx, pub.replay_endpoint)
        with caplog.at_level(logging.WARNING, logger="events.stream.publisher"):
            dealer.send_multipart([b"", b"\x01\x02"])  # seq not 8 bytes
            dealer.send_multipart([b"junk", SEQ.pack(0)])  # no empty delimiter
            dealer.send(b"")  # too few frames
            dealer.send_multipart([b"", SEQ.pack(0)])  # a good one still gets served
            assert _recv(dealer) == [b"", b"", SEQ.pack(0), b"x"]
            assert _recv(dealer)[:3] == [b"", b"", END]
        dealer.close()
        assert pub.stats.malformed_requests == 3
        assert pub.stats.replay_requests == 1
    assert sum("malformed replay request" in r.getMessage() for r in caplog.records) == 3


def test_full_queue_drops_the_batch_but_consumes_its_seq(ctx: Ctx) -> None:
    entered, release = threading.Event(), threading.Event()

    def hold_first(seq: int) -> bool:
        if seq == 0:  # the sender thread parks here, so the queue behind it fills up
            entered.set()
            release.wait(5)
        return False

    pub = ZmqEventPublisher(
        "inproc://full", "inproc://full-r", context=ctx, max_queue=2, drop_live=hold_first
    )
    try:
        sub = _sub(ctx, pub.endpoint)
        assert pub.wait_for_subscribers(1, timeout_s=5)
        assert pub.publish_payload(b"s0") == 0
        assert entered.wait(5)
        seqs = [pub.publish_payload(b"s%d" % i) for i in range(1, 5)]
        assert seqs == [1, 2, 3, 4]  # 3 and 4 were refused, yet numbered
        assert pub.stats.dropped_batches == 2
        assert pub.stats.published == 3
        release.set()
        assert pub.flush(5)
        assert [_recv(sub)[1] for _ in range(3)] == [SEQ.pack(0), SEQ.pack(1), SEQ.pack(2)]
        assert pub.publish_payload(b"s5") == 5
        assert _recv(sub)[1] == SEQ.pack(5)  # 3 and 4 never exist: a gap for subscribers
        assert pub.replay_endpoint is not None
        dealer = _dealer(ctx, pub.replay_endpoint)
        dealer.send_multipart([b"", SEQ.pack(3)])
        assert _recv(dealer)[2] == SEQ.pack(5)  # dropped batches are not replayable either
        dealer.close()
        sub.close()
    finally:
        release.set()
        pub.close()


def test_drop_live_keeps_the_frame_replayable(ctx: Ctx) -> None:
    with ZmqEventPublisher(
        "inproc://dl", "inproc://dl-r", context=ctx, drop_live=lambda s: s == 1
    ) as pub:
        sub = _sub(ctx, pub.endpoint)
        assert pub.wait_for_subscribers(1, timeout_s=5)
        for i in range(3):
            pub.publish_payload(b"d%d" % i)
        assert [_recv(sub)[2] for _ in range(2)] == [b"d0", b"d2"]
        assert pub.flush(5)
        assert pub.stats.dropped_live == 1 and pub.stats.sent == 2
        assert pub.replay_endpoint is not None
        dealer = _dealer(ctx, pub.replay_endpoint)
        dealer.send_multipart([b"", SEQ.pack(1)])
        assert _recv(dealer)[3] == b"d1"
        dealer.close()
        sub.close()


def test_close_sends_what_was_queued_and_refuses_more(ctx: Ctx) -> None:
    pub = ZmqEventPublisher("inproc://close", context=ctx)
    sub = _sub(ctx, pub.endpoint)
    assert pub.wait_for_subscribers(1, timeout_s=5)
    for i in range(200):
        pub.publish_payload(b"c%d" % i)
    pub.close(timeout_s=5)
    assert [_recv(sub)[2] for _ in range(200)] == [b"c%d" % i for i in range(200)]
    with pytest.raises(PublisherError, match="closed"):
        pub.publish_payload(b"late")
    pub.close()  # idempotent
    sub.close()


def test_bind_conflict_is_a_clear_error(ctx: Ctx) -> None:
    with (
        ZmqEventPublisher("inproc://taken", context=ctx),
        pytest.raises(PublisherError, match="cannot attach to inproc://taken"),
    ):
        ZmqEventPublisher("inproc://taken", context=ctx)


def test_bad_sizes_are_rejected(ctx: Ctx) -> None:
    with pytest.raises(ValueError, match="max_queue"):
        ZmqEventPublisher("inproc://bad", context=ctx, max_queue=0)


def test_concurrent_publishers_get_unique_seqs_and_nothing_is_left_unsent(ctx: Ctx) -> None:
    # many threads racing the sender thread's doorbell: a lost wake-up leaves batches queued,
    # which flush() would then report
    with ZmqEventPublisher("inproc://many", context=ctx, max_queue=1 << 16) as pub:
        sub = _sub(ctx, pub.endpoint)
        assert pub.wait_for_subscribers(1, timeout_s=5)
        seqs: list[list[int]] = [[] for _ in range(4)]

        def burst(i: int) -> None:
            for n in range(500):
                seqs[i].append(pub.publish_payload(b"%d-%d" % (i, n)))
                if n % 50 == 0:
                    assert pub.flush(5)

        threads = [threading.Thread(target=burst, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert pub.flush(5)
        assert sorted(s for part in seqs for s in part) == list(range(2000))
        received = [SEQ.unpack(_recv(sub)[1])[0] for _ in range(2000)]
        assert received == list(range(2000))  # in seq order on the wire
        sub.close()


def test_positional_wire_form_for_vllm_0_11_consumers(ctx: Ctx) -> None:
    # vLLM 0.11's BlockStored fields in order: block_hashes, parent_block_hash, token_ids,
    # block_size, lora_id, medium (its array_like struct; see tests/data/engines/vllm-0.11.0)
    with ZmqEventPublisher("inproc://positional", context=ctx, wire_form="positional") as pub:
        sub = _sub(ctx, pub.endpoint)
        assert pub.wait_for_subscribers(1, timeout_s=5)
        pub.publish([stored(1, 11, 12), removed(2, 11)], ts=2.0)
        frames = _recv(sub)
        sub.close()
    ts, events, rank = msgpack.unpackb(frames[2])
    assert (ts, rank) == (2.0, 0)
    assert events == [
        ["BlockStored", [11, 12], None, [11, 1, 2, 3, 12, 1, 2, 3], 4, None, "GPU"],
        ["BlockRemoved", [11], None],  # a removal with no cache level names no medium
    ]


def test_wire_form_is_checked_up_front(ctx: Ctx) -> None:
    with pytest.raises(ValueError, match="wire_form"):
        ZmqEventPublisher("inproc://form1", context=ctx, wire_form="array")
    with pytest.raises(ValueError, match="positional"):
        ZmqEventPublisher("inproc://form2", context=ctx, wire_form="positional", extensions=True)

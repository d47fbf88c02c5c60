"""Every bound on outside input holds: oversized frames are dropped (and show as a gap) on each
socket that reads outside input, a flood of big frames leaves the reader's memory flat, absurd
cache levels are counted instead of allocated, a sequence jump costs the doctor nothing, and no
``DecodeLimits`` value makes the decoder misbehave."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import threading
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from zmq_helpers import (
    DEADLINE_S,
    SEQ,
    FakePublisher,
    StateModel,
    payload,
    poll_until,
    stored,
    zmq_context,
)

from events.stream.publisher import ZmqEventPublisher
from events.stream.security import DEFAULT_MAX_MESSAGE_BYTES
from events.stream.subscriber import ZmqEventSubscriber
from events.tools.doctor import Doctor, DoctorOptions
from events.tools.listener import listen
from events.wire.codec import encode_batch
from events.wire.model import (
    DecodedBatch,
    EventDiff,
    KVCacheEvent,
    Removed,
    Stored,
    StoredBlock,
    Updated,
    cache_level_of,
)
from router_sim.router.indexer import LEVEL_OUT_OF_RANGE, MAX_CACHE_LEVEL, KvIndexer

Ctx = zmq.Context[zmq.Socket[bytes]]
pytestmark = pytest.mark.timeout(60)
CAP = 64 * 1024  # a small cap keeps the oversized frames of these tests small
QUIET_MS = 300


@pytest.fixture
def ctx() -> Iterator[Ctx]:
    yield from zmq_context()


def test_subscriber_drops_an_oversized_frame_and_counts_the_gap(ctx: Ctx) -> None:
    fake = FakePublisher(ctx, transport="tcp")  # MAXMSGSIZE is enforced on network transports
    model = StateModel()
    try:
        with ZmqEventSubscriber(context=ctx, max_message_bytes=CAP) as sub:
            sub.add_worker(0, fake.endpoint)
            fake.wait_subscribed()
            fake.send(0, payload([stored(0, 1)]))
            poll_until(sub, model, lambda: sub.status(0).received == 1)
            fake.send(1, payload([stored(1, 666)]) + b"\0" * (2 * CAP))
            # ZeroMQ drops the connection and never redials after such a protocol error; the
            # subscriber redials itself, and the next batch (resent until it gets through,
            # as a live stream would go on) arrives
            deadline = time.monotonic() + DEADLINE_S
            while sub.status(0).received < 2:
                assert time.monotonic() < deadline, "the subscriber did not come back"
                fake.send(2, payload([stored(2, 3)]))
                model.apply(sub.poll(20))
            status = sub.status(0)
            assert 666 not in model.blocks[0]  # the oversized batch never got in
            assert (status.gaps, status.resyncs) == (1, 1)  # its loss is visible: no replay
            assert model.blocks[0] == {3} and status.state == "degraded"
    finally:
        for s in (fake.pub, fake.router):
            s.close(linger=0)


def test_listener_drops_an_oversized_frame_and_redials(ctx: Ctx) -> None:
    fake = FakePublisher(ctx, transport="tcp")
    seqs: list[int] = []
    done = threading.Event()

    def feed() -> None:
        fake.wait_subscribed()
        fake.send(0, payload([stored(0, 1)]))
        fake.send(1, b"\0" * (2 * CAP))
        while not done.wait(0.02):  # the stream goes on; seq 2 gets through once redialled
            fake.send(2, payload([stored(2, 3)]))

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    try:
        n = listen(
            [fake.endpoint],
            lambda w, frames, replay: seqs.append(SEQ.unpack(frames[1])[0]),
            count=2,
            timeout_s=DEADLINE_S,
            max_message_bytes=CAP,
        )
        assert (n, seqs) == (2, [0, 2])
    finally:
        done.set()
        feeder.join(DEADLINE_S)
        for s in (fake.pub, fake.router):
            s.close(linger=0)


def test_publisher_replay_socket_drops_an_oversized_request(ctx: Ctx) -> None:
    with ZmqEventPublisher(
        "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", context=ctx, max_message_bytes=CAP
    ) as pub:
        pub.publish([stored(0, 1)])
        assert pub.flush(DEADLINE_S) and pub.replay_endpoint is not None
        big, good = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
        try:
            for s in (big, good):
                s.setsockopt(zmq.LINGER, 0)
                s.connect(pub.replay_endpoint)
            big.send_multipart([b"", SEQ.pack(0), b"\0" * (2 * CAP)])
            good.send_multipart([b"", SEQ.pack(0)])
            assert good.poll(int(DEADLINE_S * 1000)), "a normal request got no reply"
            assert not big.poll(QUIET_MS)
        finally:
            big.close(linger=0)
            good.close(linger=0)


_SENDER = textwrap.dedent(
    """
    import sys, zmq
    from events.wire.codec import encode_batch
    frames, size = int(sys.argv[1]), int(sys.argv[2])
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.setsockopt(zmq.XPUB_VERBOSER, 1)  # every (re)subscription, even overlapping ones
    pub.bind("tcp://127.0.0.1:*")
    print(pub.getsockopt_string(zmq.LAST_ENDPOINT), flush=True)
    assert pub.poll(10000) and pub.recv()[0] == 1
    big = b"\\0" * size
    for seq in range(1, frames + 1):
        pub.send_multipart([b"", seq.to_bytes(8, "big"), big])
    while pub.poll(10000):  # each drop (0) and reconnect (1) of the subscriber
        if pub.recv()[0] == 1:  # back after a drop: a small batch it can take
            pub.send_multipart([b"", (frames + 1).to_bytes(8, "big"), encode_batch([], 1.0)])
    """
)


def _hwm_kb() -> int:
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+)", status).group(1))  # type: ignore[union-attr]


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_a_flood_of_big_frames_leaves_the_subscriber_memory_flat(ctx: Ctx) -> None:
    frames, size = 4, 40 << 20  # 160 MB in frames over the default 16 MiB cap
    assert size > DEFAULT_MAX_MESSAGE_BYTES
    sender = subprocess.Popen(
        [sys.executable, "-c", _SENDER, str(frames), str(size)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert sender.stdout is not None
        endpoint = sender.stdout.readline().strip()
        with ZmqEventSubscriber(context=ctx) as sub:
            sub.add_worker(0, endpoint)
            Path("/proc/self/clear_refs").write_text("5")  # reset the peak to the current RSS
            before = _hwm_kb()
            model = StateModel()
            poll_until(sub, model, lambda: sub.status(0).received >= 1, timeout_s=30)
            grown_mb = (_hwm_kb() - before) / 1024
            assert sub.status(0).last_seq == frames + 1  # only the small batch got in
        assert grown_mb < 40, f"peak RSS grew {grown_mb:.0f} MB for {frames} x {size >> 20} MB"
    finally:
        sender.kill()
        sender.wait(DEADLINE_S)


@pytest.mark.parametrize("by_tokens", [False, True])
def test_absurd_cache_levels_are_counted_not_allocated(by_tokens: bool) -> None:
    ix = KvIndexer(4, key_by_tokens=by_tokens)
    tier = cache_level_of("TIER9999999")  # a TIER number the model takes literally
    assert tier > MAX_CACHE_LEVEL
    huge = 2**64 - 1
    events = [
        KVCacheEvent(0, Stored(None, [StoredBlock(1, [1, 2, 3, 4])], 4)),
        KVCacheEvent(1, Stored(None, [StoredBlock(2, [5, 6, 7, 8], cache_level=tier)], 4)),
        KVCacheEvent(2, Stored(None, [StoredBlock(3, [9, 9, 9, 9], cache_level=huge)], 4)),
        KVCacheEvent(3, Removed([1], cache_level=huge)),
        KVCacheEvent(4, Updated(1, cache_level=EventDiff(0, huge))),
        KVCacheEvent(5, Stored(None, [StoredBlock(4, [1, 1, 1, 1], cache_level=1)], 4)),
    ]
    tracemalloc.start()
    try:
        ix.apply_batch(0, DecodedBatch(0.0, events))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
    assert ix.anomalies[LEVEL_OUT_OF_RANGE] == 4
    assert ix.block_count(0) == 2  # block 1 on the device, block 4 on tier 1: the rest refused
    # a medium past TIER numbering is a bounded level of its own, not a huge bit
    assert cache_level_of("TIER100000000") <= MAX_CACHE_LEVEL


def test_doctor_gap_costs_constant_memory() -> None:
    doctor = Doctor(DoctorOptions(), ["tcp://127.0.0.1:5557"])
    tracemalloc.start()
    try:
        for seq, h in ((0, 1), (2**40, 2), (2**63, 3)):
            doctor.feed(0, [b"", SEQ.pack(seq), encode_batch([stored(0, h)], 1.0)])
        findings = doctor.finish()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
    gaps = [f.message for f in findings if f.kind == "gap"]
    assert len(gaps) == 2 and "1099511627775 batch(es) lost" in gaps[0]


def test_no_decode_limits_value_crashes_the_decoder() -> None:
    # in a child: a crash in native code would take the test runner with it
    code = textwrap.dedent(
        """
        from events.wire.codec import DecodeLimits, decode_batch, encode_batch
        from events.wire.model import KVCacheEvent, Stored, StoredBlock
        body = encode_batch([KVCacheEvent(0, Stored(None, [StoredBlock(1, [1, 2])], 2))], 1.0)
        names = [n for n in DecodeLimits.__slots__]
        for name in names:
            for value in (2**31, 2**61, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**200):
                try:
                    limits = DecodeLimits(**{name: value})
                except ValueError:
                    continue
                assert len(decode_batch(body, limits).events) == 1, (name, value)
        print("ok", len(names))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=50, check=False
    )
    assert done.returncode == 0 and done.stdout.startswith("ok"), done.stderr[-2000:]

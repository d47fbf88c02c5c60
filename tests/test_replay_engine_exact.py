"""The replay socket is engine-exact (WIRE.md 5): an ordinary replay request gets exactly what
vLLM's publisher sends, so clients written for vLLM read this project's publisher unchanged.

- golden transcripts (tests/data/engines/replay/, hand-derived from vLLM's publisher code and
  checked against the released wheels by scripts/check_replay_transcripts.py, outside CI): the
  live frames and the reply to each request, byte for byte, in the layout of each version
  (0.25.1: no topic frame; 0.26.0 / 0.33.0: topic frame, empty in the end marker);
- a client loop written here from vLLM's documented reference subscriber (on a gap it asks the
  replay socket from the next seq, stops at the first empty payload, and decodes every other
  payload as an array-like batch ``[ts, events, data_parallel_rank]`` with msgspec) reads a
  stream with gaps from this project's publisher to the end, in both layouts;
- the project's extensions answer only requests no engine client sends: the hello (start
  seq 2**64 - 2) and the extended request (``kvx1`` + start seq); an engine answers both with
  its end marker alone.
- no blind start: a subscriber joining an idle engine-shaped publisher (written here as vLLM's
  publisher behaves) gets its history at once from the replay socket.
"""

from __future__ import annotations

import json
import threading
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from zmq_helpers import (
    END,
    SEQ,
    StateModel,
    free_tcp_port,
    poll_until,
    stored,
    tcp_any,
    zmq_context,
)

from events.stream.publisher import ZmqEventPublisher
from events.stream.snapshot import HELLO_START, PublisherInfo, parse_info, replay_request
from events.stream.subscriber import ZmqEventSubscriber
from events.wire.codec import encode_batch
from events.wire.model import KVCacheEvent, Removed

pytestmark = pytest.mark.timeout(60)
Ctx = zmq.Context[zmq.Socket[bytes]]
TRANSCRIPTS = sorted((Path(__file__).parent / "data" / "engines" / "replay").glob("*.json"))


@pytest.fixture
def ctx() -> Iterator[Ctx]:
    yield from zmq_context()


def _transcript(path: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(path.read_text())
    return doc


def _topic_frame(doc: dict[str, Any]) -> bool:
    return bool(doc["version"] != "0.25.1")


def _hex(frames: list[bytes]) -> list[str]:
    return [f.hex() for f in frames]


def _dealer(ctx: Ctx, endpoint: str) -> zmq.Socket[bytes]:
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(endpoint)
    return d


def _reply(dealer: zmq.Socket[bytes]) -> list[list[bytes]]:
    """Every message of one replay reply, end marker included."""
    out: list[list[bytes]] = []
    while True:
        assert dealer.poll(5000), "the replay reply stopped before its end marker"
        frames = dealer.recv_multipart()
        out.append(frames)
        if frames[-2] == END:
            return out


def test_there_is_a_transcript_per_layout() -> None:
    assert [p.name for p in TRANSCRIPTS] == [
        "vllm-0.25.1.json",
        "vllm-0.26.0.json",
        "vllm-0.33.0.json",
    ]


@pytest.mark.parametrize("path", TRANSCRIPTS, ids=lambda p: p.stem)
def test_replies_are_byte_identical_to_the_engines(ctx: Ctx, path: Path) -> None:
    doc = _transcript(path)
    topic = bytes.fromhex(doc["topic_hex"])
    with ZmqEventPublisher(
        tcp_any(),
        tcp_any(),
        topic=topic,
        context=ctx,
        replay_topic_frame=_topic_frame(doc),
    ) as pub:
        assert pub.replay_endpoint is not None
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub.endpoint)
        assert pub.wait_for_subscribers(1, timeout_s=5)
        for b in doc["batches"]:
            assert pub.publish_payload(bytes.fromhex(b["payload_hex"])) == b["seq"]
        live = []
        for _ in doc["batches"]:
            assert sub.poll(5000)
            live.append(_hex(sub.recv_multipart()))
        assert live == doc["live"]
        assert pub.flush(5)
        dealer = _dealer(ctx, pub.replay_endpoint)
        for ex in doc["exchanges"]:
            dealer.send_multipart([bytes.fromhex(f) for f in ex["request"]])
            assert [_hex(m) for m in _reply(dealer)] == ex["reply"]
        dealer.close()
        sub.close()


# ----------------------------------------------------------------- vLLM's reference client


class _Batch(msgspec.Struct, array_like=True):
    """What vLLM's clients decode a payload as: an array ``[ts, events, dp_rank]`` (a payload
    that is not an array, such as an info record, fails with a ValidationError)."""

    ts: float
    events: list[dict[str, Any]]
    data_parallel_rank: int | None = None


class ReferenceClient:
    """vLLM's documented reference subscriber, as a loop: live frames ``[topic, seq,
    payload]``; when a seq skips ahead it asks the replay socket from the seq after the last
    one it saw, then reads replies until the first empty payload, decoding every other one as
    a batch and keeping the ones newer than its last seq."""

    def __init__(self, ctx: Ctx, endpoint: str, replay_endpoint: str) -> None:
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.replay = _dealer(ctx, replay_endpoint)
        self.decoder = msgspec.msgpack.Decoder(type=_Batch)
        self.last_seq = -1
        self.seen: list[int] = []
        self.batches: list[_Batch] = []

    def _take(self, seq: int, payload: bytes) -> None:
        self.batches.append(self.decoder.decode(payload))  # raises on a non-batch payload
        self.seen.append(seq)
        self.last_seq = seq

    def step(self) -> None:
        assert self.sub.poll(5000), "no live frame"
        _, seq_b, payload = self.sub.recv_multipart()
        seq = int.from_bytes(seq_b, "big")
        if self.last_seq >= 0 and seq > self.last_seq + 1:
            self.replay.send_multipart([b"", (self.last_seq + 1).to_bytes(8, "big")])
            while True:
                assert self.replay.poll(5000), "replay stopped before its end marker"
                frames = self.replay.recv_multipart()[1:]  # the DEALER's empty delimiter
                seq_b, data = frames[-2], frames[-1]
                if not data:
                    break  # the end of the replay: an empty payload
                replayed = int.from_bytes(seq_b, "big")
                if replayed > self.last_seq:
                    self._take(replayed, data)
        if seq > self.last_seq:
            self._take(seq, payload)

    def close(self) -> None:
        self.sub.close()
        self.replay.close()


@pytest.mark.parametrize("topic_frame", [True, False], ids=["vllm>=0.26", "vllm<=0.25"])
def test_vllms_reference_client_reads_gaps_and_replays_to_the_end(
    ctx: Ctx, topic_frame: bool
) -> None:
    lost = {2, 3, 6}  # never sent live; the replay ring has them
    with ZmqEventPublisher(
        tcp_any(),
        tcp_any(),
        topic="kv",
        context=ctx,
        drop_live=lambda seq: seq in lost,
        replay_topic_frame=topic_frame,
    ) as pub:
        assert pub.replay_endpoint is not None
        client = ReferenceClient(ctx, pub.endpoint, pub.replay_endpoint)
        assert pub.wait_for_subscribers(1, timeout_s=5)
        for i in range(9):
            pub.publish([stored(i, 100 + i), KVCacheEvent(i, Removed([100 + i]))], ts=float(i))
        for _ in range(9 - len(lost)):
            client.step()
        client.close()
    assert client.seen == list(range(9))
    assert [b.ts for b in client.batches] == [float(i) for i in range(9)]
    assert all(b.data_parallel_rank == 0 for b in client.batches)
    assert [[e["type"] for e in b.events] for b in client.batches] == [
        ["BlockStored", "BlockRemoved"]
    ] * 9


def test_the_reference_decoder_rejects_an_info_record() -> None:
    """Why the end marker of an ordinary replay must stay empty: the info record that once
    travelled there is not a batch to vLLM's decoder."""
    from events.stream.snapshot import pack_info

    decoder = msgspec.msgpack.Decoder(type=_Batch)
    with pytest.raises((msgspec.ValidationError, msgspec.DecodeError)):
        decoder.decode(pack_info(PublisherInfo(1, 2, True)))


# ----------------------------------------------------------------- the extensions


@pytest.mark.parametrize("topic_frame", [True, False])
def test_only_the_hello_and_the_extended_request_carry_the_info(
    ctx: Ctx, topic_frame: bool
) -> None:
    with ZmqEventPublisher(
        tcp_any(), tcp_any(), topic="kv", context=ctx, replay_topic_frame=topic_frame
    ) as pub:
        assert pub.replay_endpoint is not None
        for i in range(3):
            pub.publish_payload(encode_batch([stored(i, i + 1)], float(i)))
        assert pub.flush(5)
        dealer = _dealer(ctx, pub.replay_endpoint)
        info = PublisherInfo(pub.incarnation, 3, snapshots=False)
        end_prefix = [b"", b"", END] if topic_frame else [b"", END]

        dealer.send_multipart([b"", SEQ.pack(1)])  # ordinary: engine-exact, empty end payload
        reply = _reply(dealer)
        assert [m[-2] for m in reply] == [SEQ.pack(1), SEQ.pack(2), END]
        assert reply[-1] == [*end_prefix, b""]

        dealer.send_multipart([b"", replay_request(1, extended=True)])
        reply = _reply(dealer)
        assert [m[-2] for m in reply] == [SEQ.pack(1), SEQ.pack(2), END]
        assert reply[-1][:-1] == end_prefix and parse_info(reply[-1][-1]) == info

        dealer.send_multipart([b"", SEQ.pack(HELLO_START)])  # the hello: end marker alone
        reply = _reply(dealer)
        assert len(reply) == 1 and parse_info(reply[0][-1]) == info
        dealer.close()


def test_an_engine_reads_the_extended_request_as_a_seq_beyond_its_ring() -> None:
    """vLLM and SGLang read the request frame with ``int.from_bytes(frame, "big")`` whatever
    its length: the 12 bytes of an extended request are a start beyond any ring they keep."""
    for start in (0, 1, 2**64 - 1):
        assert int.from_bytes(replay_request(start, extended=True), "big") >= 2**90
    assert replay_request(5) == SEQ.pack(5)


# ----------------------------------------------------------------- an engine-shaped publisher


class EnginePublisher:
    """A publisher that behaves as vLLM's does (from its documented behaviour): each batch is
    sent live, then kept in a ring; a replay request ``[id, b"", start]`` reads ``start`` with
    ``int.from_bytes`` and gets every ringed batch with seq >= start, then the end marker with
    an empty payload. ``topic_frame`` False: vLLM <= 0.25.1's layout."""

    def __init__(
        self, ctx: Ctx, topic_frame: bool, endpoints: tuple[str, str] | None = None
    ) -> None:
        live, replay = endpoints or (tcp_any(), tcp_any())
        # XPUB sends as vLLM's PUB does; it also shows the test when a subscriber has joined
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(live)
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(replay)
        self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.topic_frame = topic_frame
        self.ring: deque[tuple[int, bytes]] = deque(maxlen=100)
        self.requests: list[bytes] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def wait_subscribed(self, timeout_s: float = 5.0) -> None:
        """Until a subscriber's subscription reached the live socket (a live frame sent before
        would be dropped by ZeroMQ, as by any PUB)."""
        if not self.pub.poll(int(timeout_s * 1000)):
            raise AssertionError("no subscriber joined the live socket in time")
        self.pub.recv()

    def publish(self, seq: int, payload: bytes) -> None:
        self.pub.send_multipart([b"", SEQ.pack(seq), payload])
        with self._lock:
            self.ring.append((seq, payload))

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(20):
                continue
            frames = self.router.recv_multipart()
            if len(frames) != 3:
                continue
            ident, _, body = frames
            self.requests.append(body)
            start = int.from_bytes(body, "big")
            with self._lock:
                items = [(s, p) for s, p in self.ring if s >= start]
            for s, p in items:
                head = [ident, b"", b""] if self.topic_frame else [ident, b""]
                self.router.send_multipart([*head, SEQ.pack(s), p])
            end = [ident, b"", b"", END, b""] if self.topic_frame else [ident, b"", END, b""]
            self.router.send_multipart(end)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.pub.close(0)
        self.router.close(0)


@pytest.mark.parametrize("topic_frame", [True, False])
def test_joining_an_idle_engine_gets_its_history_at_once(ctx: Ctx, topic_frame: bool) -> None:
    engine = EnginePublisher(ctx, topic_frame)
    try:
        for i in range(3):  # published before anyone listened; the engine is idle since
            engine.publish(i, encode_batch([stored(i, 10 + i)], float(i)))
        model = StateModel()
        # a generous replay timeout: a join retried under load would ask twice
        with ZmqEventSubscriber(context=ctx, replay_timeout_ms=5000) as sub:
            sub.add_worker(0, engine.endpoint, engine.replay_endpoint)
            # the replay ends with the end marker, read after the last replayed batch
            poll_until(
                sub,
                model,
                lambda: sub.status(0).last_seq == 2 and not sub.status(0).replaying,
            )
            status = sub.status(0)
            assert status.state == "ok"
            assert model.blocks[0] == {10, 11, 12}
            assert status.recovered == 3 and status.resyncs == 0
            # a live batch continues the replayed history
            engine.wait_subscribed()
            engine.publish(3, encode_batch([stored(3, 13)], 3.0))
            poll_until(sub, model, lambda: sub.status(0).last_seq == 3)
            assert model.blocks[0] == {10, 11, 12, 13}
        # the engine got an extended request first (answered by its end marker alone), then
        # the plain one it replays from
        assert engine.requests[:2] == [replay_request(0, extended=True), SEQ.pack(0)]
    finally:
        engine.close()


def test_joining_this_projects_idle_publisher_gets_history_and_incarnation(ctx: Ctx) -> None:
    with ZmqEventPublisher(tcp_any(), tcp_any(), context=ctx) as pub:
        assert pub.replay_endpoint is not None
        for i in range(3):
            pub.publish([stored(i, 10 + i)])
        assert pub.flush(5)
        model = StateModel()
        # no probe and no retried join within the test, however slow the machine
        with ZmqEventSubscriber(
            context=ctx, replay_timeout_ms=5000, probe_interval_ms=60000
        ) as sub:
            sub.add_worker(0, pub.endpoint, pub.replay_endpoint)
            # the incarnation comes with the end marker, after the last replayed batch
            poll_until(
                sub,
                model,
                lambda: sub.status(0).last_seq == 2 and not sub.status(0).replaying,
            )
            status = sub.status(0)
            assert status.state == "ok" and status.incarnation == pub.incarnation
            assert model.blocks[0] == {10, 11, 12}
        assert pub.stats.replay_requests == 1  # one extended request did it all


def test_an_engine_that_comes_up_after_the_join_is_asked_again(ctx: Ctx) -> None:
    """The router may start before its engines (still loading their models): an unanswered
    join is asked again, waiting longer each time, until the engine's replay answers."""
    live = f"tcp://127.0.0.1:{free_tcp_port()}"
    replay = f"tcp://127.0.0.1:{free_tcp_port()}"
    model = StateModel()
    with ZmqEventSubscriber(context=ctx, replay_timeout_ms=100) as sub:
        sub.add_worker(0, live, replay)
        assert sub.status(0).replaying
        poll_until(sub, model, lambda: not sub.status(0).replaying)  # the join timed out
        assert sub.status(0).resyncs == 0  # nothing was known, so nothing was lost
        engine = EnginePublisher(ctx, topic_frame=True, endpoints=(live, replay))
        try:
            for i in range(2):
                engine.publish(i, encode_batch([stored(i, 20 + i)], float(i)))
            poll_until(sub, model, lambda: sub.status(0).last_seq == 1)
            assert model.blocks[0] == {20, 21} and sub.status(0).state == "ok"
        finally:
            engine.close()


def test_an_engine_that_published_nothing_is_exact_after_the_join(ctx: Ctx) -> None:
    """An empty ring (an engine keeps its newest batches, forgetting only past its size) is
    an empty history: the worker is "ok" at once, not waiting for a first batch."""
    from router_sim.service.core import _state

    engine = EnginePublisher(ctx, topic_frame=True)
    try:
        with ZmqEventSubscriber(context=ctx, replay_timeout_ms=5000) as sub:
            sub.add_worker(0, engine.endpoint, engine.replay_endpoint)
            model = StateModel()
            assert sub.status(0).replaying
            assert _state(True, sub.status(0).state, sub.status(0).last_seq) == "waiting"
            poll_until(sub, model, lambda: not sub.status(0).replaying)
            status = sub.status(0)
            assert status.state == "ok" and status.last_seq is None
            assert _state(True, status.state, status.last_seq) == "ok"
            engine.wait_subscribed()
            engine.publish(0, encode_batch([stored(0, 30)], 0.0))
            poll_until(sub, model, lambda: sub.status(0).last_seq == 0)
            assert model.blocks[0] == {30} and sub.status(0).state == "ok"
    finally:
        engine.close()
    assert _state(True, "degraded", None) == "waiting" and _state(False, "ok", 3) == "down"

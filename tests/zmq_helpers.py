"""Shared pieces of the ZeroMQ tests: a context that must terminate, a fake publisher whose
frames and replay answers the test controls, event builders and a tiny state model."""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator

import zmq

from events.stream.subscriber import (
    BatchDelivery,
    ResyncRequired,
    SubscriberMessage,
    ZmqEventSubscriber,
)
from events.wire.codec import encode_batch
from events.wire.model import (
    AllBlocksCleared,
    KVCacheEvent,
    Removed,
    Stored,
    StoredBlock,
)

SEQ = struct.Struct(">Q")
END = b"\xff" * 8
#: every blocking step in these tests gives up after this long
DEADLINE_S = 5.0


def zmq_context() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    """A fresh context; after the test it must terminate within the deadline, which only
    happens when every socket created in it was closed (a leaked socket blocks term())."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield ctx
    done = threading.Thread(target=ctx.term, daemon=True)
    done.start()
    done.join(DEADLINE_S)
    if done.is_alive():
        raise AssertionError("zmq context did not terminate: a socket was left open")


def tcp_any() -> str:
    """An endpoint that binds an ephemeral port on the loopback interface."""
    return "tcp://127.0.0.1:*"


def stored(event_id: int, *hashes: int, parent: int | None = None) -> KVCacheEvent:
    """A Stored event chaining ``hashes`` (4 tokens each, derived from the hash)."""
    blocks = [StoredBlock(h, [h % 1000, 1, 2, 3]) for h in hashes]
    return KVCacheEvent(event_id, Stored(parent, blocks, block_size=4))


def removed(event_id: int, *hashes: int) -> KVCacheEvent:
    return KVCacheEvent(event_id, Removed(list(hashes)))


def cleared(event_id: int) -> KVCacheEvent:
    return KVCacheEvent(event_id, AllBlocksCleared())


def payload(events: Iterable[KVCacheEvent], ts: float = 1.0) -> bytes:
    return encode_batch(list(events), ts)


class StateModel:
    """The set of block hashes a consumer believes each worker holds."""

    def __init__(self) -> None:
        self.blocks: dict[int, set[int | str]] = {}
        self.seqs: dict[int, list[int]] = {}
        self.resyncs: dict[int, list[str]] = {}

    def apply_events(self, worker: int, events: Iterable[KVCacheEvent]) -> None:
        held = self.blocks.setdefault(worker, set())
        for event in events:
            data = event.data
            if isinstance(data, Stored):
                held.update(b.block_hash for b in data.blocks)
            elif isinstance(data, Removed):
                held.difference_update(data.block_hashes)
            elif isinstance(data, AllBlocksCleared):
                held.clear()

    def apply(self, messages: Iterable[SubscriberMessage]) -> None:
        for m in messages:
            if isinstance(m, ResyncRequired):
                self.blocks[m.worker] = set()
                self.resyncs.setdefault(m.worker, []).append(m.reason)
            else:
                assert isinstance(m, BatchDelivery)
                self.seqs.setdefault(m.worker, []).append(m.seq)
                self.apply_events(m.worker, m.batch.events)


def poll_until(
    sub: ZmqEventSubscriber,
    model: StateModel,
    done: Callable[[], bool],
    timeout_s: float = DEADLINE_S,
) -> None:
    """Poll ``sub`` into ``model`` until ``done()``; fail at the deadline."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached before the deadline")
        model.apply(sub.poll(20))


def wait_until(done: Callable[[], bool], timeout_s: float = DEADLINE_S) -> None:
    """Poll a condition another thread makes true (short waits between checks)."""
    deadline = time.monotonic() + timeout_s
    wake = threading.Event()
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached before the deadline")
        wake.wait(0.005)


class FakePublisher:
    """An XPUB and a ROUTER the test drives frame by frame: injects duplicates, reordering,
    garbage, and answers (or ignores) replay requests on request."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], transport: str = "inproc") -> None:
        self.pub = ctx.socket(zmq.XPUB)
        self.router = ctx.socket(zmq.ROUTER)
        for s in (self.pub, self.router):
            s.setsockopt(zmq.LINGER, 0)
            if transport == "inproc":
                s.bind(f"inproc://fake-{id(self)}-{s.type}")
            else:
                s.bind(tcp_any())
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.extended = False

    def wait_subscribed(self) -> None:
        if not self.pub.poll(int(DEADLINE_S * 1000)):
            raise AssertionError("no subscription reached the fake publisher")
        assert self.pub.recv()[0] == 1

    def send(self, seq: int, body: bytes, topic: bytes = b"") -> None:
        self.pub.send_multipart([topic, SEQ.pack(seq), body])

    def next_request(self) -> tuple[bytes, int]:
        """The next replay request: (client identity, start seq); ``extended`` then says
        whether it came in this project's extended form (``kvx1`` + start)."""
        if not self.router.poll(int(DEADLINE_S * 1000)):
            raise AssertionError("no replay request arrived")
        ident, empty, start = self.router.recv_multipart()
        self.extended = len(start) == 12 and start[:4] == b"kvx1"
        if self.extended:
            start = start[4:]
        assert empty == b"" and len(start) == 8
        return ident, SEQ.unpack(start)[0]

    def answer(self, ident: bytes, batches: Iterable[tuple[int, bytes]]) -> None:
        for seq, body in batches:
            self.router.send_multipart([ident, b"", b"", SEQ.pack(seq), body])
        self.router.send_multipart([ident, b"", b"", END, b""])

    def close(self) -> None:
        self.pub.close(linger=0)
        self.router.close(linger=0)


def free_tcp_port() -> int:
    """A port on 127.0.0.1 that nothing listens on right now (for a peer that must connect to
    a fixed address; another process could take it in between, which tests accept)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port

"""Raw listening for ``kv-events``: SUB sockets per worker, gap filling over replay sockets.

Unlike :class:`events.subscriber.ZmqEventSubscriber`, which hands an application decoded,
ordered batches, the listener hands its callback the raw frames exactly as they arrived
(malformed ones included), so ``listen --record`` captures what was on the wire and the doctor
judges it. A gap (or a stream first seen above seq 0) is filled from the publisher's replay
socket (WIRE.md 5) when one is given; replayed messages are marked as such.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import zmq

from events.endpoints import EndpointError, connectable, should_bind
from events.publisher import END_SEQ

OnMessage = Callable[[int, list[bytes], bool], None]
"""Called with (worker index, frames, replayed) for every received message."""


def listen(
    endpoints: Sequence[str],
    on_message: OnMessage,
    *,
    replay_endpoints: Sequence[str] = (),
    topic: str = "",
    count: int | None = None,
    timeout_s: float | None = None,
    bind: bool = False,
    replay_timeout_s: float = 1.0,
) -> int:
    """Receive messages from one SUB socket per endpoint until ``count`` live messages arrived
    or ``timeout_s`` passed; returns the number of live messages. With replay endpoints, a gap
    (or a stream first seen above seq 0) is filled from the publisher's replay socket.
    Raises :class:`~events.endpoints.EndpointError` for an endpoint ZeroMQ cannot attach to."""
    for endpoint in replay_endpoints:
        should_bind(endpoint)  # refuse a bad replay endpoint now, not at the first gap
    ctx = zmq.Context()
    socks: list[zmq.Socket[bytes]] = []
    try:
        poller = zmq.Poller()
        for endpoint in endpoints:
            sock = ctx.socket(zmq.SUB)
            socks.append(sock)  # before anything can fail: an open socket blocks ctx.term()
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
            try:
                if bind:
                    sock.bind(endpoint)
                else:
                    sock.connect(connectable(endpoint))
            except zmq.ZMQError as exc:
                verb = "bind" if bind else "connect to"
                raise EndpointError(
                    f"cannot {verb} {endpoint}: {exc}; write tcp://HOST:PORT, ipc://PATH or "
                    "inproc://NAME"
                ) from exc
            poller.register(sock, zmq.POLLIN)
        last: dict[int, int] = {}
        received = 0
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while count is None or received < count:
            wait_ms = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1e3))
            ready = dict(poller.poll(wait_ms))
            if not ready:
                break
            for worker, sock in enumerate(socks):
                if sock not in ready:
                    continue
                frames = sock.recv_multipart()
                seq = int.from_bytes(frames[1], "big") if len(frames) == 3 else None
                prev = last.get(worker)
                want_from = None
                if seq is not None and worker < len(replay_endpoints):
                    if prev is None and seq > 0:
                        want_from = 0
                    elif prev is not None and seq > prev + 1:
                        want_from = prev + 1
                if want_from is not None:
                    for replayed in _replay(
                        ctx, replay_endpoints[worker], want_from, seq or 0, replay_timeout_s
                    ):
                        on_message(worker, replayed, True)
                if seq is not None:
                    last[worker] = seq
                on_message(worker, frames, False)
                received += 1
                if count is not None and received >= count:
                    break
        return received
    finally:
        for sock in socks:
            sock.close(linger=0)
        ctx.term()


def _replay(
    ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, start: int, stop: int, timeout_s: float
) -> list[list[bytes]]:
    """Ask a replay socket for batches ``start..stop-1`` (WIRE.md 5); returns their frames
    ``[topic, seq, payload]``. A silent or broken replay socket gives what arrived in time."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    got: list[list[bytes]] = []
    try:
        try:
            dealer.connect(connectable(endpoint))
        except zmq.ZMQError as exc:
            raise EndpointError(f"cannot connect to replay endpoint {endpoint}: {exc}") from exc
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        deadline = time.monotonic() + timeout_s
        while True:
            left_ms = int((deadline - time.monotonic()) * 1e3)
            if left_ms <= 0 or not dealer.poll(left_ms):
                break
            frames = dealer.recv_multipart()
            if len(frames) == 4 and frames[2] == END_SEQ:
                break
            if len(frames) == 4 and len(frames[2]) == 8 and int.from_bytes(frames[2], "big") < stop:
                got.append(frames[1:])
    finally:
        dealer.close(linger=0)
    return got

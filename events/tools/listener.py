"""Raw listening for ``kv-events``: SUB sockets per worker, gap filling over replay sockets.

Unlike :class:`events.stream.subscriber.ZmqEventSubscriber`, which hands an application decoded,
ordered batches, the listener hands its callback the raw frames (malformed ones included), so
``listen --record`` captures what was on the wire and the doctor judges it. The order of
well-formed frames, the gap filling and the replay deadlines come from the same
:class:`~events.stream.sequencer.StreamSequencer` the subscriber uses: a gap (or a stream first seen
above seq 0) is filled from the publisher's replay socket (WIRE.md 5, every engine's reply
layout) when one is given, replayed messages are marked as such and come before the live frame
that revealed the gap. Frames still held back when listening ends are handed over as they are.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final

import zmq
from zmq.utils.monitor import recv_monitor_message

from events.stream.endpoints import EndpointError, connectable, should_bind
from events.stream.publisher import END_SEQ
from events.stream.security import (
    DEFAULT_MAX_MESSAGE_BYTES,
    CurveClient,
    limit_inbound,
    secure_client,
)
from events.stream.sequencer import Abandon, Deliver, Output, Request, StreamSequencer
from events.stream.snapshot import parse_info, replay_request

OnMessage = Callable[[int, list[bytes], bool], None]
"""Called with (worker index, frames, replayed) for every received message."""


def _raw(payload: bytes) -> bytes:
    return payload


@dataclass(slots=True)
class _Stream:
    worker: int
    seq: StreamSequencer[bytes]
    replay_endpoint: str | None
    dealer: zmq.Socket[bytes] | None = None
    topic: bytes = b""
    topics: dict[int, bytes] = field(default_factory=dict)  # replayed seq -> its topic frame


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
    curve: CurveClient | None = None,
    max_message_bytes: int | None = DEFAULT_MAX_MESSAGE_BYTES,
) -> int:
    """Receive messages from one SUB socket per endpoint until ``count`` live messages arrived
    or ``timeout_s`` passed; returns the number of live messages. With replay endpoints, a gap
    (or a stream first seen above seq 0) is filled from the publisher's replay socket.
    Raises :class:`~events.stream.endpoints.EndpointError` for an endpoint ZeroMQ cannot attach to.
    ``curve`` and ``max_message_bytes``: as for
    :class:`~events.stream.subscriber.ZmqEventSubscriber`
    (an endpoint that sent a message over the cap is redialled, as the subscriber does)."""

    def secure(sock: zmq.Socket[bytes]) -> None:
        if curve is not None:
            secure_client(sock, curve)
        limit_inbound(sock, max_message_bytes)

    for endpoint in replay_endpoints:
        should_bind(endpoint)  # refuse a bad replay endpoint now, not at the first gap
    ctx = zmq.Context()
    socks: list[zmq.Socket[bytes]] = []
    streams: list[_Stream] = []
    try:
        poller = zmq.Poller()
        owners: dict[zmq.Socket[bytes], tuple[_Stream, bool]] = {}
        monitors: dict[zmq.Socket[bytes], _Dial] = {}
        for worker, endpoint in enumerate(endpoints):
            sock = ctx.socket(zmq.SUB)
            socks.append(sock)  # before anything can fail: an open socket blocks ctx.term()
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
            secure(sock)
            try:
                if bind:
                    sock.bind(endpoint)
                else:
                    if not endpoint.startswith("inproc://"):  # watched from the first handshake
                        dial = _Dial(sock, connectable(endpoint))
                        monitors[dial.monitor] = dial
                        poller.register(dial.monitor, zmq.POLLIN)
                    sock.connect(connectable(endpoint))
            except zmq.ZMQError as exc:
                verb = "bind" if bind else "connect to"
                raise EndpointError(
                    f"cannot {verb} {endpoint}: {exc}; write tcp://HOST:PORT, ipc://PATH or "
                    "inproc://NAME"
                ) from exc
            replay = replay_endpoints[worker] if worker < len(replay_endpoints) else None
            stream = _Stream(
                worker,
                StreamSequencer(_raw, replay=replay is not None, replay_timeout_s=replay_timeout_s),
                replay,
            )
            streams.append(stream)
            poller.register(sock, zmq.POLLIN)
            owners[sock] = (stream, False)

        def run(stream: _Stream, outputs: list[Output[bytes]]) -> None:
            for o in outputs:
                if isinstance(o, Deliver):
                    t = stream.topics.pop(o.seq, stream.topic) if o.replayed else stream.topic
                    on_message(stream.worker, [t, o.seq.to_bytes(8, "big"), o.item], o.replayed)
                elif isinstance(o, Request):
                    if stream.dealer is None:
                        stream.dealer = _dealer(ctx, stream.replay_endpoint, secure)
                        socks.append(stream.dealer)
                        poller.register(stream.dealer, zmq.POLLIN)
                        owners[stream.dealer] = (stream, True)
                    body = replay_request(o.start, extended=o.extended)
                    stream.dealer.send_multipart([b"", body])
                elif isinstance(o, Abandon) and stream.dealer is not None:
                    poller.unregister(stream.dealer)
                    owners.pop(stream.dealer)
                    stream.dealer.close(linger=0)
                    socks.remove(stream.dealer)
                    stream.dealer = None

        received = 0
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            busy = [s for s in streams if s.seq.mode != "live"]
            if count is not None and received >= count and not busy:
                break
            now = time.monotonic()
            wake = [s.seq.deadline for s in busy if s.seq.deadline is not None]
            wake += [d.dropped_at + _REDIAL_AFTER_S for d in monitors.values() if d.dropped_at]
            until = min([*wake, *([deadline] if deadline is not None else [])], default=None)
            wait_ms = None if until is None else max(0, int((until - now) * 1e3))
            for dial in monitors.values():
                dial.redial()  # before polling: see _Dial
            ready = dict(poller.poll(wait_ms))
            now = time.monotonic()
            if not ready and deadline is not None and now >= deadline:
                break
            for sock in list(ready):
                if sock in monitors:
                    monitors[sock].read()
                    continue
                owner = owners.get(sock)
                if owner is None:
                    continue
                stream, is_replay = owner
                if is_replay:
                    _read_replay(stream, sock, now, run)
                    continue
                frames = sock.recv_multipart()
                received += 1
                if count is not None and received >= count:
                    for live in socks[: len(endpoints)]:
                        with contextlib.suppress(KeyError):
                            poller.unregister(live)  # only replays are finished from here
                if len(frames) != 3 or len(frames[1]) != 8:
                    on_message(stream.worker, frames, False)  # for the doctor to judge
                else:
                    stream.topic = frames[0]
                    run(stream, stream.seq.live(int.from_bytes(frames[1], "big"), frames[2], now))
            for stream in streams:
                if stream.seq.deadline is not None and now >= stream.seq.deadline:
                    run(stream, stream.seq.tick(now))
        for stream in streams:  # frames still waiting for a gap that never filled
            for seq, payload in stream.seq.drain_held():
                on_message(stream.worker, [stream.topic, seq.to_bytes(8, "big"), payload], False)
        return received
    finally:
        for dial in monitors.values():  # stop the events before closing their socket
            with contextlib.suppress(zmq.ZMQError):
                dial.sock.disable_monitor()
            dial.monitor.close(linger=0)
        for sock in socks:
            sock.close(linger=0)
        ctx.term()


#: a dropped SUB that ZeroMQ has not started redialling by then is redialled here
_REDIAL_AFTER_S: Final = 0.2


class _Dial:
    """Redials a connecting SUB that ZeroMQ dropped for a protocol error (a message over
    ``max_message_bytes`` is one): ZeroMQ redials after a lost connection (CONNECT_RETRIED
    follows the drop at once), never after that.
    The redial waits for the point just before the next poll: a poll may have taken the first
    frame of a message off the SUB, and cutting its pipe before the rest is read aborts libzmq
    (``!_more`` in fq.cpp)."""

    def __init__(self, sock: zmq.Socket[bytes], endpoint: str) -> None:
        self.sock = sock
        self.endpoint = endpoint
        self.up = False
        self.dropped_at: float | None = None
        events = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED
        self.monitor: zmq.Socket[bytes] = sock.get_monitor_socket(events)

    def read(self) -> None:
        with contextlib.suppress(zmq.Again):
            while True:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)["event"]
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self.up = True
                elif event == zmq.EVENT_CONNECT_RETRIED:
                    self.dropped_at = None  # ZeroMQ redials this one itself
                elif self.up:  # dropped after a handshake (a failed handshake is not retried)
                    self.up = False
                    self.dropped_at = time.monotonic()

    def redial(self) -> None:
        if self.dropped_at is not None and time.monotonic() - self.dropped_at >= _REDIAL_AFTER_S:
            self.dropped_at = None
            with contextlib.suppress(zmq.ZMQError):
                self.sock.disconnect(self.endpoint)
                self.sock.connect(self.endpoint)


def _dealer(
    ctx: zmq.Context[zmq.Socket[bytes]],
    endpoint: str | None,
    secure: Callable[[zmq.Socket[bytes]], None],
) -> zmq.Socket[bytes]:
    assert endpoint is not None
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        secure(dealer)
        dealer.connect(connectable(endpoint))
    except zmq.ZMQError as exc:
        dealer.close(linger=0)
        raise EndpointError(f"cannot connect to replay endpoint {endpoint}: {exc}") from exc
    return dealer


def _read_replay(
    stream: _Stream,
    sock: zmq.Socket[bytes],
    now: float,
    run: Callable[[_Stream, list[Output[bytes]]], None],
) -> None:
    """Replies in either layout: ``[b"", topic, seq, payload]`` or, from vLLM <= 0.25.1,
    ``[b"", seq, payload]``; each replay ends with the end marker (seq ff*8)."""
    with contextlib.suppress(zmq.Again):
        while stream.dealer is sock:
            frames = sock.recv_multipart(zmq.NOBLOCK)
            n = len(frames)
            if n not in (3, 4) or frames[0] != b"" or len(frames[n - 2]) != 8:
                stream.seq.malformed()
                continue
            seq_b, body = frames[n - 2], frames[n - 1]
            if seq_b == END_SEQ:
                run(stream, stream.seq.replay_end(parse_info(body), now))
                continue
            seq = int.from_bytes(seq_b, "big")
            stream.topics[seq] = frames[1] if n == 4 else stream.topic
            run(stream, stream.seq.replayed_frame(seq, body, now))

"""ZeroMQ subscriber of KV cache event batches that survives loss (WIRE.md sections 4-5, 7).

A thin socket shell around :class:`events.stream.sequencer.StreamSequencer`, which decides
everything
about order, loss, restarts and snapshots (read its docstring for the rules). Per worker: one
SUB socket (frames do not say which worker sent them, and topics may be equal), and one DEALER
that connects to the worker's replay endpoint when it has one (engines always bind theirs).
All socket work happens inside :meth:`ZmqEventSubscriber.poll` on the caller's thread: no
background thread, so a simulator that drives it stays deterministic.

Per worker the subscriber hands out, in seq order, ``BatchDelivery(worker, seq, batch)`` and,
when the view must be dropped, ``ResyncRequired(worker, reason)``: the caller drops everything it
knows about that worker; deliveries after it rebuild what they can. Against this project's
publishers a lost range is then repaired by a snapshot: ``ResyncRequired`` is followed by the
snapshot's deliveries (``BatchDelivery.snapshot`` True), after which the view is exact.

Replay replies are read in every layout engines use: ``[b"", topic, seq, payload]`` (vLLM >=
0.26, SGLang, this project) and ``[b"", seq, payload]`` (vLLM <= 0.25.1), each ending with the
end marker (seq ``ff``*8). This project's publishers add their incarnation and snapshot support
in the end marker's last frame, only in reply to this project's own requests (the hello, the
extended replay request: :mod:`events.stream.snapshot`); engines answer those with their end
marker alone, and are then asked in their own form.

No blind start: a worker with a replay endpoint is asked for its history from seq 0 as soon as
it is added, so an idle engine's state is known before its next batch (the worker is
``replaying`` meanwhile).

Call ``poll()`` regularly: deadlines and probes are checked there, and ZeroMQ completes a SUB's
resubscription after a reconnect only while the socket is being used. The subscriber is not
thread-safe: use it from one thread.

State: a worker is ``"ok"`` when its delivered history is provably complete (see the
sequencer); otherwise ``"degraded"``: the caller's view then holds no stale blocks (it dropped
them) but may miss blocks stored during a lost range.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import Final, Literal, TypeAlias

import zmq
from zmq.utils.monitor import recv_monitor_message

from events.stream.endpoints import EndpointError, connectable
from events.stream.publisher import END_SEQ, SEQ
from events.stream.security import (
    DEFAULT_MAX_MESSAGE_BYTES,
    CurveClient,
    limit_inbound,
    secure_client,
)
from events.stream.sequencer import (
    Abandon,
    Deliver,
    Lost,
    Output,
    Request,
    RequestSnapshot,
    Reset,
    StreamSequencer,
)
from events.stream.snapshot import (
    SNAPSHOT_TAG,
    SnapshotAssembler,
    SnapshotError,
    parse_info,
    replay_request,
)
from events.wire.codec import DecodeLimits, decode_batch
from events.wire.model import AllBlocksCleared, DecodedBatch

log = logging.getLogger(__name__)

#: messages read from one socket before other sockets and the caller get a turn
_READ_BURST: Final = 64
_MONITOR_EVENTS: Final = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED
)
#: a dropped SUB that ZeroMQ has not started redialling by then is redialled here
_REDIAL_AFTER_S: Final = 0.2


@dataclass(frozen=True, slots=True)
class BatchDelivery:
    """One decoded batch of ``worker``, delivered in seq order. ``snapshot``: a part of a
    snapshot that replaces the view dropped by the ``ResyncRequired`` just before it."""

    worker: int
    seq: int
    batch: DecodedBatch
    snapshot: bool = False


@dataclass(frozen=True, slots=True)
class ResyncRequired:
    """Drop ``worker``'s state; later deliveries rebuild it (a snapshot's, exactly)."""

    worker: int
    reason: str


SubscriberMessage: TypeAlias = BatchDelivery | ResyncRequired


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    """Snapshot of one worker's stream (see the module docstring for ``state``)."""

    worker: int
    state: Literal["ok", "degraded"]
    last_seq: int | None
    replaying: bool
    connected: bool
    received: int
    gaps: int
    replayed: int
    duplicates: int
    restarts: int
    resyncs: int
    decode_errors: int
    snapshots: int = 0
    incarnation: int | None = None
    recovered: int = 0
    """Batches only a replay delivered (lost live): see ``StreamSequencer.recovered``."""


class SubscriberError(RuntimeError):
    """Misuse of the subscriber (unknown or duplicate worker, use after close)."""


@dataclass(slots=True)
class _Worker:
    worker: int
    endpoint: str
    replay_endpoint: str | None
    bind: bool
    sub: zmq.Socket[bytes]
    seq: StreamSequencer[DecodedBatch]
    dealer: zmq.Socket[bytes] | None = None
    monitor: zmq.Socket[bytes] | None = None
    connected: bool = False
    was_connected: bool = False
    parts: SnapshotAssembler = field(default_factory=SnapshotAssembler)


def _is_clear(batch: DecodedBatch) -> bool:
    return any(isinstance(e.data, AllBlocksCleared) for e in batch.events)


class ZmqEventSubscriber:
    """Receives event batches from many workers' publishers; see the module docstring.

    ``rcvhwm`` bounds the live frames queued per worker while the caller is not polling
    (ZeroMQ drops beyond it; the gap is replayed). ``limits`` bound what one payload may cost
    the decoder. ``replay_timeout_ms``: silence after which a replay is given up;
    ``replay_max_ms``: the most one replay may take, however it trickles. ``probe_interval_ms``:
    quiet time after which the replay endpoint is asked what lies beyond the last seq (None:
    no probes, no hello and no reconnect check: the behaviour of a plain vLLM consumer).
    ``curve``: CURVE client keys and the publisher's public key (:mod:`events.stream.security`);
    ``max_message_bytes``: ZeroMQ drops a peer that sends a bigger message (None: no cap), so
    queued memory per worker is at most ``rcvhwm`` times it. ``join``: ask each worker's replay
    for its history from seq 0 as soon as it is added (False: wait for its next batch).
    """

    def __init__(
        self,
        topic: str | bytes = "",
        replay_timeout_ms: int = 1000,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        limits: DecodeLimits | None = None,
        *,
        rcvhwm: int = 100000,
        replay_max_ms: int = 30000,
        snapshot_timeout_ms: int = 10000,
        probe_interval_ms: int | None = 2000,
        curve: CurveClient | None = None,
        max_message_bytes: int | None = DEFAULT_MAX_MESSAGE_BYTES,
        join: bool = True,
    ) -> None:
        self._join = join
        self._ctx = context if context is not None else zmq.Context.instance()
        self._curve = curve  # events.stream.security: CURVE client on every SUB and DEALER
        self._max_message_bytes = max_message_bytes
        self._dropped: dict[int, float] = {}  # worker -> when its SUB lost its connection
        self._topic = topic.encode() if isinstance(topic, str) else bytes(topic)
        self._replay_timeout_s = replay_timeout_ms / 1000.0
        self._replay_max_s = replay_max_ms / 1000.0
        self._snapshot_timeout_s = snapshot_timeout_ms / 1000.0
        self._probe_s = None if probe_interval_ms is None else probe_interval_ms / 1000.0
        self._limits = limits
        self._rcvhwm = rcvhwm
        self._workers: dict[int, _Worker] = {}
        self._owners: dict[zmq.Socket[bytes], tuple[_Worker, str]] = {}
        self._poller = zmq.Poller()
        self._closed = False

    def _decode(self, payload: bytes) -> DecodedBatch:
        return decode_batch(payload, self._limits)

    # ----------------------------------------------------------------- workers

    def add_worker(
        self,
        worker: int,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        bind: bool = False,
    ) -> None:
        """Subscribe to ``worker``'s publisher at ``endpoint`` (and its replay ROUTER).

        The SUB socket connects, unless ``bind`` is True: use that when the publisher's live
        endpoint is in connect mode (``tcp://host:port``, see :mod:`events.stream.endpoints`). The
        replay DEALER always connects: publishers (engines and this project's) bind it.
        """
        if self._closed:
            raise SubscriberError("subscriber is closed; create a new one")
        if worker in self._workers:
            raise SubscriberError(f"worker {worker} already added; remove_worker() it first")
        seq: StreamSequencer[DecodedBatch] = StreamSequencer(
            self._decode,
            is_clear=_is_clear,
            replay=replay_endpoint is not None,
            replay_timeout_s=self._replay_timeout_s,
            replay_max_s=self._replay_max_s,
            snapshot_timeout_s=self._snapshot_timeout_s,
            probe_interval_s=self._probe_s,
        )
        w = _Worker(worker, endpoint, replay_endpoint, bind, self._ctx.socket(zmq.SUB), seq)
        try:
            w.sub.setsockopt(zmq.LINGER, 0)
            # frames beyond this are dropped by ZeroMQ while the caller does not poll; the gap
            # is then replayed
            w.sub.setsockopt(zmq.RCVHWM, self._rcvhwm)
            w.sub.setsockopt(zmq.SUBSCRIBE, self._topic)
            self._secure(w.sub)
            if endpoint.startswith("inproc://"):
                w.connected = True  # inproc pipes exist as soon as both ends are attached
            else:
                w.monitor = w.sub.get_monitor_socket(_MONITOR_EVENTS)
            _attach(w.sub, endpoint, bind)
            if replay_endpoint is not None:
                w.dealer = self._new_dealer(w)
        except BaseException:
            self._close_worker(w)
            raise
        self._workers[worker] = w
        self._register(w.sub, w, "live")
        if w.monitor is not None:
            self._register(w.monitor, w, "monitor")
        if w.dealer is not None:
            self._register(w.dealer, w, "replay")
        if w.dealer is not None and self._join:
            # no blind start: the history from seq 0 at once (only transport commands come
            # out of a join, nothing to deliver)
            joined: list[SubscriberMessage] = []
            self._run(w, seq.join(time.monotonic()), joined)
            assert not joined

    def remove_worker(self, worker: int) -> None:
        """Stop listening to ``worker`` and forget its state."""
        w = self._workers.pop(worker, None)
        if w is None:
            raise SubscriberError(f"worker {worker} is not subscribed")
        self._close_worker(w)

    @property
    def workers(self) -> list[int]:
        return sorted(self._workers)

    def status(self, worker: int) -> WorkerStatus:
        """The state and counters of ``worker``'s stream."""
        w = self._workers.get(worker)
        if w is None:
            raise SubscriberError(f"worker {worker} is not subscribed")
        q = w.seq
        return WorkerStatus(
            worker=worker,
            state="ok" if q.complete else "degraded",
            last_seq=q.last_seq,
            replaying=q.mode != "live",
            connected=w.connected,
            received=q.received,
            gaps=q.gaps,
            replayed=q.replayed,
            recovered=q.recovered,
            duplicates=q.duplicates,
            restarts=q.restarts,
            resyncs=q.resyncs,
            decode_errors=q.decode_errors,
            snapshots=q.snapshots_applied,
            incarnation=q.incarnation,
        )

    def wait_connected(self, timeout_s: float = 5.0) -> bool:
        """Wait until every worker's live transport has completed its ZeroMQ handshake
        (socket monitor; inproc counts as connected once attached).

        This proves the connection, not that the publisher has processed the subscription yet:
        publishers that must not miss the first batch call ``wait_for_subscribers`` (the XPUB
        handshake). A batch missed anyway is recovered: a worker whose first seq is above 0 is
        replayed from seq 0. Live frames are not consumed here.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            waiting = [w for w in self._workers.values() if not w.connected]
            if not waiting:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            poller = zmq.Poller()
            for w in waiting:
                if w.monitor is not None:
                    poller.register(w.monitor, zmq.POLLIN)
            for sock, _ in poller.poll(max(1, math.ceil(left * 1000))):
                self._read_monitor(self._owners[sock][0], [])

    # ----------------------------------------------------------------- polling

    def poll(self, timeout_ms: int = 0) -> list[SubscriberMessage]:
        """Process whatever arrived and return the resulting messages, in order per worker.

        Waits up to ``timeout_ms`` for at least one message; returns early as soon as there is
        one. Deadlines and probes are checked here, so call it regularly.
        """
        if self._closed:
            raise SubscriberError("subscriber is closed; create a new one")
        out: list[SubscriberMessage] = []
        deadline = time.monotonic() + max(timeout_ms, 0) / 1000.0
        while True:
            self._redial()
            for sock, _ in self._poller.poll(self._wait_ms(deadline, out)):
                owner = self._owners.get(sock)
                if owner is None:
                    continue  # closed earlier in this round (dealer replaced)
                w, kind = owner
                if kind == "live":
                    self._read_live(w, out)
                elif kind == "replay":
                    self._read_replay(w, sock, out)
                else:
                    self._read_monitor(w, out)
            now = time.monotonic()
            for w in list(self._workers.values()):
                wake = w.seq.deadline
                if wake is not None and now >= wake:
                    self._run(w, w.seq.tick(now), out)
            if out or time.monotonic() >= deadline:
                return out

    def _wait_ms(self, deadline: float, out: list[SubscriberMessage]) -> int:
        if out:
            return 0
        until = deadline
        for w in self._workers.values():
            wake = w.seq.deadline
            if wake is not None:
                until = min(until, wake)
        for dropped in self._dropped.values():  # a redial is due then (see _redial)
            until = min(until, dropped + _REDIAL_AFTER_S)
        return max(0, math.ceil((until - time.monotonic()) * 1000))

    def close(self) -> None:
        """Close every socket (linger 0). Idempotent."""
        if self._closed:
            return
        self._closed = True
        for w in list(self._workers.values()):
            self._close_worker(w)
        self._workers.clear()

    def __enter__(self) -> ZmqEventSubscriber:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ----------------------------------------------------------------- socket reading

    def _read_live(
        self, w: _Worker, out: list[SubscriberMessage], burst: int = _READ_BURST
    ) -> None:
        with contextlib.suppress(zmq.Again):
            for _ in range(burst):
                frames = w.sub.recv_multipart(zmq.NOBLOCK)
                if len(frames) != 3 or len(frames[1]) != 8:
                    w.seq.decode_errors += 1
                    log.warning(
                        "worker %d: ignored a live message of %d frames; expected "
                        "[topic, seq (8 bytes), payload]",
                        w.worker,
                        len(frames),
                    )
                    continue
                self._run(w, w.seq.live(SEQ.unpack(frames[1])[0], frames[2], time.monotonic()), out)
                if self._workers.get(w.worker) is not w:
                    return

    def _read_replay(
        self, w: _Worker, sock: zmq.Socket[bytes], out: list[SubscriberMessage]
    ) -> None:
        with contextlib.suppress(zmq.Again):
            for _ in range(_READ_BURST):
                if w.dealer is not sock:
                    return  # the dealer was replaced: replies to an abandoned request
                frames = sock.recv_multipart(zmq.NOBLOCK)
                # the live frames already queued come first (at most the socket's high-water
                # mark): a reply that finds the ring moved on must not call lost what the live
                # socket holds, nor ask again for it
                self._read_live(w, out, self._rcvhwm or _READ_BURST * 1024)
                if self._workers.get(w.worker) is not w or w.dealer is not sock:
                    return
                self._on_replay(w, frames, out)

    def _on_replay(self, w: _Worker, frames: list[bytes], out: list[SubscriberMessage]) -> None:
        """One reply on the replay socket, in any layout of WIRE.md 5 and 7."""
        now = time.monotonic()
        n = len(frames)
        if n == 4 and frames[0] == b"" and frames[1] == SNAPSHOT_TAG and len(frames[2]) != 8:
            try:
                snap = w.parts.add(frames[2], frames[3])
            except SnapshotError as exc:
                w.seq.malformed()
                log.warning("worker %d: ignored a malformed snapshot reply: %s", w.worker, exc)
                return
            if snap is not None:
                self._run(w, w.seq.snapshot(snap, now), out)
            return
        if n in (3, 4) and frames[0] == b"" and len(frames[n - 2]) == 8:
            seq_b, body = frames[n - 2], frames[n - 1]
            if seq_b == END_SEQ:
                self._run(w, w.seq.replay_end(parse_info(body), now), out)
            else:
                self._run(w, w.seq.replayed_frame(SEQ.unpack(seq_b)[0], body, now), out)
            return
        w.seq.malformed()
        log.warning("worker %d: ignored a malformed replay message (%d frames)", w.worker, n)

    def _read_monitor(self, w: _Worker, out: list[SubscriberMessage]) -> None:
        if w.monitor is None:
            return
        with contextlib.suppress(zmq.Again):
            while True:
                event = recv_monitor_message(w.monitor, zmq.NOBLOCK)
                kind = event["event"]
                up = kind == zmq.EVENT_HANDSHAKE_SUCCEEDED
                # ZeroMQ redials a lost connection (CONNECT_RETRIED follows the drop at once),
                # never one it dropped for a protocol error (a message over
                # max_message_bytes is one): that worker would go silent for good
                if kind == zmq.EVENT_DISCONNECTED and w.connected and not w.bind:
                    self._dropped[w.worker] = time.monotonic()
                elif kind == zmq.EVENT_CONNECT_RETRIED:
                    self._dropped.pop(w.worker, None)
                if up and not w.connected and w.was_connected:
                    # maybe a restarted publisher that kept its address: ask it
                    self._run(w, w.seq.reconnected(time.monotonic()), out)
                w.connected = up
                w.was_connected = w.was_connected or up

    # ----------------------------------------------------------------- sequencer outputs

    def _run(
        self, w: _Worker, outputs: list[Output[DecodedBatch]], out: list[SubscriberMessage]
    ) -> None:
        for o in outputs:
            if isinstance(o, Deliver):
                out.append(BatchDelivery(w.worker, o.seq, o.item, o.snapshot))
            elif isinstance(o, (Lost, Reset)):
                if isinstance(o, Lost):
                    log.warning("worker %d: resync required: %s", w.worker, o.reason)
                out.append(ResyncRequired(w.worker, o.reason))
            elif isinstance(o, Request):
                self._send(w, (b"", replay_request(o.start, extended=o.extended)))
            elif isinstance(o, RequestSnapshot):
                w.parts.reset()
                self._send(w, (b"", SNAPSHOT_TAG))
            else:
                assert isinstance(o, Abandon)
                self._abandon(w)

    def _send(self, w: _Worker, frames: tuple[bytes, bytes]) -> None:
        if w.dealer is None:
            return
        try:
            w.dealer.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            # no replay peer connected yet: the request times out like an unanswered one
            log.warning("worker %d: replay request not sent: no replay peer", w.worker)

    # ----------------------------------------------------------------- sockets

    def _new_dealer(self, w: _Worker) -> zmq.Socket[bytes]:
        assert w.replay_endpoint is not None
        dealer = self._ctx.socket(zmq.DEALER)
        try:
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.RCVHWM, 0)  # a replay is bounded by the publisher's ring
            # an engine's replay endpoint may come up after this subscriber: retry soon
            dealer.setsockopt(zmq.RECONNECT_IVL, 50)
            self._secure(dealer)
            _attach(dealer, connectable(w.replay_endpoint), False)
        except BaseException:
            dealer.close(linger=0)
            raise
        return dealer

    def _redial(self) -> None:
        """Reconnect the SUBs ZeroMQ dropped for good. Only here, before polling: a poll may
        have taken the first frame of a message off a SUB, and cutting that pipe before the
        rest is read aborts libzmq (``!_more`` in fq.cpp)."""
        if not self._dropped:
            return
        now = time.monotonic()
        for worker, when in list(self._dropped.items()):
            w = self._workers.get(worker)
            if w is None:
                del self._dropped[worker]
            elif now - when >= _REDIAL_AFTER_S:
                del self._dropped[worker]
                with contextlib.suppress(zmq.ZMQError):
                    w.sub.disconnect(w.endpoint)
                    w.sub.connect(w.endpoint)

    def _secure(self, sock: zmq.Socket[bytes]) -> None:
        """CURVE (when configured) and the inbound size cap, before the socket attaches."""
        if self._curve is not None:
            secure_client(sock, self._curve)
        limit_inbound(sock, self._max_message_bytes)

    def _abandon(self, w: _Worker) -> None:
        """Replies to the request in flight must never be read as replies to a later one: a
        new DEALER (a new identity) makes the publisher's late replies go nowhere."""
        w.parts.reset()
        if w.dealer is None:
            return
        self._unregister(w.dealer)
        w.dealer.close(linger=0)
        w.dealer = self._new_dealer(w)
        self._register(w.dealer, w, "replay")

    def _register(self, sock: zmq.Socket[bytes], w: _Worker, kind: str) -> None:
        self._owners[sock] = (w, kind)
        self._poller.register(sock, zmq.POLLIN)

    def _unregister(self, sock: zmq.Socket[bytes]) -> None:
        self._owners.pop(sock, None)
        self._poller.unregister(sock)

    def _close_worker(self, w: _Worker) -> None:
        for sock in (w.sub, w.dealer, w.monitor):
            if sock is not None and sock in self._owners:
                self._unregister(sock)
        if w.monitor is not None:
            with contextlib.suppress(zmq.ZMQError):
                w.sub.disable_monitor()
            w.monitor.close(linger=0)
        if w.dealer is not None:
            w.dealer.close(linger=0)
        w.sub.close(linger=0)


def _attach(sock: zmq.Socket[bytes], endpoint: str, bind: bool) -> None:
    try:
        if bind:
            sock.bind(endpoint)
        else:
            sock.connect(endpoint)
    except zmq.ZMQError as exc:
        verb = "bind" if bind else "connect"
        raise EndpointError(f"cannot {verb} {endpoint}: {exc}") from exc

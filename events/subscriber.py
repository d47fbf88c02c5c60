"""ZeroMQ subscriber of KV cache event batches that survives loss (WIRE.md sections 4-5).

One SUB socket per worker (frames do not say which worker sent them, and topics may be equal)
plus one DEALER per worker that has a replay endpoint. All socket work happens inside
:meth:`ZmqEventSubscriber.poll` on the caller's thread: no background thread, so a simulator
that drives it stays deterministic.

Per worker the subscriber hands out, in seq order, ``BatchDelivery(worker, seq, batch)`` and,
when part of the history cannot be recovered, ``ResyncRequired(worker, reason)``: the caller
drops everything it knows about that worker; deliveries after it rebuild what they can.

* **gap** (seq above the next expected one): live batches are held back and the missing range
  is replayed from the publisher's ring; replayed batches are applied first, then the held-back
  ones, so an older event never lands after a newer one (a replayed ``Stored(A)`` cannot
  resurrect ``A`` after a live ``Removed(A)``). Duplicates (seq below the next) are dropped.
* **unrecoverable**: the replay starts above the requested seq (the ring forgot it, or the
  batch was dropped before it was ever sent), the replay endpoint stays silent for
  ``replay_timeout_ms``, or there is no replay endpoint -> ``ResyncRequired``, then the stream
  continues from the first seq still available.
* **publisher restart**: a seq below the next one whose payload differs from the one received
  under that seq (when that seq was never received: a seq of 0, or one older than the last
  ``DIGEST_WINDOW`` seqs) -> ``ResyncRequired`` ("publisher restarted") and the new stream is
  replayed from seq 0. A duplicate carries the same bytes as the original, so it is never
  mistaken for a restart. A restart whose first frame seen is already past the old next seq
  cannot be told from a gap on this wire (it has no incarnation id): it is replayed as a gap,
  from the new publisher's ring. A publisher that starts with ``AllBlocksCleared`` as its first
  batch makes every subscriber exact again whatever it detected.
* **new subscriber**: a worker whose first live seq is above 0 replays from seq 0.
* an undecodable payload counts as ``decode_errors`` and as a lost batch: a live one is
  replayed, a replayed one is unrecoverable.

Call ``poll()`` regularly: replay deadlines are checked there, and ZeroMQ completes a SUB's
resubscription after a reconnect only while the socket is being used. The subscriber is not
thread-safe: use it from one thread.

State: a worker is ``"ok"`` when its delivered history is provably complete: every batch since
seq 0 of the current publisher, or since a delivered ``AllBlocksCleared`` (the publisher's state
was then known to be empty). After a ``ResyncRequired`` it is ``"degraded"`` until one of those
holds again; the caller's view of a degraded worker holds no stale blocks (it dropped them) but
may miss blocks stored during the lost range.
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import math
import time
import zlib
from collections import deque
from dataclasses import dataclass, field
from types import TracebackType
from typing import Final, Literal, TypeAlias

import zmq
from zmq.utils.monitor import recv_monitor_message

from events.codec import DecodeError, DecodeLimits, decode_batch
from events.endpoints import EndpointError
from events.model import AllBlocksCleared, DecodedBatch
from events.publisher import END_SEQ, SEQ

log = logging.getLogger(__name__)

#: how many recent (seq, payload digest) pairs a worker keeps to tell duplicates from restarts
DIGEST_WINDOW: Final = 4096
#: messages read from one socket before other sockets and the caller get a turn
_READ_BURST: Final = 64
_MONITOR_EVENTS: Final = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED


@dataclass(frozen=True, slots=True)
class BatchDelivery:
    """One decoded batch of ``worker``, delivered in seq order."""

    worker: int
    seq: int
    batch: DecodedBatch


@dataclass(frozen=True, slots=True)
class ResyncRequired:
    """Part of ``worker``'s history is lost: drop its state; later deliveries rebuild it."""

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


class SubscriberError(RuntimeError):
    """Misuse of the subscriber (unknown or duplicate worker, use after close)."""


@dataclass(slots=True)
class _Worker:
    worker: int
    endpoint: str
    replay_endpoint: str | None
    bind: bool
    sub: zmq.Socket[bytes]
    dealer: zmq.Socket[bytes] | None = None
    monitor: zmq.Socket[bytes] | None = None
    connected: bool = False
    next_seq: int | None = None  # None until the first frame: history unknown
    last_seq: int | None = None
    complete: bool = False
    pending: dict[int, bytes] = field(default_factory=dict)  # held-back live frames
    heap: list[int] = field(default_factory=list)  # seqs of ``pending``, min first
    replay_deadline: float | None = None  # set while a replay is in flight
    replay_progress: bool = False
    abandoned: int = 0  # given-up requests whose replies a bound DEALER must still skip
    digests: dict[int, int] = field(default_factory=dict)
    digest_order: deque[int] = field(default_factory=deque)
    received: int = 0
    gaps: int = 0
    replayed: int = 0
    duplicates: int = 0
    restarts: int = 0
    resyncs: int = 0
    decode_errors: int = 0


class ZmqEventSubscriber:
    """Receives event batches from many workers' publishers; see the module docstring.

    ``rcvhwm`` bounds the live frames queued per worker while the caller is not polling
    (ZeroMQ drops beyond it; the gap is replayed). ``limits`` bound what one payload may cost
    the decoder.
    """

    def __init__(
        self,
        topic: str | bytes = "",
        replay_timeout_ms: int = 1000,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        limits: DecodeLimits | None = None,
        *,
        rcvhwm: int = 100000,
    ) -> None:
        self._ctx = context if context is not None else zmq.Context.instance()
        self._topic = topic.encode() if isinstance(topic, str) else bytes(topic)
        self._replay_timeout_s = replay_timeout_ms / 1000.0
        self._limits = limits
        self._rcvhwm = rcvhwm
        self._workers: dict[int, _Worker] = {}
        self._owners: dict[zmq.Socket[bytes], tuple[_Worker, str]] = {}
        self._poller = zmq.Poller()
        self._closed = False

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

        The subscriber connects, unless ``bind`` is True: use that when the publisher's
        endpoint is in connect mode (``tcp://host:port``, see :mod:`events.endpoints`).
        """
        if self._closed:
            raise SubscriberError("subscriber is closed; create a new one")
        if worker in self._workers:
            raise SubscriberError(f"worker {worker} already added; remove_worker() it first")
        w = _Worker(worker, endpoint, replay_endpoint, bind, self._ctx.socket(zmq.SUB))
        try:
            w.sub.setsockopt(zmq.LINGER, 0)
            # frames beyond this are dropped by ZeroMQ while the caller does not poll; the gap
            # is then replayed
            w.sub.setsockopt(zmq.RCVHWM, self._rcvhwm)
            w.sub.setsockopt(zmq.SUBSCRIBE, self._topic)
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
        return WorkerStatus(
            worker=worker,
            state="ok" if w.complete else "degraded",
            last_seq=w.last_seq,
            replaying=w.replay_deadline is not None,
            connected=w.connected,
            received=w.received,
            gaps=w.gaps,
            replayed=w.replayed,
            duplicates=w.duplicates,
            restarts=w.restarts,
            resyncs=w.resyncs,
            decode_errors=w.decode_errors,
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
                self._read_monitor(self._owners[sock][0])

    # ----------------------------------------------------------------- polling

    def poll(self, timeout_ms: int = 0) -> list[SubscriberMessage]:
        """Process whatever arrived and return the resulting messages, in order per worker.

        Waits up to ``timeout_ms`` for at least one message; returns early as soon as there is
        one. Replay deadlines are checked here, so call it regularly while replays are pending.
        """
        if self._closed:
            raise SubscriberError("subscriber is closed; create a new one")
        out: list[SubscriberMessage] = []
        deadline = time.monotonic() + max(timeout_ms, 0) / 1000.0
        while True:
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
                    self._read_monitor(w)
            self._expire_replays(out)
            if out or time.monotonic() >= deadline:
                return out

    def _wait_ms(self, deadline: float, out: list[SubscriberMessage]) -> int:
        if out:
            return 0
        until = deadline
        for w in self._workers.values():
            if w.replay_deadline is not None:
                until = min(until, w.replay_deadline)
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

    def _read_live(self, w: _Worker, out: list[SubscriberMessage]) -> None:
        with contextlib.suppress(zmq.Again):
            for _ in range(_READ_BURST):
                frames = w.sub.recv_multipart(zmq.NOBLOCK)
                if len(frames) != 3 or len(frames[1]) != 8:
                    w.decode_errors += 1
                    log.warning(
                        "worker %d: ignored a live message of %d frames; expected "
                        "[topic, seq (8 bytes), payload]",
                        w.worker,
                        len(frames),
                    )
                    continue
                w.received += 1
                self._on_live(w, SEQ.unpack(frames[1])[0], frames[2], out)
                if self._workers.get(w.worker) is not w:
                    return

    def _read_replay(
        self, w: _Worker, sock: zmq.Socket[bytes], out: list[SubscriberMessage]
    ) -> None:
        with contextlib.suppress(zmq.Again):
            for _ in range(_READ_BURST):
                if w.dealer is not sock:
                    return  # the dealer was replaced after a restart: stale replies
                frames = sock.recv_multipart(zmq.NOBLOCK)
                self._on_replay(w, frames, out)

    def _read_monitor(self, w: _Worker) -> None:
        if w.monitor is None:
            return
        with contextlib.suppress(zmq.Again):
            while True:
                event = recv_monitor_message(w.monitor, zmq.NOBLOCK)
                w.connected = event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED

    # ----------------------------------------------------------------- stream logic

    def _on_live(self, w: _Worker, seq: int, payload: bytes, out: list[SubscriberMessage]) -> None:
        if w.next_seq is None:
            self._first(w, seq, payload, out)
            return
        if seq < w.next_seq or seq in w.pending:
            if self._is_duplicate(w, seq, payload):
                w.duplicates += 1
            else:
                self._restart(w, seq, payload, out)
            return
        if w.replay_deadline is not None:
            self._hold(w, seq, payload)
            return
        if seq == w.next_seq:
            self._apply(w, seq, payload, out, from_replay=False)
        else:
            w.gaps += 1
            self._hold(w, seq, payload)
        self._advance(w, out, allow_replay=True, why="gap in the live stream")

    def _first(self, w: _Worker, seq: int, payload: bytes, out: list[SubscriberMessage]) -> None:
        w.next_seq = 0
        if seq == 0:
            self._apply(w, seq, payload, out, from_replay=False)
        else:
            self._hold(w, seq, payload)
        self._advance(w, out, allow_replay=True, why=f"stream joined at seq {seq}")

    def _is_duplicate(self, w: _Worker, seq: int, payload: bytes) -> bool:
        held = w.pending.get(seq)
        if held is not None:
            return held == payload
        digest = w.digests.get(seq)
        if digest is not None:
            return digest == _digest(payload)
        # never received under this seq: a stale straggler, unless it can only be a new stream
        assert w.next_seq is not None
        return seq != 0 and seq + DIGEST_WINDOW >= w.next_seq

    def _restart(self, w: _Worker, seq: int, payload: bytes, out: list[SubscriberMessage]) -> None:
        w.restarts += 1
        self._resync(w, f"publisher restarted: seq {seq} arrived after seq {w.last_seq}", out)
        if w.replay_deadline is not None:
            self._abandon_replay(w)  # replies of the old stream must not be read as the new
        w.replay_deadline = None
        w.pending.clear()
        w.heap.clear()
        w.digests.clear()
        w.digest_order.clear()
        w.next_seq = None
        self._first(w, seq, payload, out)

    def _hold(self, w: _Worker, seq: int, payload: bytes) -> None:
        if seq not in w.pending:
            w.pending[seq] = payload
            heapq.heappush(w.heap, seq)  # may duplicate a stale entry; harmless

    def _advance(
        self, w: _Worker, out: list[SubscriberMessage], *, allow_replay: bool, why: str
    ) -> None:
        """Apply held-back frames in order; at a gap, replay it or (if not allowed) resync."""
        while w.heap and w.replay_deadline is None:
            assert w.next_seq is not None
            seq = w.heap[0]
            if seq not in w.pending:
                heapq.heappop(w.heap)  # stale entry: applied while bridging a replay
            elif seq < w.next_seq:
                heapq.heappop(w.heap)
                del w.pending[seq]
                w.duplicates += 1
            elif seq == w.next_seq:
                heapq.heappop(w.heap)
                self._apply(w, seq, w.pending.pop(seq), out, from_replay=False)
            elif allow_replay and w.dealer is not None:
                self._request_replay(w)
            else:
                lost = f"seqs {w.next_seq}..{seq - 1} lost"
                if w.dealer is None:
                    lost += " and the worker has no replay endpoint"
                self._resync(w, f"{why}: {lost}", out)
                w.next_seq = seq

    def _request_replay(self, w: _Worker) -> None:
        assert w.dealer is not None and w.next_seq is not None
        try:
            w.dealer.send_multipart((b"", SEQ.pack(w.next_seq)), zmq.NOBLOCK)
        except zmq.Again:
            # a bound DEALER with no publisher connected: the request times out like a silent one
            log.warning("worker %d: replay request not sent: no replay peer", w.worker)
        w.replay_deadline = time.monotonic() + self._replay_timeout_s
        w.replay_progress = False

    def _on_replay(self, w: _Worker, frames: list[bytes], out: list[SubscriberMessage]) -> None:
        if w.abandoned:
            if len(frames) == 4 and frames[2] == END_SEQ:
                w.abandoned -= 1
            return
        if w.replay_deadline is None or w.next_seq is None:
            return  # nothing asked: a late reply to a request already given up
        # the timeout measures silence, so a long replay that keeps streaming is not cut off
        w.replay_deadline = time.monotonic() + self._replay_timeout_s
        if len(frames) == 4 and frames[2] == END_SEQ:
            w.replay_deadline = None
            start = w.next_seq
            self._advance(
                w,
                out,
                allow_replay=w.replay_progress,
                why=f"replay from seq {start} ended without covering the gap",
            )
            return
        if len(frames) != 4 or frames[0] != b"" or len(frames[2]) != 8:
            w.decode_errors += 1
            log.warning("worker %d: ignored a malformed replay message", w.worker)
            return
        seq = SEQ.unpack(frames[2])[0]
        w.replayed += 1
        while w.next_seq < seq:
            start = w.next_seq
            held = w.pending.pop(start, None)
            if held is not None:
                # a frame held back bridges this seq (its heap entry goes stale; _advance skips
                # stale entries); if it cannot be decoded it is lost like a replayed one
                self._apply(w, start, held, out, from_replay=True)
                continue
            # nobody has [start, resume): the publisher no longer buffers it
            resume = min((s for s in w.pending if start < s < seq), default=seq)
            self._resync(
                w,
                f"replay reached seq {seq} without seqs {start}..{resume - 1}: the publisher"
                " no longer buffers them (expired, or dropped before they were sent)",
                out,
            )
            w.next_seq = resume
        if seq < w.next_seq:
            w.duplicates += 1
            return
        w.replay_progress = True
        self._apply(w, seq, frames[3], out, from_replay=True)

    def _expire_replays(self, out: list[SubscriberMessage]) -> None:
        now = time.monotonic()
        for w in list(self._workers.values()):
            if w.replay_deadline is not None and now >= w.replay_deadline:
                w.replay_deadline = None
                self._abandon_replay(w)
                ms = round(self._replay_timeout_s * 1000)
                self._advance(w, out, allow_replay=False, why=f"replay endpoint silent for {ms} ms")

    def _apply(
        self,
        w: _Worker,
        seq: int,
        payload: bytes,
        out: list[SubscriberMessage],
        *,
        from_replay: bool,
    ) -> None:
        try:
            batch = decode_batch(payload, self._limits)
        except DecodeError as exc:
            w.decode_errors += 1
            if from_replay or w.dealer is None:
                self._resync(w, f"batch seq {seq} cannot be decoded: {exc}", out)
                w.next_seq = seq + 1
            elif w.replay_deadline is None:
                self._request_replay(w)  # a fresh copy may decode; if not, it is lost
            return
        if seq == 0 or any(isinstance(e.data, AllBlocksCleared) for e in batch.events):
            w.complete = True
        w.next_seq = seq + 1
        w.last_seq = seq
        w.digests[seq] = _digest(payload)
        w.digest_order.append(seq)
        if len(w.digest_order) > DIGEST_WINDOW:
            w.digests.pop(w.digest_order.popleft(), None)
        out.append(BatchDelivery(w.worker, seq, batch))

    def _resync(self, w: _Worker, reason: str, out: list[SubscriberMessage]) -> None:
        w.resyncs += 1
        w.complete = False
        log.warning("worker %d: resync required: %s", w.worker, reason)
        out.append(ResyncRequired(w.worker, reason))

    # ----------------------------------------------------------------- sockets

    def _new_dealer(self, w: _Worker) -> zmq.Socket[bytes]:
        assert w.replay_endpoint is not None
        dealer = self._ctx.socket(zmq.DEALER)
        try:
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.RCVHWM, 0)  # a replay is bounded by the publisher's ring
            _attach(dealer, w.replay_endpoint, w.bind)
        except BaseException:
            dealer.close(linger=0)
            raise
        return dealer

    def _abandon_replay(self, w: _Worker) -> None:
        """Make sure replies to the request in flight are never read as replies to a later one.

        A connecting DEALER is replaced (a new identity: the publisher's late replies go
        nowhere). A bound one cannot be (its address is released asynchronously), so the
        replies of abandoned requests are skipped up to their end markers instead.
        """
        if w.dealer is None:
            return
        if w.bind:
            w.abandoned += 1
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


def _digest(payload: bytes) -> int:
    """Tells two payloads under one seq apart (a restart) from a repeat (a duplicate). crc32
    and the length rather than hash(): as fast, and the same in every process (hash() of bytes
    is salted per process), so a digest can be logged and compared."""
    return zlib.crc32(payload) | (len(payload) << 32)


def _attach(sock: zmq.Socket[bytes], endpoint: str, bind: bool) -> None:
    try:
        if bind:
            sock.bind(endpoint)
        else:
            sock.connect(endpoint)
    except zmq.ZMQError as exc:
        verb = "bind" if bind else "connect"
        raise EndpointError(f"cannot {verb} {endpoint}: {exc}") from exc

"""ZeroMQ publisher of KV cache event batches with a replay buffer (WIRE.md sections 4-5).

Threading model::

    caller thread                         sender thread (owns every socket below)
    publish(events) --seq--> deque ----> encode -> ring buffer -> XPUB  [topic, seq, payload]
                     (bounded; a doorbell  ROUTER replay: [id, "", start] -> batches >= start,
                      PAIR wakes the thread)               then the end marker

``publish()`` never blocks: it assigns the next sequence number the moment it accepts a batch
and hands the batch over. When the hand-over queue is full the batch is dropped and counted,
and its sequence number is still consumed. A dropped batch was never accepted, so it is in
neither the live stream nor the replay buffer: subscribers see a gap that replay cannot fill
and resynchronize that worker. Encoding happens on the sender thread, so the caller pays only
for the hand-over.

The live socket is an XPUB: on the wire it is a PUB for SUB clients, and the subscription
frames it receives give a real readiness handshake (:meth:`ZmqEventPublisher.wait_for_subscribers`).
A batch is appended to the ring buffer before it is sent live, so any seq a subscriber has seen
live is replayable until the ring forgets it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Final

import zmq

from events.codec import encode_batch
from events.endpoints import connectable, offset_for_rank, should_bind
from events.model import KVCacheEvent

log = logging.getLogger(__name__)

SEQ: Final = struct.Struct(">Q")
#: seq field of the replay end marker
END_SEQ: Final = b"\xff" * 8
_MALFORMED_LOG_FIRST: Final = 10
_bell_ids = itertools.count()


class PublisherError(RuntimeError):
    """The publisher could not set up its sockets, or was used after close()."""


@dataclass(slots=True)
class PublisherStats:
    """Counters of one publisher (a snapshot when read through ``ZmqEventPublisher.stats``)."""

    published: int = 0  # batches accepted (seq assigned, queued for the sender thread)
    dropped_batches: int = 0  # batches refused because the queue was full (seq consumed)
    encode_errors: int = 0  # accepted batches the codec failed to encode (seq becomes a gap)
    sent: int = 0  # frames handed to the live socket
    dropped_live: int = 0  # frames withheld from the live socket by the drop_live hook
    replay_requests: int = 0
    replayed_batches: int = 0
    malformed_requests: int = 0
    subscribers: int = 0  # live subscriptions matching the topic, as the XPUB reported them


_Item = tuple[int, "Sequence[KVCacheEvent] | bytes", float]


class ZmqEventPublisher:
    """Publishes event batches as ``[topic, seq (8-byte BE), payload]`` with replay.

    ``endpoint`` / ``replay_endpoint`` follow the bind/connect rule and data-parallel offset of
    :mod:`events.endpoints`; :attr:`endpoint` and :attr:`replay_endpoint` give the addresses a
    subscriber connects to (a ``tcp://127.0.0.1:*`` endpoint binds an ephemeral port).
    ``drop_live(seq)`` is a fault-injection hook called on the sender thread: True withholds
    that frame from the live socket while keeping it replayable, as a frame lost on the network.
    ``bind`` overrides the bind/connect rule for both endpoints (None: follow the rule), e.g. to
    bind one interface's fixed port again after a restart.

    Bounds: ``max_queue`` batches wait for the sender thread; the ring keeps the last
    ``buffer_steps`` encoded batches for replay (its memory is that many payloads; none without
    a ``replay_endpoint``); ``hwm`` frames per subscriber wait in ZeroMQ before it drops (0: no
    limit). ``dp_rank`` also fills the payload's ``data_parallel_rank``. The context defaults to
    ``zmq.Context.instance()``; inproc endpoints need the subscriber on the same context.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str | bytes = "",
        dp_rank: int = 0,
        buffer_steps: int = 10000,
        hwm: int = 100000,
        max_queue: int = 10000,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        drop_live: Callable[[int], bool] | None = None,
        *,
        bind: bool | None = None,
    ) -> None:
        if buffer_steps < 0 or hwm < 0 or max_queue < 1:
            raise ValueError(
                f"need buffer_steps >= 0, hwm >= 0, max_queue >= 1; got {buffer_steps}, "
                f"{hwm}, {max_queue}"
            )
        self._ctx = context if context is not None else zmq.Context.instance()
        self._topic = topic.encode() if isinstance(topic, str) else bytes(topic)
        self._dp_rank = dp_rank
        self._max_queue = max_queue
        self._drop_live = drop_live
        # only the replay socket reads the ring: without one, keeping payloads is waste
        ring_size = buffer_steps if replay_endpoint is not None else 0
        self._ring: deque[tuple[int, bytes]] = deque(maxlen=ring_size)
        self._queue: deque[_Item] = deque()
        self._lock = threading.Lock()  # seq assignment + queue order + the caller's bell
        self._progress = threading.Condition()
        self._stats = PublisherStats()
        self._next_seq = 0
        self._handled = 0  # seqs the sender thread has finished with (sent, dropped or failed)
        self._bell_rung = False
        self._closed = False
        self._stop_deadline: float | None = None
        self._sub_counts: dict[bytes, int] = {}

        sockets: list[zmq.Socket[bytes]] = []
        try:
            self._xpub = self._ctx.socket(zmq.XPUB)
            sockets.append(self._xpub)
            self._xpub.setsockopt(zmq.SNDHWM, hwm)
            self._xpub.setsockopt(zmq.LINGER, 0)  # close() sets a bounded linger explicitly
            # every subscribe and unsubscribe frame, per subscriber, so they can be counted
            self._xpub.setsockopt(zmq.XPUB_VERBOSER, 1)
            self._endpoint = self._attach(self._xpub, offset_for_rank(endpoint, dp_rank), bind)
            self._router: zmq.Socket[bytes] | None = None
            self._replay_endpoint: str | None = None
            if replay_endpoint is not None:
                self._router = self._ctx.socket(zmq.ROUTER)
                sockets.append(self._router)
                self._router.setsockopt(zmq.LINGER, 0)
                # a whole replay must fit in the peer's pipe; unroutable peers raise, not vanish
                self._router.setsockopt(zmq.SNDHWM, buffer_steps + 16)
                self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
                # always bound, as engines do: subscribers (bind mode included) connect to it
                self._replay_endpoint = self._attach(
                    self._router, offset_for_rank(replay_endpoint, dp_rank), True
                )
            bell_name = f"inproc://kv-events-publisher-bell-{next(_bell_ids)}-{id(self)}"
            self._bell_rx = self._ctx.socket(zmq.PAIR)
            sockets.append(self._bell_rx)
            self._bell_rx.bind(bell_name)
            self._bell_tx = self._ctx.socket(zmq.PAIR)
            sockets.append(self._bell_tx)
            self._bell_tx.setsockopt(zmq.LINGER, 0)
            self._bell_tx.connect(bell_name)
        except BaseException:
            for s in sockets:
                s.close(linger=0)
            raise
        self._thread = threading.Thread(
            target=self._run, name=f"kv-events-publisher[{self._endpoint}]", daemon=True
        )
        self._thread.start()

    # ----------------------------------------------------------------- caller side

    @property
    def endpoint(self) -> str:
        """The live endpoint a subscriber connects to (bound address, or the one connected to)."""
        return self._endpoint

    @property
    def replay_endpoint(self) -> str | None:
        """The replay endpoint a subscriber's DEALER connects to, if replay is enabled."""
        return self._replay_endpoint

    @property
    def topic(self) -> bytes:
        return self._topic

    @property
    def next_seq(self) -> int:
        """The seq the next accepted (or dropped) batch gets."""
        return self._next_seq

    @property
    def stats(self) -> PublisherStats:
        """A snapshot of the counters."""
        return dataclasses.replace(self._stats)

    def publish(self, events: Sequence[KVCacheEvent], ts: float | None = None) -> int:
        """Queue one batch of events (one iteration) and return its seq; never blocks.

        The batch is encoded with :func:`events.codec.encode_batch` on the sender thread. When
        the queue is full the batch is dropped (``stats.dropped_batches``) and its seq is still
        consumed, so subscribers see the loss.
        """
        # a copy of the list: the caller may reuse its own while the batch waits in the queue
        return self._enqueue(list(events), time.time() if ts is None else ts)

    def publish_payload(self, payload: bytes) -> int:
        """Queue an already encoded payload (WIRE.md 4 envelope) and return its seq."""
        return self._enqueue(bytes(payload), 0.0)

    def _enqueue(self, data: Sequence[KVCacheEvent] | bytes, ts: float) -> int:
        with self._lock:
            if self._closed:
                raise PublisherError(
                    f"publisher {self._endpoint} is closed; create a new one to publish again"
                )
            seq = self._next_seq
            self._next_seq = seq + 1
            if len(self._queue) >= self._max_queue:
                self._stats.dropped_batches += 1
                self._mark_handled(1)
                return seq
            self._queue.append((seq, data, ts))
            self._stats.published += 1
            if not self._bell_rung:
                self._bell_rung = True
                self._ring_bell()
        return seq

    def wait_for_subscribers(self, n: int = 1, timeout_s: float = 5.0) -> bool:
        """Wait until at least ``n`` subscriptions matching the topic reached the XPUB socket.

        A subscription seen here is applied: every batch sent afterwards reaches that subscriber
        (barring HWM overflow). Returns False when the deadline passes first.
        """
        deadline = time.monotonic() + timeout_s
        with self._progress:
            while self._stats.subscribers < n:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return False
                self._progress.wait(left)
        return True

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until the sender thread has handed every accepted batch to ZeroMQ (or dropped it
        on purpose). False when the deadline passes first."""
        deadline = time.monotonic() + timeout_s
        with self._progress:
            while self._handled < self._next_seq:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return False
                self._progress.wait(left)
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop accepting batches, send what is queued (within ``timeout_s``), close the sockets.

        Pending frames get at most the remaining time as ZeroMQ linger. Idempotent.
        """
        with self._lock:
            if self._closed:
                already = True
            else:
                already = False
                self._closed = True
                self._stop_deadline = time.monotonic() + max(timeout_s, 0.0)
                self._ring_bell()
        if already:
            self._thread.join(timeout_s)
            return
        self._thread.join(max(timeout_s, 0.0) + 1.0)
        if self._thread.is_alive():
            log.warning("publisher %s: sender thread did not stop in time", self._endpoint)
        self._bell_tx.close(linger=0)

    def __enter__(self) -> ZmqEventPublisher:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _ring_bell(self) -> None:
        # the thread may already be gone: it stops on its own once it sees the stop deadline,
        # and a crashed thread was logged; neither may turn publish() or close() into an error
        with contextlib.suppress(zmq.Again):
            self._bell_tx.send(b"", zmq.NOBLOCK)

    def _mark_handled(self, count: int) -> None:
        with self._progress:
            self._handled += count
            self._progress.notify_all()

    def _attach(self, sock: zmq.Socket[bytes], endpoint: str, bind: bool | None) -> str:
        try:
            if should_bind(endpoint) if bind is None else bind:
                sock.bind(endpoint)
                last = sock.getsockopt(zmq.LAST_ENDPOINT)
                assert isinstance(last, bytes)
                return connectable(last.decode())
            sock.connect(endpoint)
            return endpoint
        except zmq.ZMQError as exc:
            raise PublisherError(
                f"cannot attach to {endpoint}: {exc}; pick a free port or another endpoint"
            ) from exc

    # ----------------------------------------------------------------- sender thread

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._xpub, zmq.POLLIN)
        poller.register(self._bell_rx, zmq.POLLIN)
        if self._router is not None:
            poller.register(self._router, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll(None if self._stop_deadline is None else 0))
                if self._xpub in ready:
                    self._read_subscriptions()
                if self._bell_rx in ready:
                    self._drain_bell()
                self._send_queued()
                if self._router is not None and self._router in ready:
                    self._serve_replays(self._router)
                if self._stop_deadline is not None and (
                    not self._queue or time.monotonic() >= self._stop_deadline
                ):
                    break
        except Exception:
            log.exception("publisher %s: sender thread failed", self._endpoint)
        finally:
            self._shutdown()

    def _drain_bell(self) -> None:
        # empty the bell first, then lower the flag, then (in the caller) drain the queue: a
        # batch appended before the flag drops is picked up by that drain, one appended after
        # it sees the flag down and rings again. Lowering the flag before emptying the bell
        # could swallow a ring whose flag then stays up, leaving later batches unsent.
        with contextlib.suppress(zmq.Again):
            while True:
                self._bell_rx.recv(zmq.NOBLOCK)
        self._bell_rung = False

    def _send_queued(self) -> None:
        queue = self._queue
        done = 0
        try:
            while queue:
                seq, data, ts = queue.popleft()
                done += 1
                if isinstance(data, bytes):
                    payload = data
                else:
                    try:
                        payload = encode_batch(data, ts, self._dp_rank)
                    except Exception:
                        self._stats.encode_errors += 1
                        log.exception(
                            "publisher %s: cannot encode batch seq %d", self._endpoint, seq
                        )
                        continue
                seq_b = SEQ.pack(seq)
                if self._ring.maxlen:
                    self._ring.append((seq, payload))
                if self._drop_live is not None and self._drop_live(seq):
                    self._stats.dropped_live += 1
                    continue
                self._stats.sent += 1
                self._xpub.send_multipart((self._topic, seq_b, payload), zmq.NOBLOCK)
        finally:
            if done:
                self._mark_handled(done)

    def _read_subscriptions(self) -> None:
        changed = False
        with contextlib.suppress(zmq.Again):
            while True:
                frame = self._xpub.recv(zmq.NOBLOCK)
                if not frame or frame[0] not in (0, 1):
                    continue
                sub_topic = frame[1:]
                delta = 1 if frame[0] == 1 else -1
                self._sub_counts[sub_topic] = max(0, self._sub_counts.get(sub_topic, 0) + delta)
                changed = True
        if changed:
            matching = sum(c for t, c in self._sub_counts.items() if self._topic.startswith(t))
            with self._progress:
                self._stats.subscribers = matching
                self._progress.notify_all()

    def _serve_replays(self, router: zmq.Socket[bytes]) -> None:
        with contextlib.suppress(zmq.Again):
            while True:
                frames = router.recv_multipart(zmq.NOBLOCK)
                if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                    self._malformed(frames)
                    continue
                self._stats.replay_requests += 1
                self._replay(router, frames[0], SEQ.unpack(frames[2])[0])

    def _replay(self, router: zmq.Socket[bytes], identity: bytes, start: int) -> None:
        try:
            for seq, payload in self._ring:
                if seq >= start:
                    router.send_multipart(
                        (identity, b"", self._topic, SEQ.pack(seq), payload), zmq.NOBLOCK
                    )
                    self._stats.replayed_batches += 1
            router.send_multipart((identity, b"", b"", END_SEQ, b""), zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            # the client is gone or not reading; it times out and resynchronizes
            log.warning("publisher %s: replay from seq %d aborted: %s", self._endpoint, start, exc)

    def _malformed(self, frames: list[bytes]) -> None:
        self._stats.malformed_requests += 1
        n = self._stats.malformed_requests
        if n <= _MALFORMED_LOG_FIRST or n % 1000 == 0:
            log.warning(
                "publisher %s: ignored malformed replay request #%d (%d frames, sizes %s); "
                "expected [identity, b'', start_seq as 8-byte big-endian]",
                self._endpoint,
                n,
                len(frames),
                [len(f) for f in frames[:5]],
            )

    def _shutdown(self) -> None:
        leftover = len(self._queue)
        if leftover:
            self._queue.clear()
            log.warning(
                "publisher %s: %d queued batches not sent at close", self._endpoint, leftover
            )
            self._mark_handled(leftover)
        deadline = self._stop_deadline
        linger_ms = 0 if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
        self._xpub.close(linger=linger_ms)
        if self._router is not None:
            self._router.close(linger=0)
        self._bell_rx.close(linger=0)
        with self._progress:
            self._progress.notify_all()

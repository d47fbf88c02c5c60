"""ZeroMQ publisher of KV cache event batches with a replay buffer (WIRE.md sections 4-5, 7).

Threading model::

    caller thread                         sender thread (owns the XPUB)
    publish(events) --seq--> deque ----> encode -> ring buffer -> XPUB  [topic, seq, payload]
                     (bounded; a doorbell
                      PAIR wakes the thread)   replay thread (owns the ROUTER)
                                               [id, "", start] -> batches >= start, end marker
                                               [id, "", "kv-snapshot"] -> snapshot parts

``publish()`` never blocks: it assigns the next sequence number the moment it accepts a batch
and hands the batch over. When the hand-over queue is full the batch is dropped and counted,
and its sequence number is still consumed. A dropped batch was never accepted, so it is in
neither the live stream nor the replay buffer: subscribers see a gap that replay cannot fill.
Loss upstream (the event manager's full buffer) is made visible the same way with
:meth:`ZmqEventPublisher.skip`. Nothing is ever lost silently.

Replays run on their own thread, so they never delay live sends: clients are served in turn,
a few messages each, with a bounded number of clients, a request rate per client, and a
deadline for a client that stops reading. A reply to an ordinary replay request is exactly
vLLM's (WIRE.md 5: the end marker's payload empty, the topic frame as the emulated version
sends it), so clients written for vLLM read it unchanged. Only requests no engine client sends
get this project's extensions: the hello and the extended request end with this publisher's
*incarnation* (a random id drawn at start) and how many seqs it has handled; with a
``snapshot_provider`` it also answers snapshot requests with the worker's complete state
(:mod:`events.stream.snapshot`). A sender thread that dies makes ``publish()`` raise.

The live socket is an XPUB: on the wire it is a PUB for SUB clients, and the subscription
frames it receives give a real readiness handshake (:meth:`ZmqEventPublisher.wait_for_subscribers`).
A batch is appended to the ring buffer before it is sent live, so any seq a subscriber has seen
live is replayable until the ring forgets it.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import itertools
import logging
import os
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Final, Protocol

import zmq

from events.loss import leading_loss, lost_events
from events.stream.endpoints import offset_for_rank, should_bind
from events.stream.security import (
    DEFAULT_MAX_MESSAGE_BYTES,
    CurveServer,
    limit_inbound,
    secure_server,
)
from events.stream.snapshot import (
    SNAPSHOT_TAG,
    PublisherInfo,
    SnapshotHeader,
    pack_header,
    pack_info,
    parse_replay_request,
    split_parts,
)
from events.wire.codec import encode_batch
from events.wire.model import KVCacheEvent

log = logging.getLogger(__name__)

SEQ: Final = struct.Struct(">Q")
#: seq field of the replay end marker
END_SEQ: Final = b"\xff" * 8
_MALFORMED_LOG_FIRST: Final = 10
#: messages sent to one replay client before the next client gets a turn
_REPLAY_CHUNK: Final = 16
#: requests a client may send in a burst before its request rate applies
_REQUEST_BURST: Final = 8.0
_bell_ids = itertools.count()

SnapshotProvider = Callable[[], "Sequence[KVCacheEvent] | None"]
"""Returns the worker's complete state as Stored events, consistent with every batch published
so far; None when it cannot now (it is asked again at the next publish)."""


class DrainedEvents(Protocol):
    """What :meth:`ZmqEventPublisher.publish_drained` reads: the event manager's drain side
    (:class:`events.manager.KVCacheEventManager`)."""

    def flush(self) -> int: ...

    def take_dropped(self) -> int: ...

    def get_latest_events(self, timeout_ms: float = 0) -> list[KVCacheEvent]: ...


class PublisherError(RuntimeError):
    """The publisher could not set up its sockets, was used after close(), or its sender
    thread died."""


@dataclass(slots=True)
class PublisherStats:
    """Counters of one publisher (a snapshot when read through ``ZmqEventPublisher.stats``)."""

    published: int = 0  # batches accepted (seq assigned, queued for the sender thread)
    dropped_batches: int = 0  # batches refused because the queue was full (seq consumed)
    skipped: int = 0  # seqs consumed by skip(): loss upstream made visible
    encode_errors: int = 0  # accepted batches the codec failed to encode (seq becomes a gap)
    sent: int = 0  # frames handed to the live socket
    dropped_live: int = 0  # frames withheld from the live socket by the drop_live hook
    replay_requests: int = 0
    replayed_batches: int = 0
    malformed_requests: int = 0
    replay_refused: int = 0  # requests over a client's rate or the client limit
    replay_clients_dropped: int = 0  # clients that stopped reading their replay
    snapshot_requests: int = 0
    snapshots_sent: int = 0
    subscribers: int = 0  # live subscriptions matching the topic, as the XPUB reported them


@dataclass(frozen=True, slots=True)
class PublisherHealth:
    """Whether the publisher's threads run; a dead sender means nothing is being sent."""

    sender_alive: bool
    replay_alive: bool | None  # None: no replay endpoint
    queued: int
    incarnation: int


_Item = tuple[int, "Sequence[KVCacheEvent] | bytes", float]


@dataclass(slots=True)
class _Client:
    """One replay client with something left to send it."""

    queue: deque[tuple[bytes, ...]] = field(default_factory=deque)  # frames to send
    blocked_since: float | None = None


class _RateLimit:
    """A token bucket per client identity: ``rate`` requests per second after a burst. Idle
    entries are pruned, so a flood of new identities cannot grow it without bound."""

    def __init__(self, rate: float, max_entries: int = 4096) -> None:
        self.rate = rate
        self.max_entries = max_entries
        self._buckets: dict[bytes, tuple[float, float]] = {}  # ident -> (tokens, when)

    def allow(self, ident: bytes, now: float) -> bool:
        tokens, when = self._buckets.get(ident, (_REQUEST_BURST, now))
        tokens = min(_REQUEST_BURST, tokens + (now - when) * self.rate)
        if tokens < 1.0:
            self._buckets[ident] = (tokens, now)
            return False
        self._buckets[ident] = (tokens - 1.0, now)
        if len(self._buckets) > self.max_entries:
            full = (_REQUEST_BURST - 1.0) / self.rate
            for k, (_, t) in list(self._buckets.items()):
                if now - t > full:
                    del self._buckets[k]
            if len(self._buckets) > self.max_entries:  # all busy: forget the oldest half
                for k in list(self._buckets)[: self.max_entries // 2]:
                    del self._buckets[k]
        return True


class ZmqEventPublisher:
    """Publishes event batches as ``[topic, seq (8-byte BE), payload]`` with replay.

    ``endpoint`` follows the bind/connect rule and data-parallel offset of
    :mod:`events.stream.endpoints`; ``replay_endpoint`` gets the offset and is always bound, as
    engines bind theirs. :attr:`endpoint` and :attr:`replay_endpoint` give the addresses a
    subscriber connects to (a ``tcp://127.0.0.1:*`` endpoint binds an ephemeral port; a
    wildcard ``tcp://*:P`` listens on every interface and reads ``tcp://0.0.0.0:P``).
    ``drop_live(seq)`` is a fault-injection hook called on the sender thread: True withholds
    that frame from the live socket while keeping it replayable, as a frame lost on the network.
    ``bind`` overrides the bind/connect rule of the live endpoint (None: follow the rule).

    Bounds: ``max_queue`` batches wait for the sender thread; the ring keeps the last
    ``buffer_steps`` encoded batches for replay (its memory is that many payloads; none without
    a ``replay_endpoint``); ``hwm`` frames per subscriber wait in ZeroMQ before it drops (0: no
    limit). Replay: at most ``max_replay_clients`` clients at once, one replay at a time per
    client (a request on top of an unfinished one is refused), ``replay_rate`` requests per
    second per client (after a small burst), and a client that reads nothing of its replay for
    ``replay_client_timeout_s`` is dropped. ``dp_rank`` also fills the payload's
    ``data_parallel_rank``. ``incarnation`` (default: random) identifies this start of the
    publisher. The context defaults to ``zmq.Context.instance()``; inproc endpoints need the
    subscriber on the same context.

    Security (:mod:`events.stream.security`): ``curve`` makes both sockets CURVE servers that admit
    only the allowed client keys (encrypted, authenticated); ``max_message_bytes`` caps what a
    peer may send to either socket (subscription frames, replay requests).

    Wire: ``wire_form`` ``"map"`` (default: what vLLM >= 0.25 and SGLang decode) or
    ``"positional"`` (array events, for consumers built on vLLM 0.11); ``extensions`` sends
    tier moves and creation as this project's ``BlockUpdated`` / ``CacheCreated`` events,
    which engines' decoders reject (see :func:`events.wire.codec.encode_batch`).
    ``replay_topic_frame``: replay replies carry the topic frame, as vLLM >= 0.26 and SGLang
    send them (``[b"", topic, seq, payload]``); False: vLLM <= 0.25.1's ``[b"", seq, payload]``.
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
        incarnation: int | None = None,
        snapshot_provider: SnapshotProvider | None = None,
        max_replay_clients: int = 64,
        replay_rate: float = 500.0,
        replay_client_timeout_s: float = 5.0,
        curve: CurveServer | None = None,
        max_message_bytes: int | None = DEFAULT_MAX_MESSAGE_BYTES,
        wire_form: str = "map",
        extensions: bool = False,
        replay_topic_frame: bool = True,
    ) -> None:
        if wire_form not in ("map", "positional"):
            raise ValueError(f"wire_form must be 'map' or 'positional', got {wire_form!r}")
        if wire_form == "positional" and extensions:
            raise ValueError("extension events have no positional form: use wire_form='map'")
        if buffer_steps < 0 or hwm < 0 or max_queue < 1:
            raise ValueError(
                f"need buffer_steps >= 0, hwm >= 0, max_queue >= 1; got {buffer_steps}, "
                f"{hwm}, {max_queue}"
            )
        if max_replay_clients < 1 or replay_rate <= 0 or replay_client_timeout_s <= 0:
            raise ValueError(
                "need max_replay_clients >= 1, replay_rate > 0, replay_client_timeout_s > 0"
            )
        self._ctx = context if context is not None else zmq.Context.instance()
        self._topic = topic.encode() if isinstance(topic, str) else bytes(topic)
        self._dp_rank = dp_rank
        self._wire_form = wire_form
        self._extensions = extensions
        self._replay_topic_frame = replay_topic_frame
        self._max_queue = max_queue
        self._drop_live = drop_live
        self.incarnation: Final[int] = (
            int.from_bytes(os.urandom(8), "big") if incarnation is None else incarnation
        )
        self._provider = snapshot_provider
        self._max_clients = max_replay_clients
        self._replay_rate = replay_rate
        self._client_timeout_s = replay_client_timeout_s
        # only the replay socket reads the ring: without one, keeping payloads is waste
        ring_size = buffer_steps if replay_endpoint is not None else 0
        self._ring: deque[tuple[int, bytes]] = deque(maxlen=ring_size)
        self._ring_seqs: deque[int] = deque(maxlen=ring_size)  # the ring's seqs, for bisect
        self._ring_lock = threading.Lock()
        self._ring_next = 0  # every seq below it was ringed, sent or dropped by the sender
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
        self._snapshot_wanted = False
        self._snap_lock = threading.Lock()  # the snapshot hand-over and the replay bell
        self._snap_ready: tuple[int, Sequence[KVCacheEvent]] | None = None
        self._replay_stop = False
        self._sender_dead = False  # set by the sender thread when it fails

        sockets: list[zmq.Socket[bytes]] = []
        try:
            self._xpub = self._ctx.socket(zmq.XPUB)
            sockets.append(self._xpub)
            self._xpub.setsockopt(zmq.SNDHWM, hwm)
            self._xpub.setsockopt(zmq.LINGER, 0)  # close() sets a bounded linger explicitly
            # every subscribe and unsubscribe frame, per subscriber, so they can be counted
            self._xpub.setsockopt(zmq.XPUB_VERBOSER, 1)
            # CURVE and the inbound size cap (events.stream.security); set before attaching
            self._guards = [] if curve is None else [secure_server(self._xpub, curve)]
            limit_inbound(self._xpub, max_message_bytes)
            self._endpoint = self._attach(self._xpub, offset_for_rank(endpoint, dp_rank), bind)
            self._router: zmq.Socket[bytes] | None = None
            self._replay_endpoint: str | None = None
            if replay_endpoint is not None:
                self._router = self._ctx.socket(zmq.ROUTER)
                sockets.append(self._router)
                self._router.setsockopt(zmq.LINGER, 0)
                # a slow client's pipe fills and it waits its turn; unroutable peers raise
                self._router.setsockopt(zmq.SNDHWM, 1000)
                self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
                if curve is not None:
                    self._guards.append(secure_server(self._router, curve))
                limit_inbound(self._router, max_message_bytes)
                # always bound, as engines do: subscribers (bind mode included) connect to it
                self._replay_endpoint = self._attach(
                    self._router, offset_for_rank(replay_endpoint, dp_rank), True
                )
            self._bell_rx, self._bell_tx = self._bell_pair(sockets, "send")
            self._rbell_rx, self._rbell_tx = self._bell_pair(sockets, "replay")
        except BaseException:
            for s in sockets:
                s.close(linger=0)
            for guard in getattr(self, "_guards", ()):
                guard.close()
            raise
        self._thread = threading.Thread(
            target=self._run, name=f"kv-events-publisher[{self._endpoint}]", daemon=True
        )
        self._replay_thread: threading.Thread | None = None
        if self._router is not None:
            self._replay_thread = threading.Thread(
                target=self._run_replay,
                name=f"kv-events-replay[{self._replay_endpoint}]",
                daemon=True,
            )
        self._thread.start()
        if self._replay_thread is not None:
            self._replay_thread.start()

    def _bell_pair(
        self, sockets: list[zmq.Socket[bytes]], what: str
    ) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes]]:
        name = f"inproc://kv-events-publisher-{what}-bell-{next(_bell_ids)}-{id(self)}"
        rx = self._ctx.socket(zmq.PAIR)
        sockets.append(rx)
        rx.bind(name)
        tx = self._ctx.socket(zmq.PAIR)
        sockets.append(tx)
        tx.setsockopt(zmq.LINGER, 0)
        tx.connect(name)
        return rx, tx

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

    def health(self) -> PublisherHealth:
        """Whether the threads run (a dead sender thread also makes ``publish()`` raise)."""
        replay = self._replay_thread
        return PublisherHealth(
            sender_alive=self._thread.is_alive(),
            replay_alive=None if replay is None else replay.is_alive(),
            queued=len(self._queue),
            incarnation=self.incarnation,
        )

    def publish(self, events: Sequence[KVCacheEvent], ts: float | None = None) -> int:
        """Queue one batch of events (one iteration) and return its seq; never blocks.

        The batch is encoded with :func:`events.wire.codec.encode_batch` on the sender thread. When
        the queue is full the batch is dropped (``stats.dropped_batches``) and its seq is still
        consumed, so subscribers see the loss. When a snapshot was requested, the provider is
        called here, right after the batch: its state is then the sum of every batch so far.
        Raises :class:`PublisherError` when closed or when the sender thread died.

        A loss marker at the head of ``events`` (what the event manager's
        ``get_latest_events`` hands out first after its buffer overflowed, see
        :mod:`events.loss`) becomes a burned seq (:meth:`skip`) before the batch, which carries
        the rest: the loss is a gap every subscriber sees, whichever way the events were drained.
        """
        if leading_loss(events):
            self.skip()
            events = events[1:]
        # a copy of the list: the caller may reuse its own while the batch waits in the queue
        seq = self._enqueue(list(events), time.time() if ts is None else ts)
        if self._snapshot_wanted:
            self._offer_snapshot(seq + 1)
        return seq

    def publish_drained(
        self, source: DrainedEvents, ts: float | None = None, *, empty: bool = False
    ) -> list[KVCacheEvent] | None:
        """End an engine iteration: flush ``source``, turn what its full buffer dropped into a
        gap (:meth:`skip`) and publish what it drained, in that order, so no loss is silent.

        Returns the published batch, or None when nothing was drained and ``empty`` is False
        (a heartbeat passes ``empty=True``). With a snapshot provider, a pending snapshot
        request is answered here too, published or not.
        """
        source.flush()
        if source.take_dropped():
            self.skip()
        events = source.get_latest_events()
        if events or empty:
            self.publish(events, ts)
            return events
        self.serve_snapshots()
        return None

    def publish_payload(self, payload: bytes) -> int:
        """Queue an already encoded payload (WIRE.md 4 envelope) and return its seq."""
        seq = self._enqueue(bytes(payload), 0.0)
        if self._snapshot_wanted:
            self._offer_snapshot(seq + 1)
        return seq

    def skip(self) -> int:
        """Consume one seq without sending anything: a loss upstream (e.g. events the event
        manager's full buffer dropped, see ``KVCacheEventManager.take_dropped``) becomes a gap
        every subscriber sees and no replay fills. Returns the seq consumed."""
        with self._lock:
            self._check_usable()
            seq = self._next_seq
            self._next_seq = seq + 1
            self._stats.skipped += 1
        self._mark_handled(1)
        return seq

    def serve_snapshots(self) -> bool:
        """Answer pending snapshot requests now (for an engine with nothing to publish for a
        while); call it only when everything drained so far was published. True if one was
        handed to the replay thread."""
        if not self._snapshot_wanted:
            return False
        with self._lock:
            next_seq = self._next_seq
        return self._offer_snapshot(next_seq)

    def _offer_snapshot(self, next_seq: int) -> bool:
        provider = self._provider
        if provider is None:
            return False
        events = provider()
        if events is None:
            return False  # not consistent now: asked again at the next publish
        with self._snap_lock:
            self._snapshot_wanted = False
            self._snap_ready = (next_seq, list(events))
            with contextlib.suppress(zmq.ZMQError):
                self._rbell_tx.send(b"", zmq.NOBLOCK)
        return True

    def _check_usable(self) -> None:
        if self._closed:
            raise PublisherError(
                f"publisher {self._endpoint} is closed; create a new one to publish again"
            )
        if self._sender_dead:
            raise PublisherError(
                f"publisher {self._endpoint}: its sender thread died (see the log), so nothing "
                "is sent; close it and create a new publisher"
            )

    def _enqueue(self, data: Sequence[KVCacheEvent] | bytes, ts: float) -> int:
        with self._lock:
            self._check_usable()
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
        if self._replay_thread is not None:
            with self._snap_lock:
                self._replay_stop = True
                with contextlib.suppress(zmq.ZMQError):
                    self._rbell_tx.send(b"", zmq.NOBLOCK)
            self._replay_thread.join(max(timeout_s, 0.0) + 1.0)
        with self._snap_lock:
            self._rbell_tx.close(linger=0)
        if self._replay_thread is None:
            self._rbell_rx.close(linger=0)
        for guard in self._guards:  # after the threads closed their sockets
            guard.close()

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
        # and a crashed thread was logged; neither may turn close() into an error
        with contextlib.suppress(zmq.ZMQError):
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
                # the truth: tcp://*:P listens on every interface and says tcp://0.0.0.0:P
                return last.decode()
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
        try:
            while True:
                ready = dict(poller.poll(None if self._stop_deadline is None else 0))
                if self._xpub in ready:
                    self._read_subscriptions()
                if self._bell_rx in ready:
                    self._drain_bell()
                self._send_queued()
                if self._stop_deadline is not None and (
                    not self._queue or time.monotonic() >= self._stop_deadline
                ):
                    break
        except Exception:
            self._sender_dead = True
            log.exception(
                "publisher %s: sender thread failed; publish() now raises", self._endpoint
            )
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
        keep = self._ring.maxlen
        try:
            while queue:
                seq, data, ts = queue.popleft()
                done += 1
                if isinstance(data, bytes):
                    payload = data
                else:
                    try:
                        payload = encode_batch(
                            data,
                            ts,
                            self._dp_rank,
                            form=self._wire_form,
                            extensions=self._extensions,
                        )
                    except Exception:
                        self._stats.encode_errors += 1
                        lost = sum(lost_events(e) for e in data)
                        if lost:  # a loss marker inside the batch (publish takes a leading one)
                            log.warning(
                                "publisher %s: batch seq %d holds a loss marker (%d events "
                                "dropped upstream): not sent, a gap",
                                self._endpoint,
                                seq,
                                lost,
                            )
                        else:
                            log.exception(
                                "publisher %s: cannot encode batch seq %d", self._endpoint, seq
                            )
                        continue
                # ringed (and counted as handled for replay's end marker) before it is sent
                with self._ring_lock:
                    if keep:
                        self._ring.append((seq, payload))
                        self._ring_seqs.append(seq)
                    self._ring_next = seq + 1
                if self._drop_live is not None and self._drop_live(seq):
                    self._stats.dropped_live += 1
                    continue
                self._stats.sent += 1
                self._xpub.send_multipart((self._topic, SEQ.pack(seq), payload), zmq.NOBLOCK)
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
        self._bell_rx.close(linger=0)
        with self._progress:
            self._progress.notify_all()

    # ----------------------------------------------------------------- replay thread

    def _info(self) -> PublisherInfo:
        """What the end marker says: how many seqs are handled, as an airtight lower bound."""
        with self._lock:
            assigned = self._next_seq
        with self._progress:
            handled = self._handled
        if handled >= assigned:
            next_seq = assigned
        else:
            with self._ring_lock:
                next_seq = self._ring_next
        return PublisherInfo(self.incarnation, next_seq, self._provider is not None)

    def _run_replay(self) -> None:
        router = self._router
        assert router is not None
        clients: dict[bytes, _Client] = {}
        waiters: list[bytes] = []
        rates = _RateLimit(self._replay_rate)
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(self._rbell_rx, zmq.POLLIN)
        try:
            while not self._replay_stop:
                sending = any(c.queue and c.blocked_since is None for c in clients.values())
                blocked = any(c.blocked_since is not None for c in clients.values())
                wait = 0 if sending else (10 if blocked else None)
                ready = dict(poller.poll(wait))
                if router in ready:
                    self._serve_requests(router, clients, waiters, rates)
                if self._rbell_rx in ready:
                    with contextlib.suppress(zmq.Again):
                        while True:
                            self._rbell_rx.recv(zmq.NOBLOCK)
                    self._hand_out_snapshot(clients, waiters)
                self._send_replays(router, clients)
                if sending:
                    time.sleep(0)  # let the sender thread run between chunks
        except Exception:
            log.exception("publisher %s: replay thread failed", self._endpoint)
        finally:
            router.close(linger=0)
            self._rbell_rx.close(linger=0)

    def _serve_requests(
        self,
        router: zmq.Socket[bytes],
        clients: dict[bytes, _Client],
        waiters: list[bytes],
        rates: _RateLimit,
    ) -> None:
        now = time.monotonic()
        with contextlib.suppress(zmq.Again):
            for _ in range(256):  # then the replies in flight get a turn
                frames = router.recv_multipart(zmq.NOBLOCK)
                if len(frames) != 3 or frames[1] != b"":
                    self._malformed(frames)
                    continue
                ident, body = frames[0], frames[2]
                if not rates.allow(ident, now):
                    self._stats.replay_refused += 1  # a flood: the client times out
                    continue
                client = clients.get(ident)
                if client is not None and client.queue:
                    # a client waits for its reply before asking again (one that gives up
                    # asks under a new identity): a request on top of an unfinished replay is
                    # a flood, refused so the replay in progress goes on
                    self._stats.replay_refused += 1
                    continue
                if client is None:
                    if len(clients) >= self._max_clients:
                        self._stats.replay_refused += 1
                        self._refuse(router, ident, body)
                        continue
                    client = clients[ident] = _Client()
                if body == SNAPSHOT_TAG:
                    self._stats.snapshot_requests += 1
                    if self._provider is None:
                        self._refuse(router, ident, body)
                    elif ident not in waiters:
                        waiters.append(ident)
                        self._snapshot_wanted = True
                elif (request := parse_replay_request(body)) is not None:
                    self._stats.replay_requests += 1
                    start, extended = request
                    # The end marker says how far the publisher had got when these items were
                    # taken (what _info says, read before them): read when it is sent, it
                    # could name seqs ringed since, which this reply does not hold, and the
                    # client would take them for lost.
                    info = self._info()
                    with self._ring_lock:
                        i = bisect.bisect_left(self._ring_seqs, start)
                        items = list(itertools.islice(self._ring, i, None))
                    if self._replay_topic_frame:
                        topic = self._topic
                        client.queue.extend((b"", topic, SEQ.pack(q), p) for q, p in items)
                    else:
                        client.queue.extend((b"", SEQ.pack(q), p) for q, p in items)
                    client.queue.append(self._end_marker(pack_info(info) if extended else b""))
                    self._stats.replayed_batches += len(items)
                else:
                    self._malformed(frames)

    def _end_marker(self, body: bytes) -> tuple[bytes, ...]:
        """The end of a replay: ``body`` is empty (engine-exact) but for the extensions."""
        if self._replay_topic_frame:
            return (b"", b"", END_SEQ, body)
        return (b"", END_SEQ, body)

    def _refuse(self, router: zmq.Socket[bytes], ident: bytes, body: bytes) -> None:
        with contextlib.suppress(zmq.ZMQError):
            if body == SNAPSHOT_TAG:
                header = pack_header(SnapshotHeader(self.incarnation, 0, 0, 0))
                router.send_multipart((ident, b"", SNAPSHOT_TAG, header, b""), zmq.NOBLOCK)
            else:
                request = parse_replay_request(body)
                info = pack_info(self._info()) if request is not None and request[1] else b""
                router.send_multipart((ident, *self._end_marker(info)), zmq.NOBLOCK)

    def _hand_out_snapshot(self, clients: dict[bytes, _Client], waiters: list[bytes]) -> None:
        with self._snap_lock:
            ready, self._snap_ready = self._snap_ready, None
        if ready is None or not waiters:
            return
        next_seq, events = ready
        ts = time.time()
        payloads = [encode_batch(part, ts, self._dp_rank) for part in split_parts(events)]
        n = len(payloads)
        for ident in waiters:
            client = clients.setdefault(ident, _Client())
            for i, payload in enumerate(payloads):
                header = pack_header(SnapshotHeader(self.incarnation, next_seq, i, n))
                client.queue.append((b"", SNAPSHOT_TAG, header, payload))
            self._stats.snapshots_sent += 1
        waiters.clear()

    def _send_replays(self, router: zmq.Socket[bytes], clients: dict[bytes, _Client]) -> None:
        now = time.monotonic()
        for ident, client in list(clients.items()):
            queue = client.queue
            try:
                for _ in range(_REPLAY_CHUNK):
                    if not queue:
                        break
                    router.send_multipart((ident, *queue[0]), zmq.NOBLOCK)
                    queue.popleft()
                client.blocked_since = None
            except zmq.Again:
                if client.blocked_since is None:
                    client.blocked_since = now
                elif now - client.blocked_since > self._client_timeout_s:
                    self._drop_client(clients, ident, "stopped reading its replay")
            except zmq.ZMQError as exc:  # gone (ROUTER_MANDATORY: unroutable)
                self._drop_client(clients, ident, str(exc))
                continue
            if not queue:
                del clients[ident]  # owed nothing: forget it

    def _drop_client(self, clients: dict[bytes, _Client], ident: bytes, why: str) -> None:
        clients.pop(ident, None)
        self._stats.replay_clients_dropped += 1
        log.warning("publisher %s: replay client dropped: %s", self._endpoint, why)

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

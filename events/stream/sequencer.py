"""The one state machine that orders a worker's event stream (no sockets, time passed in).

A publisher numbers its batches 0, 1, 2, ... per incarnation (WIRE.md 4). What reaches a
consumer may be dropped, duplicated, reordered, cut short, or come from a publisher that
restarted. :class:`StreamSequencer` turns what arrives into an exact history, or says loudly
that it cannot. Its inputs are what the transport saw (a live frame, a replayed frame, the end
of a replay, a snapshot, a reconnect, the passing of time); its outputs are messages for the
consumer (:class:`Deliver`, :class:`Lost`, :class:`Reset`) and commands for the transport
(:class:`Request`, :class:`RequestSnapshot`, :class:`Abandon`), in the order they must happen.
The subscriber, ``kv-events listen`` and the doctor's live mode all drive this one class.

Rules:

* **order**: batches are delivered in seq order. A frame above the next expected seq is held
  back while the gap is replayed; replayed batches come first, then the held ones, so an older
  event never lands after a newer one. Duplicates (same seq, same bytes) are dropped.
* **loss**: a gap that replay cannot fill (no replay endpoint, the ring forgot it, the replay
  endpoint stays silent, an undecodable replayed batch) is :class:`Lost`: the consumer drops
  the worker's view, and the stream goes on from the first seq still available.
* **restart**: a seq going backwards with other bytes than the batch first received under it,
  or a publisher incarnation (learned at the end of every replay, see :mod:`events.stream.snapshot`)
  that changed, is :class:`Lost` ("publisher restarted"); the new stream is taken from seq 0.
* **snapshot**: while the history is incomplete and the publisher answers snapshot requests,
  one is requested; its :class:`Reset` replaces the consumer's view with the publisher's state
  at a stated seq, and the stream continues after it: the view is exact again in one round trip.
* **join**: a consumer that joins a worker (:meth:`StreamSequencer.join`) asks its replay for
  the history from seq 0 at once, so an idle publisher's state is known before its next batch
  (no blind start); after a reconnect it does the same (an engine's replayed batches are
  compared with the ones delivered under the same seqs: another batch means a restart).
* **probe**: after the first frame, after a reconnect and after every ``probe_interval_s`` of
  quiet, a hello (a replay request for the end marker alone) asks the publisher for its info: a
  restart that kept the seqs going and a lost tail (then fetched by a replay) are found that
  way, not only when the next batch arrives.
* **engine-exact requests**: with probes, the replay requests that fetch batches are *extended*
  (:func:`events.stream.snapshot.replay_request`): this project's publishers end their reply
  with their info, engines read the request as a seq beyond their ring and send their end marker
  alone, after which this stream asks them in the engines' own form. Plain requests get the
  engines' plain reply from either kind of publisher (WIRE.md 5).
* **backlog**: a consumer may be behind, its frames still queued on its live socket; a replay
  that finds the ring moved on must not call them lost. A gap's replay takes nothing beyond the
  highest seq received live, and a straggler too old to judge is checked against the
  publisher's incarnation instead of being taken for a restart.

"ok" (:attr:`StreamSequencer.complete`) means the delivered history is provably complete: from
seq 0 of the current incarnation, since a delivered clear, or since an applied snapshot.
"""

from __future__ import annotations

import heapq
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Generic, Literal, TypeAlias, TypeVar

# HELLO_START is re-exported: it lives with the other extensions in events.stream.snapshot
from events.stream.snapshot import HELLO_START as HELLO_START
from events.stream.snapshot import PublisherInfo, Snapshot

T = TypeVar("T")

DIGEST_WINDOW: Final = 4096
#: the longest wait between two joins of an endpoint that has not answered yet
JOIN_RETRY_MAX_S: Final = 30.0


@dataclass(slots=True)  # not frozen: built once per batch, and frozen init costs 4x
class Deliver(Generic[T]):
    """Apply ``item`` (batch ``seq``); ``snapshot`` marks the parts of an applied snapshot."""

    seq: int
    item: T
    replayed: bool = False
    snapshot: bool = False


@dataclass(frozen=True, slots=True)
class Lost:
    """History was lost: drop the worker's view; later deliveries rebuild what they can.
    ``span``: the seqs known lost (first, last), when known; ``restart``: a new publisher."""

    reason: str
    span: tuple[int, int] | None = None
    restart: bool = False


@dataclass(frozen=True, slots=True)
class Reset:
    """Drop the worker's view: the snapshot deliveries that follow replace it exactly."""

    reason: str
    next_seq: int


@dataclass(frozen=True, slots=True)
class Request:
    """Transport: send a replay request from ``start``; ``extended``: in this project's form,
    whose reply ends with the publisher's info (:func:`events.stream.snapshot.replay_request`)."""

    start: int
    extended: bool = False


@dataclass(frozen=True, slots=True)
class RequestSnapshot:
    """Transport: send a snapshot request."""


@dataclass(frozen=True, slots=True)
class Abandon:
    """Transport: replies to the request in flight must never be read (new DEALER identity)."""


Output: TypeAlias = "Deliver[T] | Lost | Reset | Request | RequestSnapshot | Abandon"
Mode = Literal["live", "replay", "snapshot"]
#: what a replay request is for: fill a known gap, learn the publisher's info (a hello, also
#: after a reconnect), look for a lost tail after a quiet spell (probe), fetch that tail, fetch
#: the whole history on joining (join) or after a reconnect (rejoin)
RequestKind = Literal["gap", "hello", "probe", "tail", "join", "rejoin"]


def digest(payload: bytes) -> int:
    """Tells a repeat of a payload from another payload under the same seq (crc32 and length:
    fast, and equal in every process, unlike ``hash()``)."""
    return zlib.crc32(payload) | (len(payload) << 32)


class StreamSequencer(Generic[T]):
    """Sequences one worker's stream; see the module docstring.

    ``decode`` turns a payload into the delivered item (raising ``ValueError`` for a bad one);
    ``is_clear`` says whether an item empties the publisher's state (its history is then
    complete). ``replay``: whether the worker has a replay endpoint.
    """

    def __init__(
        self,
        decode: Callable[[bytes], T],
        *,
        is_clear: Callable[[T], bool] = lambda _: False,
        replay: bool = True,
        replay_timeout_s: float = 1.0,
        replay_max_s: float = 30.0,
        snapshot_timeout_s: float = 5.0,
        probe_interval_s: float | None = None,
        digest_window: int = DIGEST_WINDOW,
    ) -> None:
        self._decode = decode
        self._is_clear = is_clear
        self.replay = replay
        self.replay_timeout_s = replay_timeout_s
        self.replay_max_s = replay_max_s
        self.snapshot_timeout_s = snapshot_timeout_s
        self.probe_interval_s = probe_interval_s
        self._window = digest_window
        self.mode: Mode = "live"
        self.next_seq: int | None = None
        self.last_seq: int | None = None
        self.complete = False
        self.incarnation: int | None = None
        self.snapshots = False  # the publisher answers snapshot requests
        #: whether the publisher answers extended requests (this project's) or not (an
        #: engine's); None: not known yet
        self.extended: bool | None = None
        self._request_extended = False
        self._request_first = 0
        self._replay_high = -1  # the highest seq replayed in answer to the request in flight
        self._join_at: float | None = None  # when to ask an unanswered join again
        self._join_wait = replay_timeout_s
        self._rejoin = False  # a restart was found: fetch the new stream's history from 0
        self._pending: dict[int, bytes] = {}
        self._heap: list[int] = []
        self._deadline: float | None = None
        self._hard_deadline = 0.0
        self._progress = False
        self._retry_snapshot_at = 0.0
        self._next_probe: float | None = None
        self._mark = 0  # 1 + the highest live seq received from this publisher
        self._mark_at_request = 0
        self._request_start = 0
        self._request_kind: RequestKind = "gap"
        self._verify = False  # a straggler arrived: ask whether the publisher restarted
        self._reconnect_probe = False  # a probe after a reconnect is in flight
        self._digests: dict[int, int] = {}
        self._digest_order: deque[int] = deque()
        self.received = 0
        self.gaps = 0
        self.replayed = 0
        """Batches taken from replies to gap replays, some of which may also have come live
        meanwhile: how many depends on when the gap was seen, a matter of timing."""
        self.recovered = 0
        """Batches only a replay delivered: lost on the live socket (or sent before this
        consumer joined). Live frames arrive in order, so a replayed batch below the highest
        seq received live can no longer come live: the count depends on what was lost, not on
        timing."""
        self.duplicates = 0
        self.restarts = 0
        self.resyncs = 0
        self.snapshots_applied = 0
        self.decode_errors = 0

    # ------------------------------------------------------------------ inputs

    @property
    def deadline(self) -> float | None:
        """When :meth:`tick` must next be called (None: only when something arrives)."""
        if self._deadline is not None:
            return self._deadline
        wake = self._next_probe
        if self._join_at is not None:
            wake = self._join_at if wake is None else min(wake, self._join_at)
        if not self.complete and self.snapshots and self.replay and self.mode == "live":
            wake = self._retry_snapshot_at if wake is None else min(wake, self._retry_snapshot_at)
        return wake

    @property
    def held(self) -> int:
        return len(self._pending)

    def drain_held(self) -> list[tuple[int, bytes]]:
        """Hand over (and forget) the frames held back for a gap, in seq order."""
        held = sorted(self._pending.items())
        self._pending.clear()
        self._heap.clear()
        return held

    def live(self, seq: int, payload: bytes, now: float) -> list[Output[T]]:
        """A frame from the live socket."""
        out: list[Output[T]] = []
        self.received += 1
        mark = self._mark
        if seq >= mark:
            nxt = self.next_seq
            if nxt is not None and mark and seq > mark and seq > nxt:
                self.gaps += 1  # seqs skipped between the highest one seen and this one
            self._mark = seq + 1
        self._on_live(seq, payload, out, now)
        self._after(out, now)
        return out

    def replayed_frame(self, seq: int, payload: bytes, now: float) -> list[Output[T]]:
        """A batch replayed in answer to the request in flight."""
        out: list[Output[T]] = []
        if self.mode == "replay":
            self._on_replayed(seq, payload, out, now)
            self._after(out, now)
        return out

    def replay_end(self, info: PublisherInfo | None, now: float) -> list[Output[T]]:
        """The end marker of the replay in flight, with the publisher's info if it sent one."""
        out: list[Output[T]] = []
        if self.mode != "replay":
            return out
        self.mode = "live"
        self._deadline = None
        kind = self._request_kind
        start = self._request_start
        plain = info is None and (self._request_extended or kind in ("hello", "probe"))
        if plain and self._plain_answer(kind, out, now):
            self._after(out, now)
            return out
        self._reconnect_probe = False
        # another request is worth it when this one may not have covered the gap: something
        # came back, the stream moved on while it was in flight, a live frame newer than the
        # request arrived, or the publisher had not yet handled the missing seqs when it
        # answered. Else the ring no longer has them.
        progress = (
            self._progress
            or self.next_seq != start
            or self._mark > self._mark_at_request  # a frame revealed the gap after the ask
            or (info is not None and self.next_seq is not None and info.next_seq <= self.next_seq)
        )
        if info is not None:
            self._learn(info, out)
            if kind == "join" and info.next_seq == 0 and self.next_seq == 0:
                self.complete = True  # it has published nothing: the empty history is all
        elif (
            kind == "join"
            and not self._request_extended
            and self._replay_high < 0
            and self.next_seq == 0
            and not self._pending
            and self._mark == 0
        ):
            # an engine's ring keeps its newest batches and forgets only past its size: an
            # empty one has published nothing yet, so the empty history is all
            self.complete = True
        reached = max(-1 if self.last_seq is None else self.last_seq, self._mark - 1)
        if self._request_kind == "rejoin" and self._replay_high < reached:
            # a publisher's ring keeps its newest batch, so the same one would have replayed
            # at least the newest seq this stream received (engines ring a batch as they
            # send it, this project's publishers before)
            self.restarts += 1
            self._lost(
                f"publisher restarted: its replay no longer reaches seq {reached}",
                out,
                restart=True,
            )
            self._forget_stream()
            self.next_seq = 0
            self._rejoin = True
        if self._rejoin and self.mode == "live":
            self._rejoin = False
            self._request_replay(out, now, "join")  # the new stream's history, at once
            self._after(out, now)
            return out
        self._advance(
            out,
            now,
            allow_replay=progress,
            why=f"replay from seq {start} ended without covering the gap",
        )
        if (
            kind in ("probe", "tail", "join", "rejoin")
            and info is not None
            and self.mode == "live"
            and self.next_seq is not None
            and not self._pending
            and self.next_seq < info.next_seq
        ):
            # after a quiet spell the publisher has handled seqs this stream never saw: fetch
            # them; if the ring no longer has them, they are lost
            if kind == "probe" or progress:
                self._request_replay(out, now, "tail")
            else:
                self._lost(
                    f"seqs {self.next_seq}..{info.next_seq - 1} were never sent (dropped by the "
                    "publisher) or expired",
                    out,
                    (self.next_seq, info.next_seq - 1),
                )
                self.next_seq = info.next_seq
        self._after(out, now)
        return out

    def malformed(self) -> None:
        """A replay reply that could not be parsed: counted; it does not extend the replay."""
        self.decode_errors += 1

    def snapshot(self, snap: Snapshot, now: float) -> list[Output[T]]:
        """A complete snapshot reply (or a refusal)."""
        out: list[Output[T]] = []
        if self.mode != "snapshot":
            return out
        self.mode = "live"
        self._deadline = None
        items: list[T] = []
        failed = "refused" if snap.refused else None
        if failed is None:
            try:
                items = [self._decode(p) for p in snap.payloads]
            except ValueError as exc:
                self.decode_errors += 1
                failed = f"undecodable: {exc}"
        if failed is not None:
            self._retry_snapshot_at = now + self.snapshot_timeout_s
            self._advance(out, now, allow_replay=True, why="snapshot " + failed)
            self._after(out, now)
            return out
        self.snapshots_applied += 1
        self.incarnation = snap.incarnation
        seq = snap.next_seq
        out.append(Reset(f"state replaced by a snapshot at seq {seq}", seq))
        for item in items:
            out.append(Deliver(max(seq - 1, 0), item, snapshot=True))
        self.complete = True
        self.next_seq = seq
        self.last_seq = seq - 1 if seq else None
        self._digests.clear()
        self._digest_order.clear()
        for s in [s for s in self._pending if s < seq]:
            del self._pending[s]
        self._advance(out, now, allow_replay=True, why="gap after a snapshot")
        self._after(out, now)
        return out

    def reconnected(self, now: float) -> list[Output[T]]:
        """The live transport completed a new handshake: maybe another publisher. Probe."""
        out: list[Output[T]] = []
        if not self.replay or self.probe_interval_s is None or self.next_seq is None:
            return out
        if self.mode != "live":
            out.append(Abandon())
            self.mode = "live"
            self._deadline = None
        if self.extended and self.probe_interval_s is not None:
            self._request_replay(out, now, "hello")  # its incarnation says whether it restarted
        else:
            # an engine (or a publisher not known yet): its history from seq 0, compared with
            # what was delivered (another batch under a delivered seq is a restart)
            self._request_replay(out, now, "rejoin", start=0)
        self._reconnect_probe = True
        return out

    def join(self, now: float) -> list[Output[T]]:
        """The consumer joins the worker: ask its replay for the history from seq 0 at once,
        so that an idle publisher's state is known before its next batch. Nothing to do
        without a replay endpoint or once the stream has started."""
        out: list[Output[T]] = []
        if not self.replay or self.next_seq is not None or self.mode != "live":
            return out
        self.next_seq = 0
        self._request_replay(out, now, "join")
        self._after(out, now)
        return out

    def tick(self, now: float) -> list[Output[T]]:
        """Let time pass: expire requests, retry a snapshot, probe."""
        out: list[Output[T]] = []
        if self._deadline is not None and now >= self._deadline:
            what = self.mode
            self.mode = "live"
            self._deadline = None
            out.append(Abandon())
            if what == "snapshot":
                self._retry_snapshot_at = now + self.snapshot_timeout_s
                self._advance(out, now, allow_replay=True, why="snapshot request unanswered")
            else:
                if self._reconnect_probe:
                    # maybe another publisher now, maybe not: the view may hold its blocks
                    self._reconnect_probe = False
                    self._lost(
                        "reconnected, and the replay endpoint did not say whether the "
                        "publisher restarted",
                        out,
                    )
                    self._forget_stream()
                    return self._tick_done(out, now)
                if self._request_kind == "join" and self._nothing_yet():
                    # unanswered, nothing received: the endpoint may not be up yet (an engine
                    # loading its model): ask again later, waiting longer each time
                    self._join_at = now + self._join_wait
                    self._join_wait = min(2 * self._join_wait, JOIN_RETRY_MAX_S)
                    return self._tick_done(out, now)
                if now >= self._hard_deadline:
                    why = f"replay took longer than {round(self.replay_max_s * 1000)} ms"
                else:
                    why = f"replay endpoint silent for {round(self.replay_timeout_s * 1000)} ms"
                self._advance(out, now, allow_replay=False, why=why)
        elif self.mode == "live" and self._join_at is not None and now >= self._join_at:
            self._join_at = None
            if self._nothing_yet():
                self._request_replay(out, now, "join")
        elif (
            self.mode == "live"
            and self._next_probe is not None
            and now >= self._next_probe
            and self.next_seq is not None
        ):
            self._request_replay(out, now, "probe")
        self._after(out, now)
        return out

    def _nothing_yet(self) -> bool:
        """Joined, and nothing delivered, held or learned since."""
        return (
            self.next_seq == 0
            and self.last_seq is None
            and not self._pending
            and self.incarnation is None
            and self.extended is None
        )

    # ------------------------------------------------------------------ logic

    def _after(self, out: list[Output[T]], now: float) -> None:
        """Request a snapshot when one can make an incomplete history exact; plan the probe."""
        if self._verify and self.mode == "live" and self.next_seq is not None:
            self._verify = False
            self._request_replay(out, now, "hello")
        if (
            self.mode == "live"
            and not self.complete
            and self.snapshots
            and self.replay
            and self.next_seq is not None
            and now >= self._retry_snapshot_at
        ):
            out.append(RequestSnapshot())
            self.mode = "snapshot"
            self._deadline = now + self.snapshot_timeout_s
        # an engine's replay says nothing a probe could learn: only this project's are probed
        probes = self.probe_interval_s is not None and self.extended is not False
        if self.mode == "live" and self.replay and probes:
            assert self.probe_interval_s is not None
            if self._next_probe is None or out:
                self._next_probe = now + self.probe_interval_s
        else:
            self._next_probe = None

    def _learn(self, info: PublisherInfo, out: list[Output[T]]) -> None:
        """Take the publisher's info from an end marker; a different publisher means a restart.

        Two signs, each airtight: another incarnation id, or fewer seqs handled than this
        consumer had received before it sent the request (every frame received was handled
        before it was sent, so the publisher that sent it had handled more).
        """
        changed = self.incarnation is not None and info.incarnation != self.incarnation
        behind = info.next_seq < self._mark_at_request
        if changed or behind:
            self.restarts += 1
            why = (
                f"incarnation {self.incarnation:016x} became {info.incarnation:016x}"
                if changed and self.incarnation is not None
                else f"it has handled {info.next_seq} seqs, {self._mark_at_request} were seen"
            )
            self._lost(f"publisher restarted: {why}", out, restart=True)
            # the frames held may be the old publisher's: the new stream is replayed from 0
            self._drop_held()
            self._mark = 0
            self.next_seq = 0
            self.last_seq = None
            self._rejoin = True
        self.incarnation = info.incarnation
        self.snapshots = info.snapshots
        self.extended = True

    def _plain_answer(self, kind: RequestKind, out: list[Output[T]], now: float) -> bool:
        """A reply without this project's info to a request that asks for it: the endpoint is
        an engine's (it read an extended request as a seq beyond its ring). True when the
        request is asked again, in the engines' form."""
        was_ours = self.extended
        self.extended = False
        if was_ours:
            # it answered this project's requests before: another publisher now
            self.restarts += 1
            self._lost(
                "publisher restarted: its replay endpoint no longer answers this project's "
                "requests",
                out,
                restart=True,
            )
            self._forget_stream()
            self.next_seq = 0
            self._reconnect_probe = False
            self._request_replay(out, now, "join")
            return True
        if not self._request_extended:
            return False  # a hello to an engine: nothing more to learn
        self._request_replay(out, now, kind, start=self._request_first)  # the same, plain
        return True

    def _on_live(self, seq: int, payload: bytes, out: list[Output[T]], now: float) -> None:
        if self.next_seq is None:
            self._first(seq, payload, out, now)
            return
        if seq < self.next_seq or seq in self._pending:
            if self._is_duplicate(seq, payload):
                self.duplicates += 1
            else:
                self._restart(seq, payload, out, now)
            return
        if seq == self.next_seq and self.mode != "snapshot":
            # in order: applied at once, even while a replay is in flight (its copy of this
            # batch is then a duplicate), so a probe never delays the live stream
            self._apply(seq, payload, out, now, replayed=False)
        else:
            self._hold(seq, payload)
        self._advance(out, now, allow_replay=True, why="gap in the live stream")

    def _first(self, seq: int, payload: bytes, out: list[Output[T]], now: float) -> None:
        self.next_seq = 0
        if seq == 0:
            self._apply(seq, payload, out, now, replayed=False)
        else:
            self._hold(seq, payload)
        self._advance(out, now, allow_replay=True, why=f"stream joined at seq {seq}")
        if (
            self.replay
            and self.probe_interval_s is not None
            and self.incarnation is None
            and self.mode == "live"
        ):
            # a hello: the end of this (empty) replay names the incarnation, so that a later
            # restart is recognised whatever seq the new publisher shows first
            self._request_replay(out, now, "hello")

    def _is_duplicate(self, seq: int, payload: bytes) -> bool:
        held = self._pending.get(seq)
        if held is not None:
            return held == payload
        known = self._digests.get(seq)
        if known is not None:
            return known == digest(payload)
        # never received under this seq: a stale straggler, unless it can only be a new stream
        assert self.next_seq is not None
        if seq == 0:
            return False
        if seq + self._window >= self.next_seq:
            return True
        if self.incarnation is not None and self.replay:
            self._verify = True  # too old to tell: the publisher's info will say
            return True
        return False

    def _restart(self, seq: int, payload: bytes, out: list[Output[T]], now: float) -> None:
        self.restarts += 1
        self._lost(
            f"publisher restarted: seq {seq} arrived after seq {self.last_seq}", out, restart=True
        )
        if self.mode != "live":
            out.append(Abandon())  # replies of the old stream must not be read as the new
        self.mode = "live"
        self._deadline = None
        self._drop_held()
        self.incarnation = None
        self.next_seq = None
        self._mark = seq + 1
        self._first(seq, payload, out, now)

    def _drop_held(self) -> None:
        """Forget the frames held back and the digests of the applied ones: they belong to a
        stream that is over."""
        self._pending.clear()
        self._heap.clear()
        self._digests.clear()
        self._digest_order.clear()

    def _forget_stream(self) -> None:
        """Start over as a new consumer would: the next frame opens the stream."""
        self._drop_held()
        self.incarnation = None
        self.next_seq = None
        self.last_seq = None
        self._mark = 0

    def _tick_done(self, out: list[Output[T]], now: float) -> list[Output[T]]:
        self._after(out, now)
        return out

    def _hold(self, seq: int, payload: bytes) -> None:
        if seq not in self._pending:
            self._pending[seq] = payload
            heapq.heappush(self._heap, seq)  # may duplicate a stale entry; skipped later

    def _advance(self, out: list[Output[T]], now: float, *, allow_replay: bool, why: str) -> None:
        """Apply held frames in order; at a gap, replay it or (if not allowed) lose it."""
        pending, heap = self._pending, self._heap
        while heap and self.mode != "snapshot":
            assert self.next_seq is not None
            seq = heap[0]
            if seq not in pending:
                heapq.heappop(heap)  # stale entry
            elif seq < self.next_seq:
                heapq.heappop(heap)
                del pending[seq]
                self.duplicates += 1
            elif seq == self.next_seq:
                heapq.heappop(heap)
                self._apply(seq, pending.pop(seq), out, now, replayed=False)
            elif self.mode != "live":
                return  # the request in flight covers the gap
            elif allow_replay and self.replay:
                self._request_replay(out, now)
            else:
                lost = f"seqs {self.next_seq}..{seq - 1} lost"
                if not self.replay:
                    lost += " and the worker has no replay endpoint"
                self._lost(f"{why}: {lost}", out, (self.next_seq, seq - 1))
                self.next_seq = seq

    def _request_replay(
        self, out: list[Output[T]], now: float, kind: RequestKind = "gap", start: int | None = None
    ) -> None:
        assert self.next_seq is not None
        hello = kind in ("hello", "probe")
        extended = not hello and self.probe_interval_s is not None and self.extended is not False
        first = self.next_seq if start is None else start
        out.append(Request(HELLO_START if hello else first, extended))
        self._request_extended = extended
        self._request_first = first
        self._replay_high = -1
        self._request_kind = kind
        self._request_start = self.next_seq
        self._mark_at_request = self._mark
        self.mode = "replay"
        self._deadline = now + self.replay_timeout_s
        self._hard_deadline = now + self.replay_max_s
        self._progress = False

    def _on_replayed(self, seq: int, payload: bytes, out: list[Output[T]], now: float) -> None:
        assert self.next_seq is not None
        kind = self._request_kind
        self._replay_high = max(self._replay_high, seq)
        if kind == "rejoin" and seq < self.next_seq:
            known = self._digests.get(seq)
            if known is None or known == digest(payload):
                self.duplicates += 1  # delivered already (or too old to tell)
                return
            # another batch under a seq this stream delivered: the publisher restarted
            self.restarts += 1
            self._lost(
                f"publisher restarted: replayed seq {seq} is not the batch delivered under it",
                out,
                restart=True,
            )
            self._forget_stream()
            self.next_seq = 0
            self._request_kind = "join"  # the rest of this reply is the new stream's history
        if kind in ("hello", "probe") or (kind == "gap" and seq >= self._mark_at_request):
            # beyond every seq received live: this consumer may simply be behind, with the
            # frame still queued on its live socket (a ring that moved on must not make a
            # backlog look lost); the live stream brings it, or shows its loss as a gap
            return
        self.replayed += 1
        pending = self._pending
        while self.next_seq < seq:
            start = self.next_seq
            held = pending.pop(start, None)
            if held is not None:
                self._apply(start, held, out, now, replayed=True)  # a held frame bridges it
                continue
            resume = min((s for s in pending if start < s < seq), default=seq)
            self._lost(
                f"replay reached seq {seq} without seqs {start}..{resume - 1}: the publisher no "
                "longer buffers them (expired, or dropped before they were sent)",
                out,
                (start, resume - 1),
            )
            self.next_seq = resume
        if seq < self.next_seq:
            self.duplicates += 1
            return
        # only progress extends the replay, and never past replay_max_s: an endpoint that
        # trickles garbage or repeats cannot keep the stream waiting
        self._deadline = min(now + self.replay_timeout_s, self._hard_deadline)
        self._progress = True
        held = pending.pop(seq, None)
        if held is not None:  # it also arrived live: delivered as such
            self._apply(seq, held, out, now, replayed=False)
        elif self._apply(seq, payload, out, now, replayed=True):
            self.recovered += 1

    def _apply(
        self, seq: int, payload: bytes, out: list[Output[T]], now: float, *, replayed: bool
    ) -> bool:
        """Decode and deliver batch ``seq``; False when it does not decode."""
        try:
            item = self._decode(payload)
        except ValueError as exc:
            self.decode_errors += 1
            if replayed or not self.replay:
                self._lost(f"batch seq {seq} cannot be decoded: {exc}", out)
                self.next_seq = seq + 1
            elif self.mode == "live":
                self._request_replay(out, now)  # a fresh copy may decode; if not, it is lost
            return False
        if seq == 0 or self._is_clear(item):
            self.complete = True
        self.next_seq = seq + 1
        self.last_seq = seq
        self._digests[seq] = digest(payload)
        self._digest_order.append(seq)
        if len(self._digest_order) > self._window:
            self._digests.pop(self._digest_order.popleft(), None)
        out.append(Deliver(seq, item, replayed=replayed))
        return True

    def _lost(
        self,
        reason: str,
        out: list[Output[T]],
        span: tuple[int, int] | None = None,
        *,
        restart: bool = False,
    ) -> None:
        self.resyncs += 1
        self.complete = False
        out.append(Lost(reason, span, restart))

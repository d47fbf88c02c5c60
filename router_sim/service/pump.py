"""The event pump: the router service's ZeroMQ side, on a thread of its own.

:class:`events.stream.subscriber.ZmqEventSubscriber` is synchronous and not thread-safe, and the
router's index is mutated by every applied batch. So one thread owns the subscriber: it polls
(the wait happens inside ZeroMQ, with the GIL released), then hands each round's messages to
the event loop, which applies them to the :class:`~router_sim.router.routing.Router` between two
HTTP
requests. The index therefore has a single writer, the loop, and routing reads it without a
lock. The pump waits until the loop has applied a round before polling again: when the loop is
busy, frames queue in ZeroMQ (bounded by the subscriber's HWM; a loss is replayed) rather than
in Python memory.

A round can be large (a late subscriber's replay, a burst of long prompts: a 512-block Stored
batch takes ~0.3 ms to apply), and requests wait while the loop applies it. So the loop applies
a round in slices of at most ``slice_s`` (one message at least), and between two slices goes
back to its sockets, so a request that arrived meanwhile waits for one slice, not the round.
Messages stay in order; the next round is polled once the whole round is applied.

Fleet changes (add, remove, resubscribe after a worker restart) are commands run on the pump's
thread, in order with the messages: a removal or a restart reaches the loop as a message placed
after every batch of the old subscription.

The statuses it hands out count over a worker's whole life in the fleet: when a subscription
ends (the worker restarted, or was removed), its counters are kept and added to those of the
next subscription of the same worker id, so a counter never goes back (Prometheus' ``rate()``
would read a decrease as a reset); a resubscription after a restart counts as one restart.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, TypeAlias

from events.stream.security import CurveClient
from events.stream.subscriber import (
    ResyncRequired,
    SubscriberMessage,
    WorkerStatus,
    ZmqEventSubscriber,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WorkerRemoved:
    """``worker`` left the fleet: forget it."""

    worker: int


PumpItem: TypeAlias = SubscriberMessage | WorkerRemoved

_COUNTERS: Final = (
    "received",
    "gaps",
    "replayed",
    "duplicates",
    "restarts",
    "resyncs",
    "decode_errors",
    "snapshots",
    "recovered",
)
MAX_RETIRED: Final = 65_536
"""Worker ids whose past counters are kept after they left (the oldest are forgotten)."""
_Command: TypeAlias = tuple[str, int, str | None, str | None, "concurrent.futures.Future[None]"]


class EventPump:
    """See the module docstring. ``apply`` runs on ``loop`` with each round's items."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        apply: Callable[[list[PumpItem]], None],
        *,
        replay_timeout_ms: int = 1000,
        poll_ms: int = 20,
        curve: CurveClient | None = None,
        slice_s: float = 0.001,
        on_slice: Callable[[float], None] | None = None,
    ) -> None:
        self._loop = loop
        self._apply = apply
        self._poll_ms = poll_ms
        self._slice_s = slice_s
        self._on_slice = on_slice  # told how long each slice held the loop
        self._sub = ZmqEventSubscriber(replay_timeout_ms=replay_timeout_ms, curve=curve)
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._statuses: dict[int, WorkerStatus] = {}
        self._retired: dict[int, dict[str, int]] = {}  # counters of ended subscriptions
        self._thread = threading.Thread(target=self._run, name="router-event-pump", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        """False once the pump's thread has stopped (closed, or failed: see the log)."""
        return self._thread.is_alive()

    def statuses(self) -> dict[int, WorkerStatus]:
        """The latest stream status of every subscribed worker (a snapshot, replaced whole
        after each round, so reading it from the loop needs no lock)."""
        return self._statuses

    # ------------------------------------------------------------- commands

    def _command(
        self, op: str, worker: int, events: str | None = None, replay: str | None = None
    ) -> asyncio.Future[None]:
        fut: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._commands.put((op, worker, events, replay, fut))
        return asyncio.wrap_future(fut, loop=self._loop)

    def add_worker(self, worker: int, events: str, replay: str | None) -> asyncio.Future[None]:
        """Subscribe to a worker's stream (raises what ``add_worker`` raises, when awaited)."""
        return self._command("add", worker, events, replay)

    def remove_worker(self, worker: int) -> asyncio.Future[None]:
        """Unsubscribe; the loop then receives :class:`WorkerRemoved`."""
        return self._command("remove", worker)

    def resubscribe(self, worker: int, events: str, replay: str | None) -> asyncio.Future[None]:
        """A new incarnation of ``worker`` runs: drop the old stream's state and start over
        (the loop receives ``ResyncRequired``; the new stream is replayed from its seq 0)."""
        return self._command("resubscribe", worker, events, replay)

    def _run_command(self, cmd: _Command, out: list[PumpItem]) -> None:
        """Run one command; its future is resolved later, once ``out`` reached the loop."""
        op, worker, events, replay, fut = cmd
        try:
            if op in ("remove", "resubscribe") and worker in self._sub.workers:
                self._retire(self._sub.status(worker), restart=op == "resubscribe")
                self._sub.remove_worker(worker)
            if op in ("add", "resubscribe"):
                assert events is not None
                self._sub.add_worker(worker, events, replay)
            if op == "remove":
                out.append(WorkerRemoved(worker))
            elif op == "resubscribe":
                out.append(ResyncRequired(worker, "the worker restarted (new incarnation)"))
        except Exception as exc:
            fut.set_exception(exc)

    def _retire(self, status: WorkerStatus, *, restart: bool) -> None:
        past = self._retired.pop(status.worker, None) or dict.fromkeys(_COUNTERS, 0)
        for name in _COUNTERS:
            past[name] += getattr(status, name)
        past["restarts"] += restart
        self._retired[status.worker] = past  # re-inserted: the newest last
        if len(self._retired) > MAX_RETIRED:
            del self._retired[next(iter(self._retired))]

    def _snapshot(self) -> dict[int, WorkerStatus]:
        """Every subscribed worker's status, its ended subscriptions' counters added."""
        out: dict[int, WorkerStatus] = {}
        for w in self._sub.workers:
            st = self._sub.status(w)
            past = self._retired.get(w)
            if past is not None:
                st = dataclasses.replace(st, **{k: getattr(st, k) + past[k] for k in _COUNTERS})
            out[w] = st
        return out

    # ------------------------------------------------------------- thread

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                items: list[PumpItem] = []
                done: list[concurrent.futures.Future[None]] = []
                while True:
                    try:
                        cmd = self._commands.get_nowait()
                    except queue.Empty:
                        break
                    self._run_command(cmd, items)
                    done.append(cmd[-1])
                if done:
                    # a command is complete once its effect is applied and visible in the
                    # statuses: whoever awaited it then sees the fleet as it asked
                    self._statuses = self._snapshot()
                    if items:
                        self._hand_over(items)
                        items = []
                    for fut in done:
                        if not fut.done():
                            fut.set_result(None)
                if self._sub.workers:
                    items.extend(self._sub.poll(self._poll_ms))
                else:
                    self._stop.wait(self._poll_ms / 1000.0)  # idle: nothing to poll yet
                self._statuses = self._snapshot()
                if items:
                    self._hand_over(items)
        except Exception:
            log.exception("the event pump stopped")
        finally:
            self._sub.close()

    def _hand_over(self, items: list[PumpItem]) -> None:
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        applied = 0

        def apply_slice() -> None:
            """Apply messages until the slice's time is spent, then let the loop serve its
            sockets and continue (see the module docstring)."""
            nonlocal applied
            start = time.perf_counter()
            try:
                while applied < len(items):
                    item = items[applied]
                    applied += 1
                    self._apply([item])
                    if applied < len(items) and time.perf_counter() - start >= self._slice_s:
                        self._loop.call_soon(apply_slice)
                        return
            except BaseException:
                done.set_result(None)
                raise
            finally:
                if self._on_slice is not None:
                    self._on_slice(time.perf_counter() - start)
            done.set_result(None)

        try:
            self._loop.call_soon_threadsafe(apply_slice)
        except RuntimeError:
            self._stop.set()  # the loop is closed: the service is shutting down
            return
        while not self._stop.is_set():
            try:
                done.result(timeout=0.5)
                return
            except concurrent.futures.TimeoutError:
                continue

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the thread and close the subscriber."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

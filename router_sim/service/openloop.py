"""An open-loop (constant-rate) HTTP load generator, to state "p99 at N requests/s".

A closed-loop generator (each connection sends its next request when the previous answer is
in) measures queueing by construction: at saturation, by Little's law, the mean latency is
its concurrency divided by the throughput, so its p99 says how deep the client keeps the
queue, not what a request costs at a given load. And when the server stalls, a closed-loop
client stops sending, so the requests it would have sent during the stall are never measured
(coordinated omission).

:class:`OpenLoop` sends on a fixed schedule instead (``start + k / rate``, or Poisson arrivals
of the same mean rate), whatever answers come back, over a pool of keep-alive connections
with one request in flight each, and charges every latency from the request's *scheduled*
send time, as wrk2 does: a late send (the client or the machine stalled) or a wait for a free
connection is part of the latency. It counts the sends that left late and the requests that
waited for a connection, so a client that could not keep its schedule is visible.

:class:`OpenLoop` is the pure part: a clock and a ``send(connection, index)`` are injected,
so it runs the same on a fake clock (tests) and on real sockets (:func:`run_open_loop`).
"""

from __future__ import annotations

import math
import random
import select
import socket
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass


def schedule(
    rate: float, duration_s: float, start: float = 0.0, *, poisson: bool = False, seed: int = 0
) -> list[float]:
    """Send times in ``[start, start + duration_s)`` at ``rate`` per second: evenly spaced,
    or Poisson arrivals (exponential gaps) of the same mean rate."""
    if not rate > 0 or not duration_s >= 0:
        raise ValueError(f"rate must be > 0 and duration >= 0, got {rate}, {duration_s}")
    end = start + duration_s
    if not poisson:
        return [start + k / rate for k in range(math.ceil(duration_s * rate - 1e-9))]
    rng = random.Random(seed)
    times: list[float] = []
    t = start
    while t < end:
        times.append(t)
        t += rng.expovariate(rate)
    return times


def quantile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank quantile (the smallest value with at least ``q`` of the values at or
    under it); NaN for no values."""
    if not sorted_values:
        return math.nan
    return sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)]


@dataclass(frozen=True, slots=True)
class OpenLoopReport:
    """What a run gives, over the requests scheduled in the measured window."""

    offered_rate: float
    scheduled: int
    completed: int
    errors: int  # answered with another status than 200, or lost with their connection
    unanswered: int  # still in flight (or never sent) when the run ended
    late_sends: int  # the client reached them more than ``late_after_s`` after their time
    waited_for_connection: int  # due while every connection had a request in flight
    send_lag_p99_s: float  # how late the client reached a request (not counting a wait
    send_lag_max_s: float  # for a connection: that is the server's doing)
    achieved_rate: float  # answers per second, from the window's start to the last answer
    latency_s: dict[str, float]  # p50, p90, p99, p99.9, max: from the scheduled send time
    service_p99_s: float  # p99 from the actual send time (what a closed loop would see)
    answered_total: int = 0  # status-200 answers over the whole run, warm-up included (what
    # the server decided: its CPU over the run divided by this is its cost per request)


QUANTILES = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("p99.9", 0.999), ("max", 1.0))


class OpenLoop:
    """Sends request ``k`` at ``times[k]`` on a free connection (see the module docstring).

    The driver calls :meth:`tick` when the next send is due (it returns when that is), and
    :meth:`answered` / :meth:`lost` as connections report. A request due while all
    connections are busy waits in FIFO order for the next one that frees.
    """

    def __init__(
        self,
        times: Sequence[float],
        connections: int,
        clock: Callable[[], float],
        send: Callable[[int, int], None],
        *,
        late_after_s: float = 0.001,
    ) -> None:
        if connections < 1:
            raise ValueError(f"connections must be >= 1, got {connections}")
        self.times = times
        self._clock = clock
        self._send = send
        self.late_after_s = late_after_s
        self._free = list(range(connections - 1, -1, -1))  # pop() takes connection 0 first
        self._inflight: dict[int, int] = {}  # connection -> request index
        self._backlog: deque[int] = deque()
        self._next = 0
        n = len(times)
        self.sent_at = [math.nan] * n
        self.lag = [math.nan] * n  # how late the client itself was (not a connection wait)
        self.done_at = [math.nan] * n
        self.ok = [False] * n
        self.waited = [False] * n

    @property
    def finished(self) -> bool:
        """Every request was sent and answered (or lost)."""
        return self._next == len(self.times) and not self._inflight and not self._backlog

    def tick(self) -> float | None:
        """Send every request due by now; the time the next one is due (None: all sent)."""
        now = self._clock()
        times = self.times
        while self._next < len(times) and times[self._next] <= now:
            self._dispatch(self._next)
            self._next += 1
        return times[self._next] if self._next < len(times) else None

    def _dispatch(self, i: int) -> None:
        self.lag[i] = self._clock() - self.times[i]
        if not self._free:
            self.waited[i] = True
            self._backlog.append(i)
            return
        self._start(self._free.pop(), i)

    def _start(self, conn: int, i: int) -> None:
        self._inflight[conn] = i
        self.sent_at[i] = self._clock()
        self._send(conn, i)

    def answered(self, conn: int, ok: bool) -> None:
        """``conn``'s answer is complete (``ok``: status 200); it takes the next waiting
        request, if any."""
        i = self._inflight.pop(conn)
        self.done_at[i] = self._clock()
        self.ok[i] = ok
        if self._backlog:
            self._start(conn, self._backlog.popleft())
        else:
            self._free.append(conn)

    def lost(self, conn: int) -> None:
        """``conn`` closed: its request (if any) failed, and it takes no more."""
        i = self._inflight.pop(conn, None)
        if i is not None:
            self.done_at[i] = self._clock()
        if conn in self._free:
            self._free.remove(conn)

    def report(self, window_start: float, window_end: float) -> OpenLoopReport:
        """Figures over the requests scheduled in ``[window_start, window_end)``."""
        idx = [i for i, t in enumerate(self.times) if window_start <= t < window_end]
        t = self.times
        done = [i for i in idx if not math.isnan(self.done_at[i])]
        good = [i for i in done if self.ok[i]]
        lags = sorted(self.lag[i] for i in idx if not math.isnan(self.lag[i]))
        lat = sorted(self.done_at[i] - t[i] for i in good)
        service = sorted(self.done_at[i] - self.sent_at[i] for i in good)
        last = max((self.done_at[i] for i in good), default=window_end)
        span = max(last, window_end) - window_start
        return OpenLoopReport(
            offered_rate=len(idx) / (window_end - window_start),
            scheduled=len(idx),
            completed=len(good),
            errors=len(done) - len(good),
            unanswered=len(idx) - len(done),
            late_sends=sum(1 for x in lags if x > self.late_after_s),
            waited_for_connection=sum(1 for i in idx if self.waited[i]),
            send_lag_p99_s=quantile(lags, 0.99),
            send_lag_max_s=quantile(lags, 1.0),
            achieved_rate=len(good) / span if span > 0 else math.nan,
            latency_s={name: quantile(lat, q) for name, q in QUANTILES},
            service_p99_s=quantile(service, 0.99),
            answered_total=sum(self.ok),
        )


class _Connection:
    """One keep-alive HTTP/1.1 connection: writes prebuilt requests, frames each answer by
    its status line and ``Content-Length`` (nothing else is parsed: the generator shares the
    cores with the server it measures)."""

    def __init__(self, conn: int, sock: socket.socket) -> None:
        self.conn, self.sock = conn, sock
        self.buf = b""

    def read(self) -> list[bool] | None:
        """The answers completed by what arrived (True: status 200); None: the server closed
        the connection or sent an answer that cannot be framed (no ``Content-Length``)."""
        try:
            data = self.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return []
        except OSError:
            return None
        if not data:
            return None
        self.buf += data
        done: list[bool] = []
        while True:
            head_end = self.buf.find(b"\r\n\r\n")
            if head_end < 0:
                return done
            head = self.buf[:head_end].lower()
            try:
                length = int(head.split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
            except (IndexError, ValueError):
                return None
            end = head_end + 4 + length
            if len(self.buf) < end:
                return done
            self.buf = self.buf[end:]
            done.append(head.startswith(b"http/1.1 200"))


def http_request(host: str, port: int, path: str, content_type: str, body: bytes) -> bytes:
    """A keep-alive HTTP/1.1 POST, as bytes."""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def run_open_loop(
    host: str,
    port: int,
    requests: Sequence[bytes],
    rate: float,
    duration_s: float,
    *,
    warmup_s: float = 0.5,
    connections: int = 64,
    poisson: bool = False,
    drain_s: float = 2.0,
) -> OpenLoopReport:
    """Send ``requests`` (round robin, prebuilt HTTP bytes) to ``host:port`` at ``rate``
    per second for ``warmup_s + duration_s``; report over the last ``duration_s``.

    The loop is written out (``select()`` on the connections with a request in flight, with
    a timeout to the next scheduled send): the generator runs on the cores it measures, and
    with asyncio's loop, transports and timers it took ~130 us of CPU per request here
    against ~90 (most of which is the kernel's loopback delivery). select's timeout has
    microseconds (epoll's whole milliseconds, which would be charged to every request). A
    send writes the whole request, blocking only when the socket's buffer is full; a
    connection that fails is not used again and its request counts as an error."""
    conns: list[_Connection] = []
    try:
        for k in range(connections):
            sock = socket.create_connection((host, port))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setblocking(False)
            conns.append(_Connection(k, sock))
        busy: dict[int, _Connection] = {}  # fileno -> connection with a request in flight

        def send(conn: int, i: int) -> None:
            c = conns[conn]
            data = requests[i % len(requests)]
            try:
                try:
                    sent = c.sock.send(data)
                except BlockingIOError:
                    sent = 0
                if sent < len(data):  # the buffer is full: wait for the rest to go
                    c.sock.setblocking(True)
                    c.sock.sendall(data[sent:])
                    c.sock.setblocking(False)
            except OSError:  # the server closed it (an idle keep-alive timed out, ...)
                driver.lost(conn)
                return
            busy[c.sock.fileno()] = c

        start = time.monotonic() + 0.01
        times = schedule(rate, warmup_s + duration_s, start, poisson=poisson)
        driver = OpenLoop(times, connections, time.monotonic, send)
        due: float | None = start
        deadline = math.inf
        while not driver.finished:
            now = time.monotonic()
            if due is not None and due <= now:
                due = driver.tick()
                if due is None:
                    deadline = now + drain_s
                continue
            if now >= deadline:
                break
            wait = min(due if due is not None else deadline, deadline) - now
            readable = list(busy)
            if not readable:
                time.sleep(wait)
                continue
            ready, _, _ = select.select(readable, [], [], wait)
            for fd in ready:
                c = busy[fd]
                answers = c.read()
                if answers is None or len(answers) > 1:  # closed, or answers not asked for
                    del busy[fd]
                    c.sock.close()
                    driver.lost(c.conn)
                elif answers:
                    del busy[fd]  # answered() may send the next request on it at once
                    driver.answered(c.conn, answers[0])
    finally:
        for c in conns:
            c.sock.close()
    return driver.report(start + warmup_s, start + warmup_s + duration_s)

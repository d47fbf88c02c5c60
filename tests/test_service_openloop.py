"""The open-loop load generator: send on schedule, charge latency from the scheduled time.

The scheduler runs on a fake clock (rates of 1,024/s keep every time an exact binary
fraction, so the expected latencies are exact); one short run goes through real loopback
sockets to an aiohttp server.
"""

from __future__ import annotations

import asyncio
import math
import socket
import threading
from collections.abc import Iterator

import pytest
from aiohttp import web

from router_sim.service.openloop import (
    OpenLoop,
    http_request,
    quantile,
    run_open_loop,
    schedule,
)

pytestmark = pytest.mark.timeout(30)

GAP = 1 / 1024  # the schedule's step at 1,024 requests/s


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_schedule_is_evenly_spaced_or_poisson_with_the_same_mean_rate() -> None:
    assert schedule(1024, 4 * GAP, start=1.0) == [1.0 + k * GAP for k in range(4)]
    assert len(schedule(1000, 2.0)) == 2000
    arrivals = schedule(1000, 20.0, poisson=True, seed=3)
    assert 19_000 < len(arrivals) < 21_000  # 20,000 expected, sd ~141
    assert arrivals == sorted(arrivals) and arrivals[-1] < 20.0
    with pytest.raises(ValueError):
        schedule(0, 1.0)


def test_quantile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert quantile(values, 0.5) == 50.0
    assert quantile(values, 0.99) == 99.0
    assert quantile(values, 0.999) == 100.0
    assert quantile(values, 1.0) == 100.0
    assert math.isnan(quantile([], 0.5))


def test_a_late_send_is_charged_from_its_scheduled_time() -> None:
    clock = FakeClock()
    sent: list[tuple[int, int, float]] = []
    loop = OpenLoop(
        [k * GAP for k in range(8)],
        connections=8,
        clock=clock,
        send=lambda c, i: sent.append((c, i, clock.now)),
    )
    # the client wakes 5 steps late: requests 0..5 go out together
    clock.now = 5 * GAP
    assert loop.tick() == 6 * GAP
    assert [(c, i) for c, i, _ in sent] == [(k, k) for k in range(6)]
    assert all(t == 5 * GAP for _, _, t in sent)
    clock.now = 5.5 * GAP  # each answered half a step after it was sent
    for c in range(6):
        loop.answered(c, ok=True)
    for k in (6, 7):
        clock.now = k * GAP
        loop.tick()
        clock.now = (k + 0.5) * GAP
        loop.answered(sent[-1][0], ok=True)
    assert loop.finished
    report = loop.report(0.0, 8 * GAP)
    # latencies from the schedule: 5.5, 4.5, ..., 0.5 steps, then 0.5, 0.5
    assert report.latency_s["max"] == 5.5 * GAP
    assert report.latency_s["p50"] == 1.5 * GAP  # 4th of 8 sorted: 0.5, 0.5, 0.5, 1.5, ...
    assert report.service_p99_s == 0.5 * GAP  # from the actual send: all 0.5 steps
    # sends more than 1 ms (1.024 steps) late: requests 0..3 (5, 4, 3, 2 steps)
    assert report.late_sends == 4
    assert report.send_lag_max_s == 5 * GAP
    assert report.completed == 8 and report.errors == 0 and report.unanswered == 0


def test_requests_wait_for_a_free_connection_and_the_achieved_rate_shows_saturation() -> None:
    """One connection, answers taking 2 steps, offered one per step: the server does half
    the offered rate, and request k waits for the k answers before it."""
    clock = FakeClock()
    n = 64
    inflight: list[int] = []
    loop = OpenLoop(
        [k * GAP for k in range(n)], 1, clock, lambda c, i: inflight.append(i), late_after_s=0
    )
    answers_at: list[float] = []
    step = 0
    while not loop.finished:
        clock.now = step * GAP
        loop.tick()
        if inflight and step >= 2 * (len(answers_at) + 1):  # one answer every 2 steps
            answers_at.append(clock.now)
            loop.answered(0, ok=True)
        step += 1
    report = loop.report(0.0, n * GAP)
    # request k is answered at 2(k+1) steps, scheduled at k: latency (k + 2) steps
    assert report.latency_s["max"] == (n - 1 + 2) * GAP
    assert report.latency_s["p50"] == (31 + 2) * GAP
    assert report.achieved_rate == pytest.approx(n / (2 * n * GAP))  # half of 1,024/s
    assert report.offered_rate == pytest.approx(1024)
    assert report.waited_for_connection == n - 1
    assert report.late_sends == 0  # waiting for a connection is not a late send


def test_errors_and_lost_connections_are_counted_not_timed() -> None:
    clock = FakeClock()
    sent: list[tuple[int, int]] = []
    loop = OpenLoop([0.0, 0.0, 0.0], 3, clock, lambda c, i: sent.append((c, i)))
    loop.tick()
    clock.now = 0.001
    loop.answered(0, ok=True)
    loop.answered(1, ok=False)  # a 5xx
    loop.lost(2)
    report = loop.report(0.0, 1.0)
    assert (report.completed, report.errors, report.unanswered) == (1, 2, 0)
    assert report.latency_s["max"] == 0.001
    assert report.achieved_rate == 1.0  # one good answer over the 1 s window


def test_the_window_leaves_out_the_warm_up() -> None:
    clock = FakeClock()
    loop = OpenLoop([k * GAP for k in range(8)], 8, clock, lambda c, i: None)
    clock.now = 8 * GAP
    loop.tick()
    report = loop.report(4 * GAP, 8 * GAP)
    assert report.scheduled == 4 and report.unanswered == 4 and report.completed == 0
    for conn in range(8):  # every answer, warm-up included, is what the server decided
        loop.answered(conn, ok=conn != 5)
    assert loop.report(4 * GAP, 8 * GAP).answered_total == 7


@pytest.fixture
def server() -> Iterator[tuple[int, list[bytes]]]:
    """An aiohttp server on 127.0.0.1 in a thread: 500 for ``/bad``, else 200; ``/once``
    closes the connection after its answer."""
    seen: list[bytes] = []
    ready = threading.Event()
    state: dict[str, object] = {}

    async def handle(request: web.Request) -> web.Response:
        seen.append(await request.read())
        resp = web.Response(status=200 if request.path != "/bad" else 500, body=b'{"w": 1}')
        if request.path == "/once":
            resp.force_close()  # the connection closes after this answer
        return resp

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/{name}", handle)
        # no access log: a handler another test left on a since-closed stream would be written
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        site = web.TCPSite(runner, "127.0.0.1", port)
        await site.start()
        stop = asyncio.Event()
        state.update(port=port, stop=stop, loop=asyncio.get_running_loop())
        ready.set()
        await stop.wait()
        await runner.cleanup()

    thread = threading.Thread(target=asyncio.run, args=(main(),))
    thread.start()
    assert ready.wait(10)
    port = state["port"]
    assert isinstance(port, int)
    yield port, seen
    loop = state["loop"]
    stop = state["stop"]
    assert isinstance(loop, asyncio.AbstractEventLoop) and isinstance(stop, asyncio.Event)
    loop.call_soon_threadsafe(stop.set)
    thread.join(10)


def test_a_short_run_over_loopback(server: tuple[int, list[bytes]]) -> None:
    port, seen = server
    ok = [http_request("127.0.0.1", port, "/ok", "application/json", b"[%d]" % i) for i in (1, 2)]
    report = run_open_loop("127.0.0.1", port, ok, 200, 0.5, warmup_s=0.1, connections=4)
    assert report.scheduled == 100 and report.completed == 100 and report.errors == 0
    assert len(seen) == 120 and seen[:2] == [b"[1]", b"[2]"]  # warm-up included
    assert report.latency_s["p50"] <= report.latency_s["max"] < 2.0
    bad = [http_request("127.0.0.1", port, "/bad", "application/json", b"[]")]
    report = run_open_loop("127.0.0.1", port, bad, 100, 0.2, warmup_s=0.0, connections=2)
    assert report.errors == 20 and report.completed == 0


def test_connections_the_server_closed_are_not_used_again(server: tuple[int, list[bytes]]) -> None:
    port, _ = server
    once = [http_request("127.0.0.1", port, "/once", "application/json", b"[]")]
    report = run_open_loop(
        "127.0.0.1", port, once, 100, 0.1, warmup_s=0.0, connections=2, drain_s=0.5
    )
    # each connection carries one answer; a request sent on it afterwards fails, and those
    # due once both are gone are never sent
    assert report.scheduled == 10 and report.completed == 2
    assert report.errors + report.unanswered == 8

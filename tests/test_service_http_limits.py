"""The router service's HTTP server is bounded in time and connections, answers every error in
its JSON shape and logs a client that goes away as one line (a real server on loopback,
raw sockets as the hostile clients)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import socket
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import pytest
from aiohttp import web

from events.tools.cli_args import ArgError
from router_sim.cli import build_parser
from router_sim.service import settings
from router_sim.service.app import build_app
from router_sim.service.core import RouterService
from router_sim.service.fleet import FleetFile
from router_sim.service.http_limits import (
    ConnectionGuard,
    GuardedSite,
    HttpLimits,
    limits_from,
)

pytestmark = pytest.mark.timeout(60)
#: every wait on the server gives up after this long (the limits under test are ~0.3 s)
BOUND_S = 10.0
# (aiohttp's keep-alive timer also closes a connection whose headers are not complete within
# keepalive_timeout_s of its start: the header deadline is tested under a longer one)
FAST = HttpLimits(header_timeout_s=0.3, body_timeout_s=0.3, keepalive_timeout_s=1.0)
T = TypeVar("T")


@asynccontextmanager
async def serving(limits: HttpLimits) -> AsyncIterator[tuple[int, ConnectionGuard]]:
    """The service (no workers) on a loopback port, served through its guard."""
    svc = RouterService(FleetFile(), health_interval_s=0.05, probe_timeout_s=0.5)
    guard = ConnectionGuard(limits)
    runner = web.AppRunner(build_app(svc, guard), access_log=None, **guard.runner_kwargs())
    await runner.setup()
    try:
        site = GuardedSite(runner, guard, "127.0.0.1", 0)
        await site.start()
        yield runner.addresses[0][1], guard
    finally:
        await runner.cleanup()


def _connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=BOUND_S)
    s.settimeout(0.05)
    return s


def _read_until_closed(s: socket.socket, trickle: bytes = b"") -> tuple[bytes, float]:
    """Everything the server sends until it closes, sending ``trickle`` (a byte at a time)
    whenever it is quiet; and how long that took. Fails past :data:`BOUND_S`."""
    start = time.monotonic()
    data = b""
    pending = trickle
    while True:
        if time.monotonic() - start > BOUND_S:
            raise AssertionError(f"the server kept the connection open; got {data!r}")
        try:
            chunk = s.recv(65536)
        except TimeoutError:
            if pending:
                try:
                    s.sendall(pending[:1])
                except OSError:  # closed meanwhile: the next recv says so
                    pending = b""
                pending = pending[1:] or pending  # a byte at a time, the last one forever
            continue
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    s.close()
    return data, time.monotonic() - start


def _answer(raw: bytes) -> tuple[int, dict[str, str], Any]:
    """Status, headers and JSON body of the one HTTP answer in ``raw``."""
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:])}
    return status, headers, json.loads(body)


def _error_shape(body: Any, code: int) -> str:
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "code"}
    assert body["error"]["code"] == code
    message: str = body["error"]["message"]
    return message


async def _off_loop(fn: Callable[..., T], *args: Any) -> T:
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


async def _until(done: Callable[[], bool]) -> None:
    deadline = time.monotonic() + BOUND_S
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached before the deadline")
        await asyncio.sleep(0.01)  # the server runs on this loop: yield to it, then look again


def _no_traceback(caplog: pytest.LogCaptureFixture) -> None:
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]


def test_slowloris_headers_body_and_idle_connections_are_closed_in_bounded_time(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)

    async def main() -> None:
        async with serving(FAST) as (port, guard):
            # idle: never sends a byte
            data, _ = await _off_loop(_read_until_closed, _connect(port))
            assert data == b""
            # headers trickled a byte at a time: the deadline runs from the first byte
            s = _connect(port)
            s.sendall(b"POST /route HTTP/1.1\r\nHost: x\r\n")
            data, _ = await _off_loop(_read_until_closed, s, b"X-Slow: " + b"a" * 1000)
            status, headers, body = _answer(data)
            assert status == 408 and headers["content-type"] == "application/json"
            assert "headers" in _error_shape(body, 408)
            # the body trickled after complete headers
            s = _connect(port)
            s.sendall(b"POST /route HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n[1")
            data, _ = await _off_loop(_read_until_closed, s, b"," * 1000)
            status, headers, body = _answer(data)
            assert status == 408 and "body" in _error_shape(body, 408)
            assert headers["connection"].lower() == "close"
            assert (guard.header_timeouts, guard.body_timeouts) == (1, 1)
            await _until(lambda: guard.connections == 0)

    asyncio.run(main())
    _no_traceback(caplog)


def test_a_connection_over_the_cap_gets_a_json_503() -> None:
    async def main() -> None:
        async with serving(HttpLimits(max_connections=2)) as (port, guard):
            held = [_connect(port), _connect(port)]
            await _until(lambda: guard.connections == 2)
            data, _ = await _off_loop(_read_until_closed, _connect(port))
            status, _, body = _answer(data)
            assert status == 503 and "too many connections" in _error_shape(body, 503)
            assert guard.refused == 1
            for s in held:
                s.close()
            await _until(lambda: guard.connections == 0)
            # room again: served
            s = _connect(port)
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            data, _ = await _off_loop(_read_until_closed, s)
            assert _answer(data)[0] in (200, 503)  # 503: the event pump's own state
            assert guard.refused == 1

    asyncio.run(main())


def _exchange(port: int, request: bytes) -> tuple[int, dict[str, str], Any]:
    s = _connect(port)
    s.sendall(request)
    data, _ = _read_until_closed(s)
    return _answer(data)


def _post(path: str, body: bytes, content_type: str | None) -> bytes:
    ctype = b"" if content_type is None else f"Content-Type: {content_type}\r\n".encode()
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        f"Content-Length: {len(body)}\r\n".encode()
        + ctype
        + b"\r\n"
        + body
    )


def test_malformed_http_and_deep_json_are_json_400s_without_tracebacks(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)

    async def main() -> None:
        async with serving(FAST) as (port, _):
            for garbage in (
                b"GARBAGE\r\n\r\n",
                b"GET / HTTP/1.1\r\nBad Header\r\n\r\n",
                b"GET /" + b"a" * 10_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",  # line too long
                b"GET / HTTP/1.1\r\nHost: x\r\nX: " + b"b" * 10_000 + b"\r\n\r\n",
            ):
                status, headers, body = await _off_loop(_exchange, port, garbage)
                assert 400 <= status < 500 and headers["content-type"] == "application/json"
                assert "\n" not in _error_shape(body, status)
            deep = b"[" * 100_000
            for path, payload in (
                ("/route", deep),
                ("/route", b'{"prompt": [1], "x": ' + deep + b"}"),
                ("/route", b'{"prompt": ' + deep + b"}"),
                ("/v1/completions", b'{"prompt": ' + deep + b"}"),
            ):
                req = _post(path, payload, "application/json")
                status, _, body = await _off_loop(_exchange, port, req)
                assert status == 400, (path, body)
                _error_shape(body, 400)

    asyncio.run(main())
    _no_traceback(caplog)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_packed_ids_only_with_their_content_type() -> None:
    async def main() -> None:
        async with serving(FAST) as (port, _):
            prompt = json.dumps({"prompt": [1, 2, 3, 4]}).encode()
            # no Content-Type: JSON, read as a prompt (no worker to route it to: 503)
            status, _, body = await _off_loop(_exchange, port, _post("/route", prompt, None))
            assert status == 503 and body["error"]["type"] == "service_unavailable"
            for ctype in ("application/json", "text/plain; charset=utf-8"):
                req = _post("/route", prompt, ctype)
                assert (await _off_loop(_exchange, port, req))[0] == 503
            # the same bytes declared packed are token ids, refused for their length (not 4k)
            req = _post("/route", prompt + b"xx", "application/octet-stream")
            status, _, body = await _off_loop(_exchange, port, req)
            assert status == 400 and "multiple of 4" in _error_shape(body, 400)
            req = _post("/route", (7).to_bytes(4, "little") * 4, "application/octet-stream")
            assert (await _off_loop(_exchange, port, req))[0] == 503
            for ctype in ("text/csv", "multipart/form-data; boundary=x", "image/png"):
                status, _, body = await _off_loop(_exchange, port, _post("/route", prompt, ctype))
                assert status == 415, ctype
                assert "application/octet-stream" in _error_shape(body, 415)

    asyncio.run(main())


def test_a_client_gone_mid_body_is_one_log_line(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)

    async def main() -> None:
        async with serving(HttpLimits()) as (port, guard):
            for _ in range(5):
                s = _connect(port)
                s.sendall(b"POST /route HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n[1,")
                s.close()
            await _until(lambda: guard.disconnects == 5)

    asyncio.run(main())
    _no_traceback(caplog)
    gone = [r for r in caplog.records if "went away" in r.getMessage()]
    assert len(gone) == 5 and all("\n" not in r.getMessage() for r in gone)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def _serve_args(argv: list[str]) -> argparse.Namespace:
    args = build_parser().parse_args(["serve", *argv])
    settings.resolve(args)  # the defaults, as router-sim serve fills them
    return args


def test_the_limits_are_serve_flags_with_defaults_and_ranges() -> None:
    assert limits_from(_serve_args([])) == HttpLimits()
    given = ["--header-timeout", "2", "--body-timeout", "3", "--keepalive-timeout", "4"]
    args = _serve_args([*given, "--max-connections", "5"])
    assert limits_from(args) == HttpLimits(2.0, 3.0, 4.0, 5)
    for flag, value in (
        ("--header-timeout", "0"),
        ("--body-timeout", "nan"),
        ("--keepalive-timeout", "1e9"),
        ("--max-connections", "0"),
    ):
        with pytest.raises(ArgError, match=flag):
            limits_from(_serve_args([flag, value]))

"""The HTTP server's time and connection bounds, and JSON for every error it answers itself.

aiohttp reads a request's headers without a deadline and its body as slowly as the client
sends it; a connection that never finishes either holds its socket and a handler for as long
as the client likes. :class:`ConnectionGuard` bounds each phase of a connection:

- **idle** (no request in progress, nothing received since the last answer): closed after
  ``keepalive_timeout_s`` (aiohttp's own keep-alive timer, which also covers a connection
  that never sends anything);
- **headers** (the first byte of a request received, its headers not complete): a
  ``408`` after ``header_timeout_s`` from that first byte, however the rest trickles in;
- **body** (headers complete): the body must be read within ``body_timeout_s``, else ``408``;
  a client that goes away meanwhile is logged as one line, not a traceback.

At most ``max_connections`` connections are served at once; the next ones get a ``503`` and
are closed. Every error answer is the service's JSON (``{"error": {"message", "type",
"code"}}``, :func:`router_sim.service.protocol.error_response`), also for malformed HTTP,
which aiohttp answers in plain text itself, and JSON nested too deeply to read is a ``400``.

The middleware (:meth:`ConnectionGuard.middleware`) works in any aiohttp server (the test
server included); the connection phases need the site :class:`GuardedSite`, which serves
through the guard's protocol.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Final

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from events.tools.cli_args import check_float, check_int
from router_sim.service.protocol import Handler, error_response

log = logging.getLogger(__name__)

DEFAULT_HEADER_TIMEOUT_S: Final = 10.0
DEFAULT_BODY_TIMEOUT_S: Final = 30.0
DEFAULT_KEEPALIVE_TIMEOUT_S: Final = 60.0
DEFAULT_MAX_CONNECTIONS: Final = 1000
LINGER_S: Final = 2.0


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """The bounds of :class:`ConnectionGuard` (seconds, connections)."""

    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    keepalive_timeout_s: float = DEFAULT_KEEPALIVE_TIMEOUT_S
    max_connections: int = DEFAULT_MAX_CONNECTIONS

    def __post_init__(self) -> None:
        for name in ("header_timeout_s", "body_timeout_s", "keepalive_timeout_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 < value <= 3600):
                raise ValueError(f"{name} must be in (0, 3600] seconds, got {value!r}")
        if not 1 <= self.max_connections <= 1_000_000:
            raise ValueError(f"max_connections must be in [1, 10**6], got {self.max_connections}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of :class:`HttpLimits` (``router-sim serve``)."""
    p.add_argument(
        "--header-timeout",
        type=float,
        default=DEFAULT_HEADER_TIMEOUT_S,
        help="seconds from a request's first byte to the end of its headers, else a 408",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=DEFAULT_BODY_TIMEOUT_S,
        help="seconds to read a request's body once its headers are in, else a 408",
    )
    p.add_argument(
        "--keepalive-timeout",
        type=float,
        default=DEFAULT_KEEPALIVE_TIMEOUT_S,
        help="seconds an idle connection stays open, between requests or before the first",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=DEFAULT_MAX_CONNECTIONS,
        help="connections served at once; the next ones get a 503 and are closed",
    )


def limits_from(args: argparse.Namespace) -> HttpLimits:
    """:class:`HttpLimits` from the flags of :func:`add_arguments` (``ArgError`` if out of
    range)."""
    check_float("--header-timeout", args.header_timeout, 0.0, 3600.0, low_open=True)
    check_float("--body-timeout", args.body_timeout, 0.0, 3600.0, low_open=True)
    check_float("--keepalive-timeout", args.keepalive_timeout, 0.0, 3600.0, low_open=True)
    check_int("--max-connections", args.max_connections, 1, 1_000_000)
    return HttpLimits(
        args.header_timeout, args.body_timeout, args.keepalive_timeout, args.max_connections
    )


JSON_BODY_TYPES: Final = frozenset(
    {"application/json", "text/plain", "application/x-www-form-urlencoded"}
)
"""Content types a JSON body may come with: JSON's own, and what clients send for a string
body by default (aiohttp's ``data=str``, curl's ``-d``)."""


def body_form(request: web.BaseRequest, packed: str) -> str | None:
    """How to read ``request``'s body: ``"packed"`` only when its Content-Type says so
    (``packed``), ``"json"`` for a JSON type or none at all, None (a 415) for any other.
    aiohttp reports a missing Content-Type as ``application/octet-stream``, so the header
    itself is read: a JSON body sent without one is JSON, not token ids."""
    if request.headers.get("Content-Type") is None:
        return "json"
    kind = request.content_type
    if kind == packed:
        return "packed"
    if kind in JSON_BODY_TYPES or kind.endswith("+json"):
        return "json"
    return None


def unsupported(request: web.BaseRequest, packed: str) -> web.Response:
    """The 415 of :func:`body_form`."""
    return error_response(
        415,
        f"Content-Type {request.content_type} is not accepted here: send JSON "
        f"(application/json) or packed token ids ({packed})",
    )


def _raw_answer(status: int, message: str) -> bytes:
    """A complete HTTP/1.1 answer with the service's JSON error, closing the connection (for
    the protocol, which answers outside any request handler)."""
    body = error_response(status, message).body
    assert isinstance(body, bytes)
    phrase = HTTPStatus(status).phrase
    head = (
        f"HTTP/1.1 {status} {phrase}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


class _Refuse(asyncio.Protocol):
    """A connection over the cap: answered 503 and closed at once."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.write(_raw_answer(503, "too many connections; retry later"))
        transport.close()


class _Conn:
    """One connection's phase: a request in progress, or the header deadline armed."""

    __slots__ = ("closing", "in_request", "seen_during_request", "timer")

    def __init__(self) -> None:
        self.in_request = False
        self.timer: asyncio.TimerHandle | None = None
        self.seen_during_request = False
        self.closing = False  # answered with Connection: close: nothing more is read


class _GuardedHandler(RequestHandler):
    """aiohttp's connection protocol, told to the guard: bytes received (the header
    deadline), connection lost, and its own error answers (malformed HTTP) in JSON.

    aiohttp's web server makes plain ``RequestHandler`` objects; :meth:`ConnectionGuard.
    protocol_factory` turns each into this class, which adds no state (``__slots__`` empty:
    the layouts agree), so the rest of aiohttp sees the handler it made."""

    __slots__ = ()
    guard: ConnectionGuard  # set on the per-guard subclass

    def data_received(self, data: bytes) -> None:
        self.guard._received(self)
        super().data_received(data)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.guard._lost(self)
        super().connection_lost(exc)

    def handle_error(
        self,
        request: Any,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        text = message or (str(exc) if exc is not None else HTTPStatus(status).phrase)
        text = " ".join(text.split())  # aiohttp's parser messages span lines
        if status >= 500:
            log.error("HTTP %d answering %s", status, request.remote, exc_info=exc)
        else:  # malformed HTTP: the client's fault, one line
            log.warning("HTTP %d to %s: %s", status, request.remote, text)
        resp = error_response(status, text)
        resp.force_close()
        return resp


class ConnectionGuard:
    """Per server: the live connections, their phases, and the request middleware."""

    def __init__(self, limits: HttpLimits | None = None) -> None:
        self.limits: Final = HttpLimits() if limits is None else limits
        self._conns: dict[RequestHandler, _Conn] = {}
        self._handler_cls: type[_GuardedHandler] = type(
            "GuardedHandler", (_GuardedHandler,), {"__slots__": (), "guard": self}
        )
        self.refused = 0
        """Connections refused over ``max_connections``."""
        self.header_timeouts = 0
        self.body_timeouts = 0
        self.disconnects = 0
        """Clients that went away while their request's body was read."""

    @property
    def connections(self) -> int:
        """Connections open now (through :meth:`protocol_factory`)."""
        return len(self._conns)

    def runner_kwargs(self) -> dict[str, Any]:
        """What ``web.AppRunner`` needs for these limits: aiohttp's keep-alive timer, and how
        long it goes on reading (and ignoring) a body after answering early, so a client
        still sending gets the answer instead of a reset: at most :data:`LINGER_S` (aiohttp's
        own 10 s would let a client that trickles its body hold the connection that long)."""
        return {
            "keepalive_timeout": self.limits.keepalive_timeout_s,
            "lingering_time": min(LINGER_S, self.limits.body_timeout_s),
        }

    def protocol_factory(self, server: web.Server) -> Any:
        """The protocol factory for ``loop.create_server``: ``server``'s handlers, guarded."""

        def make() -> asyncio.BaseProtocol:
            if len(self._conns) >= self.limits.max_connections:
                self.refused += 1
                return _Refuse()
            handler = server()
            handler.__class__ = self._handler_cls
            self._conns[handler] = _Conn()
            return handler

        return make

    # ------------------------------------------------------------- connection phases

    def _received(self, handler: RequestHandler) -> None:
        conn = self._conns.get(handler)
        if conn is None or conn.closing:
            return
        if conn.in_request:
            conn.seen_during_request = True
        elif conn.timer is None:
            self._arm(handler, conn)

    def _arm(self, handler: RequestHandler, conn: _Conn) -> None:
        loop = asyncio.get_running_loop()
        conn.timer = loop.call_later(self.limits.header_timeout_s, self._header_late, handler)

    def _header_late(self, handler: RequestHandler) -> None:
        conn = self._conns.get(handler)
        if conn is None or conn.in_request:
            return
        conn.timer = None
        transport = handler.transport
        if not isinstance(transport, asyncio.Transport) or transport.is_closing():
            return  # closed meanwhile (aiohttp's keep-alive timer, or the client)
        self.header_timeouts += 1
        limit = self.limits.header_timeout_s
        peer = transport.get_extra_info("peername")
        log.warning("HTTP 408 to %s: headers not complete within %gs", peer, limit)
        transport.write(_raw_answer(408, f"request headers not complete within {limit:g}s"))
        handler.force_close()

    def _lost(self, handler: RequestHandler) -> None:
        conn = self._conns.pop(handler, None)
        if conn is not None and conn.timer is not None:
            conn.timer.cancel()

    def _started(self, handler: RequestHandler) -> _Conn | None:
        conn = self._conns.get(handler)
        if conn is None:
            return None
        if conn.timer is not None:
            conn.timer.cancel()
            conn.timer = None
        conn.in_request = True
        conn.seen_during_request = False
        return conn

    def _finished(
        self, handler: RequestHandler, conn: _Conn, resp: web.StreamResponse | None
    ) -> None:
        conn.in_request = False
        if resp is None or resp.keep_alive is False:  # None: aiohttp decides (keep-alive)
            conn.closing = True
            return
        if conn.seen_during_request and handler in self._conns and conn.timer is None:
            # the next request began arriving meanwhile: its headers' deadline runs now
            self._arm(handler, conn)

    # ----------------------------------------------------------------- the middleware

    async def _answer(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        limit = self.limits.body_timeout_s
        try:
            try:
                # a body that came whole with its headers (the usual small one) needs no
                # deadline: the handler's own read returns at once
                if request.body_exists and not request.content.is_eof():
                    async with asyncio.timeout(limit):
                        await request.read()
            except TimeoutError:
                self.body_timeouts += 1
                log.warning(
                    "HTTP 408 to %s: %s %s body not read within %gs",
                    request.remote,
                    request.method,
                    request.path,
                    limit,
                )
                resp = error_response(408, f"request body not read within {limit:g}s")
                resp.force_close()
                return resp
            try:
                return await handler(request)
            except RecursionError:  # msgspec and json refuse nesting deeper than the stack
                return error_response(400, "JSON nested too deeply to read")
        except ConnectionError as exc:
            self.disconnects += 1
            log.info(
                "client %s went away during %s %s (%s)",
                request.remote,
                request.method,
                request.path,
                " ".join(str(exc).split()) or type(exc).__name__,
            )
            # never delivered (nginx's 499: the client closed the request); the metrics see it
            resp = error_response(499, "client closed the connection")
            resp.force_close()
            return resp

    async def guarded(self, handler: Handler, request: web.Request) -> web.StreamResponse:
        """``handler(request)`` under the guard: the body read within ``body_timeout_s``
        before the handler runs (its own ``request.read()`` then returns at once), JSON nested
        too deeply a 400, a client that went away one log line; the connection's phase
        follows (see :meth:`middleware`, which is this as an aiohttp middleware)."""
        conn = self._started(request.protocol)
        resp: web.StreamResponse | None = None
        try:
            resp = await self._answer(request, handler)
            return resp
        finally:
            if conn is not None:
                self._finished(request.protocol, conn, resp)

    @property
    def middleware(self) -> Any:
        """:meth:`guarded` as an aiohttp middleware (the service calls it from its own single
        middleware instead: aiohttp wraps each middleware around the handler per request,
        which costs microseconds apiece)."""
        guard = self

        @web.middleware
        async def limits(request: web.Request, handler: Handler) -> web.StreamResponse:
            return await guard.guarded(handler, request)

        return limits


GUARD: Final = web.AppKey("http_guard", ConnectionGuard)
"""Where :func:`router_sim.service.app.build_app` keeps the app's guard."""


class GuardedSite(web.BaseSite):
    """A TCP site that serves through ``guard`` (``web.TCPSite`` otherwise)."""

    __slots__ = ("_guard", "_host", "_port", "_reuse_port")

    def __init__(
        self,
        runner: web.BaseRunner,
        guard: ConnectionGuard,
        host: str,
        port: int,
        *,
        reuse_port: bool | None = None,
    ) -> None:
        super().__init__(runner)
        self._guard = guard
        self._host = host
        self._port = port
        self._reuse_port = reuse_port

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert isinstance(server, web.Server)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self._guard.protocol_factory(server),
            self._host,
            self._port,
            reuse_port=self._reuse_port,
        )

"""CURVE authentication and encryption for the event stream, and inbound size limits.

Why: a ``BlockStored`` carries the token ids of users' prompts, and the replay socket hands out
the recent history to whoever asks. Without CURVE any peer that reaches the port reads both,
and (with a bind-mode subscriber) any peer can connect and publish forged events that steer
routing. ZeroMQ's CURVE (RFC 26, CurveZMQ) encrypts every frame and authenticates both ends:

* the **publisher is the CURVE server** on its live socket (PUB/XPUB) and its replay ROUTER. It
  holds a key pair; a ZAP handler (:class:`zmq.auth.thread.ThreadAuthenticator`) admits only
  client public keys on its allow-list;
* **subscribers and listeners are CURVE clients** on their SUB and DEALER sockets: each holds
  its own key pair and the server's public key, and the handshake fails unless the peer proves
  it holds the server's secret key. The roles do not depend on who binds, so a bind-mode
  subscriber still refuses a forged publisher (it cannot complete the handshake).

Keys are files in pyzmq's certificate format (``zmq.auth.create_certificates``): ``NAME.key``
holds the public key, ``NAME.key_secret`` both; ``kv-events keygen`` writes a pair.

ZAP is per ZeroMQ context, so one authenticator serves every server socket of a context; each
socket gets its own ZAP domain with its own allow-list, and ``ZAP_ENFORCE_DOMAIN`` makes a
socket refuse connections outright if the handler were ever missing (fail closed).
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from events.tools.limits import MAX_KEY_FILE_BYTES, InputTooLarge, read_bounded_bytes

DEFAULT_MAX_MESSAGE_BYTES: Final = 16 * 1024 * 1024
"""Largest inbound ZeroMQ message a socket reading outside input accepts (``MAXMSGSIZE``).
A real batch is a few kB to a few MB (a 128k-token prompt stored in one batch is under 1 MB of
token ids); ZeroMQ drops the connection of a peer that sends more before buffering the message,
so a 200 MB frame costs the reader nothing; the peer reconnects and a lost live frame is a gap
like any other. Worst-case queued memory per socket is its RCVHWM times this."""
_KEY_LEN: Final = 40  # a Z85-encoded 32-byte CURVE key
_domains = itertools.count()


class SecurityError(ValueError):
    """A key file that cannot be used, or an invalid security setting."""


@dataclass(frozen=True, slots=True)
class KeyPair:
    """A CURVE key pair, Z85-encoded (40 ASCII bytes each)."""

    public: bytes
    secret: bytes

    def __repr__(self) -> str:  # never print a secret key into a log
        return f"KeyPair(public={self.public.decode()!r}, secret=...)"


@dataclass(frozen=True, slots=True)
class CurveServer:
    """What a publisher needs: its key pair and the client public keys it admits."""

    keys: KeyPair
    allowed_clients: frozenset[bytes]


@dataclass(frozen=True, slots=True)
class CurveClient:
    """What a subscriber or listener needs: its key pair and the publisher's public key."""

    keys: KeyPair
    server_public: bytes


def generate_keys(directory: str | Path, name: str) -> tuple[Path, Path]:
    """Write ``NAME.key`` (public) and ``NAME.key_secret`` (readable by the owner only) in
    ``directory``; returns both paths. Refuses to overwrite an existing pair."""
    folder = Path(directory)
    if not name or "/" in name or name.startswith("."):
        raise SecurityError(f"key name {name!r} must be a plain file name")
    public, secret = folder / f"{name}.key", folder / f"{name}.key_secret"
    for path in (public, secret):
        if path.exists():
            raise SecurityError(f"{path} exists; remove it or choose another name")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        made_public, made_secret = zmq.auth.create_certificates(folder, name)
        os.chmod(made_secret, 0o600)
    except OSError as exc:
        raise SecurityError(f"cannot write keys in {folder}: {exc.strerror or exc}") from None
    return Path(made_public), Path(made_secret)


def _load(path: str | Path) -> tuple[bytes, bytes | None]:
    p = Path(path)
    try:
        read_bounded_bytes(p, "CURVE key file", MAX_KEY_FILE_BYTES)  # /dev/zero is no key
        public, secret = zmq.auth.load_certificate(p)
    except InputTooLarge as exc:
        raise SecurityError(str(exc)) from None
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise SecurityError(f"{p}: not a CURVE key file ({exc})") from None
    for key in (public, secret):
        if key is not None and len(key) != _KEY_LEN:
            raise SecurityError(f"{p}: a key is {len(key)} characters, not {_KEY_LEN}")
    return public, secret


def load_keypair(path: str | Path) -> KeyPair:
    """The key pair in a ``.key_secret`` file."""
    public, secret = _load(path)
    if secret is None:
        raise SecurityError(f"{path} holds no secret key: pass the .key_secret file")
    return KeyPair(public, secret)


def load_public_key(path: str | Path) -> bytes:
    """The public key in a ``.key`` (or ``.key_secret``) file."""
    return _load(path)[0]


def load_allowed_keys(paths: Iterable[str | Path]) -> frozenset[bytes]:
    """Client public keys from ``.key`` files, or from every ``*.key`` file of a folder."""
    keys: set[bytes] = set()
    for path in paths:
        p = Path(path)
        files = sorted(p.glob("*.key")) if p.is_dir() else [p]
        if not files:
            raise SecurityError(f"{p}: no .key files in this folder")
        keys.update(load_public_key(f) for f in files)
    return frozenset(keys)


class _Gate:
    """The ZAP handler of one context: one allow-list per ZAP domain, refcounted."""

    def __init__(self, context: zmq.Context[Any]) -> None:
        self.auth = ThreadAuthenticator(context)
        self.auth.start()  # bound before any server socket exists: no unauthenticated window
        self.domains: set[str] = set()


_gates: dict[int, _Gate] = {}
_gates_lock = threading.Lock()


class ServerGuard:
    """Keeps a server socket's allow-list registered; :meth:`close` it after the socket."""

    def __init__(self, context: zmq.Context[Any], domain: str) -> None:
        self._context = context
        self.domain = domain
        self._closed = False

    def close(self) -> None:
        """Forget the allow-list; the context's ZAP handler stops with its last socket."""
        with _gates_lock:
            if self._closed:
                return
            self._closed = True
            gate = _gates.get(id(self._context))
            if gate is None:
                return
            gate.auth.certs.pop(self.domain, None)
            gate.domains.discard(self.domain)
            if not gate.domains:
                del _gates[id(self._context)]
                gate.auth.stop()


def secure_server(sock: zmq.Socket[Any], server: CurveServer) -> ServerGuard:
    """Make ``sock`` a CURVE server admitting only ``server.allowed_clients``.

    Call before the socket binds or connects; close the returned guard after the socket.
    """
    context = sock.context
    with _gates_lock:
        gate = _gates.get(id(context))
        if gate is None:
            gate = _gates[id(context)] = _Gate(context)
        domain = f"kv-events-{next(_domains)}"
        gate.auth.certs[domain] = {key: True for key in server.allowed_clients}
        gate.domains.add(domain)
    sock.setsockopt(zmq.ZAP_DOMAIN, domain.encode())
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, server.keys.secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, server.keys.public)
    return ServerGuard(context, domain)


def secure_client(sock: zmq.Socket[Any], client: CurveClient) -> None:
    """Make ``sock`` a CURVE client of the server whose public key is ``server_public``.

    Call before the socket binds or connects."""
    sock.setsockopt(zmq.CURVE_SERVERKEY, client.server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, client.keys.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, client.keys.secret)


def limit_inbound(sock: zmq.Socket[Any], max_message_bytes: int | None) -> None:
    """Cap inbound messages at ``max_message_bytes`` (None: no cap). A peer that sends a
    bigger one is disconnected by ZeroMQ before the message is buffered."""
    if max_message_bytes is None:
        return
    if isinstance(max_message_bytes, bool) or not isinstance(max_message_bytes, int):
        raise SecurityError(f"max_message_bytes must be an int, got {max_message_bytes!r}")
    if not 1 <= max_message_bytes < 2**63:
        raise SecurityError(f"max_message_bytes must be >= 1, got {max_message_bytes}")
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)


def curve_client_from(key_file: str | None, server_key_file: str | None) -> CurveClient | None:
    """CURVE client settings from a ``.key_secret`` file and the server's ``.key`` file (both
    or neither: one alone is a :class:`SecurityError`, not a silently plain connection)."""
    if key_file is None and server_key_file is None:
        return None
    if key_file is None or server_key_file is None:
        raise SecurityError("CURVE needs both the client's .key_secret and the server's .key")
    return CurveClient(load_keypair(key_file), load_public_key(server_key_file))

"""Up-front checks of command-line and file input, shared by ``kv-events`` and ``router-sim``.

Why a module of its own: argparse's ``type=float`` takes ``nan``, ``inf`` and ``1e400``,
``type=int`` takes ``10**30``, and a string flag takes text that is not UTF-8 (a non-UTF-8 byte
in ``argv`` arrives as a lone surrogate); each then fails far away (a traceback in ZeroMQ's
``poll``, a ``MemoryError`` in an allocator, a hang in a loop sized by the value, a NaN table).
Every check here turns such a value into one :class:`ArgError` whose message names the flag,
the value and the accepted range, checked before any work starts. :class:`OneLineParser`
makes argparse's own errors one line on stderr as well (exit status 2).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import math
from typing import Any, Final, NoReturn

from kvcache.scope import ReuseScope, cache_salt_id

EXIT_OK: Final = 0
EXIT_PROBLEMS: Final = 1
EXIT_UNVERIFIED: Final = 3
"""``kv-events doctor --require-verified``: no problem found, but not every block hash verified."""
EXIT_USAGE: Final = 2
TCP_PORT_MAX: Final = 65535
MAX_TIMEOUT_S: Final = 10_000_000.0
"""Longest ``--timeout`` (about 116 days): ZeroMQ's poll takes a C long of milliseconds."""
MAX_COUNT: Final = 10**12
"""Most messages a ``--count`` may ask for (more than a stream sends in years)."""
MAX_BLOCK_TOKENS: Final = 2**20
MAX_CACHE_SALTS: Final = 256
"""Most ``doctor --cache-salt`` values (each first block is recomputed under every one)."""
"""Largest tokens-per-block any command accepts (engines use 1 to a few thousand)."""
_SCHEMES: Final = ("tcp://", "ipc://", "inproc://")


class ArgError(ValueError):
    """A command-line or file value out of type or range; the message says which and why."""


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line on stderr (exit status 2).

    argparse prints the whole usage block before the error; scripts that read stderr, and
    operators reading a log, want only the line that says what was wrong (``--help`` prints the
    usage). Subparsers made from it are of the same class.
    """

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, error_line(f"{self.prog}: error: {message} (see --help)"))


def check_int(flag: str, value: int | None, low: int, high: int) -> None:
    """``low <= value <= high`` for an int flag (``None``: not given, nothing to check)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArgError(f"{flag} must be an integer, got {value!r}")
    if not low <= value <= high:
        raise ArgError(f"{flag} must be in [{low}, {high}], got {_short(value)}")


def check_float(
    flag: str, value: float | None, low: float, high: float, *, low_open: bool = False
) -> None:
    """A finite number in ``[low, high]`` (``(low, high]`` with ``low_open``)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ArgError(f"{flag} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ArgError(f"{flag} must be a finite number, got {value}")
    above = value > low if low_open else value >= low
    if not above or value > high:
        opening = "(" if low_open else "["
        raise ArgError(f"{flag} must be in {opening}{low:g}, {high:g}], got {value:g}")


def check_utf8(flag: str, value: str | None) -> None:
    """Text that will be encoded (a topic, a salt, an address) must be valid UTF-8."""
    if value is None:
        return
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        shown = value.encode("utf-8", "backslashreplace").decode("ascii", "replace")
        raise ArgError(f"{flag} is not valid UTF-8 text: {shown!r}") from None


def check_endpoint(flag: str, endpoint: str) -> None:
    """A ZeroMQ address this project can use: ``tcp://HOST:PORT``, ``ipc://PATH`` or
    ``inproc://NAME``, with a port in 1..65535 (or ``*``) and a well-formed numeric host.

    ZeroMQ connects asynchronously: ``tcp://127.0.0.1:99999`` or ``tcp://256.1.1.1:5`` would
    be accepted and then never deliver anything, which reads as a silent stream.
    """
    check_utf8(flag, endpoint)
    if not endpoint.startswith(_SCHEMES):
        raise ArgError(f"{flag} {endpoint!r}: write tcp://HOST:PORT, ipc://PATH or inproc://NAME")
    scheme, _, rest = endpoint.partition("://")
    if not rest:
        raise ArgError(f"{flag} {endpoint!r} names no address after {scheme}://")
    if scheme != "tcp":
        return
    host, sep, port = rest.rpartition(":")
    if not sep or not host:
        raise ArgError(f"{flag} {endpoint!r} has no host or port; write tcp://HOST:PORT")
    if port != "*" and not (port.isascii() and port.isdigit() and 1 <= int(port) <= TCP_PORT_MAX):
        raise ArgError(f"{flag} {endpoint!r}: the port must be 1..{TCP_PORT_MAX} or *")
    bare = host.strip("[]")
    if bare.replace(".", "").isdigit() or ":" in bare:  # looks numeric: must be a real address
        try:
            ipaddress.ip_address(bare)
        except ValueError:
            raise ArgError(f"{flag} {endpoint!r}: {bare!r} is not an IP address") from None


def loads_json(text: str, what: str) -> Any:
    """Standard JSON only: no ``NaN``/``Infinity`` (Python's json takes them by default) and
    nesting too deep for the parser is an :class:`ArgError`, not a ``RecursionError``."""

    def constant(name: str) -> NoReturn:
        raise ArgError(f"{what}: {name} is not a JSON number")

    try:
        return json.loads(text, parse_constant=constant)
    except json.JSONDecodeError as exc:
        where = f"line {exc.lineno} column {exc.colno}"
        raise ArgError(f"{what}: not JSON ({exc.msg} at {where})") from None
    except RecursionError:
        raise ArgError(f"{what}: JSON nested too deeply to read") from None


def _short(value: int) -> str:
    text = str(value)
    return text if len(text) <= 24 else f"{text[:10]}...({len(text)} digits)"


U64_MAX: Final = 2**64 - 1


def check_kv_events_args(args: argparse.Namespace) -> None:
    """Every flag ``kv-events`` parsed, by name (a subcommand without the flag skips it)."""
    endpoints = list(getattr(args, "endpoints", None) or [])
    target = getattr(args, "target", None)
    if isinstance(target, str) and target.startswith(_SCHEMES):
        endpoints.append(target)
    for endpoint in endpoints:
        check_endpoint("endpoint", endpoint)
    replays = getattr(args, "replay_endpoint", None) or []
    for endpoint in replays:
        check_endpoint("--replay-endpoint", endpoint)
    if replays and len(replays) > len(endpoints):
        raise ArgError(
            f"{len(replays)} --replay-endpoint for {len(endpoints)} endpoint(s): give at most "
            "one per endpoint, in the same order"
        )
    check_utf8("--topic", getattr(args, "topic", None))
    salts = getattr(args, "cache_salt", None)
    if isinstance(salts, list) and len(salts) > MAX_CACHE_SALTS:
        raise ArgError(f"--cache-salt is given {len(salts)} times; at most {MAX_CACHE_SALTS}")
    for salt in salts if isinstance(salts, list) else [salts]:
        check_utf8("--cache-salt", salt)
    check_utf8("--name", getattr(args, "name", None))
    check_int("--count", getattr(args, "count", None), 1, MAX_COUNT)
    check_float("--timeout", getattr(args, "timeout", None), 0.0, MAX_TIMEOUT_S, low_open=True)
    check_int("--block-size", getattr(args, "block_size", None), 1, MAX_BLOCK_TOKENS)
    check_int("--tokens-per-block", getattr(args, "tokens_per_block", None), 1, MAX_BLOCK_TOKENS)
    check_int("--lora-id", getattr(args, "lora_id", None), 0, U64_MAX)
    check_int("--salt-id", getattr(args, "salt_id", None), 0, U64_MAX)
    check_int("--max-message-bytes", getattr(args, "max_message_bytes", None), 1, 2**31)


def error_line(text: str) -> str:
    """``text`` as one printable line: newlines folded, lone surrogates (from non-UTF-8 argv
    bytes) escaped, so writing it cannot raise ``UnicodeEncodeError`` on a strict stream."""
    flat = " ".join(text.split())
    return flat.encode("utf-8", "backslashreplace").decode("utf-8") + "\n"


class UsageError(Exception):
    """Bad command-line input; the message says what to change."""


def parse_tokens(text: str) -> list[int]:
    parts = text.replace(",", " ").split()
    if not parts:
        raise UsageError("no tokens given: pass --tokens 1,2,3 or a --tokens-file")
    for p in parts:
        # ASCII digits only, and few of them: int() also takes "1_000", "²"-like digits of
        # other scripts (some of which it then refuses) and 5,000-digit numbers
        digits = p[1:] if p[:1] == "-" else p
        if not (digits.isascii() and digits.isdigit()) or len(digits) > 20:
            shown = p if len(p) <= 24 else f"{p[:10]}...({len(p)} characters)"
            raise UsageError(f"token {shown!r} is not an integer id")
    return [int(p) for p in parts]


def scope_from(args: argparse.Namespace) -> ReuseScope | None:
    salt: int | None = None
    if args.cache_salt is not None and args.salt_id is not None:
        raise UsageError("give either --cache-salt or --salt-id, not both")
    if args.cache_salt is not None:
        salt = cache_salt_id(args.cache_salt)
    elif args.salt_id is not None:
        salt = args.salt_id
    if args.lora_id is None and salt is None:
        return None
    try:
        return ReuseScope(args.lora_id, salt)
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc)) from None

"""Capture files: raw KV event frames as received, for ``kv-events doctor`` and regression tests.

Format (JSON lines, UTF-8, one object per line):

- line 1, the header: ``{"format": "kv-events-capture", "version": 1, "endpoints": [...]}``
  (``endpoints[w]`` is where worker ``w`` was listened to; may be empty);
- then one line per received ZeroMQ message, in receive order::

      {"i": 0, "worker": 0, "replay": false, "frames": ["<base64>", "<base64>", "<base64>"]}

  ``i`` is the receive index, ``worker`` the index of the endpoint it came from, ``replay`` true
  for a message obtained from the publisher's replay socket, and ``frames`` the raw frames
  (``[topic, seq as 8-byte big-endian, msgpack payload]`` on a well-formed stream) in base64.

Frames are kept raw, malformed ones included, so the doctor judges exactly what was on the wire.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Final

from events.tools.limits import MAX_CAPTURE_CHARS, MAX_LINE_CHARS, InputTooLarge, bounded_lines

CAPTURE_FORMAT: Final = "kv-events-capture"
CAPTURE_VERSION: Final = 1


class CaptureError(ValueError):
    """A capture file that is not in the kv-events capture format."""


@dataclass(frozen=True, slots=True)
class CapturedMessage:
    """One received multipart message."""

    index: int
    worker: int
    frames: tuple[bytes, ...]
    replay: bool = False


class CaptureWriter:
    """Appends received messages to a capture file (flushed per message, so an interrupted
    listener leaves a readable file)."""

    def __init__(self, stream: IO[str], endpoints: Sequence[str] = ()) -> None:
        self._stream = stream
        self._index = 0
        header = {"format": CAPTURE_FORMAT, "version": CAPTURE_VERSION, "endpoints": [*endpoints]}
        stream.write(json.dumps(header) + "\n")
        stream.flush()

    def write(self, worker: int, frames: Sequence[bytes], replay: bool = False) -> None:
        """Record one message."""
        line = {
            "i": self._index,
            "worker": worker,
            "replay": replay,
            "frames": [base64.b64encode(f).decode("ascii") for f in frames],
        }
        self._stream.write(json.dumps(line) + "\n")
        self._stream.flush()
        self._index += 1

    @property
    def count(self) -> int:
        """Messages written so far."""
        return self._index


@dataclass(frozen=True, slots=True)
class Capture:
    """A capture file's content."""

    endpoints: list[str]
    messages: list[CapturedMessage]


def _parse_line(number: int, text: str) -> CapturedMessage:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CaptureError(f"line {number}: not JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise CaptureError(f"line {number}: expected a JSON object, got {type(obj).__name__}")
    index, worker, frames = obj.get("i"), obj.get("worker"), obj.get("frames")
    if not isinstance(index, int) or not isinstance(worker, int) or worker < 0:
        raise CaptureError(f"line {number}: 'i' and 'worker' must be non-negative integers")
    if not isinstance(frames, list) or not all(isinstance(f, str) for f in frames):
        raise CaptureError(f"line {number}: 'frames' must be a list of base64 strings")
    try:
        raw = tuple(base64.b64decode(f, validate=True) for f in frames)
    except (binascii.Error, ValueError):
        raise CaptureError(f"line {number}: a frame is not valid base64") from None
    return CapturedMessage(index, worker, raw, bool(obj.get("replay", False)))


def _parse_header(first: str | None) -> list[str]:
    if first is None:
        raise CaptureError("empty file: a capture starts with a kv-events-capture header line")
    try:
        header = json.loads(first)
    except json.JSONDecodeError:
        header = None
    if not isinstance(header, dict) or header.get("format") != CAPTURE_FORMAT:
        raise CaptureError(
            "not a kv-events capture: the first line must be the header "
            f'{{"format": "{CAPTURE_FORMAT}", ...}}; record one with `kv-events listen --record`'
        )
    if header.get("version") != CAPTURE_VERSION:
        raise CaptureError(
            f"capture version {header.get('version')!r} is not supported (expected "
            f"{CAPTURE_VERSION})"
        )
    endpoints = header.get("endpoints", [])
    return [str(e) for e in endpoints] if isinstance(endpoints, list) else []


def read_capture(
    path: str | Path,
    *,
    max_line: int = MAX_LINE_CHARS,
    max_total: int = MAX_CAPTURE_CHARS,
) -> Capture:
    """Read a whole capture file; raises :class:`CaptureError` for anything malformed,
    including a line over ``max_line`` characters or a file over ``max_total`` (it is held in
    memory: ``/dev/zero`` or a runaway recording are refused, not read until memory runs
    out)."""
    with open(path, encoding="utf-8") as stream:
        try:
            lines = bounded_lines(stream, "the capture", max_line, max_total)
            first = next(lines, None)
            endpoints = _parse_header(None if first is None else first[1])
            messages = [_parse_line(number, text) for number, text in lines if text.strip()]
        except UnicodeDecodeError as exc:  # captures are ASCII JSON lines
            raise CaptureError(f"not a kv-events capture: not UTF-8 text ({exc.reason})") from None
        except InputTooLarge as exc:
            raise CaptureError(str(exc)) from None
    return Capture(endpoints, messages)


def write_capture(
    path: str | Path,
    messages: Sequence[tuple[int, Sequence[bytes]] | tuple[int, Sequence[bytes], bool]],
    endpoints: Sequence[str] = (),
) -> None:
    """Write ``(worker, frames[, replay])`` messages as a capture file."""
    with open(path, "w", encoding="utf-8") as stream:
        writer = CaptureWriter(stream, endpoints)
        for item in messages:
            writer.write(item[0], item[1], bool(item[2]) if len(item) > 2 else False)

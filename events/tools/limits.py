"""Bounded reading of the files a command line names.

Every file argument is hostile: ``/dev/zero`` has no end and no newline, a gzip member may
inflate a thousandfold, a "line" may be a gigabyte. The readers here never hold more than a
cap's worth of any file and say which cap was hit, so a command refuses such input with one
clear line instead of a ``MemoryError`` (or a machine brought to its knees first):

- :func:`read_bounded_bytes`, :func:`read_bounded_text`: a whole small file (a token list, a
  golden file, a fleet file, a key), at most ``max_bytes``;
- :func:`bounded_lines`: the lines of a stream (a trace, a capture), each at most
  ``max_line`` characters and all of them at most ``max_total``; the caller streams them.

Both raise :class:`InputTooLarge` (a ``ValueError``) naming the file and the cap.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import IO, Final

MAX_TOKENS_FILE_BYTES: Final = 64 << 20
"""Largest ``--tokens-file`` (64 MiB: about 6M token ids written out)."""
MAX_SMALL_FILE_BYTES: Final = 64 << 20
"""Largest file read whole that is not a token list: golden files and corpora, fleet files,
sweep grids (64 MiB, far past any real one)."""
MAX_KEY_FILE_BYTES: Final = 64 << 10
"""Largest CURVE key file (one is ~300 bytes)."""
MAX_LINE_CHARS: Final = 64 << 20
"""Longest line of a trace or a capture (64 MiB; a trace row of 2**20 hash ids is ~20 MB, a
capture line of a 16 MiB message ~22 MB of base64)."""
MAX_TRACE_CHARS: Final = 8 << 30
"""Most text read from one trace (8 GiB after decompression; the bundled one is ~8 MB)."""
MAX_CAPTURE_CHARS: Final = 1 << 30
"""Most text read from one capture file (1 GiB; it is held in memory whole)."""


class InputTooLarge(ValueError):
    """A file, or a line of it, is over its cap; the message names the file and the cap."""


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} bytes"


def read_bounded_bytes(path: str | Path, what: str, max_bytes: int) -> bytes:
    """The whole of a file of at most ``max_bytes`` bytes (``OSError`` passes through; a
    larger file or an endless one is :class:`InputTooLarge`, after reading one byte past the
    cap: ``stat`` sizes lie for devices and pipes)."""
    with open(path, "rb") as stream:
        data = stream.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise InputTooLarge(f"{what} {path} is larger than {_size(max_bytes)}")
    return data


def read_bounded_text(path: str | Path, what: str, max_bytes: int) -> str:
    """:func:`read_bounded_bytes` as UTF-8 text (``UnicodeDecodeError`` passes through)."""
    return read_bounded_bytes(path, what, max_bytes).decode("utf-8")


def bounded_lines(
    stream: IO[str], what: str, max_line: int, max_total: int, start: int = 1
) -> Iterator[tuple[int, str]]:
    """``(line number, line)`` for each line of ``stream`` from number ``start``, never
    reading a line longer than ``max_line`` characters (its newline included) or more than
    ``max_total`` in all (:class:`InputTooLarge` when the file has more; ``what`` names the
    file in its message)."""
    total = 0
    number = start
    while True:
        line = stream.readline(max_line + 1)
        if not line:
            return
        total += len(line)
        if len(line) > max_line:
            raise InputTooLarge(f"{what} line {number} is over {_size(max_line)}")
        if total > max_total:
            raise InputTooLarge(f"{what} is over {_size(max_total)} of text")
        yield number, line
        number += 1

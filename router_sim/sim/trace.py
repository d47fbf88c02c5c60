"""Mooncake-format request traces.

One JSON object per line: ``timestamp`` (ms from the start), ``input_length``, ``output_length``
(tokens) and ``hash_ids`` (one id per 512-token block of the prompt; two requests share an id at
position i only if they share the whole prefix up to it). Files may be gzip-compressed
(``.gz``). Each hash id expands to its own tokens
(:func:`router_sim.sim.workloads.expand_hash_ids`),
lazily, when a worker or the router needs the prompt.

The Mooncake conversation trace ships with the package (``router_sim/data``): pass
``"mooncake"`` as the path to use it.
"""

from __future__ import annotations

import gzip
import math
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import IO, Annotated, Final

import msgspec

from events.tools.cli_args import ArgError, loads_json
from events.tools.limits import MAX_LINE_CHARS, MAX_TRACE_CHARS, InputTooLarge, bounded_lines
from router_sim.sim.workloads import TOKENS_PER_HASH_ID, Request

BUNDLED: Final[dict[str, str]] = {"mooncake": "conversation_trace.jsonl.gz"}
"""Short names of the traces bundled in ``router_sim/data``."""


MAX_TRACE_TOKENS: Final = 2**20
"""Largest input_length or output_length of a trace row (1,048,576 tokens, past any model's
context today): ``output_length`` 10**9 used to hang the simulator decoding, 2**30 to divide by
zero inside it."""
MAX_TIMESTAMP_MS: Final = 1e13
"""Largest |timestamp| (about 317 years in ms): later times only turn arithmetic into NaN."""
MAX_HASH_ID: Final = 2**63 - 1


class _Row(msgspec.Struct):
    """A well-formed row, as msgspec reads it in one typed pass (exact JSON types: no bool for
    an int, no string for a number; unknown fields ignored, as below). A line it refuses is
    read again by the checks of :func:`_row`, which say what is wrong."""

    timestamp: Annotated[float, msgspec.Meta(ge=-MAX_TIMESTAMP_MS, le=MAX_TIMESTAMP_MS)]
    input_length: Annotated[int, msgspec.Meta(ge=1, le=MAX_TRACE_TOKENS)]
    output_length: Annotated[int, msgspec.Meta(ge=0, le=MAX_TRACE_TOKENS)]
    hash_ids: list[Annotated[int, msgspec.Meta(ge=0, le=MAX_HASH_ID)]]


_ROW_DECODER: Final = msgspec.json.Decoder(_Row)


class TraceError(ValueError):
    """A trace line is malformed; the message names the file and line."""


@dataclass(slots=True)
class TraceRow:
    """One line of a Mooncake trace, as written in the file."""

    timestamp: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def resolve_trace(path: str | Path) -> Path:
    """A bundled trace's file for a short name (``"mooncake"``), else ``path`` itself."""
    name = str(path)
    if name in BUNDLED:
        ref = resources.files("router_sim") / "data" / BUNDLED[name]
        with resources.as_file(ref) as p:
            if not p.exists():
                raise FileNotFoundError(f"bundled trace {name!r} is missing from the package")
            return Path(p)
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(
            f"trace file {p} not found; give a .jsonl/.jsonl.gz path or one of {sorted(BUNDLED)}"
        )
    return p


def _open(path: Path) -> IO[str]:
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    return path.open("r", encoding="utf-8")


def _row(obj: object, where: str, tokens_per_hash_id: int) -> TraceRow:
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    missing = [
        k for k in ("timestamp", "input_length", "output_length", "hash_ids") if k not in obj
    ]
    if missing:
        raise TraceError(f"{where}: missing field {missing[0]!r}")
    # exact JSON types, no coercion: "10", true and 600.5 are not token counts
    ts, inp, out, ids = obj["timestamp"], obj["input_length"], obj["output_length"], obj["hash_ids"]
    if not _is_number(ts) or not abs(ts) <= MAX_TIMESTAMP_MS:
        raise TraceError(f"{where}: timestamp must be a number of ms within +-1e13, got {ts!r}")
    if not _is_int(inp) or not 1 <= inp <= MAX_TRACE_TOKENS:
        raise TraceError(f"{where}: input_length must be an integer in [1, 2**20], got {inp!r}")
    if not _is_int(out) or not 0 <= out <= MAX_TRACE_TOKENS:
        raise TraceError(f"{where}: output_length must be an integer in [0, 2**20], got {out!r}")
    if not isinstance(ids, list) or not all(_is_int(h) and 0 <= h <= MAX_HASH_ID for h in ids):
        raise TraceError(f"{where}: hash_ids must be a list of non-negative integers below 2**63")
    return _checked_row(float(ts), inp, out, tuple(ids), where, tokens_per_hash_id)


def _checked_row(
    ts: float, inp: int, out: int, ids: tuple[int, ...], where: str, tokens_per_hash_id: int
) -> TraceRow:
    """A row of well-typed fields, once its hash ids are known to cover its prompt."""
    if len(ids) < math.ceil(inp / tokens_per_hash_id):
        raise TraceError(
            f"{where}: {len(ids)} hash ids cannot cover input_length {inp} "
            f"at {tokens_per_hash_id} tokens per id"
        )
    return TraceRow(ts, inp, out, ids)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def iter_trace(
    path: str | Path, tokens_per_hash_id: int = TOKENS_PER_HASH_ID
) -> Iterator[TraceRow]:
    """The rows of a trace file in file order (blank lines skipped)."""
    p = resolve_trace(path)
    lineno = 0
    try:
        with _open(p) as fh:
            # bounded: /dev/zero or a gzip bomb is refused at the cap, not read into memory
            for lineno, line in bounded_lines(fh, str(p), MAX_LINE_CHARS, MAX_TRACE_CHARS):
                if not line.strip():
                    continue
                try:  # the typed pass; anything it refuses takes the checks below
                    fast = _ROW_DECODER.decode(line)
                except (msgspec.MsgspecError, RecursionError):  # deep nesting: json says so
                    pass
                else:
                    yield _checked_row(
                        fast.timestamp,
                        fast.input_length,
                        fast.output_length,
                        tuple(fast.hash_ids),
                        f"{p}:{lineno}",
                        tokens_per_hash_id,
                    )
                    continue
                try:  # standard JSON: NaN/Infinity and deep nesting are errors, not values
                    obj = loads_json(line, f"{p}:{lineno}")
                except ArgError as exc:
                    raise TraceError(str(exc)) from None
                yield _row(obj, f"{p}:{lineno}", tokens_per_hash_id)
    except InputTooLarge as exc:
        raise TraceError(f"{exc}: not a trace this tool reads") from None
    except (OSError, EOFError, UnicodeDecodeError, zlib.error) as exc:
        # not gzip, truncated, a directory, not UTF-8: the file, not a line, is at fault
        raise TraceError(
            f"{p}: cannot read it as a .jsonl or .jsonl.gz trace after line {lineno} ({exc})"
        ) from None


def _spread(rows: list[TraceRow], spread_ms: float) -> list[float]:
    """Per row, an offset that spreads rows sharing a timestamp evenly over ``spread_ms``."""
    if spread_ms <= 0:
        return [0.0] * len(rows)
    counts: dict[float, int] = {}
    for r in rows:
        counts[r.timestamp] = counts.get(r.timestamp, 0) + 1
    seen: dict[float, int] = {}
    out = []
    for r in rows:
        i = seen.get(r.timestamp, 0)
        seen[r.timestamp] = i + 1
        out.append(spread_ms * i / counts[r.timestamp])
    return out


def load_trace(
    path: str | Path,
    *,
    speedup: float = 1.0,
    max_requests: int | None = None,
    tokens_per_hash_id: int = TOKENS_PER_HASH_ID,
    spread_ms: float = 0.0,
) -> list[Request]:
    """Requests of a trace, arrival times divided by ``speedup``, at most ``max_requests``.

    ``spread_ms`` > 0 de-quantizes a trace whose timestamps come in buckets (the Mooncake
    traces group requests about 3 s apart): the rows sharing a timestamp arrive evenly spaced
    over ``spread_ms`` from it, in file order (no randomness). Timestamps are made relative to
    the earliest one; a request with ``output_length`` 0 is given
    one output token (a request always produces its first token).
    """
    if speedup <= 0:
        raise ValueError(f"speedup must be > 0, got {speedup}")
    if max_requests is not None and max_requests < 0:
        raise ValueError(f"max_requests must be >= 0, got {max_requests}")
    rows: list[TraceRow] = []
    for row in iter_trace(path, tokens_per_hash_id):
        if max_requests is not None and len(rows) >= max_requests:
            break
        rows.append(row)
    t0 = min((r.timestamp for r in rows), default=0.0)
    offsets = _spread(rows, spread_ms)
    out = [
        Request(
            request_id=i,
            arrival_ms=(row.timestamp - t0 + offsets[i]) / speedup,
            input_length=row.input_length,
            output_length=max(1, row.output_length),
            hash_ids=row.hash_ids,
            tokens_per_hash_id=tokens_per_hash_id,
        )
        for i, row in enumerate(rows)
    ]
    out.sort(key=lambda r: r.arrival_ms)  # stable: equal timestamps keep file order
    for i, r in enumerate(out):
        r.request_id = i
    return out

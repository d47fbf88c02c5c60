"""Mooncake-format request traces.

One JSON object per line: ``timestamp`` (ms from the start), ``input_length``, ``output_length``
(tokens) and ``hash_ids`` (one id per 512-token block of the prompt; two requests share an id at
position i only if they share the whole prefix up to it). Files may be gzip-compressed
(``.gz``). Each hash id expands to its own tokens (:func:`router_sim.workloads.expand_hash_ids`),
lazily, when a worker or the router needs the prompt.

The Mooncake conversation trace ships with the package (``router_sim/data``): pass
``"mooncake"`` as the path to use it.
"""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import IO, Final

from router_sim.workloads import TOKENS_PER_HASH_ID, Request

BUNDLED: Final[dict[str, str]] = {"mooncake": "conversation_trace.jsonl.gz"}
"""Short names of the traces bundled in ``router_sim/data``."""


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
    try:
        ts = float(obj["timestamp"])
        inp = int(obj["input_length"])
        out = int(obj["output_length"])
        ids = tuple(int(h) for h in obj["hash_ids"])
    except KeyError as exc:
        raise TraceError(f"{where}: missing field {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise TraceError(f"{where}: bad field value ({exc})") from None
    if inp < 1 or out < 0:
        raise TraceError(f"{where}: input_length must be >= 1 and output_length >= 0")
    if any(h < 0 for h in ids):
        raise TraceError(f"{where}: hash ids must be non-negative")
    if len(ids) < math.ceil(inp / tokens_per_hash_id):
        raise TraceError(
            f"{where}: {len(ids)} hash ids cannot cover input_length {inp} "
            f"at {tokens_per_hash_id} tokens per id"
        )
    return TraceRow(ts, inp, out, ids)


def iter_trace(
    path: str | Path, tokens_per_hash_id: int = TOKENS_PER_HASH_ID
) -> Iterator[TraceRow]:
    """The rows of a trace file in file order (blank lines skipped)."""
    p = resolve_trace(path)
    lineno = 0
    try:
        with _open(p) as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise TraceError(f"{p}:{lineno}: not JSON ({exc.msg})") from None
                yield _row(obj, f"{p}:{lineno}", tokens_per_hash_id)
    except (OSError, EOFError, UnicodeDecodeError) as exc:
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

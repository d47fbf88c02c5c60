"""This project's extensions on the replay socket: publisher info, incarnations and snapshots.

Engines (vLLM, SGLang) answer a replay request with the buffered batches and an end marker
whose last frame is empty, and so does this project's publisher for every request an engine
client sends (WIRE.md 5): clients written for vLLM stop on that empty payload. Its extensions
answer only requests no engine client sends, and an engine answers each of them with its end
marker alone (it reads the request frame with ``int.from_bytes``, as a seq beyond its ring):

- the *hello*, a replay from ``HELLO_START`` (2**64 - 2): the end marker alone, whose last
  frame is this publisher's *info* record;
- the *extended replay request*, ``b"kvx1" | start_seq u64 BE`` (12 bytes): the ordinary reply,
  but the end marker carries the info (:func:`replay_request`);
- the *snapshot request*.

Layouts (docs/WIRE.md, section 7)::

    info      = b"kvx1" | incarnation u64 BE | next_seq u64 BE | flags u8    (21 bytes)
                flags bit 0: the publisher answers snapshot requests
    extended  = [b"", b"kvx1" | start_seq u64 BE]      (DEALER side)
    request   = [b"", b"kv-snapshot"]                  (DEALER side)
    reply     = [b"", b"kv-snapshot", header, payload]  one message per part
    header    = incarnation u64 BE | next_seq u64 BE | part u32 BE | parts u32 BE  (24 bytes)
                parts == 0: refused (no snapshot can be made now); payload is empty

A snapshot is the worker's complete state as ``Stored`` events in ordinary batch payloads,
consistent with every batch of that incarnation below ``next_seq`` (and with none after).
The incarnation is a random 64-bit id drawn at each publisher start: a subscriber that sees it
change knows the publisher restarted, whatever the sequence numbers say.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from events.wire.model import KVCacheEvent, Stored

INFO_MAGIC: Final = b"kvx1"
#: a replay from here (the hello) gets the end marker alone, with the info from this project's
#: publishers; no engine client asks it (no engine reaches that seq)
HELLO_START: Final = 2**64 - 2
_SEQ: Final = struct.Struct(">Q")
_INFO: Final = struct.Struct(">4sQQB")
_HEADER: Final = struct.Struct(">QQII")
#: the snapshot request's second frame, and the tag frame of every snapshot reply part
SNAPSHOT_TAG: Final = b"kv-snapshot"
#: blocks per snapshot part: well inside the decoder's limits, and small enough that a part
#: costs about what a live batch does to decode
PART_BLOCKS: Final = 1024
FLAG_SNAPSHOTS: Final = 1


class SnapshotError(ValueError):
    """A snapshot reply that cannot be assembled (bad header, too large, parts mixed up)."""


@dataclass(frozen=True, slots=True)
class PublisherInfo:
    """What a publisher of this project says about itself at the end of every replay."""

    incarnation: int
    next_seq: int
    snapshots: bool


def replay_request(start: int, *, extended: bool = False) -> bytes:
    """The frame of a replay request from ``start``: 8 bytes (what engines' clients send), or
    ``b"kvx1"`` and those 8 (``extended``: the reply's end marker carries this project's info;
    an engine reads the 12 bytes as a start beyond its ring and sends its end marker alone)."""
    return INFO_MAGIC + _SEQ.pack(start) if extended else _SEQ.pack(start)


def parse_replay_request(frame: bytes) -> tuple[int, bool] | None:
    """(start, extended) of a replay request frame; None when it is not one."""
    if len(frame) == 8:
        start: int = _SEQ.unpack(frame)[0]
        return start, start == HELLO_START
    if len(frame) == 12 and frame.startswith(INFO_MAGIC):
        return _SEQ.unpack_from(frame, 4)[0], True
    return None


def pack_info(info: PublisherInfo) -> bytes:
    return _INFO.pack(
        INFO_MAGIC, info.incarnation, info.next_seq, FLAG_SNAPSHOTS if info.snapshots else 0
    )


def parse_info(frame: bytes) -> PublisherInfo | None:
    """The info in an end marker's last frame; None for engines' empty frame or anything else."""
    if len(frame) != _INFO.size or not frame.startswith(INFO_MAGIC):
        return None
    _, incarnation, next_seq, flags = _INFO.unpack(frame)
    return PublisherInfo(incarnation, next_seq, bool(flags & FLAG_SNAPSHOTS))


@dataclass(frozen=True, slots=True)
class SnapshotHeader:
    incarnation: int
    next_seq: int
    part: int
    parts: int


def pack_header(header: SnapshotHeader) -> bytes:
    return _HEADER.pack(header.incarnation, header.next_seq, header.part, header.parts)


def parse_header(frame: bytes) -> SnapshotHeader:
    if len(frame) != _HEADER.size:
        raise SnapshotError(f"snapshot header of {len(frame)} bytes; expected {_HEADER.size}")
    return SnapshotHeader(*_HEADER.unpack(frame))


@dataclass(frozen=True, slots=True)
class Snapshot:
    """An assembled snapshot: the payloads of its parts, in order. ``payloads`` is empty for a
    refusal (``refused`` True)."""

    incarnation: int
    next_seq: int
    payloads: tuple[bytes, ...]
    refused: bool = False


class SnapshotAssembler:
    """Collects the parts of one snapshot reply, bounded in parts and bytes."""

    def __init__(self, max_parts: int = 4096, max_bytes: int = 1 << 30) -> None:
        self.max_parts = max_parts
        self.max_bytes = max_bytes
        self._header: SnapshotHeader | None = None
        self._parts: list[bytes] = []
        self._bytes = 0

    def reset(self) -> None:
        self._header = None
        self._parts = []
        self._bytes = 0

    def add(self, header_frame: bytes, payload: bytes) -> Snapshot | None:
        """Add one reply part; returns the snapshot once complete. Raises SnapshotError (and
        forgets what it had) for a part that does not continue the one being assembled."""
        try:
            header = parse_header(header_frame)
            if header.parts == 0:
                self.reset()
                return Snapshot(header.incarnation, header.next_seq, (), refused=True)
            first = self._header
            if header.parts > self.max_parts:
                raise SnapshotError(f"snapshot of {header.parts} parts; at most {self.max_parts}")
            if first is None:
                if header.part != 0:
                    raise SnapshotError(f"snapshot starts at part {header.part}, not 0")
                self._header = first = header
            elif (header.incarnation, header.next_seq, header.parts) != (
                first.incarnation,
                first.next_seq,
                first.parts,
            ) or header.part != len(self._parts):
                raise SnapshotError("snapshot parts out of order or from two snapshots")
            self._bytes += len(payload)
            if self._bytes > self.max_bytes:
                raise SnapshotError(f"snapshot larger than {self.max_bytes} bytes")
        except SnapshotError:
            self.reset()
            raise
        self._parts.append(payload)
        if len(self._parts) < first.parts:
            return None
        done = Snapshot(first.incarnation, first.next_seq, tuple(self._parts))
        self.reset()
        return done


def split_parts(
    events: Sequence[KVCacheEvent], part_blocks: int = PART_BLOCKS
) -> list[list[KVCacheEvent]]:
    """Group snapshot events into parts of at most about ``part_blocks`` blocks each; a longer
    chain is cut into pieces whose parent is the previous piece's last block (order kept, so
    every parent is stored before its children)."""
    parts: list[list[KVCacheEvent]] = [[]]
    room = part_blocks
    for event in events:
        data = event.data
        if not isinstance(data, Stored):
            parts[-1].append(event)
            continue
        blocks = data.blocks
        parent = data.parent_hash
        start = 0
        while start < len(blocks):
            if room == 0:
                parts.append([])
                room = part_blocks
            piece = blocks[start : start + room]
            parts[-1].append(
                KVCacheEvent(
                    event.event_id,
                    Stored(parent, list(piece), data.block_size),
                    event.window_size,
                    event.hash_algo,
                    event.attention_dp_rank,
                )
            )
            parent = piece[-1].block_hash
            start += len(piece)
            room -= len(piece)
    return [p for p in parts if p] or [[]]

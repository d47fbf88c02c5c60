"""Event codecs: the msgpack wire format of WIRE.md section 4 and the JSON shape of section 6.

This module holds the wire encoder and re-exports the decoder (``events.wire.decode``) and
the JSON codec (``events.wire.json_codec``), so ``events.wire.codec`` is the one import callers
need.

Payload: a msgpack array ``[ts: float64, events: array, data_parallel_rank: int | nil]``.
:func:`encode_batch` writes vLLM-style tagged maps:

- ``Stored``  -> ``BlockStored`` (``block_hashes``, ``parent_block_hash``, ``token_ids``,
  ``block_size``, ``lora_id``, ``medium``, ``lora_name``) plus this project's extensions
  ``cache_salt_id``, ``hash_algo`` and ``priority``. One wire event carries one value of
  lora_id / medium / priority / salt and only its last block may be short, so a ``Stored``
  whose blocks differ in those is sent as several chained ``BlockStored`` events.
- ``Removed`` -> ``BlockRemoved``; ``AllBlocksCleared`` -> ``AllBlocksCleared``.
- ``Updated`` and ``Created`` have no event of their own in vLLM's or SGLang's decoders, which
  reject a whole batch with an event type they do not know. By default a tier move
  (``Updated`` with a ``cache_level`` diff) travels as the pair engines send for it:
  ``BlockRemoved`` on the old medium, then a placeholder ``BlockStored`` on the new one (no
  token ids, ``block_size`` 0, as vLLM's CPU offload announces blocks); a priority change and
  ``Created`` are not sent. With ``extensions=True`` they travel as this project's extension
  events ``{"type": "BlockUpdated", "block_hash", "cache_level": [old, new] | nil,
  "priority": [old, new] | nil}`` and ``{"type": "CacheCreated", "num_blocks_per_cache_level"}``.
- Every event map also carries ``event_id``; ``window_size`` and ``attention_dp_rank`` only when
  they are not the defaults (0, the batch's rank).
- ``form="positional"`` writes each event as an array instead, for consumers built on vLLM
  0.11, whose events are positional (0.25.1 already reads maps): ``["BlockStored",
  block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]`` (vLLM 0.11's
  fields, in its order), ``["BlockRemoved", block_hashes, medium]``, ``["AllBlocksCleared"]``;
  extension fields are not sent (a positional decoder reads them by position), and extension
  events are map-only.

What the default writes decodes in vLLM >= 0.26 and SGLang: their map-form structs ignore
unknown fields and every field they require is present (``lora_id``, ``lora_name``,
``medium``); tests check it against the structs recorded from their releases
(``tests/data/engines/decoder_rules.json``).

Each wire event is a Struct of the writer's (``events.wire.structs.writer_types("native")``,
declared from the table the decoder's Structs come from), and :func:`encode_payload`, the one
writer of payloads (the simulator's engine dialects use it with their engines' Structs), has
msgspec write them. Token ids that come packed (``array('i')``, as the event manager's records
hold them) are handed to msgspec as their list (``array.tolist()``).

Hashes travel as uint64. A ``v2_sha256`` hash (64 hex characters) travels as a 32-byte msgpack
``bin`` and decodes back to its hex string: an extension, since 64-bit integers cannot hold it.

:func:`decode_batch` is tolerant of what existing engines send (map or legacy positional
events, 2- or 3-element envelopes, int64 hashes read as two's complement, unknown fields and
event types skipped) and strict about everything else: any malformed payload raises
:class:`DecodeError`, and :class:`DecodeLimits` bound the work and memory one payload can cost.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from operator import attrgetter
from typing import Any, Final, cast

import msgspec
from msgspec import UNSET

from events.wire.decode import DEFAULT_LIMITS, DecodeLimits, decode_batch
from events.wire.json_codec import (
    DecodeError,
    from_json,
    to_json,
)
from events.wire.model import (
    AllBlocksCleared,
    BlockHash,
    Created,
    EventDiff,
    KVCacheEvent,
    Removed,
    Stored,
    StoredBlock,
    TokenIds,
    Updated,
    medium_of,
    wire_runs,
)
from events.wire.structs import writer_types
from kvcache.scope import U64_LIMIT

# msgspec writes the payload (the library vLLM and SGLang encode these events with): a Struct's
# fields in declared order, each int in its smallest form, floats as float64, bytes as bin.
_ENCODER: Final = msgspec.msgpack.Encoder()

_DEFAULT_ALGO: Final = "v1_block_key"

# the writer's event Structs (events.wire.structs.WRITERS["native"])
_NATIVE: Final = writer_types("native")
_STORED: Final = _NATIVE.map["BlockStored"]
_REMOVED: Final = _NATIVE.map["BlockRemoved"]
_CLEARED: Final = _NATIVE.map["AllBlocksCleared"]
_UPDATED: Final = _NATIVE.map["BlockUpdated"]
_CREATED: Final = _NATIVE.map["CacheCreated"]
_SHA256_BYTES: Final = 32


def _wire_hash(h: BlockHash) -> int | bytes:
    if type(h) is int:
        if not 0 <= h < U64_LIMIT:
            raise ValueError(f"block hash {h} is not an unsigned 64-bit value")
        return h
    if isinstance(h, str) and len(h) == 2 * _SHA256_BYTES:
        try:
            return bytes.fromhex(h)
        except ValueError:
            pass
    raise ValueError(
        f"block hash {h!r} is neither a uint64 nor a 64-character hex v2_sha256 digest"
    )


def _wire_hashes(hashes: list[BlockHash]) -> list[int | bytes]:
    if hashes and set(map(type, hashes)) == {int}:
        ints = cast(list[int], hashes)
        if min(ints) >= 0 and max(ints) < U64_LIMIT:
            return list(ints)
    return [_wire_hash(h) for h in hashes]


def _tail(event: KVCacheEvent, dp_rank: int | None) -> tuple[Any, int, Any, Any]:
    """The event's own fields every wire event of it carries: ``hash_algo`` unless the
    default, ``event_id``, ``window_size`` unless 0, ``attention_dp_rank`` unless the batch's
    (UNSET: not written)."""
    rank = event.attention_dp_rank
    return (
        UNSET if event.hash_algo == _DEFAULT_ALGO else event.hash_algo,
        event.event_id,
        event.window_size or UNSET,
        UNSET if rank == dp_rank else rank,
    )


_Run = tuple[int, TokenIds, list[BlockHash]]
_TOKENS: Final = attrgetter("tokens")
_BLOCK_HASH: Final = attrgetter("block_hash")
_TYPECODE: Final = attrgetter("typecode")


def join_tokens(parts: list[TokenIds]) -> TokenIds:
    """A run's token ids, from its blocks' ids, in one container: an ``array('i')`` when every
    part is one, else a list (a lone part as it is: the writers only read it). This writer's
    and the engine dialects' (``router_sim.sim.dialects``) runs are joined here."""
    if len(parts) == 1:
        return parts[0]
    if set(map(type, parts)) == {array} and set(map(_TYPECODE, parts)) == {"i"}:
        return array("i", b"".join(cast("list[array[int]]", parts)))
    return [t for part in parts for t in part]


def _stored_runs(blocks: list[StoredBlock], block_size: int) -> list[_Run]:
    """The wire events of a Stored event's blocks (:func:`events.wire.model.wire_runs`) as
    ``(end, token_ids, hashes)``: the run's token ids (packed when every block's are) and
    hashes concatenated in order."""
    tokens = list(map(_TOKENS, blocks))
    sizes = list(map(len, tokens))
    if min(sizes) < 1 or max(sizes) > block_size:
        i, n = next((i, n) for i, n in enumerate(sizes) if not 0 < n <= block_size)
        raise ValueError(
            f"stored block {i} has {n} tokens; blocks must hold 1..block_size ({block_size}) tokens"
        )
    hashes = list(map(_BLOCK_HASH, blocks))
    runs: list[_Run] = []
    start = 0
    for end in wire_runs(blocks, block_size):
        runs.append((end, join_tokens(tokens[start:end]), hashes[start:end]))
        start = end
    return runs


def wire_tokens(tokens: TokenIds) -> TokenIds:
    """Token ids as msgspec writes them: packed ones (``array('i')``) as a list of their ints
    (msgspec would write an array's buffer as bin), anything else as it is."""
    return tokens.tolist() if type(tokens) is array else tokens


def _encode_stored(event: KVCacheEvent, data: Stored, dp_rank: int | None, out: list[Any]) -> None:
    blocks = data.blocks
    if not blocks:
        return  # nothing stored: nothing to announce
    block_size = data.block_size or len(blocks[0].tokens)
    if data.block_size is not None and data.block_size < 1:
        raise ValueError(f"Stored.block_size must be >= 1, got {block_size}")
    parent = data.parent_hash
    _, event_id, window, rank = _tail(event, dp_rank)
    start = 0
    for end, token_ids, hashes in _stored_runs(blocks, block_size):
        first = blocks[start]
        out.append(
            _STORED(
                block_hashes=_wire_hashes(hashes),
                parent_block_hash=None if parent is None else _wire_hash(parent),
                token_ids=wire_tokens(token_ids),
                block_size=block_size,
                lora_id=first.lora_id,
                medium=medium_of(first.cache_level),
                lora_name=None,
                cache_salt_id=first.cache_salt_id,
                # a store always names its hash algorithm (a consumer keys its blocks by it)
                hash_algo=event.hash_algo,
                priority=first.priority,
                event_id=event_id,
                window_size=window,
                attention_dp_rank=rank,
            )
        )
        parent = hashes[-1]
        start = end


def _diff_wire(diff: EventDiff | None) -> list[int] | None:
    return None if diff is None else [diff.old_value, diff.new_value]


def _encode_move(event: KVCacheEvent, data: Updated, dp_rank: int | None, out: list[Any]) -> None:
    """A tier move as engines send it: removed on the old medium, a placeholder store (no
    token ids) on the new one. A priority change alone is not announced."""
    diff = data.cache_level
    if diff is None or diff.old_value == diff.new_value:
        return
    h = _wire_hash(data.block_hash)
    algo, event_id, window, rank = _tail(event, dp_rank)
    out.append(
        _REMOVED(
            block_hashes=[h],
            medium=medium_of(diff.old_value),
            hash_algo=algo,
            event_id=event_id,
            window_size=window,
            attention_dp_rank=rank,
        )
    )
    out.append(
        _STORED(
            block_hashes=[h],
            parent_block_hash=None,
            token_ids=[],
            block_size=0,
            lora_id=None,
            medium=medium_of(diff.new_value),
            lora_name=None,
            hash_algo=algo,
            event_id=event_id,
            window_size=window,
            attention_dp_rank=rank,
        )
    )


def _encode_event(
    event: KVCacheEvent, dp_rank: int | None, out: list[Any], extensions: bool = False
) -> None:
    data = event.data
    if isinstance(data, Stored):
        _encode_stored(event, data, dp_rank, out)
        return
    if not extensions:
        if isinstance(data, Updated):
            _encode_move(event, data, dp_rank, out)
            return
        if isinstance(data, Created):
            return
    algo, event_id, window, rank = _tail(event, dp_rank)
    wire: Any
    if isinstance(data, Removed):
        level = data.cache_level
        wire = _REMOVED(
            block_hashes=_wire_hashes(data.block_hashes),
            medium=None if level is None else medium_of(level),
            hash_algo=algo,
            event_id=event_id,
            window_size=window,
            attention_dp_rank=rank,
        )
    elif isinstance(data, AllBlocksCleared):
        wire = _CLEARED(
            hash_algo=algo, event_id=event_id, window_size=window, attention_dp_rank=rank
        )
    elif isinstance(data, Updated):
        wire = _UPDATED(
            block_hash=_wire_hash(data.block_hash),
            cache_level=_diff_wire(data.cache_level),
            priority=_diff_wire(data.priority),
            hash_algo=algo,
            event_id=event_id,
            window_size=window,
            attention_dp_rank=rank,
        )
    elif isinstance(data, Created):
        wire = _CREATED(
            num_blocks_per_cache_level=list(data.num_blocks_per_cache_level),
            hash_algo=algo,
            event_id=event_id,
            window_size=window,
            attention_dp_rank=rank,
        )
    else:
        raise TypeError(f"not an event payload: {type(data).__name__}")
    out.append(wire)


def _positional(wire: list[Any]) -> list[Any]:
    """The map-form events as vLLM 0.11's positional ones (its fields, in its order)."""
    out: list[Any] = []
    for event in wire:
        kind = _NATIVE.kind[type(event)]
        positional = _NATIVE.positional.get(kind)
        if positional is None:
            raise ValueError(f"{kind} has no positional form (extension events are map-only)")
        out.append(positional(*(getattr(event, name) for name in positional.__struct_fields__)))
    return out


WRITTEN_AS_IS: Final = (Stored, Removed, AllBlocksCleared)
"""The event kinds :func:`encode_batch` writes as one wire event each, which
:func:`decode_batch` gives back equal, a ``Stored`` provided its blocks form one run (as the
event manager's do). ``Updated`` travels as a removal plus a placeholder store and ``Created``
not at all (see the module docstring)."""


def encode_payload(events: list[Any], ts: float, dp_rank: int | None) -> bytes:
    """The payload ``[ts, events, dp_rank]`` of wire events already built as a writer's
    Structs (``events.wire.structs.writer_types``): the one place every writer's payload is
    written, this module's and the engine dialects'."""
    return _ENCODER.encode([float(ts), events, dp_rank])


def encode_batch(
    events: Iterable[KVCacheEvent],
    ts: float,
    dp_rank: int | None = None,
    *,
    form: str = "map",
    extensions: bool = False,
) -> bytes:
    """One wire payload ``[ts, events, dp_rank]`` for ``events`` in order.

    ``form``: ``"map"`` (tagged maps, what vLLM >= 0.25 and SGLang read) or ``"positional"``
    (arrays, what vLLM 0.11's consumers read). ``extensions``: send ``Updated`` and
    ``Created`` as this project's extension events instead of what engines send (see the
    module docstring).

    Raises ``ValueError`` for a hash that is not a uint64 or v2_sha256 hex digest, a stored
    block with no tokens or more than ``block_size``, an unknown ``form``, or an extension
    event in the positional form.
    """
    if form not in ("map", "positional"):
        raise ValueError(f"form must be 'map' or 'positional', got {form!r}")
    wire: list[Any] = []
    for event in events:
        _encode_event(event, dp_rank, wire, extensions)
    if form == "positional":
        wire = _positional(wire)
    return encode_payload(wire, ts, dp_rank)


__all__ = [
    "DEFAULT_LIMITS",
    "DecodeError",
    "DecodeLimits",
    "decode_batch",
    "encode_batch",
    "encode_payload",
    "from_json",
    "to_json",
]

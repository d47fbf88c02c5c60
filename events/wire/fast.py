"""Typed fast path of the wire decoder: msgspec decodes a payload straight into structs that
mirror the wire (WIRE.md section 4), checking types and ranges as it goes.

Two decoders, one per event form, each over a tagged union: map-form events tagged by their
``"type"`` field (vLLM >= 0.25, SGLang, this project), and positional events (vLLM 0.11's
``array_like`` structs) whose element 0 is the tag. Whatever these types do not accept
(a wrong type or range anywhere, an unknown field or event type, a mixed batch, SGLang's
bigram pages, a token count that does not fit its blocks, limits tighter than the defaults)
returns None, and ``events.wire.decode`` decodes the payload on its general path, which
keeps every rule and error message. What the types accept is built into model objects by
the rules both paths share (``events.wire.values``), so both paths give equal batches.

The common batch (map-form ``BlockStored`` with int hashes and token ids that fill the named
blocks, ``BlockRemoved`` with int hashes, ``AllBlocksCleared``; known fields each once, no
``extra_keys`` list, ``ts`` a float64: what this project's workers and V1 engines send) is read
first by the native reader ``events.wire._wire.decode_events`` (:func:`decode_native`), in one
pass over the payload straight into the records :func:`decode_structs` builds: msgspec's
structs cost a pass that skips every token id before the ids are read, and a Python frame per
event builds the records. It takes a strict subset of what the structs take (anything else
returns None and goes to :func:`decode_structs`), and its batches equal theirs (tested).

A store's token ids are not built as Python ints: msgspec hands them over undecoded
(``msgspec.Raw``, a view of the payload's bytes) and :func:`packed_tokens` reads them straight
into an ``array('i')`` natively, which the blocks then share as
array slices. What it does not accept (anything but a msgpack array of at most
:data:`MAX_TOKENS` ints in ``[0, 2**31)``) sends the payload to the general path like any other
refusal.

Why the bounds hold here: every type is nested at most :data:`FAST_DEPTH` deep (no ``Any``
anywhere; ``extra_keys`` items are scalars or lists of scalars; the undecoded token ids are
skipped by msgspec, which bounds their nesting by its recursion guard, and read by a parser
that refuses any nesting), every list, string and bin is
capped at the default :class:`~events.wire.decode.DecodeLimits` (strings at a quarter of
``max_str_len`` in characters, so their UTF-8 bytes fit it too), a map holds only known
fields, and the path runs only under limits at least as loose as the defaults. msgspec checks
each declared length against the bytes left before it allocates. One bound it cannot see: a
map that repeats known keys past ``max_fields`` (msgspec keeps the last value, as the general
path does below the bound); it costs no memory beyond its bytes, since each repeat replaces
the one before.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Final, TypeAlias, Union, cast

import msgspec
from msgspec import UNSET, Meta, Raw, Struct, UnsetType

# the one import of the native codec: its writers are events.wire.codec's (see below)
from events.wire import _wire
from events.wire._records import record_setters
from events.wire.json_codec import DecodeError
from events.wire.model import (
    AllBlocksCleared,
    Created,
    DecodedBatch,
    EventData,
    EventDiff,
    KVCacheEvent,
    Removed,
    Stored,
    StoredBlock,
    Updated,
    cache_level_of,
)
from events.wire.values import build_stored, salt_from_extra_keys, wire_hash, wire_hashes
from kvcache.tokens import TOKEN_LIMIT

#: the default DecodeLimits, restated (wire_decode checks they agree)
MAX_EVENTS: Final = 1 << 16
MAX_TOKENS: Final = 1 << 20
MAX_BLOCKS: Final = 1 << 16
MAX_STR: Final = 1 << 16
MAX_BIN: Final = 1 << 16
#: deepest nesting these types allow: envelope, events, event, extra_keys, entry, item
FAST_DEPTH: Final = 6

_DEFAULT_ALGO: Final = "v1_block_key"
_DEFAULT_PRIORITY: Final = 35

U64 = Annotated[int, Meta(ge=0)]
Small = Annotated[int, Meta(ge=0, lt=TOKEN_LIMIT)]
Str = Annotated[str, Meta(max_length=MAX_STR // 4)]
Hash: TypeAlias = Union[int, Annotated[bytes, Meta(min_length=1, max_length=64)]]  # noqa: UP007
Hashes = Annotated[list[Hash], Meta(max_length=MAX_BLOCKS)]
Diff = Union[tuple[U64, U64], None]  # noqa: UP007
# vLLM's extra_keys: per block, None or a list of str (LoRA name, cache salt) and (mm hash,
# offset) tuples; no deeper. A union holds one str-like type, so a store whose extra_keys
# carry bytes (prompt-embeds digests) takes the general path.
_Scalar = Union[None, bool, int, float, Str]  # noqa: UP007
_ExtraItem = Union[None, bool, int, float, Str, list[_Scalar]]  # noqa: UP007
ExtraKeys = Union[list[Union[list[_ExtraItem], None]], None]  # noqa: UP007

# gc=False: these structs live for one decode call and hold no cycles; left out of the cyclic
# collector, they do not count toward its next collection (which, in a process holding a big
# index, is what a decode's allocations mostly cost)
_MAP: Final = {"tag_field": "type", "forbid_unknown_fields": True, "gc": False}
_ARRAY: Final = {"array_like": True, "forbid_unknown_fields": True, "gc": False}


class _Common(Struct, forbid_unknown_fields=True, gc=False):
    event_id: U64 | UnsetType = UNSET
    window_size: U64 = 0
    hash_algo: Str = _DEFAULT_ALGO
    attention_dp_rank: U64 | UnsetType | None = UNSET


class MapStored(_Common, tag="BlockStored", kw_only=True, **_MAP):
    block_hashes: Hashes
    token_ids: Raw  # read by packed_tokens
    block_size: Small
    parent_block_hash: Hash | None = None
    lora_id: U64 | None = None
    medium: Str | None = None
    lora_name: Str | None = None
    cache_salt_id: U64 | None = None
    priority: Annotated[int, Meta(ge=0, lt=101)] = _DEFAULT_PRIORITY
    cache_salt: Str | None = None
    extra_keys: ExtraKeys = None
    group_idx: Small | None = None
    # vLLM's KV-cache group spec (>= 0.25): the group's attention kind and window in tokens
    kv_cache_spec_kind: Str | None = None
    kv_cache_spec_sliding_window: Annotated[int, Meta(ge=0, lt=TOKEN_LIMIT)] | None = None


class MapRemoved(_Common, tag="BlockRemoved", kw_only=True, **_MAP):
    block_hashes: Hashes
    medium: Str | None = None
    group_idx: Small | None = None


class MapCleared(_Common, tag="AllBlocksCleared", kw_only=True, **_MAP):
    pass


class MapUpdated(_Common, tag="BlockUpdated", kw_only=True, **_MAP):
    block_hash: Hash
    cache_level: Diff = None
    priority: Diff = None


class MapCreated(_Common, tag="CacheCreated", kw_only=True, **_MAP):
    num_blocks_per_cache_level: list[U64]


class PosStored(Struct, tag="BlockStored", **_ARRAY):
    block_hashes: Hashes
    parent_block_hash: Hash | None
    token_ids: Raw  # read by packed_tokens
    block_size: Small
    lora_id: U64 | None = None
    medium: Str | None = None
    lora_name: Str | None = None


class PosRemoved(Struct, tag="BlockRemoved", **_ARRAY):
    block_hashes: Hashes
    medium: Str | None = None


class PosCleared(Struct, tag="AllBlocksCleared", **_ARRAY):
    pass


class PosUpdated(Struct, tag="BlockUpdated", **_ARRAY):
    block_hash: Hash
    cache_level: Diff = None
    priority: Diff = None


class PosCreated(Struct, tag="CacheCreated", **_ARRAY):
    num_blocks_per_cache_level: list[U64]


MapEvent = Union[MapStored, MapRemoved, MapCleared, MapUpdated, MapCreated]  # noqa: UP007
PosEvent = Union[PosStored, PosRemoved, PosCleared, PosUpdated, PosCreated]  # noqa: UP007
AnyStored = Union[MapStored, PosStored]  # noqa: UP007


class MapBatch(Struct, **_ARRAY):
    ts: float
    events: Annotated[list[MapEvent], Meta(max_length=MAX_EVENTS)]
    dp_rank: Small | None = None


class PosBatch(Struct, **_ARRAY):
    ts: float
    events: Annotated[list[PosEvent], Meta(max_length=MAX_EVENTS)]
    dp_rank: Small | None = None


_MAP_DECODER: Final = msgspec.msgpack.Decoder(MapBatch)
_POS_DECODER: Final = msgspec.msgpack.Decoder(PosBatch)


def packed_tokens(data: Raw | bytes) -> array[int] | None:
    """The token ids of ``data``, one msgpack array of at most :data:`MAX_TOKENS` ints in
    ``[0, 2**31)``, as an ``array('i')``; None for anything else."""
    tokens: array[int] | None = _wire.tokens_from_msgpack(data, MAX_TOKENS)
    return tokens


pack_tokens: Callable[[object], bytes | None] = _wire.pack_tokens
"""The msgpack array of an ``array('i')`` or a list of ints, byte for byte what msgspec writes
for the same ints as a list; None for anything else (``events.wire.codec.wire_tokens``)."""

_Kinds: TypeAlias = tuple[type[Any], type[Any], type[Any]]
encode_events: Callable[[_Kinds, list[Any], float, int | None], bytes | None] = _wire.encode_events
"""The native writer of a common map-form batch (``events.wire.codec.encode_batch``)."""

wire_runs: Callable[[Sequence[StoredBlock], int], list[int]] = _wire.wire_runs
"""The BlockStored wire events a Stored event's blocks travel in, as the end of each one's
blocks: ``blocks[previous end:end]`` share one LoRA id, medium (``cache_level``), priority and
cache salt, and only an event's last block may hold fewer than ``block_size`` tokens (WIRE.md
section 4). The rule's one statement (``_wire.c``'s ``same_event``): the native writer splits
by it, and msgspec's path, the event manager and the simulated engines ask this function.
``[]`` for no blocks; a field that is not None or a 64-bit int equals the same object only."""


def _diff(value: tuple[int, int] | None) -> EventDiff | None:
    return None if value is None else EventDiff(value[0], value[1])


def with_group_spec(
    stored: Stored | None, kind: str | None, window: int | None, tokens: Sequence[int]
) -> Stored | None:
    """``stored`` with vLLM's KV-cache group spec, and a masked store's token ids (kept so a
    sliding-window group's blocks can be keyed: their tokens are the trailing ones)."""
    if stored is None or (kind is None and window is None and not stored.masked):
        return stored
    return msgspec.structs.replace(
        stored,
        group_kind=kind,
        sliding_window=window,
        # a tuple on every path (the typed one reads an array, the general one a list)
        masked_tokens=tuple(tokens) if stored.masked else None,
    )


def _stored(e: MapStored | PosStored, where: str) -> EventData | None:
    parent = e.parent_block_hash
    if type(e) is MapStored:
        group, salt = e.group_idx, e.cache_salt
        salt_id, priority = e.cache_salt_id, e.priority
        if salt is None:
            salt = salt_from_extra_keys(e.extra_keys, e.lora_name, f"{where}.extra_keys")
    else:
        group = salt = salt_id = None
        priority = _DEFAULT_PRIORITY
    level = 0 if e.medium is None else cache_level_of(e.medium)
    tokens = packed_tokens(e.token_ids)
    if tokens is None:
        raise DecodeError(f"{where}.token_ids: left to the general path")
    stored = build_stored(
        wire_hashes(e.block_hashes, where, MAX_BLOCKS),
        tokens,
        e.block_size,
        None if parent is None else wire_hash(parent, where),
        (e.lora_id, level, salt_id, priority, e.lora_name, group, salt),
        where,
    )
    if type(e) is MapStored:
        return with_group_spec(stored, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window, tokens)
    return with_group_spec(stored, None, None, tokens)  # a masked store keeps its token ids


def _data(e: MapEvent | PosEvent, where: str) -> EventData | None:
    if type(e) is MapStored or type(e) is PosStored:
        return _stored(e, where)
    if type(e) is MapRemoved or type(e) is PosRemoved:
        medium = e.medium
        return Removed(
            wire_hashes(e.block_hashes, where, MAX_BLOCKS),
            None if medium is None else cache_level_of(medium),
            e.group_idx if type(e) is MapRemoved else None,
        )
    if type(e) is MapUpdated or type(e) is PosUpdated:
        return Updated(wire_hash(e.block_hash, where), _diff(e.cache_level), _diff(e.priority))
    if type(e) is MapCreated or type(e) is PosCreated:
        return Created(list(e.num_blocks_per_cache_level))
    return AllBlocksCleared()


def decode_structs(payload: bytes | bytearray | memoryview) -> DecodedBatch | None:
    """The batch, when the typed structs accept all of ``payload``; None otherwise (the
    caller then decodes it on the general path, which says what is wrong, if anything)."""
    batch: MapBatch | PosBatch
    try:
        batch = _MAP_DECODER.decode(payload)
    except msgspec.ValidationError:
        try:
            batch = _POS_DECODER.decode(payload)
        except (msgspec.MsgspecError, RecursionError):
            return None
    except (msgspec.MsgspecError, RecursionError):  # msgspec's guard while skipping input
        return None
    ts = batch.ts
    if not math.isfinite(ts):
        return None
    dp_rank = batch.dp_rank
    events: list[KVCacheEvent] = []
    positional = type(batch) is PosBatch
    try:
        for i, e in enumerate(batch.events):
            data = _data(e, f"events[{i}]")
            if data is None:
                continue
            if positional:
                events.append(KVCacheEvent(i, data, 0, _DEFAULT_ALGO, dp_rank))
                continue
            m = cast(MapEvent, e)
            event_id, rank = m.event_id, m.attention_dp_rank
            events.append(
                KVCacheEvent(
                    i if isinstance(event_id, UnsetType) else event_id,
                    data,
                    m.window_size,
                    m.hash_algo,
                    dp_rank if isinstance(rank, UnsetType) else rank,
                )
            )
    except DecodeError:
        return None  # a malformed event: the general path leaves it out and names it
    return DecodedBatch(ts=ts, events=events, dp_rank=dp_rank, malformed=[])


# what the native reader builds its records with: each record type and its slot descriptors,
# in field order (the way events.wire._records builds StoredBlock records), and the medium rule
_NATIVE_KIT: Final = (
    StoredBlock,
    record_setters(StoredBlock),
    Stored,
    record_setters(Stored),
    Removed,
    record_setters(Removed),
    AllBlocksCleared,
    KVCacheEvent,
    record_setters(KVCacheEvent),
    DecodedBatch,
    record_setters(DecodedBatch),
    cache_level_of,
)


def decode_native(payload: bytes | bytearray | memoryview) -> DecodedBatch | None:
    """The batch, when the native reader takes all of ``payload``; None otherwise (see the
    module docstring)."""
    batch: DecodedBatch | None = _wire.decode_events(_NATIVE_KIT, payload)
    return batch


def decode_typed(payload: bytes | bytearray | memoryview) -> DecodedBatch | None:
    """The batch, when the typed path takes all of ``payload``: :func:`decode_native`, else
    :func:`decode_structs`; None when neither does (the general path's)."""
    batch = decode_native(payload)
    if batch is not None:
        return batch
    return decode_structs(payload)

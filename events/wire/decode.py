"""Decoder of the msgpack wire format (WIRE.md section 4); ``events.wire.codec`` re-exports it.

Tolerant of what existing engines send: map-form or legacy positional events, 2- or
3-element envelopes, int64 hashes (read as two's complement), bin hashes of any length,
unknown fields and event types (skipped). Strict about everything else: a malformed envelope
raises :class:`DecodeError` with the path of the bad value, a malformed event is left out of
its batch and named in ``DecodedBatch.malformed``, and :class:`DecodeLimits` bound the work and
memory one payload can cost (a payload beyond them is refused whole).

Two paths give the same batches. The typed path (``events.wire.fast``) has msgspec decode the
payload into structs that mirror the wire, checking types and ranges as it reads; it takes
well-formed map-form or positional batches under limits at least as loose as the defaults.
Everything else (malformed input, unknown fields or event types, bigram pages, tighter
limits) takes the general path: the envelope and the event list are split undecoded (their
lengths checked before anything is built), then each event in turn is decoded untyped by
msgspec (which refuses any declared length beyond the bytes present before it allocates,
and bounds nesting by its recursion guard), held to the limits by a walk over every array,
map, string and bin, checked field by field here and turned into model objects before the
next event is read. An event that may hold more than :data:`OBJECT_BUDGET` costly objects
(an empty map is one byte on the wire and ~64 in CPython) is read one level at a time: its
known fields each on its own, a long token or hash list typed, unknown fields never built.
So the general path's memory is the payload, one event's objects and the batch it returns.
Both paths build model objects by the rules in ``events.wire.values``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Final

import msgspec

from events.wire.fast import (
    FAST_DEPTH,
    MAX_BIN,
    MAX_BLOCKS,
    MAX_EVENTS,
    MAX_STR,
    MAX_TOKENS,
    decode_typed,
    with_group_spec,
)
from events.wire.json_codec import (
    DecodeError,
    expect_int,
    expect_list,
    expect_optional_int,
    expect_str,
)
from events.wire.model import (
    AllBlocksCleared,
    Created,
    DecodedBatch,
    EventData,
    EventDiff,
    KVCacheEvent,
    Removed,
    Stored,
    Updated,
    cache_level_of,
)
from events.wire.values import (
    LimitError,
    build_stored,
    salt_from_extra_keys,
)
from events.wire.values import wire_hash as _hash
from events.wire.values import wire_hashes as _hashes
from kvcache.tokens import TOKEN_LIMIT

# What msgspec's untyped decode may build that the format holds (ext types are not in it:
# msgspec returns unknown ones as Ext objects and the timestamp type as a datetime).
_SCALARS: Final = frozenset((type(None), bool, int, float, str, bytes))
_CONTAINERS: Final = frozenset((list, dict))
_KEYS: Final = frozenset((str, bytes))
_UNTYPED: Final = msgspec.msgpack.Decoder()
_FRAMING: Final = msgspec.msgpack.Decoder(msgspec.Raw)  # checks framing, builds nothing
_ENVELOPE: Final = msgspec.msgpack.Decoder(Annotated[list[msgspec.Raw], msgspec.Meta(max_length=3)])
# The lead bytes of what costs the untyped decoder a new object of more than a pointer
# (arrays, maps, strings, bins, floats, ints outside CPython's small-int cache, ext types).
# A chunk of N bytes holds at most as many such objects as it has bytes of these values (they
# also occur inside other values, so this is a bound, not a count): the general path decodes a
# chunk untyped only when that bound is within OBJECT_BUDGET, and otherwise one level at a time.
_COSTLY_LEADS: Final = bytes(
    [
        *range(0x80, 0xC0),  # fixmap, fixarray, fixstr
        *range(0xC4, 0xD4),  # bin, ext, float, uint8..64, int8..64
        *range(0xD4, 0xE0),  # fixext, str8..32, array16/32, map16/32
        *range(0xE0, 0xFB),  # negative fixints -32..-6 (-5..-1 are cached)
    ]
)
#: the most costly objects (see above) one event, or one field of it, is decoded untyped with:
#: with each at most ~72 bytes of Python objects, about 9 MB transient per event
OBJECT_BUDGET: Final = 1 << 17
_TOKEN_LIST: Final = list[Annotated[int, msgspec.Meta(ge=0, lt=TOKEN_LIMIT)]]

_DEFAULT_ALGO: Final = "v1_block_key"
_DEFAULT_PRIORITY: Final = 35


@dataclass(frozen=True, slots=True)
class DecodeLimits:
    """Bounds on what one payload may cost the decoder; anything beyond raises DecodeError.

    The payload size is checked before decoding, and no declared length beyond the bytes
    present is allocated, so memory stays proportional to ``max_payload_bytes``.
    """

    max_payload_bytes: int = 16 << 20
    max_events: int = 1 << 16
    max_tokens_per_event: int = 1 << 20
    max_blocks_per_event: int = 1 << 16
    max_str_len: int = 1 << 16
    max_bin_len: int = 1 << 16
    max_fields: int = 64
    #: nesting of arrays and maps, the envelope counting 1 (the format itself needs 4)
    max_depth: int = 8

    def __post_init__(self) -> None:
        for name in self.__slots__:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DecodeLimits.{name} must be a positive int, got {value!r}")
        if self.max_depth < 4:
            raise ValueError(
                f"DecodeLimits.max_depth must be >= 4 (the format nests 4 deep), "
                f"got {self.max_depth}"
            )


DEFAULT_LIMITS: Final = DecodeLimits()

# the typed path's types are capped at the defaults, and nest no deeper than they allow
assert (DEFAULT_LIMITS.max_events, DEFAULT_LIMITS.max_tokens_per_event) == (MAX_EVENTS, MAX_TOKENS)
assert (DEFAULT_LIMITS.max_blocks_per_event, DEFAULT_LIMITS.max_str_len) == (MAX_BLOCKS, MAX_STR)
assert DEFAULT_LIMITS.max_bin_len == MAX_BIN and DEFAULT_LIMITS.max_depth >= FAST_DEPTH
_typed_limits: dict[DecodeLimits, bool] = {DEFAULT_LIMITS: True}


def _typed_ok(limits: DecodeLimits) -> bool:
    """Whether the typed path may decode under ``limits``: only when they are at least as
    loose as the defaults, so that whatever its types accept is within them."""
    ok = _typed_limits.get(limits)
    if ok is None:
        ok = all(getattr(limits, n) >= getattr(DEFAULT_LIMITS, n) for n in DecodeLimits.__slots__)
        if len(_typed_limits) < 256:
            _typed_limits[limits] = ok
    return ok


# Field order of the legacy positional form (element 0 is the type name); the encoder's
# positional form writes vLLM 0.11's prefix of it.
POSITIONAL_FIELDS: Final[dict[str, tuple[str, ...]]] = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    ),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
    "BlockUpdated": ("block_hash", "cache_level", "priority"),
    "CacheCreated": ("num_blocks_per_cache_level",),
}
_COMMON_FIELDS: Final = ("type", "event_id", "window_size", "hash_algo", "attention_dp_rank")
# The map fields each event type has here (the typed structs declare these; tests check).
_KNOWN_FIELDS: Final[dict[str, frozenset[str]]] = {
    "BlockStored": frozenset(
        (
            *_COMMON_FIELDS,
            *POSITIONAL_FIELDS["BlockStored"],
            "cache_salt_id",
            "priority",
            "cache_salt",
            "extra_keys",
            "group_idx",
            "kv_cache_spec_kind",
            "kv_cache_spec_sliding_window",
        )
    ),
    "BlockRemoved": frozenset((*_COMMON_FIELDS, *POSITIONAL_FIELDS["BlockRemoved"], "group_idx")),
    "AllBlocksCleared": frozenset(_COMMON_FIELDS),
    "BlockUpdated": frozenset((*_COMMON_FIELDS, *POSITIONAL_FIELDS["BlockUpdated"])),
    "CacheCreated": frozenset((*_COMMON_FIELDS, *POSITIONAL_FIELDS["CacheCreated"])),
}


def _check_size(payload: bytes | bytearray | memoryview, limits: DecodeLimits) -> int:
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise DecodeError(f"payload must be bytes, got {type(payload).__name__}")
    size = memoryview(payload).nbytes
    if size == 0:
        raise DecodeError("empty payload")
    if size > limits.max_payload_bytes:
        raise DecodeError(
            f"payload of {size} bytes exceeds DecodeLimits.max_payload_bytes "
            f"({limits.max_payload_bytes})"
        )
    return size


def _msgpack_error(exc: msgspec.DecodeError) -> DecodeError:
    text = str(exc)
    if "trailing characters" in text:
        return DecodeError("trailing bytes after the payload's msgpack array")
    if "truncated" in text:
        return DecodeError("not a valid msgpack payload: truncated (incomplete input)")
    return DecodeError(f"not a valid msgpack payload: {text}")


class _Refused(DecodeError):
    """What refuses the whole payload wherever it is found (limits, the format itself), as
    opposed to a malformed event, which costs only that event."""


class _TooCostly(Exception):
    """A chunk whose costly objects may exceed :data:`OBJECT_BUDGET` (decoded level by level)."""


def _costly_exceeds(chunk: bytes, budget: int) -> bool:
    """Whether ``chunk`` may decode to more than ``budget`` costly objects (see
    ``_COSTLY_LEADS``); counted a window at a time, so a long chunk is never copied whole."""
    if len(chunk) <= budget:
        return False
    count, window = 0, 1 << 20
    with memoryview(chunk) as view:
        for start in range(0, len(chunk), window):
            part = view[start : start + window].tobytes()
            count += len(part) - len(part.translate(None, _COSTLY_LEADS))
            if count > budget:
                return True
    return False


def _untyped(chunk: bytes, limits: DecodeLimits, depth: int) -> object:
    """``chunk`` (one well-framed msgpack value at nesting ``depth``) decoded untyped and held to
    ``limits``; raises :class:`_TooCostly` rather than build past :data:`OBJECT_BUDGET`."""
    if _is_container(chunk[0]) and _costly_exceeds(chunk, OBJECT_BUDGET):
        raise _TooCostly  # (a scalar costs no more objects than its bytes: one)
    return _decode_checked(chunk, limits, depth)


def _decode_checked(chunk: bytes, limits: DecodeLimits, depth: int) -> object:
    try:
        value = _UNTYPED.decode(chunk)
    except RecursionError:  # msgspec's guard: nesting deeper than the interpreter's stack
        raise DecodeError("arrays/maps nested too deep for a KV event payload") from None
    except msgspec.DecodeError as exc:
        raise _Refused(str(_msgpack_error(exc))) from None
    _hold(value, limits, len(chunk), depth)
    return value


def _hold(value: object, limits: DecodeLimits, size: int, depth: int) -> None:
    """:func:`_check_tree` of a value inside an event, whose failure refuses the payload."""
    try:
        _check_tree(value, limits, size, depth)
    except DecodeError as exc:
        raise _Refused(str(exc)) from None


def _whole(payload: bytes | bytearray | memoryview, limits: DecodeLimits) -> object:
    """Any one msgpack value as a payload, decoded untyped and held to ``limits`` (the walk
    of :func:`_check_tree`); raises :class:`_TooCostly` past :data:`OBJECT_BUDGET`."""
    _check_size(payload, limits)
    return _untyped(bytes(payload), limits, 1)


def _array_length(chunk: bytes | memoryview) -> int | None:
    """The declared length of the msgpack array ``chunk`` starts, or None for another type."""
    lead = chunk[0]
    if 0x90 <= lead <= 0x9F:
        return lead & 0x0F
    if lead in (0xDC, 0xDD) and len(chunk) >= (3 if lead == 0xDC else 5):
        return int.from_bytes(chunk[1 : 3 if lead == 0xDC else 5], "big")
    return None


def _unpack(data: bytes, limits: DecodeLimits) -> list[msgspec.Raw]:
    """The envelope of a payload (its size already checked), its elements undecoded; any other
    top-level value raises the envelope's DecodeError (after the same checks of framing and
    limits as any payload)."""
    try:
        parts = _ENVELOPE.decode(data)
    except msgspec.ValidationError:
        try:
            _FRAMING.decode(data)
        except RecursionError:
            raise DecodeError("arrays/maps nested too deep for a KV event payload") from None
        except msgspec.DecodeError as exc:
            raise _msgpack_error(exc) from None
        n = _array_length(data)
        if n is not None:
            shape = f"{n} elements"
        else:
            try:
                shape = type(_untyped(data, limits, 1)).__name__
            except _TooCostly:
                shape = "a map" if data[0] in (0xDE, 0xDF) or 0x80 <= data[0] <= 0x8F else "?"
        raise _envelope_error(shape) from None
    except RecursionError:  # msgspec's guard while skipping the elements
        raise DecodeError("arrays/maps nested too deep for a KV event payload") from None
    except msgspec.DecodeError as exc:
        raise _msgpack_error(exc) from None
    if len(parts) not in (2, 3):
        raise _envelope_error(f"{len(parts)} elements")
    return parts  # views of the payload: the event list is never copied whole


def _envelope_error(shape: str) -> DecodeError:
    return DecodeError(
        f"payload must be an array [ts, events] or [ts, events, dp_rank], got {shape}"
    )


def _too_long(kind: str, n: int, cap: int) -> DecodeError:
    return DecodeError(
        f"not a valid msgpack payload: ValueError: {n} exceeds max_{kind}_len({cap})"
    )


def _check_tree(top: object, limits: DecodeLimits, size: int, depth0: int = 1) -> None:
    """Holds the decoded payload to ``limits``, level by level: nesting, the length of every
    array, map, string and bin, map keys (strings or bins), no ext types.

    msgspec refuses any declared length beyond the bytes left before it allocates, and its
    recursion guard bounds the nesting it builds, so what it builds is proportional to the
    payload; this walk then applies the tighter bounds (one pass over each container, with a
    C-speed type scan of its items)."""
    # no declared length can exceed the bytes present (each element costs at least one byte)
    max_array = min(size, max(limits.max_events, limits.max_tokens_per_event))
    max_map, max_str = min(size, limits.max_fields), min(size, limits.max_str_len)
    max_bin = min(size, limits.max_bin_len)
    level, depth = [top], depth0 - 1
    while level:
        depth += 1
        if depth > limits.max_depth:
            raise DecodeError(
                f"arrays/maps nested deeper than DecodeLimits.max_depth ({limits.max_depth})"
            )
        nested: list[object] = []
        for item in level:
            values: Any
            if type(item) is list:
                if len(item) > max_array:
                    raise _too_long("array", len(item), max_array)
                values = item
            elif type(item) is dict:
                if len(item) > max_map:
                    raise _too_long("map", len(item), max_map)
                keys = item.keys()
                kinds = set(map(type, keys))
                if not kinds <= _KEYS:
                    bad = next(iter(kinds - _KEYS)).__name__
                    raise DecodeError(
                        f"not a valid msgpack payload: ValueError: {bad} is not allowed for "
                        "map key when strict_map_key=True"
                    )
                _check_strings(keys, kinds, max_str, max_bin)
                values = item.values()
            elif type(item) in _SCALARS:
                continue  # a scalar envelope: the envelope check says what is wrong
            else:
                raise DecodeError(
                    f"not a valid msgpack payload: {type(item).__name__} is not in the format"
                )
            kinds = set(map(type, values))
            if not kinds <= _SCALARS:
                if not kinds <= _SCALARS | _CONTAINERS:
                    bad = next(iter(kinds - _SCALARS - _CONTAINERS)).__name__
                    raise DecodeError(f"not a valid msgpack payload: {bad} is not in the format")
                nested.extend(v for v in values if type(v) is list or type(v) is dict)
            _check_strings(values, kinds, max_str, max_bin)
        level = nested


def _check_strings(values: Any, kinds: set[type], max_str: int, max_bin: int) -> None:
    if str in kinds:
        for v in values:
            # msgpack bounds a string's UTF-8 bytes; a character is at most 4 of them
            if type(v) is str and len(v) * 4 > max_str and len(v.encode()) > max_str:
                raise _too_long("str", len(v.encode()), max_str)
    if bytes in kinds:
        for v in values:
            if type(v) is bytes and len(v) > max_bin:
                raise _too_long("bin", len(v), max_bin)


def _first_bad_token(items: list[Any]) -> int:
    """Index of the first item that is not an int in [0, 2**31), or -1 (msgspec checks the
    whole list at C speed; the index is looked for only when something is wrong)."""
    try:
        msgspec.convert(items, _TOKEN_LIST)
    except msgspec.ValidationError:
        return next(
            i for i, t in enumerate(items) if type(t) is not int or not 0 <= t < TOKEN_LIMIT
        )
    return -1


def _bigram_tokens(items: list[Any], where: str) -> list[int]:
    """SGLang's bigram pages (EAGLE): each item is the pair ``[t_i, t_i+1]``; the page's own
    tokens are the pairs' first elements (consecutive pairs share their boundary token)."""
    firsts: list[Any] = []
    for i, pair in enumerate(items):
        if type(pair) is not list or len(pair) != 2:
            raise DecodeError(f"{where}[{i}]: a bigram page holds [token, next token] pairs")
        firsts.append(pair[0])
    return firsts


def _too_many_tokens(where: str, n: int, limit: int) -> LimitError:
    return LimitError(f"{where}: {n} tokens exceed DecodeLimits.max_tokens_per_event ({limit})")


def _tokens(value: object, where: str, limit: int) -> list[int]:
    items = expect_list(value, where)
    if items and type(items[0]) is list:
        items = _bigram_tokens(items, where)
    if len(items) > limit:
        raise _too_many_tokens(where, len(items), limit)
    bad = _first_bad_token(items)
    if bad >= 0:
        item = items[bad]
        if type(item) is not int:
            raise DecodeError(f"{where}[{bad}]: token ids must be ints, got {type(item).__name__}")
        raise DecodeError(f"{where}[{bad}]: token id {item} is outside [0, 2**31)")
    return items


def _diff(value: object, where: str) -> EventDiff | None:
    if value is None:
        return None
    pair = expect_list(value, where)
    if len(pair) != 2:
        raise DecodeError(f"{where}: expected [old, new], got {len(pair)} elements")
    return EventDiff(expect_int(pair[0], f"{where}[0]"), expect_int(pair[1], f"{where}[1]"))


def _medium(value: object, where: str) -> int | None:
    return None if value is None else cache_level_of(expect_str(value, where))


def _optional_str(value: object, where: str) -> str | None:
    return None if value is None else expect_str(value, where)


def _stored(f: Mapping[str, Any], where: str, limits: DecodeLimits) -> Stored | None:
    hashes = _hashes(f.get("block_hashes"), f"{where}.block_hashes", limits.max_blocks_per_event)
    tokens = _tokens(f.get("token_ids"), f"{where}.token_ids", limits.max_tokens_per_event)
    block_size = expect_int(f.get("block_size"), f"{where}.block_size", 0, TOKEN_LIMIT)
    parent = f.get("parent_block_hash")
    parent_hash = None if parent is None else _hash(parent, f"{where}.parent_block_hash")
    lora_id = expect_optional_int(f.get("lora_id"), f"{where}.lora_id")
    level = _medium(f.get("medium"), f"{where}.medium")
    salt = expect_optional_int(f.get("cache_salt_id"), f"{where}.cache_salt_id")
    priority = expect_int(f.get("priority", _DEFAULT_PRIORITY), f"{where}.priority", 0, 101)
    lora_name = _optional_str(f.get("lora_name"), f"{where}.lora_name")
    group = expect_optional_int(f.get("group_idx"), f"{where}.group_idx", 0, TOKEN_LIMIT)
    salt_name = _optional_str(f.get("cache_salt"), f"{where}.cache_salt")
    if salt_name is None:
        salt_name = salt_from_extra_keys(f.get("extra_keys"), lora_name, f"{where}.extra_keys")
    fields = (lora_id, level or 0, salt, priority, lora_name, group, salt_name)
    kind = _optional_str(f.get("kv_cache_spec_kind"), f"{where}.kv_cache_spec_kind")
    window = expect_optional_int(
        f.get("kv_cache_spec_sliding_window"),
        f"{where}.kv_cache_spec_sliding_window",
        0,
        TOKEN_LIMIT,
    )
    stored = build_stored(hashes, tokens, block_size, parent_hash, fields, where)
    return with_group_spec(stored, kind, window, tokens)


def _data(kind: str, f: Mapping[str, Any], where: str, limits: DecodeLimits) -> EventData | None:
    if kind == "BlockStored":
        return _stored(f, where, limits)
    if kind == "BlockRemoved":
        return Removed(
            block_hashes=_hashes(
                f.get("block_hashes"), f"{where}.block_hashes", limits.max_blocks_per_event
            ),
            cache_level=_medium(f.get("medium"), f"{where}.medium"),
            group=expect_optional_int(f.get("group_idx"), f"{where}.group_idx", 0, TOKEN_LIMIT),
        )
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    if kind == "BlockUpdated":
        return Updated(
            block_hash=_hash(f.get("block_hash"), f"{where}.block_hash"),
            cache_level=_diff(f.get("cache_level"), f"{where}.cache_level"),
            priority=_diff(f.get("priority"), f"{where}.priority"),
        )
    levels = expect_list(f.get("num_blocks_per_cache_level"), f"{where}.num_blocks_per_cache_level")
    return Created([expect_int(n, f"{where}.num_blocks_per_cache_level") for n in levels])


def _event(
    raw: object, index: int, dp_rank: int | None, limits: DecodeLimits
) -> KVCacheEvent | None:
    where = f"events[{index}]"
    if type(raw) is dict:
        kind = expect_str(raw.get("type"), f"{where}.type")
        fields: Mapping[str, Any] = raw
    elif type(raw) is list:
        if not raw:
            raise DecodeError(f"{where}: an event array needs its type name as element 0")
        kind = expect_str(raw[0], f"{where}[0] (type)")
        names = POSITIONAL_FIELDS.get(kind, ())
        fields = dict(zip(names, raw[1:], strict=False))
    else:
        raise DecodeError(f"{where}: an event must be a map or an array, got {type(raw).__name__}")
    if kind not in POSITIONAL_FIELDS:
        return None  # an event type this decoder does not know: skipped
    data = _data(kind, fields, where, limits)
    if data is None:
        return None
    return KVCacheEvent(
        event_id=expect_int(fields.get("event_id", index), f"{where}.event_id"),
        data=data,
        window_size=expect_int(fields.get("window_size", 0), f"{where}.window_size"),
        hash_algo=expect_str(fields.get("hash_algo", _DEFAULT_ALGO), f"{where}.hash_algo"),
        attention_dp_rank=expect_optional_int(
            fields.get("attention_dp_rank", dp_rank), f"{where}.attention_dp_rank"
        ),
    )


def decode_batch(
    payload: bytes | bytearray | memoryview, limits: DecodeLimits | None = None
) -> DecodedBatch:
    """The batch in one wire payload.

    Raises :class:`DecodeError` (a ``ValueError``) for anything malformed: not msgpack, wrong
    envelope, wrong field types, token counts that do not match ``block_size``, or a payload
    beyond ``limits``. Unknown fields and event types are skipped.
    """
    lim = DEFAULT_LIMITS if limits is None else limits
    typed = lim is DEFAULT_LIMITS or _typed_ok(lim)
    if typed and type(payload) in (bytes, bytearray, memoryview):
        size = memoryview(payload).nbytes
        if 0 < size <= lim.max_payload_bytes:
            batch = decode_typed(payload)
            if batch is not None:
                return batch
    return decode_general(payload, lim)


_RAW_LISTS: dict[int, msgspec.msgpack.Decoder[list[msgspec.Raw]]] = {}
_RAW_MAPS: dict[int, msgspec.msgpack.Decoder[dict[Any, msgspec.Raw]]] = {}
_INT_LISTS: dict[int, msgspec.msgpack.Decoder[list[int]]] = {}
_PAIR_LISTS: dict[int, msgspec.msgpack.Decoder[list[list[int]]]] = {}
_HASH_LISTS: dict[int, msgspec.msgpack.Decoder[list[int | bytes]]] = {}
_Pair = Annotated[list[int], msgspec.Meta(min_length=2, max_length=2)]


def _capped(cache: dict[int, Any], kind: Any, n: int) -> Any:
    """A decoder of ``kind`` holding its top-level length to ``n`` before it allocates."""
    decoder = cache.get(n)
    if decoder is None:
        decoder = msgspec.msgpack.Decoder(Annotated[kind, msgspec.Meta(max_length=n)])
        if len(cache) < 64:
            cache[n] = decoder
    return decoder


def _value(chunk: bytes, where: str, limits: DecodeLimits, depth: int) -> object:
    try:
        return _untyped(chunk, limits, depth)
    except _TooCostly:
        raise LimitError(
            f"{where}: more than {OBJECT_BUDGET} arrays, maps, strings or numbers where a "
            "KV event has a few"
        ) from None


def _is_map(lead: int) -> bool:
    return 0x80 <= lead <= 0x8F or lead in (0xDE, 0xDF)


def _is_container(lead: int) -> bool:
    return 0x80 <= lead <= 0x9F or 0xDC <= lead <= 0xDF


def _staged_event(chunk: bytes, where: str, limits: DecodeLimits) -> object:
    """An event too costly to decode untyped at once, decoded one level at a time: its known
    fields each on its own (unknown ones are never built), a long token or hash list typed."""
    size = len(chunk)
    if _is_map(chunk[0]):
        cap = min(size, limits.max_fields)
        try:
            items: dict[Any, msgspec.Raw] = _capped(_RAW_MAPS, dict[Any, msgspec.Raw], cap).decode(
                chunk
            )
        except msgspec.ValidationError:
            raise LimitError(f"{where}: a map of more than {cap} fields") from None
        kinds = set(map(type, items))
        if not kinds <= _KEYS:
            raise _Refused(f"{where}: map keys must be strings or bins")
        try:
            _check_strings(
                items, kinds, min(size, limits.max_str_len), min(size, limits.max_bin_len)
            )
        except DecodeError as exc:
            raise _Refused(str(exc)) from None
        kind = items.get("type")
        name = None if kind is None else _value(bytes(kind), f"{where}.type", limits, 4)
        known = _KNOWN_FIELDS.get(name) if type(name) is str else None
        if known is None:
            return {"type": name}  # no type, or one this decoder skips: nothing more to read
        return {
            k: _field(bytes(v), f"{where}.{k}", k, limits) for k, v in items.items() if k in known
        }
    if _array_length(chunk) is None:  # one scalar: it costs no more objects than its bytes
        return _UNTYPED.decode(chunk)
    cap = min(size, max(limits.max_events, limits.max_tokens_per_event))
    try:
        elements: list[msgspec.Raw] = _capped(_RAW_LISTS, list[msgspec.Raw], cap).decode(chunk)
    except msgspec.ValidationError:
        raise LimitError(f"{where}: an array of more than {cap} elements") from None
    if not elements:
        return []
    name = _value(bytes(elements[0]), f"{where}[0]", limits, 4)
    names = POSITIONAL_FIELDS.get(name, ()) if type(name) is str else ()
    return [name] + [
        _field(bytes(v), f"{where}[{i + 1}]", f, limits)
        for i, (v, f) in enumerate(zip(elements[1:], names, strict=False))
    ]


def _field(chunk: bytes, where: str, name: str, limits: DecodeLimits) -> object:
    """One field of a costly event: untyped when within the budget, else typed as what the
    field holds (token ids, bigram pages, block hashes); anything else is beyond the limits."""
    try:
        return _untyped(chunk, limits, 4)
    except _TooCostly:
        pass
    n = _array_length(chunk)
    if name == "token_ids" and n is not None:
        if n > limits.max_tokens_per_event:
            raise _too_many_tokens(where, n, limits.max_tokens_per_event)
        try:
            return _capped(_INT_LISTS, list[int], n).decode(chunk)
        except msgspec.ValidationError:
            pass
        try:
            return _capped(_PAIR_LISTS, list[_Pair], n).decode(chunk)
        except msgspec.ValidationError:
            raise DecodeError(
                f"{where}: token ids must be ints (or SGLang's [token, next token] pairs)"
            ) from None
    if name == "block_hashes" and n is not None:
        if n > limits.max_blocks_per_event:
            raise LimitError(
                f"{where}: {n} block hashes exceed DecodeLimits.max_blocks_per_event "
                f"({limits.max_blocks_per_event})"
            )
        try:
            hashes: list[int | bytes] = _capped(_HASH_LISTS, list[int | bytes], n).decode(chunk)
        except msgspec.ValidationError:
            raise DecodeError(f"{where}: block hashes must be ints or bins") from None
        _hold(hashes, limits, len(chunk), 4)
        return hashes
    # any other field (extra_keys above all: per block a list of a few strings) may cost a few
    # objects per block, and no more
    cap = 4 * limits.max_blocks_per_event + OBJECT_BUDGET
    if _costly_exceeds(chunk, cap):
        raise LimitError(
            f"{where}: more than {cap} arrays, maps, strings or numbers, beyond what a KV "
            "event's field holds"
        )
    return _decode_checked(chunk, limits, 4)


def _event_value(chunk: bytes, index: int, limits: DecodeLimits) -> object:
    try:
        return _untyped(chunk, limits, 3)
    except _TooCostly:
        return _staged_event(chunk, f"events[{index}]", limits)


_NO_RANK: Final = object()  # a 2-element envelope


def _top(payload: bytes | bytearray | memoryview, lim: DecodeLimits) -> tuple[Any, Any, Any, bool]:
    """(ts, the events, the dp_rank or ``_NO_RANK``, whether the events are left undecoded).

    A payload whose costly objects are within :data:`OBJECT_BUDGET` is decoded in one go; any
    other is split undecoded, and its events are decoded one at a time by the caller."""
    _check_size(payload, lim)
    data = bytes(payload)
    if _array_length(data) in (2, 3) and not _costly_exceeds(data, OBJECT_BUDGET):
        top: Any = _decode_checked(data, lim, 1)
        events = expect_list(top[1], "payload[1] (events)")
        if len(events) > lim.max_events:
            raise DecodeError(
                f"{len(events)} events exceed DecodeLimits.max_events ({lim.max_events})"
            )
        return top[0], events, top[2] if len(top) == 3 else _NO_RANK, False
    parts = _unpack(data, lim)
    ts = _value(bytes(parts[0]), "payload[0] (ts)", lim, 2)
    n = _array_length(memoryview(parts[1]))
    if n is None:
        expect_list(_value(bytes(parts[1]), "payload[1] (events)", lim, 2), "payload[1] (events)")
        raise AssertionError("unreachable: a non-array is not a list")  # pragma: no cover
    if n > lim.max_events:
        raise DecodeError(f"{n} events exceed DecodeLimits.max_events ({lim.max_events})")
    chunks: list[msgspec.Raw] = _capped(_RAW_LISTS, list[msgspec.Raw], n).decode(parts[1])
    rank = _value(bytes(parts[2]), "payload[2] (dp_rank)", lim, 2) if len(parts) == 3 else _NO_RANK
    return ts, chunks, rank, True


def decode_general(
    payload: bytes | bytearray | memoryview, limits: DecodeLimits | None = None
) -> DecodedBatch:
    """:func:`decode_batch` without the typed path: every field checked one by one (what
    decodes a payload the typed structs do not accept, and their reference in tests).

    Memory stays bounded whatever the payload holds: a payload of few costly objects
    (:data:`OBJECT_BUDGET`) is decoded at once; in any other the envelope and the event list are
    split undecoded (their lengths checked before anything is built), and each event is
    decoded, checked and turned into model objects before the next: untyped when it holds few
    costly objects, else field by field."""
    lim = DEFAULT_LIMITS if limits is None else limits
    try:
        ts, events, dp_value, staged = _top(payload, lim)
        if type(ts) not in (float, int) or not math.isfinite(ts):
            raise DecodeError(f"payload[0] (ts): expected a finite number, got {ts!r:.40}")
        dp_rank = (
            None
            if dp_value is _NO_RANK
            else expect_optional_int(dp_value, "payload[2] (dp_rank)", 0, TOKEN_LIMIT)
        )
        decoded: list[KVCacheEvent] = []
        malformed: list[str] = []
        for i, chunk in enumerate(events):
            # One malformed event costs that event: the rest of the batch stands, and the
            # batch says what was left out.
            try:
                raw = _event_value(bytes(chunk), i, lim) if staged else chunk
                event = _event(raw, i, dp_rank, lim)
            except (LimitError, _Refused):
                raise
            except DecodeError as exc:
                malformed.append(str(exc))
                continue
            except (TypeError, ValueError, KeyError, IndexError, OverflowError) as exc:
                malformed.append(f"events[{i}]: {type(exc).__name__}: {exc}")
                continue
            if event is not None:
                decoded.append(event)
        return DecodedBatch(ts=float(ts), events=decoded, dp_rank=dp_rank, malformed=malformed)
    except DecodeError:
        raise
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError) as exc:
        # Every field is checked above; this keeps the promise of one error type regardless.
        raise DecodeError(f"malformed payload: {type(exc).__name__}: {exc}") from None
    except (msgspec.MsgspecError, RecursionError) as exc:
        raise DecodeError(f"not a valid msgpack payload: {exc}") from None


__all__ = ["DEFAULT_LIMITS", "DecodeError", "DecodeLimits", "decode_batch", "decode_general"]

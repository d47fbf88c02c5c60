"""Decoder of the msgpack wire format (WIRE.md section 4); ``events.wire.codec`` re-exports it.

Tolerant of what existing engines send: map-form or legacy positional events, 2- or
3-element envelopes, int64 hashes (read as two's complement), bin hashes of any length,
unknown fields and event types (skipped). Strict about everything else: a malformed envelope
raises :class:`DecodeError` with the path of the bad value, a malformed event is left out of
its batch and named in ``DecodedBatch.malformed``, and :class:`DecodeLimits` bound the work and
memory one payload can cost (a payload beyond them is refused whole).

One decoder, in three steps, each a strict subset of the next:

1. The common batch (map-form stores with int hashes and token ids that fill their blocks,
   removals, clears; what this project's workers and V1 engines send) is read in one native
   pass straight into model records (:func:`events.wire.fast.decode_native`), or not at all.
2. Otherwise the envelope is split undecoded (its lengths checked before anything is built),
   and each event is decoded by msgspec into the event Structs of ``events.wire.structs``,
   their **strict** variant: unknown fields refused, every value typed and capped, so that what
   they accept is within the limits as it stands.
3. An event the strict Structs refuse is read again on its own: held to the limits by a walk
   over every array, map, string and bin of it (decoded untyped; msgspec refuses any declared
   length beyond the bytes present before it allocates, and bounds nesting by its recursion
   guard), then decoded into the same Structs' **lenient** variant (unknown fields skipped), whose
   validation error names the bad value. An event that may hold more than
   :data:`OBJECT_BUDGET` costly objects (an empty map is one byte on the wire and ~64 in
   CPython) is not decoded untyped: its typed Structs build only its known fields, and a long
   token or hash list is read typed. So memory stays the payload, one event's objects and the
   batch returned.

The first two steps run under limits at least as loose as the defaults; any other limits take
step 3 for every event. Every step builds model events by the rules of ``events.wire.structs``
and ``events.wire.values``, so a payload gives the same batch whichever step read it.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence
from typing import Annotated, Any, Final

import msgspec

from events.wire import fast
from events.wire.json_codec import DecodeError, expect_list, expect_optional_int
from events.wire.limits import DEFAULT_LIMITS, DecodeLimits, at_least_default
from events.wire.model import DecodedBatch, KVCacheEvent
from events.wire.structs import (
    FAST_DEPTH,
    POSITIONAL_FIELDS,
    EventTypes,
    Readers,
    event_of,
    event_types,
    length_cap,
    map_fields,
)
from events.wire.values import LimitError
from kvcache.tokens import TOKEN_LIMIT

# What msgspec's untyped decode may build that the format holds (ext types are not in it:
# msgspec returns unknown ones as Ext objects and the timestamp type as a datetime).
_SCALARS: Final = frozenset((type(None), bool, int, float, str, bytes))
_CONTAINERS: Final = frozenset((list, dict))
_KEYS: Final = frozenset((str, bytes))
_UNTYPED: Final = msgspec.msgpack.Decoder()
_FRAMING: Final = msgspec.msgpack.Decoder(msgspec.Raw)  # checks framing, builds nothing
_ENVELOPE: Final = msgspec.msgpack.Decoder(Annotated[list[msgspec.Raw], msgspec.Meta(max_length=3)])
_TS: Final = msgspec.msgpack.Decoder(int | float)
_RANK: Final = msgspec.msgpack.Decoder(int | None)
# The lead bytes of what costs the untyped decoder a new object of more than a pointer
# (arrays, maps, strings, bins, floats, ints outside CPython's small-int cache, ext types).
# A chunk of N bytes holds at most as many such objects as it has bytes of these values (they
# also occur inside other values, so this is a bound, not a count): an event is decoded
# untyped (and walked) only when that bound is within OBJECT_BUDGET; any other is read by its
# typed Structs alone.
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

#: the map fields each event type has (the Structs' own fields)
_KNOWN_FIELDS: Final[dict[str, frozenset[str]]] = map_fields()
# the strict Structs nest no deeper than the default limits allow
assert DEFAULT_LIMITS.max_depth >= FAST_DEPTH


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


_RAW_LISTS: dict[int, msgspec.msgpack.Decoder[list[msgspec.Raw]]] = {}
_RAW_MAPS: dict[int, msgspec.msgpack.Decoder[dict[Any, msgspec.Raw]]] = {}
_INT_LISTS: dict[int, msgspec.msgpack.Decoder[list[int]]] = {}
_TOKEN_LISTS: dict[int, msgspec.msgpack.Decoder[list[int]]] = {}
_PAIR_LISTS: dict[int, msgspec.msgpack.Decoder[list[list[int]]]] = {}
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


#: the limit a length cap of the lenient Structs stands for, by the type msgspec names
_LENGTH_LIMITS: Final = {
    "str": "max_str_len",
    "bytes": "max_bin_len",
    "array": "max_blocks_per_event",
}


def _invalid(exc: msgspec.ValidationError, where: str) -> DecodeError:
    """msgspec's account of a value the lenient Structs refuse, at its path in the payload;
    a value past a length the limits set refuses the payload (:class:`LimitError`)."""
    text = str(exc)
    head, sep, path = text.rpartition(" - at `")
    if not sep:
        head, path = text, ""
    path = path.rstrip("`")
    at = where + path[1:] if path.startswith("$") else f"{where} ({path})" if path else where
    message = f"{at}: {head[:1].lower()}{head[1:]}"
    if "of length <=" in head:
        kind = next((k for k in _LENGTH_LIMITS if f"`{k}` of length" in head), "array")
        return LimitError(f"{message} (DecodeLimits.{_LENGTH_LIMITS[kind]})")
    return DecodeError(message)


def _read_tokens(raw: msgspec.Raw, where: str, limits: DecodeLimits) -> Sequence[int]:
    """A store's token ids as the lenient types leave them: an array of ints in range (as the
    strict types read them), else ints to check one by one (for the error), or SGLang's
    bigram pairs."""
    chunk = bytes(raw)
    n = _array_length(chunk)
    if n is None:
        return expect_list(_value(chunk, where, limits, 4), where)  # raises: not an array
    if n > limits.max_tokens_per_event:
        raise _too_many_tokens(where, n, limits.max_tokens_per_event)
    cap = length_cap(limits.max_tokens_per_event, limits)  # one decoder per limit, not per n
    try:
        return array("i", _capped(_TOKEN_LISTS, _TOKEN_LIST, cap).decode(chunk))
    except msgspec.ValidationError:
        pass
    try:
        value: Any = _untyped(chunk, limits, 4)
    except _TooCostly:
        try:
            value = _capped(_INT_LISTS, list[int], cap).decode(chunk)
        except msgspec.ValidationError:
            try:
                value = _capped(_PAIR_LISTS, list[_Pair], cap).decode(chunk)
            except msgspec.ValidationError:
                raise DecodeError(
                    f"{where}: token ids must be ints (or SGLang's [token, next token] pairs)"
                ) from None
    return _tokens(value, where, limits.max_tokens_per_event)


def _read_extra_keys(raw: msgspec.Raw, where: str, limits: DecodeLimits) -> object:
    """vLLM's ``extra_keys``: per block a few strings, tuples or bytes, and no more."""
    chunk = bytes(raw)
    try:
        return _untyped(chunk, limits, 4)
    except _TooCostly:
        pass
    cap = 4 * limits.max_blocks_per_event + OBJECT_BUDGET
    if _costly_exceeds(chunk, cap):
        raise LimitError(
            f"{where}: more than {cap} arrays, maps, strings or numbers, beyond what a KV "
            "event's field holds"
        )
    return _decode_checked(chunk, limits, 4)


_readers: dict[DecodeLimits, Readers] = {}


def _readers_of(limits: DecodeLimits) -> Readers:
    readers = _readers.get(limits)
    if readers is None:
        readers = Readers(
            lambda raw, where: _read_tokens(raw, where, limits),
            lambda raw, where: _read_extra_keys(raw, where, limits),
        )
        if len(_readers) < 64:
            _readers[limits] = readers
    return readers


def _costly_kind(chunk: bytes, where: str, limits: DecodeLimits) -> object:
    """The type name of an event too costly to decode untyped, read without building the rest:
    a map's ``type`` field (its fields counted against ``max_fields``, its keys checked), a
    positional event's element 0."""
    size = len(chunk)
    if _is_map(chunk[0]):
        cap = length_cap(limits.max_fields, limits)  # one decoder per limit, not per size
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
        return None if kind is None else _value(bytes(kind), f"{where}.type", limits, 4)
    cap = length_cap(max(limits.max_events, limits.max_tokens_per_event), limits)
    try:
        elements: list[msgspec.Raw] = _capped(_RAW_LISTS, list[msgspec.Raw], cap).decode(chunk)
    except msgspec.ValidationError:
        raise LimitError(f"{where}: an array of more than {cap} elements") from None
    return _value(bytes(elements[0]), f"{where}[0]", limits, 4) if elements else None


def _kind_name(value: object) -> str:
    return "nothing (missing or nil)" if value is None else type(value).__name__


def _lenient_event(
    chunk: bytes,
    index: int,
    dp_rank: int | None,
    limits: DecodeLimits,
    types: EventTypes,
    readers: Readers,
) -> KVCacheEvent | None:
    """Step 3 of the module docstring for one event: None for an event type this decoder does
    not know (skipped) or a store that changes nothing; DecodeError for a malformed event."""
    where = f"events[{index}]"
    lead = chunk[0]
    if not _is_container(lead):
        # one scalar (no more objects than bytes), held to the format like any value
        got = type(_decode_checked(chunk, limits, 3)).__name__
        raise DecodeError(f"{where}: an event must be a map or an array, got {got}")
    is_map = _is_map(lead)
    if not is_map and _array_length(chunk) == 0:
        raise DecodeError(f"{where}: an event array needs its type name as element 0")
    try:
        value: Any = _untyped(chunk, limits, 3)
        kind = value.get("type") if is_map else value[0]
    except _TooCostly:
        kind = _costly_kind(chunk, where, limits)
    if type(kind) is not str:
        at = f"{where}.type" if is_map else f"{where}[0] (type)"
        raise DecodeError(f"{at}: expected a string, got {_kind_name(kind)}")
    if kind not in POSITIONAL_FIELDS:
        return None
    try:
        event = types.by_kind[(is_map, kind)].decode(chunk)
    except msgspec.ValidationError as exc:
        raise _invalid(exc, where) from None
    return event_of(event, types, index, dp_rank, where, limits, readers)


_STRICT: Final = event_types(DEFAULT_LIMITS, True)
_UNREAD: Final = object()  # what the strict Structs left to the lenient ones


def _strict_event(chunk: msgspec.Raw, index: int, dp_rank: int | None) -> object:
    """Step 2 for one event: its model event (or None: it changes nothing), or ``_UNREAD``."""
    try:
        lead = memoryview(chunk)[0]
        decoder = _STRICT.map_decoder if _is_map(lead) else _STRICT.pos_decoder
        return event_of(
            decoder.decode(chunk), _STRICT, index, dp_rank, "events", DEFAULT_LIMITS, None
        )
    except (msgspec.MsgspecError, RecursionError, DecodeError, IndexError):
        return _UNREAD


def _strict_batch(payload: bytes | bytearray | memoryview) -> DecodedBatch | None:
    """Step 2 for a whole batch of one form in one msgspec call each (the common case of
    what the native reader leaves); None when any of it is not read so (step 2 then goes
    event by event)."""
    for decoder in _STRICT.batch_decoders:
        try:
            batch = decoder.decode(payload)
        except msgspec.ValidationError:
            continue  # not this form's types: the other form may read it
        except (msgspec.MsgspecError, RecursionError):
            return None  # not msgpack (or too deep) whatever the types: no form reads it
        ts, dp_rank = batch.ts, batch.dp_rank
        if not math.isfinite(ts):
            return None
        events: list[KVCacheEvent] = []
        try:
            for i, e in enumerate(batch.events):
                event = event_of(e, _STRICT, i, dp_rank, "events", DEFAULT_LIMITS, None)
                if event is not None:
                    events.append(event)
        except (DecodeError, IndexError):
            return None
        return DecodedBatch(ts=ts, events=events, dp_rank=dp_rank, malformed=[])
    return None


def _envelope(
    payload: bytes | bytearray | memoryview, lim: DecodeLimits
) -> tuple[float, list[msgspec.Raw], int | None]:
    """(ts, the events undecoded, the dp_rank) of a payload whose size is checked, its
    lengths checked before anything is built."""
    data = payload if type(payload) is bytes else bytes(payload)
    parts = _unpack(data, lim)
    try:
        ts: object = _TS.decode(parts[0])  # a number (what any other is, said below)
    except (msgspec.ValidationError, msgspec.DecodeError):
        ts = _value(bytes(parts[0]), "payload[0] (ts)", lim, 2)
    if type(ts) not in (float, int) or not math.isfinite(ts):  # type: ignore[arg-type]
        raise DecodeError(f"payload[0] (ts): expected a finite number, got {ts!r:.40}")
    n = _array_length(memoryview(parts[1]))
    if n is None:
        expect_list(_value(bytes(parts[1]), "payload[1] (events)", lim, 2), "payload[1] (events)")
        raise AssertionError("unreachable: a non-array is not a list")  # pragma: no cover
    if n > lim.max_events:
        raise DecodeError(f"{n} events exceed DecodeLimits.max_events ({lim.max_events})")
    # capped at the limit (n is within it), not at n: one decoder per limit, so that
    # payloads declaring many different lengths do not each make one
    cap = length_cap(lim.max_events, lim)
    chunks: list[msgspec.Raw] = _capped(_RAW_LISTS, list[msgspec.Raw], cap).decode(parts[1])
    dp_rank = None
    if len(parts) == 3:
        try:
            rank: object = _RANK.decode(parts[2])  # an int or nil (what any other is, below)
        except (msgspec.ValidationError, msgspec.DecodeError):
            rank = _value(bytes(parts[2]), "payload[2] (dp_rank)", lim, 2)
        dp_rank = expect_optional_int(rank, "payload[2] (dp_rank)", 0, TOKEN_LIMIT)
    return float(ts), chunks, dp_rank  # type: ignore[arg-type]


def _decode(
    payload: bytes | bytearray | memoryview, lim: DecodeLimits, strict: bool, lenient: bool
) -> DecodedBatch | None:
    """Steps 2 and 3 over a payload's events: ``strict``, each event tried on the strict
    Structs first; ``lenient``, what they leave read by step 3 (else the batch is None)."""
    _check_size(payload, lim)
    if strict:
        batch = _strict_batch(payload)
        if batch is not None:
            return batch
    ts, chunks, dp_rank = _envelope(payload, lim)
    types = event_types(lim, False)
    readers = _readers_of(lim)
    decoded: list[KVCacheEvent] = []
    malformed: list[str] = []
    for i, chunk in enumerate(chunks):
        event = _strict_event(chunk, i, dp_rank) if strict else _UNREAD
        if event is _UNREAD:
            if not lenient:
                return None
            # One malformed event costs that event: the rest of the batch stands, and the
            # batch says what was left out.
            try:
                event = _lenient_event(bytes(chunk), i, dp_rank, lim, types, readers)
            except (LimitError, _Refused):
                raise
            except DecodeError as exc:
                malformed.append(str(exc))
                continue
            except (TypeError, ValueError, KeyError, IndexError, OverflowError) as exc:
                malformed.append(f"events[{i}]: {type(exc).__name__}: {exc}")
                continue
        if event is not None:
            decoded.append(event)  # type: ignore[arg-type]
    return DecodedBatch(ts=ts, events=decoded, dp_rank=dp_rank, malformed=malformed)


def _guarded(
    payload: bytes | bytearray | memoryview, lim: DecodeLimits, strict: bool, lenient: bool
) -> DecodedBatch | None:
    try:
        return _decode(payload, lim, strict, lenient)
    except DecodeError:
        raise
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError) as exc:
        # Every value is checked on the way; this keeps the promise of one error type.
        raise DecodeError(f"malformed payload: {type(exc).__name__}: {exc}") from None
    except (msgspec.MsgspecError, RecursionError) as exc:
        raise DecodeError(f"not a valid msgpack payload: {exc}") from None


def decode_batch(
    payload: bytes | bytearray | memoryview, limits: DecodeLimits | None = None
) -> DecodedBatch:
    """The batch in one wire payload.

    Raises :class:`DecodeError` (a ``ValueError``) for anything malformed: not msgpack, wrong
    envelope, wrong field types, token counts that do not match ``block_size``, or a payload
    beyond ``limits``. Unknown fields and event types are skipped.
    """
    lim = DEFAULT_LIMITS if limits is None else limits
    loose = lim is DEFAULT_LIMITS or at_least_default(lim)
    if loose and type(payload) in (bytes, bytearray, memoryview):
        size = memoryview(payload).nbytes
        if 0 < size <= lim.max_payload_bytes:
            native = fast.decode_native(payload)
            if native is not None:
                return native
    batch = _guarded(payload, lim, loose, True)
    assert batch is not None
    return batch


def decode_general(
    payload: bytes | bytearray | memoryview, limits: DecodeLimits | None = None
) -> DecodedBatch:
    """:func:`decode_batch` by step 3 alone: every event walked and read by the lenient
    Structs (the reference the faster steps are tested against)."""
    batch = _guarded(payload, DEFAULT_LIMITS if limits is None else limits, False, True)
    assert batch is not None
    return batch


def decode_structs(payload: bytes | bytearray | memoryview) -> DecodedBatch | None:
    """The batch, when step 2 (the strict Structs) reads every event of ``payload``; None
    otherwise."""
    try:
        return _decode(payload, DEFAULT_LIMITS, True, False)
    except (DecodeError, msgspec.MsgspecError, RecursionError):
        return None


def decode_typed(payload: bytes | bytearray | memoryview) -> DecodedBatch | None:
    """The batch, when steps 1 or 2 read all of ``payload``: :func:`decode_native`, else
    :func:`decode_structs`; None when neither does."""
    batch = fast.decode_native(payload)
    if batch is not None:
        return batch
    return decode_structs(payload)


__all__ = [
    "DEFAULT_LIMITS",
    "POSITIONAL_FIELDS",
    "DecodeError",
    "DecodeLimits",
    "decode_batch",
    "decode_general",
]

"""Decoder of the msgpack wire format (WIRE.md section 4); ``events.codec`` re-exports it.

Tolerant of what existing engines send: map-form or legacy positional events, 2- or
3-element envelopes, int64 hashes (read as two's complement), bin hashes of any length,
unknown fields and event types (skipped). Strict about everything else: a malformed envelope
raises :class:`DecodeError` with the path of the bad value, a malformed event is left out of
its batch and named in ``DecodedBatch.malformed``, and :class:`DecodeLimits` bound the work and
memory one payload can cost (a payload beyond them is refused whole).

The msgpack itself is read by the msgpack library, with every length capped by the limits
before anything is allocated; this module checks shapes and values with C-speed builtins over
whole lists. With the optional extension, a header-only scan refuses deep nesting, truncation
and trailing bytes before msgpack builds any object (without it, msgpack's own stack limit and
the shape checks bound the same cases, more slowly), token ids are checked in one C pass, and
an event's StoredBlock records are built in one C call (``events._records``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import msgpack

from events.json_codec import (
    DecodeError,
    expect_int,
    expect_list,
    expect_optional_int,
    expect_str,
)
from events.model import (
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
from events.wire_fast import (
    FAST_DEPTH,
    MAX_BIN,
    MAX_BLOCKS,
    MAX_EVENTS,
    MAX_STR,
    MAX_TOKENS,
    decode_typed,
)
from events.wire_values import (
    LimitError,
    build_stored,
    salt_from_extra_keys,
)
from events.wire_values import wire_hash as _hash
from events.wire_values import wire_hashes as _hashes
from kvcache.keys import TOKEN_LIMIT

try:  # C passes over the raw bytes and token_ids when the optional extension is built
    from events._v1hash import first_bad_token as _native_first_bad_token
    from events._v1hash import msgpack_scan as _native_msgpack_scan
except ImportError:  # pragma: no cover - depends on the install
    _native_first_bad_token = None  # type: ignore[assignment]
    _native_msgpack_scan = None  # type: ignore[assignment]

_SCAN_ERRORS: Final = {
    1: "arrays/maps nested deeper than DecodeLimits.max_depth ({max_depth})",
    2: "not a valid msgpack payload: truncated (incomplete input)",
    3: "not a valid msgpack payload: invalid type byte 0xc1",
    4: "trailing bytes after the payload's msgpack array",
}

_DEFAULT_ALGO: Final = "v1_block_key"
_DEFAULT_PRIORITY: Final = 35


@dataclass(frozen=True, slots=True)
class DecodeLimits:
    """Bounds on what one payload may cost the decoder; anything beyond raises DecodeError.

    The payload size is checked before unpacking, and every msgpack length is capped before
    anything is allocated, so memory stays proportional to ``max_payload_bytes``.
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
        )
    ),
    "BlockRemoved": frozenset((*_COMMON_FIELDS, *POSITIONAL_FIELDS["BlockRemoved"], "group_idx")),
    "AllBlocksCleared": frozenset(_COMMON_FIELDS),
    "BlockUpdated": frozenset((*_COMMON_FIELDS, *POSITIONAL_FIELDS["BlockUpdated"])),
    "CacheCreated": frozenset((*_COMMON_FIELDS, *POSITIONAL_FIELDS["CacheCreated"])),
}


def _unpack(payload: bytes | bytearray | memoryview, limits: DecodeLimits) -> object:
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
    # A header-only scan refuses deep nesting and broken framing before the unpacker builds
    # anything (without the extension, msgpack's own stack limit, the shape checks and
    # _check_depth bound the same cases, more slowly).
    if _native_msgpack_scan is not None:
        status = _native_msgpack_scan(payload, min(limits.max_depth, size))
        if status:
            raise DecodeError(_SCAN_ERRORS[status].format(max_depth=limits.max_depth))
    # Every element costs at least one byte, so no declared length may exceed the size: a
    # 5-byte header announcing 2**32 elements is refused before anything is allocated.
    max_array = min(size, max(limits.max_events, limits.max_tokens_per_event))
    try:
        return msgpack.unpackb(
            payload,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_str_len=min(size, limits.max_str_len),
            max_bin_len=min(size, limits.max_bin_len),
            max_array_len=max_array,
            max_map_len=min(size, limits.max_fields),
            max_ext_len=0,  # the format has no ext types
        )
    except msgpack.ExtraData:
        raise DecodeError("trailing bytes after the payload's msgpack array") from None
    except msgpack.exceptions.StackError:
        raise DecodeError("arrays/maps nested too deep for a KV event payload") from None
    except Exception as exc:  # msgpack raises several types; all mean "not a valid payload"
        raise DecodeError(f"not a valid msgpack payload: {type(exc).__name__}: {exc}") from None


def _check_depth(value: object, budget: int, where: str) -> None:
    """Rejects arrays/maps nested more than ``budget`` levels inside ``value`` (ignored data
    included: it still costs memory and time)."""
    level = [value]
    depth = 0
    while level:
        depth += 1
        if depth > budget:
            raise LimitError(f"{where}: nested deeper than DecodeLimits.max_depth allows")
        nxt: list[object] = []
        for item in level:
            if type(item) is list:
                nxt.extend(x for x in item if type(x) is list or type(x) is dict)
            elif type(item) is dict:
                nxt.extend(x for x in item.values() if type(x) is list or type(x) is dict)
        level = nxt


def _first_bad_token(items: list[Any]) -> int:
    """Index of the first item that is not an int in [0, 2**31), or -1."""
    if _native_first_bad_token is not None:
        return _native_first_bad_token(items)
    if not items or (
        set(map(type, items)) == {int} and min(items) >= 0 and max(items) < TOKEN_LIMIT
    ):
        return -1
    return next(i for i, t in enumerate(items) if type(t) is not int or not 0 <= t < TOKEN_LIMIT)


def _bigram_tokens(items: list[Any], where: str) -> list[int]:
    """SGLang's bigram pages (EAGLE): each item is the pair ``[t_i, t_i+1]``; the page's own
    tokens are the pairs' first elements (consecutive pairs share their boundary token)."""
    firsts: list[Any] = []
    for i, pair in enumerate(items):
        if type(pair) is not list or len(pair) != 2:
            raise DecodeError(f"{where}[{i}]: a bigram page holds [token, next token] pairs")
        firsts.append(pair[0])
    return firsts


def _tokens(value: object, where: str, limit: int) -> list[int]:
    items = expect_list(value, where)
    if items and type(items[0]) is list:
        items = _bigram_tokens(items, where)
    if len(items) > limit:
        raise LimitError(
            f"{where}: {len(items)} tokens exceed DecodeLimits.max_tokens_per_event ({limit})"
        )
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
    return build_stored(hashes, tokens, block_size, parent_hash, fields, where)


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
    extra: list[object]
    if type(raw) is dict:
        kind = expect_str(raw.get("type"), f"{where}.type")
        fields: Mapping[str, Any] = raw
        known = _KNOWN_FIELDS.get(kind)
        extra = [v for k, v in raw.items() if known is None or k not in known]
    elif type(raw) is list:
        if not raw:
            raise DecodeError(f"{where}: an event array needs its type name as element 0")
        kind = expect_str(raw[0], f"{where}[0] (type)")
        names = POSITIONAL_FIELDS.get(kind, ())
        fields = dict(zip(names, raw[1:], strict=False))
        extra = raw[1 + len(names) :] if kind in POSITIONAL_FIELDS else raw[1:]
    else:
        raise DecodeError(f"{where}: an event must be a map or an array, got {type(raw).__name__}")
    for value in extra:  # ignored, but bounded like everything else
        if type(value) is list or type(value) is dict:
            _check_depth(value, limits.max_depth - 3, where)
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
    if _typed_ok(lim) and type(payload) in (bytes, bytearray, memoryview):
        size = memoryview(payload).nbytes
        if 0 < size <= lim.max_payload_bytes:
            batch = decode_typed(payload)
            if batch is not None:
                return batch
    return decode_general(payload, lim)


def decode_general(
    payload: bytes | bytearray | memoryview, limits: DecodeLimits | None = None
) -> DecodedBatch:
    """:func:`decode_batch` without the typed path: every field checked one by one (what
    decodes a payload the typed structs do not accept, and their reference in tests)."""
    lim = DEFAULT_LIMITS if limits is None else limits
    top = _unpack(payload, lim)
    try:
        if type(top) is not list or len(top) not in (2, 3):
            shape = f"{len(top)} elements" if type(top) is list else type(top).__name__
            raise DecodeError(
                f"payload must be an array [ts, events] or [ts, events, dp_rank], got {shape}"
            )
        ts = top[0]
        if type(ts) not in (float, int) or not math.isfinite(ts):
            raise DecodeError(f"payload[0] (ts): expected a finite number, got {ts!r:.40}")
        events = expect_list(top[1], "payload[1] (events)")
        if len(events) > lim.max_events:
            raise DecodeError(
                f"{len(events)} events exceed DecodeLimits.max_events ({lim.max_events})"
            )
        dp_rank = (
            expect_optional_int(top[2], "payload[2] (dp_rank)", 0, TOKEN_LIMIT)
            if len(top) == 3
            else None
        )
        decoded: list[KVCacheEvent] = []
        malformed: list[str] = []
        for i, raw in enumerate(events):
            # One malformed event costs that event: the rest of the batch stands, and the
            # batch says what was left out.
            try:
                event = _event(raw, i, dp_rank, lim)
            except LimitError:
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


__all__ = ["DEFAULT_LIMITS", "DecodeError", "DecodeLimits", "decode_batch", "decode_general"]

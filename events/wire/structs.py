"""The wire's event types, declared once (WIRE.md section 4): the Structs every decoder path
reads events into, the model events built from them, and the Structs every writer writes
(:data:`WRITERS`, :func:`writer_types`: this project's encoder and the engines' dialects).

:func:`event_types` makes, from the one table below, the msgspec Structs msgspec decodes each
wire event into, checking types and ranges as it reads: map-form events tagged by their
``"type"`` field (vLLM >= 0.25, SGLang, this project) and positional ones (vLLM 0.11's
``array_like`` structs, element 0 the tag), each capped by a :class:`DecodeLimits`. Two
variants of each type come from the same table:

- **strict**: unknown fields are refused and every value is typed, nested at most
  :data:`FAST_DEPTH` deep (``extra_keys`` items are scalars or lists of scalars), every string
  capped at a quarter of ``max_str_len`` characters (so its UTF-8 bytes fit it): what these
  accept is within the limits without any other check. Token ids are ints in ``[0, 2**31)``,
  at most ``max_tokens_per_event`` of them, made an ``array('i')`` once read;
- **lenient**: unknown fields are skipped, bin and string lengths are capped by the limits
  themselves, and the two fields whose values vary most (``token_ids``: ints or SGLang's bigram
  pairs; ``extra_keys``: strings, tuples, bytes) stay undecoded for the decoder's own readers.
  The decoder holds an event to the limits (nesting, map sizes, ext types) before decoding it
  this way (``events.wire.decode``).

:func:`event_of` turns either variant into a model event by the rules of ``events.wire.values``
(hash normalization, vLLM's cache salt inside ``extra_keys``, splitting a store's token ids into
blocks), so whichever variant read an event, its model event is the same.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Final, Union

import msgspec
from msgspec import NODEFAULT, UNSET, Meta, Raw, UnsetType

from events.wire.limits import DEFAULT_LIMITS, DecodeLimits
from events.wire.model import (
    AllBlocksCleared,
    Created,
    EventData,
    EventDiff,
    KVCacheEvent,
    Removed,
    Stored,
    Updated,
    cache_level_of,
)
from events.wire.values import build_stored, salt_from_extra_keys, wire_hash, wire_hashes
from kvcache.tokens import TOKEN_LIMIT

#: deepest nesting the strict types allow: envelope, events, event, extra_keys, entry, item
FAST_DEPTH: Final = 6
#: the longest bin hash (a 32-byte sha256, a 16-byte xxhash128, ...)
MAX_BIN_HASH: Final = 64

_DEFAULT_ALGO: Final = "v1_block_key"
_DEFAULT_PRIORITY: Final = 35

KINDS: Final = ("BlockStored", "BlockRemoved", "AllBlocksCleared", "BlockUpdated", "CacheCreated")

#: the positional form's fields in order (element 0 is the type name), and how many of them
#: an event must carry; the encoder's positional form writes vLLM 0.11's prefix of these
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
_POSITIONAL_REQUIRED: Final = {
    "BlockStored": 4,
    "BlockRemoved": 1,
    "AllBlocksCleared": 0,
    "BlockUpdated": 1,
    "CacheCreated": 1,
}

_Field = tuple[str, Any, Any]


def length_cap(length: int, limits: DecodeLimits) -> int:
    """A length cap as a Struct declares it: no value is longer than the payload's bytes, so
    capping at them changes nothing (and keeps a huge limit within what msgspec takes)."""
    return min(length, limits.max_payload_bytes, 1 << 62)


def _table(limits: DecodeLimits, strict: bool) -> dict[str, list[_Field]]:
    """Every map-form event's fields after ``type``: name, type, default (``NODEFAULT``:
    required). The one statement of the wire's fields and their types."""
    u64 = Annotated[int, Meta(ge=0)]
    small = Annotated[int, Meta(ge=0, lt=TOKEN_LIMIT)]
    chars = limits.max_str_len // 4 if strict else limits.max_str_len
    text = Annotated[str, Meta(max_length=length_cap(chars, limits))]
    if strict:  # what wire_hash takes; the lenient types leave the length rule to it
        binary: Any = Annotated[bytes, Meta(min_length=1, max_length=MAX_BIN_HASH)]
    else:
        binary = Annotated[bytes, Meta(max_length=length_cap(limits.max_bin_len, limits))]
    block_hash = Union[int, binary]  # noqa: UP007
    most_blocks = length_cap(limits.max_blocks_per_event, limits)
    most_tokens = length_cap(limits.max_tokens_per_event, limits)
    # the lenient types leave token ids to the decoder's reader (ints, or SGLang's pairs)
    tokens: Any = Annotated[list[small], Meta(max_length=most_tokens)] if strict else Raw
    hashes = Annotated[list[block_hash], Meta(max_length=most_blocks)]
    diff = Union[tuple[u64, u64], None]  # noqa: UP007
    most = max(limits.max_events, limits.max_tokens_per_event)
    counts = Annotated[list[u64], Meta(max_length=length_cap(most, limits))]
    if strict:
        # vLLM's extra_keys: per block, None or a list of str (LoRA name, cache salt) and (mm
        # hash, offset) tuples; no deeper. A union holds one str-like type, so a store whose
        # extra_keys carry bytes (prompt-embeds digests) is read by the lenient types.
        scalar = Union[None, bool, int, float, text]  # noqa: UP007
        item = Union[None, bool, int, float, text, list[scalar]]  # noqa: UP007
        extra_keys: Any = Union[list[Union[list[item], None]], None]  # noqa: UP007
    else:
        extra_keys = Raw
    common: list[_Field] = [
        ("event_id", Union[u64, UnsetType], UNSET),  # noqa: UP007
        ("window_size", u64, 0),
        ("hash_algo", text, _DEFAULT_ALGO),
        ("attention_dp_rank", Union[u64, UnsetType, None], UNSET),  # noqa: UP007
    ]
    optional_text = Union[text, None]  # noqa: UP007
    optional_small = Union[small, None]  # noqa: UP007
    optional_u64 = Union[u64, None]  # noqa: UP007
    return {
        "BlockStored": [
            *common,
            ("block_hashes", hashes, NODEFAULT),
            ("parent_block_hash", Union[block_hash, None], None),  # noqa: UP007
            ("token_ids", tokens, NODEFAULT),
            ("block_size", small, NODEFAULT),
            ("lora_id", optional_u64, None),
            ("medium", optional_text, None),
            ("lora_name", optional_text, None),
            ("cache_salt_id", optional_u64, None),
            ("priority", Annotated[int, Meta(ge=0, lt=101)], _DEFAULT_PRIORITY),
            ("cache_salt", optional_text, None),
            ("extra_keys", extra_keys, None),
            ("group_idx", optional_small, None),
            # vLLM's KV-cache group spec (>= 0.25): the group's attention kind, window in tokens
            ("kv_cache_spec_kind", optional_text, None),
            ("kv_cache_spec_sliding_window", optional_small, None),
        ],
        "BlockRemoved": [
            *common,
            ("block_hashes", hashes, NODEFAULT),
            ("medium", optional_text, None),
            ("group_idx", optional_small, None),
        ],
        "AllBlocksCleared": common,
        "BlockUpdated": [
            *common,
            ("block_hash", block_hash, NODEFAULT),
            ("cache_level", diff, None),
            ("priority", diff, None),
        ],
        "CacheCreated": [*common, ("num_blocks_per_cache_level", counts, NODEFAULT)],
    }


def map_fields() -> dict[str, frozenset[str]]:
    """The map fields each event type has (``type`` included)."""
    table = _table(DEFAULT_LIMITS, True)
    return {kind: frozenset(("type", *(name for name, _, _ in table[kind]))) for kind in KINDS}


class EventTypes:
    """The Structs of one variant under one set of limits: per event type, the map-form and
    the positional Struct; msgspec decoders of them."""

    __slots__ = (
        "batch_decoders",
        "by_kind",
        "kind",
        "map_decoder",
        "map_types",
        "pos_decoder",
        "pos_types",
        "strict",
    )

    def __init__(self, limits: DecodeLimits, strict: bool) -> None:
        table = _table(limits, strict)
        # gc=False: these structs live for one decode call and hold no cycles; left out of the
        # cyclic collector, they do not count toward its next collection (which, in a process
        # holding a big index, is what a decode's allocations mostly cost)
        config: dict[str, Any] = {"forbid_unknown_fields": strict, "gc": False}
        self.strict = strict
        self.map_types: dict[str, type] = {}
        self.pos_types: dict[str, type] = {}
        for kind in KINDS:
            fields = table[kind]
            self.map_types[kind] = msgspec.defstruct(
                f"Map{kind}", fields, tag=kind, tag_field="type", kw_only=True, **config
            )
            by_name = {name: (name, kind_type) for name, kind_type, _ in fields}
            names = POSITIONAL_FIELDS[kind]
            required = _POSITIONAL_REQUIRED[kind]
            positional: list[Any] = [
                by_name[name] if i < required else (*by_name[name], None)
                for i, name in enumerate(names)
            ]
            self.pos_types[kind] = msgspec.defstruct(
                f"Pos{kind}", positional, tag=kind, array_like=True, **config
            )
        self.kind: dict[type, str] = {t: k for k, t in self.map_types.items()}
        self.kind.update({t: k for k, t in self.pos_types.items()})
        # a decoder per form and event type (the event's type name read first), and one per
        # form over the union of its event types (tagged by name)
        self.by_kind: dict[tuple[bool, str], Any] = {
            (is_map, kind): msgspec.msgpack.Decoder(t)
            for is_map, types in ((True, self.map_types), (False, self.pos_types))
            for kind, t in types.items()
        }
        self.map_decoder: Any = msgspec.msgpack.Decoder(
            Union[tuple(self.map_types.values())]  # noqa: UP007
        )
        self.pos_decoder: Any = msgspec.msgpack.Decoder(
            Union[tuple(self.pos_types.values())]  # noqa: UP007
        )
        # a whole batch of one form: [ts, events, dp_rank?] (ts a number, msgspec takes an
        # int for it; a finite one is the caller's check)
        rank: Any = Union[Annotated[int, Meta(ge=0, lt=TOKEN_LIMIT)], None]  # noqa: UP007
        most_events = Meta(max_length=length_cap(limits.max_events, limits))
        batches: list[Any] = []
        for form, types in (("Map", self.map_types), ("Pos", self.pos_types)):
            event: Any = Union[tuple(types.values())]  # noqa: UP007
            batch_fields: list[Any] = [
                ("ts", float),
                ("events", Annotated[list[event], most_events]),
                ("dp_rank", rank, None),
            ]
            batch = msgspec.defstruct(f"{form}Batch", batch_fields, array_like=True, **config)
            batches.append(msgspec.msgpack.Decoder(batch))
        self.batch_decoders: tuple[Any, ...] = tuple(batches)


_types: dict[tuple[DecodeLimits, bool], EventTypes] = {}


def event_types(limits: DecodeLimits, strict: bool) -> EventTypes:
    """The event Structs of one variant (see the module docstring) under ``limits``."""
    types = _types.get((limits, strict))
    if types is None:
        types = EventTypes(limits, strict)
        if len(_types) < 64:
            _types[(limits, strict)] = types
    return types


class Readers:
    """What reads the values the lenient types leave undecoded: a store's token ids (ints, or
    SGLang's bigram pairs) and ``extra_keys``. Each raises DecodeError (or the
    decoder's refusal of the payload) for what it does not take."""

    __slots__ = ("extra_keys", "token_ids")

    def __init__(
        self,
        token_ids: Callable[[Raw, str], Sequence[int]],
        extra_keys: Callable[[Raw, str], object],
    ) -> None:
        self.token_ids = token_ids
        self.extra_keys = extra_keys


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
        # a tuple whatever container the ids came in
        masked_tokens=tuple(tokens) if stored.masked else None,
    )


def _diff(value: tuple[int, int] | None) -> EventDiff | None:
    return None if value is None else EventDiff(value[0], value[1])


def _stored(
    e: Any, positional: bool, where: str, limits: DecodeLimits, readers: Readers | None
) -> Stored | None:
    parent = e.parent_block_hash
    if positional:
        group = salt = salt_id = kind = window = None
        priority = _DEFAULT_PRIORITY
    else:
        group, salt = e.group_idx, e.cache_salt
        salt_id, priority = e.cache_salt_id, e.priority
        kind, window = e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window
        if salt is None:
            extra = e.extra_keys
            if type(extra) is Raw:
                assert readers is not None
                extra = readers.extra_keys(extra, f"{where}.extra_keys")
            salt = salt_from_extra_keys(extra, e.lora_name, f"{where}.extra_keys")
    level = 0 if e.medium is None else cache_level_of(e.medium)
    tokens: Sequence[int]
    if readers is None:  # the strict types read them as ints in range
        tokens = array("i", e.token_ids)
    else:
        tokens = readers.token_ids(e.token_ids, f"{where}.token_ids")
    stored = build_stored(
        wire_hashes(e.block_hashes, f"{where}.block_hashes", limits.max_blocks_per_event),
        tokens,
        e.block_size,
        None if parent is None else wire_hash(parent, f"{where}.parent_block_hash"),
        (e.lora_id, level, salt_id, priority, e.lora_name, group, salt),
        where,
    )
    # a masked store keeps its token ids
    return with_group_spec(stored, kind, window, tokens)


def _data(
    e: Any, kind: str, positional: bool, where: str, limits: DecodeLimits, readers: Readers | None
) -> EventData | None:
    if kind == "BlockStored":
        return _stored(e, positional, where, limits, readers)
    if kind == "BlockRemoved":
        medium = e.medium
        return Removed(
            wire_hashes(e.block_hashes, f"{where}.block_hashes", limits.max_blocks_per_event),
            None if medium is None else cache_level_of(medium),
            None if positional else e.group_idx,
        )
    if kind == "BlockUpdated":
        return Updated(
            wire_hash(e.block_hash, f"{where}.block_hash"), _diff(e.cache_level), _diff(e.priority)
        )
    if kind == "CacheCreated":
        return Created(list(e.num_blocks_per_cache_level))
    return AllBlocksCleared()


def event_of(
    e: Any,
    types: EventTypes,
    index: int,
    dp_rank: int | None,
    where: str,
    limits: DecodeLimits,
    readers: Readers | None,
) -> KVCacheEvent | None:
    """The model event of ``e``, an event Struct of ``types``; None for one that changes
    nothing (an empty store). ``readers``: None for the strict types (which leave no value
    undecoded). Raises DecodeError for a value the types accept
    but the format does not (token ids that do not fit their blocks, say)."""
    kind = types.kind[type(e)]
    positional = type(e) is types.pos_types[kind]
    data = _data(e, kind, positional, where, limits, readers)
    if data is None:
        return None
    if positional:
        return KVCacheEvent(index, data, 0, _DEFAULT_ALGO, dp_rank)
    event_id, rank = e.event_id, e.attention_dp_rank
    return KVCacheEvent(
        index if event_id is UNSET else event_id,
        data,
        e.window_size,
        e.hash_algo,
        dp_rank if rank is UNSET else rank,
    )


# ---------------------------------------------------------------------------------------------
# The writers: each one's events as Structs of the table's fields.
#
# msgspec writes a Struct's fields in their declared order, leaves out a field holding UNSET
# (and, with ``omit_defaults``, one holding its default), and picks the map header by the
# number of fields the type declares, the tag included: a fixmap for 15 or fewer, else a map16
# (even when fewer are written). So a writer's Struct declares exactly the fields its engine's
# own Struct declares, in that engine's order, for its frames to be byte for byte the engine's.

#: a field every event of the type carries
ALWAYS: Final = NODEFAULT

#: what every BlockStored of vLLM's (>= 0.25) carries, in its order (its positional fields);
#: SGLang's first five
_STORE: Final = tuple((name, ALWAYS) for name in POSITIONAL_FIELDS["BlockStored"])
_TAIL: Final = (("hash_algo", UNSET), ("event_id", ALWAYS), ("window_size", UNSET))
_RANK: Final = (("attention_dp_rank", UNSET),)

#: Per writer: per event type, its map fields after ``type`` in the order written, each with
#: its default (:data:`ALWAYS`: always written; UNSET: written when set; None: written when not
#: None, the engines' ``omit_defaults``), and whether the writer leaves out defaults.
WRITERS: Final[dict[str, tuple[bool, dict[str, tuple[tuple[str, Any], ...]]]]] = {
    # this project's encoder (events.wire.codec.encode_batch): vLLM's required fields, then its
    # extensions (cache_salt_id, hash_algo, priority and the event's own fields)
    "native": (
        False,
        {
            "BlockStored": (
                *_STORE,
                ("cache_salt_id", UNSET),
                ("hash_algo", UNSET),
                ("priority", UNSET),
                *_TAIL[1:],
                *_RANK,
            ),
            "BlockRemoved": (("block_hashes", ALWAYS), ("medium", ALWAYS), *_TAIL, *_RANK),
            "AllBlocksCleared": (*_TAIL, *_RANK),
            "BlockUpdated": (
                ("block_hash", ALWAYS),
                ("cache_level", ALWAYS),
                ("priority", ALWAYS),
                *_TAIL,
                *_RANK,
            ),
            "CacheCreated": (("num_blocks_per_cache_level", ALWAYS), *_TAIL, *_RANK),
        },
    ),
    # vLLM 0.33's KV-event structs (tests/data/engines/decoder_rules.json: its fields in order,
    # which are required), written as vLLM writes them (omit_defaults). The four fields after
    # kv_cache_spec_sliding_window are vLLM's; this project never sets them.
    "vllm": (
        True,
        {
            "BlockStored": (
                *_STORE,
                ("extra_keys", None),
                ("group_idx", None),
                ("kv_cache_spec_kind", None),
                ("kv_cache_spec_sliding_window", None),
                ("locality", None),
                ("ownership", None),
                ("session_id", None),
                ("lookahead_token_ids", None),
            ),
            "BlockRemoved": (
                ("block_hashes", ALWAYS),
                ("medium", ALWAYS),
                ("group_idx", None),
                ("locality", None),
                ("ownership", None),
            ),
            "AllBlocksCleared": (),
        },
    ),
    # SGLang 0.5.23's (sglang/srt/disaggregation/kv_events.py, as decoder_rules.json records
    # them), omit_defaults as SGLang writes them; session_id is SGLang's, never set here
    "sglang": (
        True,
        {
            "BlockStored": (
                *_STORE[:5],
                ("medium", None),
                ("cache_salt", None),
                ("session_id", None),
                ("lora_name", None),
            ),
            "BlockRemoved": (("block_hashes", ALWAYS), ("medium", None)),
            "AllBlocksCleared": (),
        },
    ),
}


class WriterTypes:
    """One writer's event Structs (:data:`WRITERS`): ``map[kind]`` tagged by ``"type"``, and
    for the native writer ``positional[kind]``, vLLM 0.11's ``array_like`` form of the three
    kinds it has (:data:`POSITIONAL_FIELDS` up to ``medium``). Annotated with the table's
    types (a field of the engine's the table lacks: ``Any``); msgspec does not check types
    when it writes, so these say what each field holds, for a reader."""

    __slots__ = ("kind", "map", "positional")

    def __init__(self, writer: str) -> None:
        omit, kinds = WRITERS[writer]
        table = {
            kind: {name: field_type for name, field_type, _ in fields}
            for kind, fields in _table(DEFAULT_LIMITS, True).items()
        }
        self.map: dict[str, type] = {}
        for kind, fields in kinds.items():
            declared = [(name, table[kind].get(name, Any), default) for name, default in fields]
            self.map[kind] = msgspec.defstruct(
                f"{writer.title()}{kind}",
                declared,
                tag=kind,
                tag_field="type",
                kw_only=True,
                omit_defaults=omit,
                gc=False,
            )
        self.kind: dict[type, str] = {t: k for k, t in self.map.items()}
        self.positional: dict[str, type[msgspec.Struct]] = {}
        if writer == "native":
            for kind in ("BlockStored", "BlockRemoved", "AllBlocksCleared"):
                self.positional[kind] = msgspec.defstruct(
                    f"Positional{kind}",
                    [(name, table[kind][name]) for name in POSITIONAL_FIELDS[kind][:6]],
                    tag=kind,
                    array_like=True,
                    gc=False,
                )


_writers: dict[str, WriterTypes] = {}


def writer_types(writer: str) -> WriterTypes:
    """The event Structs of ``writer``, one of :data:`WRITERS`."""
    types = _writers.get(writer)
    if types is None:
        types = _writers[writer] = WriterTypes(writer)
    return types

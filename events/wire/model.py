"""KV cache events in the TensorRT-LLM LLM API shape.

``KVCacheEvent(event_id, data, window_size, hash_algo, attention_dp_rank)`` where ``data`` is one
of :class:`Created`, :class:`Stored`, :class:`Removed`, :class:`Updated`,
:class:`AllBlocksCleared`. ``cache_level`` 0 is the device tier ("GPU" on the wire), 1 the next
("CPU"). Block hashes are ints (``v1_block_key``, ``v2_sha256_64``) or 64-char lowercase hex
strings (``v2_sha256``).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final, TypeAlias

BlockHash: TypeAlias = int | str

TokenIds: TypeAlias = Sequence[int]
"""A block's token ids: a list of ints, or packed as an ``array('i')`` (what the event path
carries from the cache to the wire and back, without a Python int per token). Which container
holds them never changes what a record means: records compare by the ids alone."""

#: cache_level <-> wire "medium"
MEDIUMS: Final[tuple[str, ...]] = ("GPU", "CPU", "DISK")

#: Engines' names for this project's tiers: SGLang calls its host tier ``CPU_PINNED`` (its
#: ``StorageMedium``: GPU = L1 device, CPU_PINNED = L2 host pinned memory, DISK = L3, EXTERNAL =
#: L4; sglang/srt/disaggregation/kv_events.py), the tier vLLM calls ``CPU``.
MEDIUM_ALIASES: Final[dict[str, int]] = {"CPU_PINNED": 1}

#: Other medium names engines send, each its own tier (never the device tier): vLLM's
#: ``STORAGE`` (0.33), ``FS`` / ``OBJ`` (0.26); SGLang's ``EXTERNAL`` (a shared pool). Levels
#: past TIER numbering so they never collide with ours.
ENGINE_MEDIUMS: Final[dict[str, int]] = {
    "STORAGE": 65,
    "FS": 66,
    "OBJ": 67,
    "EXTERNAL": 68,
}
_FIRST_UNKNOWN_LEVEL: Final = 96
_unknown_levels: dict[str, int] = {}
_MAX_UNKNOWN: Final = 1024


def medium_of(cache_level: int) -> str:
    if 0 <= cache_level < len(MEDIUMS):
        return MEDIUMS[cache_level]
    for name, level in ENGINE_MEDIUMS.items():
        if level == cache_level:
            return name
    for name, level in _unknown_levels.items():
        if level == cache_level:
            return name
    return f"TIER{cache_level}"


def cache_level_of(medium: str | None) -> int:
    """The cache level of a wire medium name. None reads as the device tier (engines that
    omit it mean the GPU); ``CPU_PINNED`` is the host tier (SGLang's name for it); every
    other name is its own tier: ours, the engines' known names, ``TIER<n>``, and any other
    name a level of its own (kept per process, bounded)."""
    if medium is None:
        return 0
    upper = medium.upper()
    if upper in MEDIUMS:
        return MEDIUMS.index(upper)
    alias = MEDIUM_ALIASES.get(upper)
    if alias is not None:
        return alias
    known = ENGINE_MEDIUMS.get(upper)
    if known is not None:
        return known
    digits = upper[4:]
    # ASCII digits only: str.isdigit also takes "²" and other scripts' digits, int() not all
    if upper.startswith("TIER") and digits.isascii() and digits.isdigit() and len(upper) < 12:
        return int(digits)
    level = _unknown_levels.get(upper)
    if level is None:
        if len(_unknown_levels) >= _MAX_UNKNOWN:
            return _FIRST_UNKNOWN_LEVEL + _MAX_UNKNOWN  # one shared level past the bound
        level = _FIRST_UNKNOWN_LEVEL + len(_unknown_levels)
        _unknown_levels[upper] = level
    return level


@dataclass(frozen=True, slots=True)
class EventDiff:
    old_value: int
    new_value: int


@dataclass(frozen=True, slots=True)
class Created:
    num_blocks_per_cache_level: list[int]


def same_tokens(a: TokenIds, b: TokenIds) -> bool:
    """Whether two blocks' token ids are the same ids, whatever their containers."""
    if a is b:
        return True
    if type(a) is type(b):
        return a == b
    return len(a) == len(b) and _as_list(a) == _as_list(b)


def _as_list(tokens: TokenIds) -> list[int]:
    return tokens.tolist() if type(tokens) is array else list(tokens)


# eq=False: the generated __eq__ would compare the token containers (a list never equals an
# array), so equality is written out below; like the generated one's, a record is unhashable
# (its tokens are a mutable list or array)
@dataclass(frozen=True, slots=True, eq=False)
class StoredBlock:
    block_hash: BlockHash
    tokens: TokenIds
    lora_id: int | None = None
    cache_level: int = 0
    priority: int = 35
    cache_salt_id: int | None = None

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        assert isinstance(other, StoredBlock)
        return (
            self.block_hash == other.block_hash
            and same_tokens(self.tokens, other.tokens)
            and self.lora_id == other.lora_id
            and self.cache_level == other.cache_level
            and self.priority == other.priority
            and self.cache_salt_id == other.cache_salt_id
        )

    __hash__ = None  # type: ignore[assignment]


def one_wire_event(a: StoredBlock, b: StoredBlock) -> bool:
    """Whether ``b`` may travel in the same BlockStored wire event as ``a``: a wire event has
    one LoRA id, medium, priority and salt for all its blocks (WIRE.md section 4). The rule's one
    statement: the event manager coalesces chains by it and the encoder splits events by it."""
    return (
        a.cache_level == b.cache_level
        and a.lora_id == b.lora_id
        and a.cache_salt_id == b.cache_salt_id
        and a.priority == b.priority
    )


@dataclass(frozen=True, slots=True)
class Stored:
    """Blocks stored as one chain: ``blocks[0]``'s parent is ``parent_hash``, each next block's
    parent is the previous one. ``block_size`` is the sender's tokens per block when known
    (it travels on the wire; the JSON shape does not carry it)."""

    parent_hash: BlockHash | None
    blocks: list[StoredBlock]
    block_size: int | None = None
    #: engine fields the router needs to key blocks by content (None: not sent):
    #: the KV-cache group (vLLM ``group_idx``), the adapter's name (``lora_name``), the
    #: request's cache salt string (SGLang ``cache_salt``; vLLM's in ``extra_keys``), and
    #: ``masked``: the wire's token ids covered more blocks than it named (sliding-window /
    #: Mamba stores leave blocks out of the hashes), so the blocks' own tokens are unknown.
    group: int | None = None
    lora_name: str | None = None
    salt: str | None = None
    masked: bool = False
    #: vLLM's KV-cache group spec on stores (``kv_cache_spec_kind``, e.g. ``"full_attention"``,
    #: ``"sliding_window"``; ``kv_cache_spec_sliding_window`` in tokens), None when not sent;
    #: ``masked_tokens``: a masked store's token ids as sent (covering the blocks it names and
    #: the ones it left out), else None
    group_kind: str | None = None
    sliding_window: int | None = None
    masked_tokens: TokenIds | None = None


@dataclass(frozen=True, slots=True)
class Removed:
    block_hashes: list[BlockHash]
    cache_level: int | None = None
    group: int | None = None


@dataclass(frozen=True, slots=True)
class Updated:
    block_hash: BlockHash
    cache_level: EventDiff | None = None
    priority: EventDiff | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


EventData: TypeAlias = Created | Stored | Removed | Updated | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class KVCacheEvent:
    event_id: int
    data: EventData
    window_size: int = 0
    hash_algo: str = "v1_block_key"
    attention_dp_rank: int | None = None


@dataclass(frozen=True, slots=True)
class DecodedBatch:
    """One decoded wire payload."""

    ts: float
    events: list[KVCacheEvent] = field(default_factory=list)
    dp_rank: int | None = None
    #: one message per malformed event left out of ``events`` (the rest of the batch stands)
    malformed: list[str] = field(default_factory=list)

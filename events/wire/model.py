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
from operator import attrgetter
from typing import Final, TypeAlias

import msgspec

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


class _Record(msgspec.Struct, frozen=True, gc=False):
    """The base of every model record: a frozen msgspec Struct, built in C by msgspec (a tenth
    of a frozen dataclass's constructor), left out of the cyclic garbage collector (a record
    holds ints, strings, token arrays and other records, never a cycle)."""


class EventDiff(_Record, frozen=True):
    old_value: int
    new_value: int


class Created(_Record, frozen=True):
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
# array), so equality is written out below; a record is unhashable (its tokens are a mutable
# list or array)
class StoredBlock(_Record, frozen=True, eq=False):
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

    def __ne__(self, other: object) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    __hash__ = None  # type: ignore[assignment]


_RUN_FIELDS: Final = attrgetter("lora_id", "cache_level", "priority", "cache_salt_id")
_TOKENS: Final = attrgetter("tokens")


def wire_runs(blocks: Sequence[StoredBlock], block_size: int) -> list[int]:
    """The BlockStored wire events a Stored event's blocks travel in, as the end of each one's
    blocks: ``blocks[previous end:end]`` share one LoRA id, medium (``cache_level``), priority
    and cache salt, and only an event's last block may hold fewer than ``block_size`` tokens
    (WIRE.md section 4). The rule's one statement: the writer (``events.wire.codec``), the
    event manager and the simulated engines ask this function. ``[]`` for no blocks."""
    blocks = tuple(blocks)  # read as they are now, whatever their attributes do to a list
    n = len(blocks)
    if n == 1:
        # a lone block is a run, short or not; read as the general case reads it (what is not
        # a block raises as there)
        _RUN_FIELDS(blocks[0])
        len(_TOKENS(blocks[0]))
        return [1]
    fields = list(map(_RUN_FIELDS, blocks))
    full = list(map(block_size.__eq__, map(len, map(_TOKENS, blocks))))
    if n and fields.count(fields[0]) == n and full.count(False) <= (not full[-1]):
        return [n]  # the common case: one run (two C passes over the blocks)
    ends = [
        i
        for i, (whole, a, b) in enumerate(zip(full, fields, fields[1:], strict=False), 1)
        if not (whole and a == b)
    ]
    if n:
        ends.append(n)
    return ends


class Stored(_Record, frozen=True):
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


class Removed(_Record, frozen=True):
    block_hashes: list[BlockHash]
    cache_level: int | None = None
    group: int | None = None


class Updated(_Record, frozen=True):
    block_hash: BlockHash
    cache_level: EventDiff | None = None
    priority: EventDiff | None = None


class AllBlocksCleared(_Record, frozen=True):
    """Every block of the worker's cache (vLLM: its device prefix cache) is gone."""


EventData: TypeAlias = Created | Stored | Removed | Updated | AllBlocksCleared


class KVCacheEvent(_Record, frozen=True):
    event_id: int
    data: EventData
    window_size: int = 0
    hash_algo: str = "v1_block_key"
    attention_dp_rank: int | None = None


class DecodedBatch(_Record, frozen=True):
    """One decoded wire payload."""

    ts: float
    events: list[KVCacheEvent] = msgspec.field(default_factory=list)
    dp_rank: int | None = None
    #: one message per malformed event left out of ``events`` (the rest of the batch stands)
    malformed: list[str] = msgspec.field(default_factory=list)

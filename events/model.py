"""KV cache events in the TensorRT-LLM LLM API shape.

``KVCacheEvent(event_id, data, window_size, hash_algo, attention_dp_rank)`` where ``data`` is one
of :class:`Created`, :class:`Stored`, :class:`Removed`, :class:`Updated`,
:class:`AllBlocksCleared`. ``cache_level`` 0 is the device tier ("GPU" on the wire), 1 the next
("CPU"). Block hashes are ints (``v1_block_key``, ``v2_sha256_64``) or 64-char lowercase hex
strings (``v2_sha256``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final, TypeAlias

BlockHash: TypeAlias = int | str

#: cache_level <-> wire "medium"
MEDIUMS: Final[tuple[str, ...]] = ("GPU", "CPU", "DISK")


def medium_of(cache_level: int) -> str:
    return MEDIUMS[cache_level] if 0 <= cache_level < len(MEDIUMS) else f"TIER{cache_level}"


def cache_level_of(medium: str | None) -> int:
    """The cache level of a wire medium name; None and unknown names read as the device tier."""
    if medium is None:
        return 0
    upper = medium.upper()
    if upper in MEDIUMS:
        return MEDIUMS.index(upper)
    if upper.startswith("TIER") and upper[4:].isdigit():
        return int(upper[4:])
    return 0


@dataclass(frozen=True, slots=True)
class EventDiff:
    old_value: int
    new_value: int


@dataclass(frozen=True, slots=True)
class Created:
    num_blocks_per_cache_level: list[int]


@dataclass(frozen=True, slots=True)
class StoredBlock:
    block_hash: BlockHash
    tokens: list[int]
    lora_id: int | None = None
    cache_level: int = 0
    priority: int = 35
    cache_salt_id: int | None = None


@dataclass(frozen=True, slots=True)
class Stored:
    """Blocks stored as one chain: ``blocks[0]``'s parent is ``parent_hash``, each next block's
    parent is the previous one. ``block_size`` is the sender's tokens per block when known
    (it travels on the wire; the JSON shape does not carry it)."""

    parent_hash: BlockHash | None
    blocks: list[StoredBlock]
    block_size: int | None = None


@dataclass(frozen=True, slots=True)
class Removed:
    block_hashes: list[BlockHash]
    cache_level: int | None = None


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

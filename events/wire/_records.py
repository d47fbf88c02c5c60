"""Construction of :class:`~events.wire.model.StoredBlock` records for the per-block paths.

The event manager builds one StoredBlock per announced block and the wire decoder one per
decoded block. Records are msgspec Structs, which msgspec constructs in C (about a tenth of a
frozen dataclass's constructor), so the builders here are plain Python: one implementation,
hashing through the V1 primitive of ``kvcache.hashing`` (one native call per chain).

Token ids stay packed where they come packed: the event manager's records hold the cache's own
``array('i')`` of each block (the cache never changes a block's array in place; a record's
tokens are data, not to be changed either), and a decoded store's ``array('i')`` gives each
block an ``array('i')`` slice. Lists stay accepted everywhere, and records compare by their
token ids whatever the container (:class:`~events.wire.model.StoredBlock`).
"""

from __future__ import annotations

from array import array
from typing import Any, Final

from events.wire.model import BlockHash, StoredBlock, TokenIds
from kvcache.hashing import v1_chain_blocks, v1_hash_packed

_FIELDS: Final = ("block_hash", "tokens", "lora_id", "cache_level", "priority", "cache_salt_id")
assert StoredBlock.__struct_fields__ == _FIELDS
_U64_LIMIT: Final = 1 << 64


def record_setters(cls: type) -> tuple[Any, ...]:
    """The field descriptors of a model record (a msgspec Struct), in field order (what the
    native batch reader, ``events.wire._wire.decode_events``, stores a record's fields
    through)."""
    names: tuple[str, ...] = cls.__struct_fields__  # type: ignore[attr-defined]
    return tuple(vars(cls)[name] for name in names)


def stored_blocks(
    hashes: list[BlockHash],
    tokens: TokenIds,
    block_size: int,
    lora_id: int | None,
    cache_level: int,
    priority: int,
    cache_salt_id: int | None,
) -> list[StoredBlock]:
    """Records for one decoded wire event: one per hash; record ``i`` holds
    ``tokens[i * block_size : (i + 1) * block_size]`` (a list's slice is a list, an array's an
    array)."""
    return [
        StoredBlock(
            h,
            tokens[i * block_size : (i + 1) * block_size],
            lora_id,
            cache_level,
            priority,
            cache_salt_id,
        )
        for i, h in enumerate(hashes)
    ]


def _packed(tokens: array[int]) -> array[int]:
    """``tokens`` as an ``array('i')``: the array itself, any other packed buffer copied into
    one (its length a multiple of 4 bytes)."""
    if type(tokens) is array and tokens.typecode == "i":
        return tokens
    if isinstance(tokens, (bytes, bytearray, memoryview)):
        data = memoryview(tokens).cast("B")
        if len(data) % 4:
            raise ValueError(f"packed token ids are 4-byte ints, got {len(data)} bytes")
        packed = array("i")
        packed.frombytes(data)
        return packed
    raise TypeError(f"block tokens must be an array('i'), got {type(tokens).__name__}")


def v1_stored_block(
    tokens: array[int],
    parent_hash: int,
    lora_id: int | None,
    salt_id: int | None,
    cache_level: int,
    priority: int,
) -> StoredBlock:
    """The record announcing one block of packed int32 ``tokens`` under its V1 hash chained to
    ``parent_hash`` (0 for a first block), holding ``tokens`` themselves (an ``array('i')``; any
    other packed buffer is copied into one). Raises ``ValueError`` for a negative token id and
    ``TypeError`` / ``OverflowError`` for a parent, LoRA id or salt outside [0, 2**64)."""
    tokens = _packed(tokens)
    h = v1_hash_packed(tokens, parent_hash, lora_id, salt_id)
    return StoredBlock(h, tokens, lora_id, cache_level, priority, salt_id)


def v1_stored_chain(
    token_arrays: list[array[int]],
    parent_hash: int,
    lora_id: int | None,
    salt_id: int | None,
    cache_level: int,
    priority: int,
    known: list[int] | None = None,
) -> list[StoredBlock]:
    """The records of a chain of blocks, one per ``array('i')`` of tokens, each hashed under
    the previous block's V1 hash (the first under ``parent_hash``, 0 for a first block).
    ``known``: the V1 hashes of the first blocks when the caller has them (taken as they are:
    trusted, not checked against the tokens); the blocks past them are hashed under the last
    one. Errors as :func:`v1_stored_block`'s."""
    if type(token_arrays) is not list:
        raise TypeError(f"token_arrays must be a list, got {type(token_arrays).__name__}")
    arrays = [_packed(t) for t in token_arrays]
    n = len(arrays)
    hashes: list[int] = []
    if known is not None:
        for h in known[:n]:
            if type(h) is not int:
                raise TypeError("v1_stored_chain: known hashes must be ints")
            if not 0 <= h < _U64_LIMIT:
                raise OverflowError("v1_stored_chain: known hashes must be in [0, 2**64)")
            hashes.append(h)
        if hashes:
            parent_hash = hashes[-1]
    if len(hashes) < n:
        # the rest in one native call, which stops before an empty block: any block past
        # that one is hashed on its own
        hashes += v1_chain_blocks(arrays[len(hashes) :], parent_hash, lora_id, salt_id)
        while len(hashes) < n:
            parent_hash = v1_hash_packed(
                arrays[len(hashes)], hashes[-1] if hashes else parent_hash, lora_id, salt_id
            )
            hashes.append(parent_hash)
    return [
        StoredBlock(h, tokens, lora_id, cache_level, priority, salt_id)
        for h, tokens in zip(hashes, arrays, strict=True)
    ]

"""Fast construction of :class:`~events.wire.model.StoredBlock` records for the per-block paths.

The event manager builds one StoredBlock per announced block and the wire decoder one per
decoded block. A frozen dataclass's generated ``__init__`` stores every field through
``object.__setattr__``, about a microsecond per record; the builders here allocate the record
with ``object.__new__`` and store each field through its slot descriptor, which is the same
store without the detour. The result is the same object (equal, frozen, and like the
dataclass not hashable), tested against the regular constructor.

Token ids stay packed where they come packed: the event manager's records hold the cache's own
``array('i')`` of each block (the cache never changes a block's array in place; a record's
tokens are data, not to be changed either), and a decoded store's ``array('i')`` gives each
block an ``array('i')`` slice. Lists stay accepted everywhere, and records compare by their
token ids whatever the container (:class:`~events.wire.model.StoredBlock`).

Each builder has a readable pure-Python form (the ``*_py`` functions, the reference) and, when
the optional extension ``events._v1hash`` is built, a native form that does the same work in one
call per event (``stored_blocks``; ``v1_stored_chain``, which also hashes) or per block
(``v1_stored_block``).
The native forms leave the token lists they make (ints only), and records whose fields are
all such values (arrays are never tracked), out of the cyclic garbage collector, which would
otherwise walk every token of every young record at each collection; a cycle cannot run
through them, so nothing is lost (see ``_v1hash.c``).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from functools import partial
from typing import Any, Final, Protocol

from events.hashing import v1_block_hash
from events.wire.model import BlockHash, StoredBlock, TokenIds

try:  # the optional extension (see events.hashing); absent, the pure forms below are used
    from events import _v1hash as _native
except ImportError:  # pragma: no cover - depends on the install
    _native = None  # type: ignore[assignment]

NATIVE: Final[bool] = _native is not None and hasattr(_native, "stored_blocks")
"""True when the native record builders are loaded."""

_FIELDS: Final = ("block_hash", "tokens", "lora_id", "cache_level", "priority", "cache_salt_id")


def record_setters(cls: type) -> tuple[Any, ...]:
    """The field descriptors of a model record (a msgspec Struct), in field order (what the
    native builders store a record's fields through)."""
    names: tuple[str, ...] = cls.__struct_fields__  # type: ignore[attr-defined]
    return tuple(vars(cls)[name] for name in names)


_DESCRIPTORS: Final[tuple[Any, ...]] = record_setters(StoredBlock)
assert StoredBlock.__struct_fields__ == _FIELDS


def stored_block(
    block_hash: BlockHash,
    tokens: TokenIds,
    lora_id: int | None,
    cache_level: int,
    priority: int,
    cache_salt_id: int | None,
) -> StoredBlock:
    """``StoredBlock(...)`` (no checks: the callers pass values they produced or validated)."""
    return StoredBlock(block_hash, tokens, lora_id, cache_level, priority, cache_salt_id)


def stored_blocks_py(
    hashes: list[BlockHash],
    tokens: TokenIds,
    block_size: int,
    lora_id: int | None,
    cache_level: int,
    priority: int,
    cache_salt_id: int | None,
) -> list[StoredBlock]:
    """One record per hash; record ``i`` holds ``tokens[i * block_size : (i + 1) * block_size]``
    (the reference form of :func:`stored_blocks`): a list's slice is a list, an array's an
    array."""
    return [
        stored_block(
            h,
            tokens[i * block_size : (i + 1) * block_size],
            lora_id,
            cache_level,
            priority,
            cache_salt_id,
        )
        for i, h in enumerate(hashes)
    ]


def v1_stored_block_py(
    tokens: array[int],
    parent_hash: int,
    lora_id: int | None,
    salt_id: int | None,
    cache_level: int,
    priority: int,
) -> StoredBlock:
    """The record announcing one block of packed int32 ``tokens`` under its V1 hash chained to
    ``parent_hash`` (0 for a first block), holding ``tokens`` themselves (an ``array('i')``; any
    other packed buffer is copied into one); the reference form of :func:`v1_stored_block`."""
    h = v1_block_hash(tokens, parent_hash, lora_id=lora_id, salt_id=salt_id)
    return _packed_record(h, tokens, lora_id, cache_level, priority, salt_id)


def _packed_record(
    h: int,
    tokens: array[int],
    lora_id: int | None,
    cache_level: int,
    priority: int,
    salt_id: int | None,
) -> StoredBlock:
    """The record of a block of hash ``h`` holding ``tokens`` as an ``array('i')`` (the array
    itself; any other packed buffer copied into one)."""
    if type(tokens) is not array or tokens.typecode != "i":
        tokens = array("i", bytes(tokens))
    return stored_block(h, tokens, lora_id, cache_level, priority, salt_id)


def v1_stored_chain_py(
    token_arrays: list[array[int]],
    parent_hash: int,
    lora_id: int | None,
    salt_id: int | None,
    cache_level: int,
    priority: int,
    known: list[int] | None = None,
) -> list[StoredBlock]:
    """The records of a chain of blocks, one per ``array('i')`` of tokens, each hashed under
    the previous block's V1 hash (the first under ``parent_hash``, 0 for a first block): the
    reference form of :func:`v1_stored_chain`. ``known``: the V1 hashes of the first blocks
    when the caller has them (taken as they are: trusted, not checked against the tokens);
    the blocks past them are hashed under the last one."""
    records: list[StoredBlock] = []
    for i, tokens in enumerate(token_arrays):
        if known is not None and i < len(known):
            h = known[i]
            if type(h) is not int:
                raise TypeError("v1_stored_chain: known hashes must be ints")
            if not 0 <= h < 1 << 64:
                raise OverflowError("v1_stored_chain: known hashes must be in [0, 2**64)")
            sb = _packed_record(h, tokens, lora_id, cache_level, priority, salt_id)
        else:
            sb = v1_stored_block_py(tokens, parent_hash, lora_id, salt_id, cache_level, priority)
        records.append(sb)
        parent_hash = int(sb.block_hash)
    return records


def _stored_blocks_native(
    hashes: list[BlockHash],
    tokens: TokenIds,
    block_size: int,
    lora_id: int | None,
    cache_level: int,
    priority: int,
    cache_salt_id: int | None,
) -> list[StoredBlock]:
    records: list[StoredBlock] = _native.stored_blocks(
        StoredBlock,
        _DESCRIPTORS,
        hashes,
        tokens,
        block_size,
        lora_id,
        cache_level,
        priority,
        cache_salt_id,
    )
    return records


stored_blocks: Callable[
    [list[BlockHash], TokenIds, int, int | None, int, int, int | None], list[StoredBlock]
] = _stored_blocks_native if NATIVE else stored_blocks_py
"""Records for one decoded wire event (see :func:`stored_blocks_py`)."""

# per block, so the native builder is bound to the record type once (partial calls it through
# vectorcall, without a Python frame in between)
v1_stored_block: Callable[[array[int], int, int | None, int | None, int, int], StoredBlock] = (
    partial(_native.v1_stored_block, StoredBlock, _DESCRIPTORS) if NATIVE else v1_stored_block_py
)
"""Hash and record of one block (see :func:`v1_stored_block_py`); ``tokens`` must be an
``array('i')``."""

NATIVE_CHAIN: Final[bool] = NATIVE and hasattr(_native, "v1_stored_chain")
"""True when the native chain builder is loaded (an extension built before it lacks it)."""


class _ChainBuilder(Protocol):
    def __call__(
        self,
        token_arrays: list[array[int]],
        parent_hash: int,
        lora_id: int | None,
        salt_id: int | None,
        cache_level: int,
        priority: int,
        known: list[int] | None = None,
    ) -> list[StoredBlock]: ...


v1_stored_chain: _ChainBuilder = (
    partial(_native.v1_stored_chain, StoredBlock, _DESCRIPTORS)
    if NATIVE_CHAIN
    else v1_stored_chain_py
)
"""Hashes and records of a chain of blocks in one call (see :func:`v1_stored_chain_py`)."""

"""Type stub of the native V1 block hash and record extension (built from _v1hash.c)."""

from collections.abc import Sequence
from typing import Any

def block_hash(tokens: object, parent_hash: int, lora_id: int | None, salt_id: int | None) -> int:
    """V1 hash of one block of packed native-endian int32 token ids."""

def chain(
    tokens: object, tokens_per_block: int, lora_id: int | None, salt_id: int | None
) -> list[int]:
    """V1 hashes of every full block of packed native-endian int32 token ids."""

def chain_lists(
    token_lists: list[Any], parent_hash: int, lora_id: int | None, salt_id: int | None
) -> list[int]:
    """V1 hash of each list of token ids in turn, chained from ``parent_hash``; stops before
    the first empty list."""

def stored_blocks(
    cls: type[Any],
    setters: tuple[Any, ...],
    hashes: list[Any],
    tokens: Sequence[int],
    block_size: int,
    lora_id: int | None,
    cache_level: int,
    priority: int,
    salt_id: int | None,
) -> list[Any]:
    """One record of ``cls`` per hash, each with its ``block_size`` slice of ``tokens`` (a list,
    or an array whose slices are arrays)."""

def v1_stored_block(
    cls: type[Any],
    setters: tuple[Any, ...],
    tokens: object,
    parent_hash: int,
    lora_id: int | None,
    salt_id: int | None,
    cache_level: int,
    priority: int,
) -> Any:
    """The V1 hash and record of one block of packed int32 token ids."""

def stored_runs(blocks: Any, block_size: int) -> list[tuple[int, Sequence[int], list[Any]]]:
    """The wire events of a Stored event's blocks: ``(end, token_ids, hashes)`` per run, the
    token ids an ``array('i')`` when every block of the run holds one, else a list."""

def v1_stored_chain(
    cls: type[Any],
    setters: tuple[Any, ...],
    token_arrays: list[Any],
    parent_hash: int,
    lora_id: int | None,
    salt_id: int | None,
    cache_level: int,
    priority: int,
    known: list[int] | None = None,
) -> list[Any]:
    """The records of a chain of blocks of packed int32 token ids, each hashed under the
    previous one's hash (the first under ``parent_hash``); ``known``: the first blocks'
    hashes, taken as they are."""

def build_events(
    spec: tuple[Any, ...],
    pending: list[Any],
    first_id: int,
    block_size: int | None,
    window_size: int,
    hash_algo: str,
    dp_rank: int | None,
) -> list[Any]:
    """The event manager's pending items as events numbered from ``first_id`` (see
    ``events.manager._build_events_py``); ``spec`` names the pending, data and event classes,
    their slot descriptors and the data classes' default trailing fields."""

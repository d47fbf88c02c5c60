"""Type stub of the native V1 block hash extension (built from _v1hash.c)."""

from typing import Any

hash_block_api: object
"""The C API of the V1 hash (a capsule, ``kvcache._v1hash.hash_block_api``) other extensions
import."""

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

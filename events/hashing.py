"""Event block hashes (WIRE.md section 3), by their former module name: they live in
``kvcache.hashing``, the one module of every block hash (the cache's SHA-256 keys, TensorRT-LLM's
V1 hash, the xxh3 content hash), at the bottom layer. Old imports keep working; the project
imports from there."""

from kvcache.hashing import (
    KEY_HASHES,
    XXH3_SEED,
    HashAlgo,
    Tokens,
    chain_hashes,
    hash_from_key,
    v1_block_hash,
    v1_chain,
    v1_chain_blocks,
    v1_chain_ints,
    v1_hash_packed,
    xxh3_content_hash,
)

__all__ = [
    "KEY_HASHES",
    "XXH3_SEED",
    "HashAlgo",
    "Tokens",
    "chain_hashes",
    "hash_from_key",
    "v1_block_hash",
    "v1_chain",
    "v1_chain_blocks",
    "v1_chain_ints",
    "v1_hash_packed",
    "xxh3_content_hash",
]

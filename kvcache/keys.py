"""Block keys and token arrays, by their former module name: what this module held now lives in
``kvcache.hashing`` (the block keys, with every other block hash) and ``kvcache.tokens`` (the
token arrays they hash). Old imports keep working; the project imports from those two."""

from kvcache.hashing import BlockKey, block_key, blockchain_keys, chain_keys, root_key
from kvcache.tokens import (
    TOKEN_LIMIT,
    checked_token_array,
    int32_array,
    pack_range,
    token_array,
    token_array_bytes,
    tokens_from_bytes,
    tokens_to_bytes,
)

__all__ = [
    "TOKEN_LIMIT",
    "BlockKey",
    "block_key",
    "blockchain_keys",
    "chain_keys",
    "checked_token_array",
    "int32_array",
    "pack_range",
    "root_key",
    "token_array",
    "token_array_bytes",
    "tokens_from_bytes",
    "tokens_to_bytes",
]

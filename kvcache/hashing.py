"""Every block hash of the project (WIRE.md sections 2 and 3), in one module at the bottom layer:
the cache keys its radix tree by them, a worker's events announce them and a router recomputes
them, all from here. It imports nothing from ``events`` or ``router_sim``.

The cache's block keys (WIRE.md 2), 32 bytes (SHA-256), never truncated:

- root key  = sha256(scope.to_bytes())
- block key = sha256(parent_key || each token as 4-byte little-endian)

Blocks are consecutive ``tokens_per_block`` chunks; the last one may be partial and is hashed
over its actual tokens (no padding, no length).

The event hashes (WIRE.md 3), one of three algorithms (:class:`HashAlgo`):

- ``v1_block_key`` (default): TensorRT-LLM's V1 ``BlockKeyHasher``, a 64-bit chained hash of a
  block's tokens, its parent's hash and the scope (salt on the first block only, LoRA id on
  every block). The native extension ``kvcache._v1hash`` computes it (its constants and mixing
  steps are given in WIRE.md 3; the tests check it against a pure-Python reference of them).
- ``v2_sha256``: the 32-byte block key as 64 lowercase hex characters.
- ``v2_sha256_64``: the first 8 bytes of that key as a big-endian unsigned integer.

Routers call :func:`chain_hashes` on a request's tokens and scope; workers derive the same
values block by block, so both sides share one definition. :func:`xxh3_content_hash` is the
router-side content hash of an optional re-keying mode.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from enum import Enum
from hashlib import sha256
from typing import Final, NewType, TypeAlias

import xxhash

from kvcache import _v1hash as _native
from kvcache.scope import DEFAULT_SCOPE, U64_LIMIT, ReuseScope
from kvcache.tokens import token_array, tokens_to_bytes

BlockKey = NewType("BlockKey", bytes)
"""A block's key in the cache (32 bytes, SHA-256)."""

EventHash: TypeAlias = int | str
"""A block hash as an event carries it: an int (``v1_block_key``, ``v2_sha256_64``) or 64 hex
characters (``v2_sha256``); ``events.wire.model.BlockHash`` is the same union."""

Tokens: TypeAlias = Sequence[int] | memoryview
"""Token ids: a sequence of ints, or packed native-endian int32s (``array('i')``, or the
``bytes`` / ``memoryview`` of ``kvcache.tokens.token_array(...)``)."""


# --- block keys (WIRE.md 2) ---------------------------------------------------------------------


def chain_keys(parent_key: bytes, data: bytes, start: int, step: int, count: int) -> list[BlockKey]:
    """The keys of ``count`` consecutive blocks of ``step`` bytes of ``data`` (packed tokens,
    :func:`kvcache.tokens.tokens_to_bytes`) from offset ``start``, each chained from the one
    before and the first from ``parent_key``."""
    if start < 0 or step < 1 or count < 0 or start + count * step > len(data):
        raise ValueError(
            f"chain_keys: {count} blocks of {step} bytes from offset {start} do not fit in "
            f"{len(data)} bytes (need start >= 0, step >= 1, count >= 0)"
        )
    keys: list[BlockKey] = []
    key = parent_key
    for off in range(start, start + count * step, step):
        key = sha256(key + data[off : off + step]).digest()
        keys.append(key)  # type: ignore[arg-type]  # a BlockKey (NewType's call costs per key)
    return keys


def root_key(scope: ReuseScope) -> BlockKey:
    """The key of a scope's root: ``sha256(scope.to_bytes())``."""
    return BlockKey(sha256(scope.to_bytes()).digest())


def block_key(parent_key: bytes, tokens: Sequence[int]) -> BlockKey:
    """The chained key of one block: ``sha256(parent_key || tokens as 4-byte LE)``."""
    return BlockKey(sha256(parent_key + tokens_to_bytes(token_array(tokens))).digest())


def blockchain_keys(
    scope: ReuseScope, tokens: Sequence[int], tokens_per_block: int
) -> list[BlockKey]:
    """One key per block of ``tokens`` under ``scope``; the last one may be partial."""
    if tokens_per_block < 1:
        raise ValueError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
    data = tokens_to_bytes(token_array(tokens))
    step = 4 * tokens_per_block
    keys: list[BlockKey] = []
    parent: bytes = root_key(scope)
    for start in range(0, len(data), step):
        parent = sha256(parent + data[start : start + step]).digest()
        keys.append(BlockKey(parent))
    return keys


# --- event hashes (WIRE.md 3) -------------------------------------------------------------------


class HashAlgo(str, Enum):
    """The ``hash_algo`` of an event stream."""

    V1_BLOCK_KEY = "v1_block_key"
    V2_SHA256 = "v2_sha256"
    V2_SHA256_64 = "v2_sha256_64"

    @classmethod
    def parse(cls, value: HashAlgo | str) -> HashAlgo:
        """The algorithm named ``value``; raises ``ValueError`` listing the valid names."""
        try:
            return cls(value)
        except ValueError:
            names = ", ".join(a.value for a in cls)
            raise ValueError(f"unknown hash_algo {value!r}; expected one of {names}") from None


def _check_u64(name: str, value: object, *, optional: bool) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int in [0, 2**64), got {type(value).__name__}")
    if not 0 <= value < U64_LIMIT:
        raise ValueError(f"{name} must be in [0, 2**64), got {value}")


_PACKED_TYPES: Final = (bytes, bytearray, memoryview)


def _as_array(tokens: Tokens) -> array[int]:
    """Validated int32 token ids (``kvcache.tokens.token_array``), unpacking bytes-like input."""
    if isinstance(tokens, _PACKED_TYPES):
        raw = memoryview(tokens).cast("B")
        if len(raw) % 4:
            raise ValueError(f"packed tokens must be whole 4-byte int32s, got {len(raw)} bytes")
        unpacked: array[int] = array("i")
        unpacked.frombytes(raw)
        return token_array(unpacked)
    return token_array(tokens)


def _int32s(tokens: Tokens) -> Tokens:
    """Tokens in a form the hash functions take.

    A list, an ``array('i')`` or a bytes-like object goes through as is: the native code
    validates a list's ids while packing them, checks a buffer's length and rejects negative
    ids itself, which spares Python-level passes over a long prompt.
    """
    if (
        type(tokens) is list
        or isinstance(tokens, _PACKED_TYPES)
        or (isinstance(tokens, array) and tokens.typecode == "i")
    ):
        return tokens
    return _as_array(tokens)


def v1_block_hash(
    tokens: Tokens,
    parent_hash: int = 0,
    lora_id: int | None = None,
    salt_id: int | None = None,
) -> int:
    """The V1 hash of one block: ``tokens`` chained to ``parent_hash`` (0 for a first block).

    Raises ``TypeError`` / ``ValueError`` for token ids outside [0, 2**31) or hash, LoRA and salt
    values outside [0, 2**64).
    """
    _check_u64("parent_hash", parent_hash, optional=False)
    _check_u64("lora_id", lora_id, optional=True)
    _check_u64("salt_id", salt_id, optional=True)
    return int(_native.block_hash(_int32s(tokens), parent_hash, lora_id, salt_id))


v1_hash_packed: Callable[[array[int], int, int | None, int | None], int] = _native.block_hash
"""``v1_block_hash(tokens, parent_hash, lora_id, salt_id)`` of an ``array('i')``, positional
and with the same checks and errors, in one native call (the per-block path of the event
manager's records)."""


v1_chain_blocks: Callable[[list[array[int]], int, int | None, int | None], list[int]] = (
    _native.chain_lists
)
"""The V1 hash of each ``array('i')`` block in turn, each chained to the one before (the first
to ``parent_hash``), in one native call; stops before the first empty block (the result is
then shorter). Checks and errors as :func:`v1_block_hash`'s."""


def v1_chain(tokens: Tokens, tokens_per_block: int, scope: ReuseScope | None = None) -> list[int]:
    """V1 hashes of the full blocks of ``tokens`` under ``scope`` (a trailing partial block
    has no hash). ``tokens`` may be a list of ids or packed int32s (see :data:`Tokens`); one
    native call hashes the whole sequence."""
    if isinstance(tokens_per_block, bool) or not isinstance(tokens_per_block, int):
        raise TypeError(f"tokens_per_block must be an int, got {type(tokens_per_block).__name__}")
    if tokens_per_block < 1:
        raise ValueError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
    scope = DEFAULT_SCOPE if scope is None else scope
    chain: list[int] = _native.chain(_int32s(tokens), tokens_per_block, scope.lora_id, scope.salt)
    return chain  # a new list: the caller may keep it


v1_chain_ints: Callable[[array[int], int, int | None, int | None], list[int]] = _native.chain
"""The V1 hashes of the full blocks of an ``array('i')`` of ``tokens_per_block``-token blocks
under a LoRA id and salt (``v1_chain_ints(tokens, tokens_per_block, lora_id, salt)``), in one
native call without :func:`v1_chain`'s Python-level checks of ``tokens_per_block``: for a
caller that has checked them (the router's hot path)."""


#: The key-derived algorithms, unchecked: for hot paths whose keys come from the radix tree.
KEY_HASHES: Final[dict[HashAlgo, Callable[[bytes], EventHash]]] = {
    HashAlgo.V2_SHA256: lambda key: bytes(key).hex(),
    HashAlgo.V2_SHA256_64: lambda key: int.from_bytes(key[:8], "big"),
}


def hash_from_key(algo: HashAlgo | str, key: bytes) -> EventHash:
    """The event hash of a 32-byte block key under a ``v2_*`` algorithm.

    ``v1_block_key`` is not derived from keys (it chains its own 64-bit values): use
    :func:`v1_block_hash` for it.
    """
    parsed = HashAlgo.parse(algo)
    if len(key) != 32:
        raise ValueError(f"block keys are 32 bytes (SHA-256), got {len(key)}")
    derive = KEY_HASHES.get(parsed)
    if derive is None:
        raise ValueError("v1_block_key hashes chain over tokens, not keys: use v1_block_hash")
    return derive(key)


def chain_hashes(
    tokens: Tokens,
    tokens_per_block: int,
    scope: ReuseScope | None = None,
    algo: HashAlgo | str = HashAlgo.V1_BLOCK_KEY,
) -> list[EventHash]:
    """The event hashes of the full blocks of a request's ``tokens`` under ``scope``.

    This is what a router computes to look a request up in its index; it equals what the
    worker's event manager announces for the same tokens, scope and ``tokens_per_block``.
    """
    parsed = HashAlgo.parse(algo)
    scope = DEFAULT_SCOPE if scope is None else scope
    if parsed is HashAlgo.V1_BLOCK_KEY:
        return v1_chain(tokens, tokens_per_block, scope)  # type: ignore[return-value]
    if tokens_per_block < 1:
        raise ValueError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
    arr = _as_array(tokens)
    full = len(arr) - len(arr) % tokens_per_block
    return [
        hash_from_key(parsed, key) for key in blockchain_keys(scope, arr[:full], tokens_per_block)
    ]


XXH3_SEED: Final = 1337
"""Seed of the router-side content hash (the value ai-dynamo's KV router uses)."""


def xxh3_content_hash(tokens: Tokens, seed: int = XXH3_SEED) -> int:
    """Router-side content hash of one block: xxh3_64 of its tokens as 4-byte LE, seeded.

    Some routers re-key blocks by content instead of trusting the engine's chained hash; this
    is not chained and ignores the scope, so it is only for that optional mode (WIRE.md 3).
    """
    return int(xxhash.xxh3_64_intdigest(tokens_to_bytes(_as_array(tokens)), seed=seed))


__all__ = [
    "KEY_HASHES",
    "XXH3_SEED",
    "BlockKey",
    "EventHash",
    "HashAlgo",
    "Tokens",
    "block_key",
    "blockchain_keys",
    "chain_hashes",
    "chain_keys",
    "hash_from_key",
    "root_key",
    "v1_block_hash",
    "v1_chain",
    "v1_chain_blocks",
    "v1_chain_ints",
    "v1_hash_packed",
    "xxh3_content_hash",
]

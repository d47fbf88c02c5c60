"""Why does a block hash not match? The usual causes, tried one by one.

A stream's hash that differs from the one recomputed from tokens, parent hash and scope
(WIRE.md 3) is almost always one of a few engine or router bugs: the salt or the LoRA id not
mixed in, the salt mixed into every block, the parent not chained, the two sides configured
with different scopes, or another algorithm altogether. :func:`explain_mismatch` recomputes the
mismatched blocks under each hypothesis and names the first one that reproduces all of them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Final

# the V1 reference's mixing steps, reused to build the buggy variant below
from events.hashing import (
    _M1,
    _MASK64,
    HashAlgo,
    _mix32,
    _mix64,
    hash_from_key,
    v1_block_hash,
    xxh3_content_hash,
)
from events.model import BlockHash, Stored
from kvcache.keys import BlockKey
from kvcache.scope import ReuseScope

ScopeOf = Callable[[int | None, int | None], ReuseScope]
"""The scope to recompute a block under, from the block's own (lora_id, cache_salt_id)."""

UNEXPLAINED: Final = (
    "unexplained: not salt/LoRA mixing, parent chaining, another scope or another "
    "algorithm; check the engine's hash function and its inputs"
)


def v1_salt_every_block(
    tokens: Sequence[int], parent_hash: int, lora_id: int | None, salt_id: int | None
) -> int:
    """The V1 hash as an engine computes it when it mixes the salt into every block (a known
    bug; WIRE.md 3 mixes it into the first block only)."""
    seed = len(tokens) ^ ((parent_hash * _M1) & _MASK64)
    if salt_id is not None:
        seed = _mix64(salt_id, seed)
    for tok in tokens:
        seed = _mix32(tok, seed)
    if lora_id is not None:
        seed = _mix64(lora_id, seed)
    return seed


def _explain_by_key(
    algo: HashAlgo, data: Stored, mismatched: list[int], keys: list[BlockKey | None]
) -> str | None:
    """The key-derived algorithms, when the block keys could be chained from the root."""
    for other in (HashAlgo.V2_SHA256_64, HashAlgo.V2_SHA256):
        if other is algo:
            continue
        if all(
            (key := keys[i]) is not None and hash_from_key(other, key) == data.blocks[i].block_hash
            for i in mismatched
        ):
            return f"another algorithm: the hashes are {other.value}, not {algo.value}"
    return None


def _explain_blocks(
    algo: HashAlgo, data: Stored, mismatched: list[int], scope_of: ScopeOf, router_scope: bool
) -> str | None:
    parents: list[BlockHash | None] = [data.parent_hash] + [b.block_hash for b in data.blocks[:-1]]
    candidates: list[
        tuple[str, Callable[[Sequence[int], int, ReuseScope, int | None, int | None], object]]
    ]
    candidates = [
        (
            "the salt is not mixed into the first block (engine ignores cache_salt_id)",
            lambda t, p, s, lo, sa: (
                v1_block_hash(t, p, s.lora_id, None) if s.salt is not None else None
            ),
        ),
        (
            "the LoRA id is not mixed in (engine ignores lora_id)",
            lambda t, p, s, lo, sa: (
                v1_block_hash(t, p, None, s.salt) if s.lora_id is not None else None
            ),
        ),
        (
            "neither the salt nor the LoRA id is mixed in",
            lambda t, p, s, lo, sa: (
                v1_block_hash(t, p, None, None)
                if s.lora_id is not None and s.salt is not None
                else None
            ),
        ),
        (
            "the salt is mixed into every block, not only the first",
            lambda t, p, s, lo, sa: (
                v1_salt_every_block(t, p, s.lora_id, s.salt)
                if s.salt is not None and p != 0
                else None
            ),
        ),
        (
            "the parent hash is not chained (every block hashed as a first block)",
            lambda t, p, s, lo, sa: v1_block_hash(t, 0, s.lora_id, s.salt) if p else None,
        ),
        (
            "the publisher's own scope (the event's lora_id / cache_salt_id) differs "
            "from the router's --lora-id / --cache-salt",
            lambda t, p, s, lo, sa: v1_block_hash(t, p, lo, sa) if router_scope else None,
        ),
        (
            "another algorithm: the router-side content hash (xxh3_64 of the tokens, seed 1337)",
            lambda t, p, s, lo, sa: xxh3_content_hash(t),
        ),
    ]
    if algo is not HashAlgo.V1_BLOCK_KEY:
        candidates.insert(
            0,
            (
                f"another algorithm: the hashes are v1_block_key, not {algo.value}",
                lambda t, p, s, lo, sa: v1_block_hash(t, p, s.lora_id, s.salt),
            ),
        )
    for name, candidate in candidates:
        explained = True
        for i in mismatched:
            blk = data.blocks[i]
            parent = parents[i]
            if not isinstance(parent, int | None) or not isinstance(blk.block_hash, int):
                explained = False
                break
            scope = scope_of(blk.lora_id, blk.cache_salt_id)
            got = candidate(blk.tokens, parent or 0, scope, blk.lora_id, blk.cache_salt_id)
            if got is None or got != blk.block_hash:
                explained = False
                break
        if explained:
            return name
    if any(isinstance(data.blocks[i].block_hash, str) for i in mismatched):
        return (
            "another algorithm: the hashes are hex strings (v2_sha256) but the block keys "
            "they should equal differ; check the scope the engine used"
            if algo is HashAlgo.V2_SHA256
            else f"another algorithm: the hashes are hex strings (v2_sha256), not {algo.value}"
        )
    return None


def explain_mismatch(
    algo: HashAlgo,
    data: Stored,
    mismatched: list[int],
    keys: list[BlockKey | None],
    scope_of: ScopeOf,
    router_scope: bool,
) -> str:
    """The cause that reproduces every mismatched block of one stored event, or
    :data:`UNEXPLAINED`.

    ``mismatched`` indexes ``data.blocks``; ``keys`` holds each block's key when it could be
    chained from the scope root; ``router_scope`` tells whether ``scope_of`` imposes the
    router's scope (so the event's own scope is a hypothesis to try).
    """
    return (
        _explain_by_key(algo, data, mismatched, keys)
        or _explain_blocks(algo, data, mismatched, scope_of, router_scope)
        or UNEXPLAINED
    )

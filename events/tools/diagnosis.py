"""Why does a block hash not match? The usual causes, tried one by one.

A stream's hash that differs from the one recomputed from tokens, parent hash and scope
(WIRE.md 3) is almost always one of a few engine or router bugs: the salt or the LoRA id not
mixed in, the salt mixed into every block, the parent not chained, the two sides configured
with different scopes, or another algorithm altogether. :func:`explain_mismatch` recomputes the
mismatched blocks under each hypothesis and names the first one that reproduces all of them.

:func:`explain_chain` does the same for a whole prompt's hashes against a golden file's
(:mod:`events.tools.hashcheck`): each cause, another block size and wider token ids included, is
replayed over the prompt, and the one that yields the observed hashes is named.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from hashlib import sha256
from typing import Final

# the V1 reference's mixing steps, reused to build the buggy variant below
from events.hashing import (
    _M1,
    _MASK64,
    HashAlgo,
    _mix32,
    _mix64,
    chain_hashes,
    hash_from_key,
    v1_block_hash,
    xxh3_content_hash,
)
from events.wire.model import BlockHash, Stored, StoredBlock
from kvcache.keys import BlockKey, root_key
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


# --------------------------------------------------------------------- whole-chain drift

XXH3_CONTENT: Final = "xxh3_content"
"""Golden-file name of the router-side content hash (:func:`events.hashing.xxh3_content_hash`):
not chained and blind to the scope, so it is a hash algorithm of its own for stability checks."""

KNOWN_ALGOS: Final[tuple[str, ...]] = (*(a.value for a in HashAlgo), XXH3_CONTENT)
"""Every algorithm this project can recompute, in golden-file spelling."""

_BLOCK_SIZES: Final = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def reference_chain(
    algo: str, tokens: Sequence[int], tokens_per_block: int, scope: ReuseScope
) -> list[BlockHash]:
    """The hashes of the full blocks of ``tokens`` under ``algo`` (one of :data:`KNOWN_ALGOS`),
    computed with this library's hashing."""
    if algo == XXH3_CONTENT:
        full = len(tokens) - len(tokens) % tokens_per_block
        return [
            xxh3_content_hash(tokens[i : i + tokens_per_block])
            for i in range(0, full, tokens_per_block)
        ]
    return chain_hashes(tokens, tokens_per_block, scope, HashAlgo.parse(algo))


def _wide_token_chain(
    algo: str, tokens: Sequence[int], tokens_per_block: int, scope: ReuseScope
) -> list[BlockHash]:
    """A v2 chain whose block keys hash token ids as 8-byte ints (a token-id type change)."""
    parent = root_key(scope)
    out: list[BlockHash] = []
    full = len(tokens) - len(tokens) % tokens_per_block
    for i in range(0, full, tokens_per_block):
        body = b"".join(t.to_bytes(8, "little") for t in tokens[i : i + tokens_per_block])
        parent = BlockKey(sha256(parent + body).digest())
        out.append(hash_from_key(algo, parent))
    return out


def _hypotheses(
    algo: str, tokens: Sequence[int], tpb: int, scope: ReuseScope
) -> list[tuple[str, Callable[[], list[BlockHash]]]]:
    """(cause, chain under that cause) pairs, the most frequent causes first; chains are
    computed lazily so a drift explained early costs little."""
    salt, lora = scope.salt, scope.lora_id
    chunks = [tokens[i : i + tpb] for i in range(0, len(tokens) - len(tokens) % tpb, tpb)]
    out: list[tuple[str, Callable[[], list[BlockHash]]]] = []
    if salt is not None:
        out.append(
            (
                "the salt is not mixed in (the hashes are the same scope's without its salt)",
                lambda: reference_chain(algo, tokens, tpb, ReuseScope(lora, None)),
            )
        )
    if lora is not None:
        out.append(
            (
                "the LoRA id is not mixed in (the hashes are the same scope's without it)",
                lambda: reference_chain(algo, tokens, tpb, ReuseScope(None, salt)),
            )
        )
    if salt is not None and lora is not None:
        out.append(
            (
                "neither the salt nor the LoRA id is mixed in",
                lambda: reference_chain(algo, tokens, tpb, ReuseScope()),
            )
        )
    if algo == HashAlgo.V1_BLOCK_KEY.value and salt is not None:

        def salt_everywhere() -> list[BlockHash]:
            parent = 0
            hashes: list[BlockHash] = []
            for chunk in chunks:
                parent = v1_salt_every_block(chunk, parent, lora, salt)
                hashes.append(parent)
            return hashes

        out.append(("the salt is mixed into every block, not only the first", salt_everywhere))
    if algo != XXH3_CONTENT:
        out.append(
            (
                "the parent chain is broken: every block is hashed as a first block",
                lambda: [reference_chain(algo, c, tpb, scope)[0] for c in chunks],
            )
        )
    for size in sorted({*_BLOCK_SIZES, tpb // 2, tpb * 2} - {0, tpb}):
        if size <= len(tokens):
            out.append(
                (
                    f"another block size: the hashes are of {size}-token blocks, not {tpb}",
                    lambda size=size: reference_chain(algo, tokens, size, scope),  # type: ignore[misc]
                )
            )
    for other in KNOWN_ALGOS:
        if other != algo:
            out.append(
                (
                    f"another algorithm: the hashes are {other}, not {algo}",
                    lambda other=other: reference_chain(other, tokens, tpb, scope),  # type: ignore[misc]
                )
            )
    if algo in (HashAlgo.V2_SHA256.value, HashAlgo.V2_SHA256_64.value):
        out.append(
            (
                "the token ids are serialized as 8-byte ints, not 4-byte (a token-id type change)",
                lambda: _wide_token_chain(algo, tokens, tpb, scope),
            )
        )
    return out


def explain_chain(
    algo: str,
    tokens: Sequence[int],
    tokens_per_block: int,
    scope: ReuseScope,
    expected: Sequence[BlockHash],
    actual: Sequence[BlockHash],
) -> str:
    """Why the hashes ``actual`` of a whole prompt differ from the golden ``expected`` ones.

    Each usual cause is replayed over the whole prompt (salt or LoRA id not mixed, the salt
    mixed into every block, the parent chain broken, another block size, another algorithm,
    wider token ids); the first whose hashes begin with ``actual`` is named. ``actual`` may be
    shorter than the prompt's chain (a capture that holds only its first blocks). For V1 the
    block-level causes of :func:`explain_mismatch` are tried last, with ``actual`` as the
    parents. Returns :data:`UNEXPLAINED` when nothing reproduces them; an ``algo`` this project
    does not know cannot be diagnosed.
    """
    got, want = list(actual), list(expected)
    if got == want:
        return "no drift"
    if got and got == want[: len(got)]:
        return f"missing blocks: only the first {len(got)} of {len(want)} blocks have hashes"
    if want and got[: len(want)] == want:
        return f"extra blocks: {len(got) - len(want)} more hashes than the golden file has"
    if algo not in KNOWN_ALGOS:
        return f"unexplained: {algo} is not one of this project's algorithms ({UNEXPLAINED})"
    if not got:
        return "no hashes at all"
    n = len(got)
    reference = reference_chain(algo, tokens, tokens_per_block, scope)
    if reference[:n] == got and len(reference) >= n:
        # the new hashes are right: the golden ones were made some other way
        why = explain_chain(algo, tokens, tokens_per_block, scope, got, want) if want else ""
        return (
            f"the hashes are this library's {algo} for the case's tokens and scope; the golden "
            f"values are not" + (f" (they look like: {why})" if why != UNEXPLAINED else "")
        )
    for cause, chain in _hypotheses(algo, tokens, tokens_per_block, scope):
        candidate = chain()
        if len(candidate) >= n and candidate[:n] == got:
            return cause
    if algo == XXH3_CONTENT or len(got) > len(want):
        return UNEXPLAINED
    data = Stored(
        None,
        [
            StoredBlock(
                h,
                list(tokens[i * tokens_per_block : (i + 1) * tokens_per_block]),
                scope.lora_id,
                cache_salt_id=scope.salt,
            )
            for i, h in enumerate(got)
        ],
        tokens_per_block,
    )
    mismatched = [i for i, h in enumerate(got) if h != want[i]]
    keys: list[BlockKey | None] = [None] * len(got)
    return explain_mismatch(
        HashAlgo.parse(algo), data, mismatched, keys, lambda lo, sa: scope, router_scope=False
    )

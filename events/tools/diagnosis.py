"""Why does a block hash not match? Known drifts, each replayed until one reproduces the hashes.

A hash that differs from the one recomputed from tokens, parent hash and scope (WIRE.md 3) is
almost always one of a few engine bugs. Each is a :class:`Cause`: what the engine does, what it
should do, and the function to fix. The catalog (every entry has a test that injects it):

- output: the hash written as a signed 64-bit int, or with its bytes reversed;
- scope: the salt or the LoRA id not mixed in, an absent LoRA id hashed as LoRA 0 (or LoRA 0
  hashed as no LoRA), the salt id derived from the ``cache_salt`` string by blake3, by sha256
  read big-endian or from the raw UTF-8 bytes instead of WIRE.md 1's sha256 (needs the string),
  the salt mixed into every block instead of the first, the publisher's scope differing from
  the router's;
- the seed: its token-count term missing, or counted twice (V1); a token count in the block
  key (v2);
- blocks: another block size (any size from 1 to twice the expected), the trailing partial
  block hashed, the parent not chained;
- another algorithm (v1 / v2 / the router-side xxh3 content hash), wider token ids (v2).

:func:`explain_event` explains the mismatched blocks of one stored event (the doctor);
:func:`explain_chain` a whole prompt's hashes against a golden file's
(:mod:`events.tools.hashcheck`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from hashlib import sha256
from typing import Final, Literal

from events.wire.model import BlockHash, Stored
from kvcache.hashing import (
    BlockKey,
    HashAlgo,
    chain_hashes,
    hash_from_key,
    root_key,
    v1_block_hash,
    xxh3_content_hash,
)
from kvcache.scope import ReuseScope, cache_salt_id
from kvcache.tokens import token_array, tokens_to_bytes

try:  # TensorRT-LLM's older salt derivation; the diagnosis needs the blake3 package for it
    import blake3 as _blake3
except ImportError:  # pragma: no cover - blake3 is a dependency; a broken install lacks it
    _blake3 = None  # type: ignore[assignment]

BLAKE3: Final[bool] = _blake3 is not None
"""Whether the blake3 salt derivation can be diagnosed (the ``blake3`` package imports)."""

UNEXPLAINED: Final = (
    "unexplained: none of the known drifts (output sign or byte order, salt or LoRA mixing or "
    "derivation, the seed's token count, block size, partial blocks, parent chaining, another "
    "scope or algorithm) reproduces it; compare the engine's hash function with "
    "the V1 hash of WIRE.md 3 (kvcache.hashing.v1_block_hash)"
)

_V1_REF: Final = "WIRE.md 3, kvcache.hashing.v1_block_hash"
_SALT_REF: Final = "kvcache.scope.cache_salt_id, WIRE.md 1"


# The V1 hash's constants and mixing steps (WIRE.md 3; TensorRT-LLM's BlockKeyHasher), from
# which the drifted variants below are built (the hash itself is kvcache._v1hash's).
_M1: Final = 0xBF58476D1CE4E5B9
_M2: Final = 0x94D049BB133111EB
_C32: Final = 0x45D9F3B
_G: Final = 0x9E3779B9
_MASK32: Final = 0xFFFFFFFF
_MASK64: Final = 0xFFFFFFFFFFFFFFFF


def _mix32(a: int, seed: int) -> int:
    a &= _MASK32
    a = (((a >> 16) ^ a) * _C32) & _MASK32
    a = (((a >> 16) ^ a) * _C32) & _MASK32
    a = (a >> 16) ^ a
    # a + G wraps at 32 bits before it is widened; the seed terms wrap at 64 bits.
    return (seed ^ (((a + _G) & _MASK32) + (seed << 6) + (seed >> 2))) & _MASK64


def _mix64(b: int, seed: int) -> int:
    b = ((b ^ (b >> 30)) * _M1) & _MASK64
    b = ((b ^ (b >> 27)) * _M2) & _MASK64
    b = b ^ (b >> 31)
    return (seed ^ (b + _G + (seed << 6) + (seed >> 2))) & _MASK64


@dataclass(frozen=True, slots=True)
class Cause:
    """One known drift: what the engine does, what it should do, and where to fix it."""

    does: str
    should: str
    fix: str

    def __str__(self) -> str:
        return f"{self.does}; it should {self.should} (fix: {self.fix})"


# ------------------------------------------------------------------------- primitives

U64: Final = 1 << 64


def signed64(value: int) -> int:
    """``value`` (an unsigned 64-bit int) read as a two's-complement signed one."""
    return value - U64 if value >= 1 << 63 else value


def bswap64(value: int) -> int:
    """``value`` with its 8 bytes in the other order."""
    return int.from_bytes((value & _MASK64).to_bytes(8, "little"), "big")


def reversed_hash(h: BlockHash) -> BlockHash:
    """A hash with its bytes reversed: a 64-bit int byte-swapped, a hex digest reversed."""
    if isinstance(h, str):
        return bytes(reversed(bytes.fromhex(h))).hex()
    return bswap64(h)


SaltDerivation = tuple[str, str, Callable[[bytes], int]]

SALT_DERIVATIONS: Final[tuple[SaltDerivation, ...]] = (
    (
        "sha256",
        "the first 8 bytes of sha256(cache_salt UTF-8) as a little-endian integer",
        lambda b: int.from_bytes(sha256(b).digest()[:8], "little"),
    ),
    (
        "blake3",
        "the first 8 bytes of blake3(cache_salt UTF-8) as a little-endian integer (TensorRT-LLM's "
        "inputs/utils.py get_cache_salt_id)",
        lambda b: -1 if _blake3 is None else int.from_bytes(_blake3.blake3(b).digest(8), "little"),
    ),
    (
        "sha256-be",
        "the first 8 bytes of sha256(cache_salt UTF-8) read big-endian",
        lambda b: int.from_bytes(sha256(b).digest()[:8], "big"),
    ),
    (
        "raw",
        "the raw UTF-8 bytes of cache_salt (the first 8, zero-padded) as a little-endian integer",
        lambda b: int.from_bytes(b[:8].ljust(8, b"\0"), "little"),
    ),
    (
        "raw-be",
        "the raw UTF-8 bytes of cache_salt (the first 8, zero-padded) read big-endian",
        lambda b: int.from_bytes(b[:8].ljust(8, b"\0"), "big"),
    ),
)
"""(name, what it computes, function of the UTF-8 bytes) for each salt derivation known;
the first is WIRE.md 1's (:func:`kvcache.scope.cache_salt_id`)."""


def salt_variants(cache_salt: str) -> list[tuple[str, str, int]]:
    """(name, description, salt id) of every known derivation other than WIRE.md 1's that
    gives another id for ``cache_salt`` (blake3 only when the package imports)."""
    data = cache_salt.encode("utf-8")
    right = cache_salt_id(cache_salt)
    out = []
    for name, what, derive in SALT_DERIVATIONS[1:]:
        value = derive(data)
        if value >= 0 and value != right:
            out.append((name, what, value))
    return out


def salt_cause(cache_salt: str, name: str, what: str, value: int) -> Cause:
    """The cause for an engine that derives ``cache_salt``'s salt id the ``name`` way."""
    return Cause(
        f"the engine derives the salt id of cache_salt {cache_salt!r} from {what} ({value})",
        f"take {SALT_DERIVATIONS[0][1]} ({cache_salt_id(cache_salt)})",
        f"the engine's cache_salt -> salt id function; reference {_SALT_REF}",
    )


Count = Literal["block", "none", "twice"]


def v1_variant(
    tokens: Sequence[int],
    parent_hash: int,
    lora_id: int | None,
    salt_id: int | None,
    *,
    count: Count = "block",
    salt_every: bool = False,
) -> int:
    """The V1 hash of WIRE.md 3 with one drift in its seed: ``count`` "none" drops the token
    count term, "twice" mixes the count in again (``mix64(len, seed)``) after the XOR;
    ``salt_every`` mixes the salt into every block instead of the first."""
    seed = (parent_hash * _M1) & _MASK64
    if count != "none":
        seed ^= len(tokens)
    if count == "twice":
        seed = _mix64(len(tokens), seed)
    if salt_id is not None and (parent_hash == 0 or salt_every):
        seed = _mix64(salt_id, seed)
    for tok in tokens:
        seed = _mix32(tok, seed)
    if lora_id is not None:
        seed = _mix64(lora_id, seed)
    return seed


def v1_salt_every_block(
    tokens: Sequence[int], parent_hash: int, lora_id: int | None, salt_id: int | None
) -> int:
    """The V1 hash as an engine computes it when it mixes the salt into every block (a known
    bug; WIRE.md 3 mixes it into the first block only)."""
    return v1_variant(tokens, parent_hash, lora_id, salt_id, salt_every=True)


def _key(parent: bytes, tokens: Sequence[int], with_count: bool = False) -> BlockKey:
    body = tokens_to_bytes(token_array(tokens))
    count = len(tokens).to_bytes(4, "little") if with_count else b""
    return BlockKey(sha256(parent + count + body).digest())


def _wide_key(parent: bytes, tokens: Sequence[int]) -> BlockKey:
    return BlockKey(sha256(parent + b"".join(t.to_bytes(8, "little") for t in tokens)).digest())


def _le64(key: bytes) -> BlockHash:
    return int.from_bytes(key[:8], "little")


def _reversed_key_hex(key: bytes) -> BlockHash:
    return bytes(reversed(key)).hex()


# ------------------------------------------------------------------------- the catalog


def _salt_not_mixed() -> Cause:
    return Cause(
        "the salt is not mixed into the first block (the engine ignores cache_salt_id)",
        "mix the salt id into the first block's seed (parent hash 0)",
        f"the engine's block hash seed; reference {_V1_REF}",
    )


def _lora_not_mixed() -> Cause:
    return Cause(
        "the LoRA id is not mixed in (the engine ignores lora_id)",
        "mix the LoRA id into every block after its tokens",
        f"the LoRA term of the engine's block hash; reference {_V1_REF}",
    )


def _lora_none_as_0() -> Cause:
    return Cause(
        "the engine hashes an absent LoRA id (None) as LoRA 0",
        "mix no LoRA term when the request has no adapter (presence is separate from value, "
        "WIRE.md 1)",
        "the LoRA term of the engine's block hash: mix it only when lora_id is not None",
    )


def _lora_0_as_none() -> Cause:
    return Cause(
        "the engine hashes LoRA id 0 as no LoRA (the LoRA id is not mixed in when it is 0)",
        "mix LoRA 0 like any other adapter id (presence is separate from value, WIRE.md 1)",
        "the LoRA term of the engine's block hash: test `lora_id is not None`, not its truth",
    )


def _neither() -> Cause:
    return Cause(
        "neither the salt nor the LoRA id is mixed in",
        "mix the salt into the first block and the LoRA id into every block",
        f"the scope terms of the engine's block hash; reference {_V1_REF}",
    )


def _salt_every() -> Cause:
    return Cause(
        "the salt is mixed into every block, not only the first",
        "mix the salt id only when the parent hash is 0 (the first block)",
        f"the engine's block hash seed; reference {_V1_REF}",
    )


def _parent() -> Cause:
    return Cause(
        "the parent hash is not chained (every block hashed as a first block)",
        "seed each block with its parent's hash (0 only for the first block)",
        "the engine's chaining: pass the previous block's hash as the parent",
    )


def _router_scope() -> Cause:
    return Cause(
        "the publisher's own scope (the event's lora_id / cache_salt_id) differs from the "
        "router's --lora-id / --salt-id",
        "hash under the scope the router computes for the request",
        "the scope one side derives from the request (or the doctor's flags)",
    )


def _count(kind: Count, algo: str) -> Cause:
    if kind == "none":
        return Cause(
            "the engine's seed has no token-count term (seed = parent * M1, not "
            "len(tokens) ^ parent * M1)",
            "start the seed from len(tokens) ^ (parent_hash * M1)",
            f"the seed line of the engine's block hash; reference {_V1_REF}",
        )
    if algo == HashAlgo.V1_BLOCK_KEY.value:
        return Cause(
            "the engine mixes the token count into the seed a second time (mix64(len, seed) "
            "after len(tokens) ^ parent * M1)",
            "count the tokens once: seed = len(tokens) ^ (parent_hash * M1)",
            f"the seed line of the engine's block hash; reference {_V1_REF}",
        )
    return Cause(
        "the engine's block key hashes a 4-byte token count before the tokens",
        "hash sha256(parent_key || tokens as 4-byte LE), no length (WIRE.md 2)",
        "the engine's block key function; reference kvcache.hashing.block_key",
    )


def _byte_order(algo: str) -> Cause:
    if algo == HashAlgo.V2_SHA256_64.value:
        return Cause(
            "the engine reads the block key's first 8 bytes little-endian",
            "read them big-endian: int.from_bytes(key[:8], 'big') (WIRE.md 3)",
            "the engine's key -> hash conversion; reference kvcache.hashing.hash_from_key",
        )
    return Cause(
        "the engine writes each hash with its bytes reversed (the other byte order)",
        f"publish the {algo} value itself as an unsigned 64-bit integer (WIRE.md 3)",
        "the engine's hash -> int conversion (int.from_bytes / struct byte order)",
    )


def signed_output() -> Cause:
    """The cause for hashes returned as signed 64-bit ints."""
    return Cause(
        "the engine returns its hashes as signed 64-bit ints (negative above 2**63)",
        "return them unsigned: h & 0xFFFFFFFFFFFFFFFF (WIRE.md 3 hashes are unsigned)",
        "the engine's hash -> int conversion (an int64 view, ctypes.c_int64 or numpy int64)",
    )


def _block_size(size: int, expected: int) -> Cause:
    return Cause(
        f"another block size: the hashes are of {size}-token blocks, not {expected}",
        f"hash blocks of {expected} tokens, the block size the router uses",
        "the block size the engine's hasher splits tokens by (tokens_per_block / block_size)",
    )


def _partial(tokens: int, expected: int) -> Cause:
    return Cause(
        f"the engine hashes the trailing partial block ({tokens} of {expected} tokens) too",
        "hash full blocks only, as routers do",
        "the engine's loop over blocks: range(0, len(tokens) - len(tokens) % block_size, "
        "block_size)",
    )


def _other_algo(other: str, algo: str) -> Cause:
    return Cause(
        f"another algorithm: the hashes are {other}, not {algo}",
        f"hash with {algo}, or announce hash_algo {other} and configure the router with it",
        "the engine's hash_algo setting (or the router's --hash-algo)",
    )


def _wide_tokens() -> Cause:
    return Cause(
        "the token ids are serialized as 8-byte ints, not 4-byte (a token-id type change)",
        "serialize token ids as 4-byte little-endian ints (WIRE.md 2)",
        "the engine's block key function; reference kvcache.hashing.block_key",
    )


# ----------------------------------------------------------------- one stored event


@dataclass(slots=True)
class EventContext:
    """One stored event whose blocks ``mismatched`` (indexes into ``data.blocks``) did not
    recompute under ``scopes`` (each block's scope as checked) with ``algo``."""

    algo: HashAlgo
    data: Stored
    mismatched: list[int]
    scopes: list[ReuseScope]
    #: the parent's block key when known (v2 chains); ignored for a chain from the root
    parent_key: BlockKey | None = None
    #: the router imposed ``scopes`` (so each block's own announced scope is a hypothesis)
    router_scope: bool = False
    #: cache_salt strings the request may have used (for the salt derivation causes)
    salts: Sequence[str] = ()
    expected_size: int | None = None
    announced: list[ReuseScope] = field(default_factory=list)


Prediction = list[BlockHash | None]


def _v1_predict(
    ctx: EventContext,
    scope_of: Callable[[ReuseScope], ReuseScope | None] = lambda s: s,
    *,
    chained: bool = True,
    count: Count = "block",
    salt_every: bool = False,
    out: Callable[[int], BlockHash] | None = None,
    inp: Callable[[int], int] | None = None,
    scopes: list[ReuseScope] | None = None,
) -> Prediction:
    """Each block's V1 hash under a drift, chained from the parents as published (``inp``
    turns a published hash back into the engine's internal value, ``out`` the other way)."""
    preds: Prediction = []
    parent = ctx.data.parent_hash
    for i, blk in enumerate(ctx.data.blocks):
        scope = scope_of((scopes or ctx.scopes)[i])
        if scope is None or not isinstance(parent, int | None):
            preds.append(None)
        else:
            p = 0 if parent is None or not chained else parent
            if p and inp is not None:
                p = inp(p)
            if count == "block" and not salt_every:
                h = v1_block_hash(blk.tokens, p, scope.lora_id, scope.salt)
            else:
                h = v1_variant(
                    list(blk.tokens), p, scope.lora_id, scope.salt, count=count,
                    salt_every=salt_every,
                )  # fmt: skip
            preds.append(h if out is None else out(h))
        parent = blk.block_hash
    return preds


def _v2_predict(
    ctx: EventContext,
    out: Callable[[bytes], BlockHash],
    scope_of: Callable[[ReuseScope], ReuseScope | None] = lambda s: s,
    *,
    chained: bool = True,
    count: bool = False,
    wide: bool = False,
) -> Prediction:
    """Each block's key-derived hash under a drift; a chain not from the root needs the
    parent's key (and no scope change, which would need the keys from the root)."""
    blocks = ctx.data.blocks
    if ctx.data.parent_hash is None:
        scope = scope_of(ctx.scopes[0])
        parent = None if scope is None else root_key(scope)
    else:
        parent = ctx.parent_key if scope_of(ctx.scopes[0]) == ctx.scopes[0] else None
    if parent is None:
        return [None] * len(blocks)
    root = parent
    preds: Prediction = []
    for blk in blocks:
        if wide:
            key = _wide_key(parent, blk.tokens)
        else:
            key = _key(parent if chained else root, blk.tokens, count)
        preds.append(out(key))
        parent = key
    return preds


def _chunk_predict(ctx: EventContext, size: int) -> Prediction:
    """A chain from the root whose hashes cover ``size``-token chunks of the event's tokens."""
    if ctx.data.parent_hash is not None:
        return [None] * len(ctx.data.blocks)
    tokens = [t for blk in ctx.data.blocks for t in blk.tokens]
    chain = chain_hashes(tokens[: len(tokens) - len(tokens) % size], size, ctx.scopes[0], ctx.algo)
    return [chain[i] if i < len(chain) else None for i in range(len(ctx.data.blocks))]


def _reproduces(preds: Prediction, ctx: EventContext, partial: bool) -> bool:
    """Every mismatched block's hash is predicted (``partial``: at least half of them, the
    rest unknown), and never a prediction that is wrong."""
    known = 0
    for i in ctx.mismatched:
        want = preds[i]
        if want is None:
            continue
        if want != ctx.data.blocks[i].block_hash:
            return False
        known += 1
    need = (len(ctx.mismatched) + 1) // 2 if partial else len(ctx.mismatched)
    return known >= max(1, need)


def _with_salt(salt: int) -> Callable[[ReuseScope], ReuseScope]:
    return lambda s: ReuseScope(s.lora_id, salt)


Hypothesis = tuple[Callable[[], Cause], Callable[[], Prediction], bool]


def _event_hypotheses(ctx: EventContext) -> list[Hypothesis]:
    algo = ctx.algo.value
    v1 = ctx.algo is HashAlgo.V1_BLOCK_KEY
    out: list[Hypothesis] = []

    def predict(**kw: object) -> Callable[[], Prediction]:
        if v1:
            return lambda: _v1_predict(ctx, **kw)  # type: ignore[arg-type]
        return lambda: _v2_predict(ctx, lambda k: hash_from_key(ctx.algo, k), **kw)  # type: ignore[arg-type]

    def add(
        cause: Callable[[], Cause], fn: Callable[[], Prediction], partial: bool = False
    ) -> None:
        out.append((cause, fn, partial))

    # another algorithm first: a whole family of mismatches at once
    if v1:
        for other in (HashAlgo.V2_SHA256_64, HashAlgo.V2_SHA256):
            add(
                lambda o=other: _other_algo(o.value, algo),  # type: ignore[misc]
                lambda o=other: _v2_predict(ctx, lambda k: hash_from_key(o, k)),  # type: ignore[misc]
            )
    else:
        add(lambda: _other_algo(HashAlgo.V1_BLOCK_KEY.value, algo), lambda: _v1_predict(ctx))
        for other in (HashAlgo.V2_SHA256_64, HashAlgo.V2_SHA256):
            if other is not ctx.algo:
                add(
                    lambda o=other: _other_algo(o.value, algo),  # type: ignore[misc]
                    lambda o=other: _v2_predict(ctx, lambda k: hash_from_key(o, k)),  # type: ignore[misc]
                )
    add(
        _salt_not_mixed,
        predict(scope_of=lambda s: ReuseScope(s.lora_id) if s.salt is not None else None),
    )
    add(
        _lora_0_as_none,
        predict(scope_of=lambda s: ReuseScope(None, s.salt) if s.lora_id == 0 else None),
    )
    add(
        _lora_none_as_0,
        predict(scope_of=lambda s: ReuseScope(0, s.salt) if s.lora_id is None else None),
    )
    add(
        _lora_not_mixed,
        predict(scope_of=lambda s: ReuseScope(None, s.salt) if s.lora_id else None),
    )
    add(
        _neither,
        predict(
            scope_of=lambda s: (
                ReuseScope() if s.lora_id is not None and s.salt is not None else None
            )
        ),
    )
    for text in ctx.salts:
        for name, what, value in salt_variants(text):
            add(
                lambda t=text, n=name, w=what, v=value: salt_cause(t, n, w, v),  # type: ignore[misc]
                predict(scope_of=_with_salt(value)),
            )
    if v1:
        add(_salt_every, lambda: _v1_predict(ctx, salt_every=True))
    add(_parent, predict(chained=False))
    if ctx.router_scope and ctx.announced and v1:
        add(_router_scope, lambda: _v1_predict(ctx, scopes=ctx.announced))
    if v1:
        add(lambda: _count("none", algo), lambda: _v1_predict(ctx, count="none"))
        add(lambda: _count("twice", algo), lambda: _v1_predict(ctx, count="twice"))
        add(lambda: _byte_order(algo), lambda: _v1_predict(ctx, out=bswap64, inp=bswap64))
    else:
        add(lambda: _count("twice", algo), predict(count=True))
        reverse = _le64 if ctx.algo is HashAlgo.V2_SHA256_64 else _reversed_key_hex
        add(lambda: _byte_order(algo), lambda: _v2_predict(ctx, reverse))
        add(_wide_tokens, lambda: _v2_predict(ctx, lambda k: hash_from_key(ctx.algo, k), wide=True))
    expected = ctx.expected_size or max(len(b.tokens) for b in ctx.data.blocks)
    for size in range(1, 2 * expected + 1):
        if size != expected:
            add(
                lambda s=size: _block_size(s, expected),  # type: ignore[misc]
                lambda s=size: _chunk_predict(ctx, s),  # type: ignore[misc]
                partial=size > expected,
            )
    add(
        lambda: _other_algo("xxh3_content (the router-side content hash, seed 1337)", algo),
        lambda: [xxh3_content_hash(b.tokens) for b in ctx.data.blocks],
    )
    return out


def explain_event(ctx: EventContext, first: Cause | None = None) -> Cause | None:
    """The known drift that reproduces every mismatched block of one stored event (tried
    after ``first``, a cause that explained this worker's earlier events), or None."""
    hypotheses = _event_hypotheses(ctx)
    if first is not None:
        hypotheses.sort(key=lambda h: h[0]() != first)
    for cause, predict, partial in hypotheses:
        if _reproduces(predict(), ctx, partial):
            return cause()
    return None


# --------------------------------------------------------------------- whole-chain drift

XXH3_CONTENT: Final = "xxh3_content"
"""Golden-file name of the router-side content hash (:func:`kvcache.hashing.xxh3_content_hash`):
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


def partial_hash(
    algo: str, tokens: Sequence[int], tokens_per_block: int, scope: ReuseScope
) -> BlockHash | None:
    """The hash the trailing partial block of ``tokens`` gets when an engine hashes it too
    (over its own tokens, chained to the last full block), or None when there is none."""
    tail = len(tokens) % tokens_per_block
    if not tail:
        return None
    rest = list(tokens[len(tokens) - tail :])
    if algo == XXH3_CONTENT:
        return xxh3_content_hash(rest)
    parsed = HashAlgo.parse(algo)
    full = reference_chain(algo, tokens, tokens_per_block, scope)
    if parsed is HashAlgo.V1_BLOCK_KEY:
        parent = full[-1] if full else 0
        assert isinstance(parent, int)
        return v1_block_hash(rest, parent, scope.lora_id, scope.salt)
    key = root_key(scope)
    for i in range(0, len(tokens) - tail, tokens_per_block):
        key = _key(key, tokens[i : i + tokens_per_block])
    return hash_from_key(parsed, _key(key, rest))


def _chain(
    algo: str,
    tokens: Sequence[int],
    tpb: int,
    scope: ReuseScope,
    *,
    count: Count = "block",
    salt_every: bool = False,
    chained: bool = True,
    out: Callable[[BlockHash], BlockHash] | None = None,
) -> list[BlockHash]:
    """A whole prompt's hashes under one drift of the seed, the chaining or the output."""
    chunks = [tokens[i : i + tpb] for i in range(0, len(tokens) - len(tokens) % tpb, tpb)]
    hashes: list[BlockHash] = []
    if algo == HashAlgo.V1_BLOCK_KEY.value:
        parent = 0
        for chunk in chunks:
            h = v1_variant(
                list(chunk), parent if chained else 0, scope.lora_id, scope.salt, count=count,
                salt_every=salt_every,
            )  # fmt: skip
            parent = h
            hashes.append(h if out is None else out(h))
        return hashes
    root = key = root_key(scope)
    for chunk in chunks:
        key = _key(key if chained else root, chunk, count == "twice")
        derived = hash_from_key(algo, key)
        hashes.append(derived if out is None else out(derived))
    return hashes


def _wide_token_chain(
    algo: str, tokens: Sequence[int], tokens_per_block: int, scope: ReuseScope
) -> list[BlockHash]:
    """A v2 chain whose block keys hash token ids as 8-byte ints (a token-id type change)."""
    parent = root_key(scope)
    out: list[BlockHash] = []
    full = len(tokens) - len(tokens) % tokens_per_block
    for i in range(0, full, tokens_per_block):
        parent = _wide_key(parent, tokens[i : i + tokens_per_block])
        out.append(hash_from_key(algo, parent))
    return out


def _byte_reversed_chain(
    algo: str, tokens: Sequence[int], tpb: int, scope: ReuseScope
) -> list[BlockHash]:
    if algo == HashAlgo.V2_SHA256_64.value:
        keys = []
        key = root_key(scope)
        for i in range(0, len(tokens) - len(tokens) % tpb, tpb):
            key = _key(key, tokens[i : i + tpb])
            keys.append(_le64(key))
        return keys
    return [reversed_hash(h) for h in reference_chain(algo, tokens, tpb, scope)]


def _hypotheses(
    algo: str, tokens: Sequence[int], tpb: int, scope: ReuseScope, cache_salt: str | None
) -> list[tuple[Cause, Callable[[], list[BlockHash]]]]:
    """(cause, chain under that cause) pairs, the most frequent causes first; chains are
    computed lazily so a drift explained early costs little."""
    salt, lora = scope.salt, scope.lora_id
    v1 = algo == HashAlgo.V1_BLOCK_KEY.value
    keyed = algo in (HashAlgo.V2_SHA256.value, HashAlgo.V2_SHA256_64.value)

    def ref(s: ReuseScope) -> Callable[[], list[BlockHash]]:
        return lambda: reference_chain(algo, tokens, tpb, s)

    out: list[tuple[Cause, Callable[[], list[BlockHash]]]] = []
    if salt is not None:
        cause = _salt_not_mixed()
        out.append(
            (
                Cause(
                    "the salt is not mixed in (the hashes are the same scope's without its salt)",
                    cause.should,
                    cause.fix,
                ),
                ref(ReuseScope(lora, None)),
            )
        )
    if lora == 0:
        out.append((_lora_0_as_none(), ref(ReuseScope(None, salt))))
    if lora is None and algo != XXH3_CONTENT:
        out.append((_lora_none_as_0(), ref(ReuseScope(0, salt))))
    if lora is not None:
        cause = _lora_not_mixed()
        out.append(
            (
                Cause(
                    "the LoRA id is not mixed in (the hashes are the same scope's without it)",
                    cause.should,
                    cause.fix,
                ),
                ref(ReuseScope(None, salt)),
            )
        )
    if salt is not None and lora is not None:
        out.append((_neither(), ref(ReuseScope())))
    if cache_salt is not None and algo != XXH3_CONTENT:
        for name, what, value in salt_variants(cache_salt):
            out.append((salt_cause(cache_salt, name, what, value), ref(ReuseScope(lora, value))))
    if v1 and salt is not None:
        out.append((_salt_every(), lambda: _chain(algo, tokens, tpb, scope, salt_every=True)))
    if algo != XXH3_CONTENT:
        cause = _parent()
        out.append(
            (
                Cause(
                    "the parent chain is broken: every block is hashed as a first block",
                    cause.should,
                    cause.fix,
                ),
                lambda: _chain(algo, tokens, tpb, scope, chained=False),
            )
        )
    if v1:
        out.append((_count("none", algo), lambda: _chain(algo, tokens, tpb, scope, count="none")))
    if v1 or keyed:
        out.append((_count("twice", algo), lambda: _chain(algo, tokens, tpb, scope, count="twice")))
    out.append((_byte_order(algo), lambda: _byte_reversed_chain(algo, tokens, tpb, scope)))
    sizes = {*range(1, 2 * tpb + 1), *_BLOCK_SIZES} - {tpb}
    for size in sorted(sizes):
        if size <= len(tokens):
            out.append(
                (
                    _block_size(size, tpb),
                    lambda size=size: reference_chain(algo, tokens, size, scope),  # type: ignore[misc]
                )
            )
    for other in KNOWN_ALGOS:
        if other != algo:
            out.append(
                (
                    _other_algo(other, algo),
                    lambda other=other: reference_chain(other, tokens, tpb, scope),  # type: ignore[misc]
                )
            )
    if keyed:
        out.append((_wide_tokens(), lambda: _wide_token_chain(algo, tokens, tpb, scope)))
    return out


def explain_chain(
    algo: str,
    tokens: Sequence[int],
    tokens_per_block: int,
    scope: ReuseScope,
    expected: Sequence[BlockHash],
    actual: Sequence[BlockHash],
    cache_salt: str | None = None,
) -> str:
    """Why the hashes ``actual`` of a whole prompt differ from the golden ``expected`` ones.

    Each known drift is replayed over the whole prompt; the first whose hashes begin with
    ``actual`` is named (``actual`` may be shorter than the prompt's chain: a capture that
    holds only its first blocks). ``cache_salt``, the request's salt string when known, lets
    the salt derivations be tried. Returns :data:`UNEXPLAINED` when nothing reproduces them;
    an ``algo`` this project does not know cannot be diagnosed.
    """
    got, want = list(actual), list(expected)
    if got == want:
        return "no drift"
    if algo in KNOWN_ALGOS and any(isinstance(h, int) and h < 0 for h in got):
        folded = [h % U64 if isinstance(h, int) else h for h in got]
        if (
            folded == want[: len(folded)]
            or folded == reference_chain(algo, tokens, tokens_per_block, scope)[: len(folded)]
        ):
            return str(signed_output())
    if got and got == want[: len(got)]:
        return f"missing blocks: only the first {len(got)} of {len(want)} blocks have hashes"
    if want and got[: len(want)] == want:
        extra = len(got) - len(want)
        if algo in KNOWN_ALGOS and extra == 1:
            tail = partial_hash(algo, tokens, tokens_per_block, scope)
            if tail is not None and got[-1] == tail:
                return f"extra blocks: {_partial(len(tokens) % tokens_per_block, tokens_per_block)}"
        return f"extra blocks: {extra} more hashes than the golden file has"
    if algo not in KNOWN_ALGOS:
        return f"unexplained: {algo} is not one of this project's algorithms ({UNEXPLAINED})"
    if not got:
        return "no hashes at all"
    n = len(got)
    reference = reference_chain(algo, tokens, tokens_per_block, scope)
    if reference[:n] == got and len(reference) >= n:
        # the new hashes are right: the golden ones were made some other way
        why = (
            explain_chain(algo, tokens, tokens_per_block, scope, got, want, cache_salt)
            if want
            else ""
        )
        return (
            f"the hashes are this library's {algo} for the case's tokens and scope; the golden "
            f"values are not" + (f" (they look like: {why})" if why != UNEXPLAINED else "")
        )
    for cause, chain in _hypotheses(algo, tokens, tokens_per_block, scope, cache_salt):
        candidate = chain()
        if len(candidate) >= n and candidate[:n] == got:
            return str(cause)
        # bigger blocks give fewer hashes: the prompt's own are the first ones found
        bigger = cause.does.startswith("another block size") and 0 < len(candidate) < n
        if bigger and got[: len(candidate)] == candidate:
            return str(cause)
    return UNEXPLAINED

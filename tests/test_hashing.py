"""Event block hashes: golden vectors of WIRE.md 3, native == reference, scope mixing rules."""

from __future__ import annotations

import json
from array import array
from pathlib import Path
from typing import Any

import pytest
from _reference import v1_block_hash as v1_block_hash_ref
from _reference import v1_chain as v1_chain_ref
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.hashing import (
    HashAlgo,
    blockchain_keys,
    chain_hashes,
    hash_from_key,
    v1_block_hash,
    v1_chain,
    xxh3_content_hash,
)
from kvcache.scope import ReuseScope
from kvcache.tokens import token_array

VECTORS: dict[str, Any] = json.loads(
    (Path(__file__).parent / "data" / "v1_hash_vectors.json").read_text()
)

U64_MAX = 2**64 - 1
TOKEN_MAX = 2**31 - 1
tokens_st = st.lists(
    st.one_of(st.integers(0, TOKEN_MAX), st.integers(TOKEN_MAX - 1000, TOKEN_MAX)), max_size=80
)
u64_st = st.one_of(st.integers(0, U64_MAX), st.integers(U64_MAX - 1000, U64_MAX), st.just(0))
opt_u64_st = st.one_of(st.none(), u64_st)


def _scope(d: dict[str, int | None]) -> ReuseScope:
    return ReuseScope(lora_id=d["lora_id"], salt=d["salt"])


# --- golden vectors ---------------------------------------------------------------------------


@pytest.mark.parametrize("fn", [v1_block_hash, v1_block_hash_ref], ids=["public", "reference"])
@pytest.mark.parametrize("vec", VECTORS["v1_block"], ids=lambda v: str(v["hash"]))
def test_v1_block_vectors(fn: Any, vec: dict[str, Any]) -> None:
    got = fn(vec["tokens"], vec["parent_hash"], vec["lora_id"], vec["salt_id"])
    assert got == vec["hash"]


@pytest.mark.parametrize("vec", VECTORS["v1_chain"], ids=lambda v: str(v["scope"]))
def test_v1_chain_vectors(vec: dict[str, Any]) -> None:
    scope = _scope(vec["scope"])
    assert v1_chain(vec["tokens"], vec["tokens_per_block"], scope) == vec["hashes"]
    assert v1_chain_ref(vec["tokens"], vec["tokens_per_block"], scope) == vec["hashes"]
    assert chain_hashes(vec["tokens"], vec["tokens_per_block"], scope) == vec["hashes"]


@pytest.mark.parametrize("vec", VECTORS["v2_sha256_keys"], ids=lambda v: str(v["scope"]))
def test_v2_vectors_derive_from_block_keys(vec: dict[str, Any]) -> None:
    scope = _scope(vec["scope"])
    keys = vec["full_block_keys"]
    assert chain_hashes(vec["tokens"], vec["tokens_per_block"], scope, "v2_sha256") == keys
    assert chain_hashes(vec["tokens"], vec["tokens_per_block"], scope, "v2_sha256_64") == [
        int(k[:16], 16) for k in keys
    ]


def test_xxh3_content_vector() -> None:
    for vec in VECTORS["xxh3_64_content"]:
        assert xxh3_content_hash(vec["tokens"], vec["seed"]) == vec["hash"]


# --- scope mixing -----------------------------------------------------------------------------


def test_salt_enters_the_first_block_only_and_lora_every_block() -> None:
    toks = list(range(8))
    salted = v1_chain(toks, 4, ReuseScope(salt=123))
    # block 0 mixes the salt; block 1 chains from block 0 and does not mix it again
    assert salted[0] == v1_block_hash(toks[:4], 0, None, 123)
    assert salted[1] == v1_block_hash(toks[4:], salted[0], None, None)
    assert salted[1] == v1_block_hash(toks[4:], salted[0], None, 123)
    lora = v1_chain(toks, 4, ReuseScope(lora_id=5))
    assert lora[1] == v1_block_hash(toks[4:], lora[0], 5, None)
    assert lora[1] != v1_block_hash(toks[4:], lora[0], None, None)


def test_presence_differs_from_value_zero() -> None:
    toks = [9, 8, 7, 6]
    plain, lora0, salt0 = (
        v1_chain(toks, 4, ReuseScope()),
        v1_chain(toks, 4, ReuseScope(lora_id=0)),
        v1_chain(toks, 4, ReuseScope(salt=0)),
    )
    assert len({plain[0], lora0[0], salt0[0]}) == 3


def test_the_32_bit_wrap_of_mix32_matters() -> None:
    # Token 0xFFFFFFFF-ish values push a + G over 2**32; widening before the add would differ.
    toks = [TOKEN_MAX, TOKEN_MAX - 1]
    ref = v1_block_hash_ref(toks)
    seed = len(toks)
    for tok in toks:
        a = tok
        a = (((a >> 16) ^ a) * 0x45D9F3B) & 0xFFFFFFFF
        a = (((a >> 16) ^ a) * 0x45D9F3B) & 0xFFFFFFFF
        a = (a >> 16) ^ a
        seed = (seed ^ (a + 0x9E3779B9 + (seed << 6) + (seed >> 2))) & U64_MAX  # no 32-bit wrap
    assert ref != seed


def test_partial_tail_has_no_hash() -> None:
    assert v1_chain(list(range(10)), 4) == v1_chain(list(range(8)), 4)
    assert v1_chain([1, 2, 3], 4) == []
    assert len(chain_hashes(list(range(10)), 4, None, HashAlgo.V2_SHA256)) == 2


# --- native agrees with the reference ----------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(tokens=tokens_st, parent=u64_st, lora=opt_u64_st, salt=opt_u64_st)
def test_native_block_hash_matches_reference(
    tokens: list[int], parent: int, lora: int | None, salt: int | None
) -> None:
    want = v1_block_hash_ref(tokens, parent, lora, salt)
    assert v1_block_hash(tokens, parent, lora, salt) == want
    assert v1_block_hash(token_array(tokens).tobytes(), parent, lora, salt) == want


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, TOKEN_MAX), max_size=300),
    tpb=st.integers(1, 40),
    lora=opt_u64_st,
    salt=opt_u64_st,
)
def test_native_chain_matches_reference(
    tokens: list[int], tpb: int, lora: int | None, salt: int | None
) -> None:
    scope = ReuseScope(lora, salt)
    want = v1_chain_ref(tokens, tpb, scope)
    arr = token_array(tokens)
    assert v1_chain(tokens, tpb, scope) == want
    assert v1_chain(arr, tpb, scope) == want
    assert v1_chain(memoryview(arr.tobytes()), tpb, scope) == want


def test_native_chain_of_a_long_prompt_without_the_gil() -> None:
    tokens = [(i * 2654435761) % (TOKEN_MAX + 1) for i in range(70_000)]  # above the GIL cutoff
    scope = ReuseScope(3, 2**64 - 5)
    assert v1_chain(token_array(tokens), 64, scope) == v1_chain_ref(tokens, 64, scope)


# --- validation -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tokens",
    [
        [1, -1],
        [2**31],
        [3, 2**70],
        (1, -1),
        array("i", [5, -2]),
        array("i", [1, 2, 3, 4, 5, -9]).tobytes(),
    ],
    ids=["list-negative", "list-too-big", "list-huge", "tuple", "array-negative", "bytes-negative"],
)
def test_out_of_range_tokens_are_rejected(tokens: Any) -> None:
    with pytest.raises(ValueError, match=r"\[0, 2\*\*31\)"):
        v1_chain(tokens, 2)
    with pytest.raises(ValueError, match=r"\[0, 2\*\*31\)"):
        v1_block_hash(tokens)


def test_bad_arguments_are_rejected_with_clear_errors() -> None:
    with pytest.raises(ValueError, match="whole 4-byte"):
        v1_chain(b"\x01\x00\x00", 1)
    with pytest.raises(TypeError, match="token ids must be ints"):
        v1_block_hash([1, "2"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="token ids must be ints"):
        v1_chain([1, 2.0], 1)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="parent_hash"):
        v1_block_hash([1], parent_hash=2**64)
    with pytest.raises(ValueError, match="lora_id"):
        v1_block_hash([1], lora_id=-1)
    with pytest.raises(TypeError, match="salt_id"):
        v1_block_hash([1], salt_id=True)
    with pytest.raises(ValueError, match="tokens_per_block"):
        v1_chain([1, 2], 0)
    with pytest.raises(ValueError, match=r"unknown hash_algo 'v3'.*v1_block_key"):
        chain_hashes([1], 1, None, "v3")
    with pytest.raises(ValueError, match="use v1_block_hash"):
        hash_from_key("v1_block_key", bytes(32))
    with pytest.raises(ValueError, match="32 bytes"):
        hash_from_key("v2_sha256", bytes(8))


def test_hash_from_key_matches_block_keys() -> None:
    key = blockchain_keys(ReuseScope(), [0, 1, 2, 3], 4)[0]
    assert hash_from_key(HashAlgo.V2_SHA256, key) == key.hex()
    assert hash_from_key("v2_sha256_64", key) == int.from_bytes(key[:8], "big")
    assert HashAlgo("v1_block_key") is HashAlgo.V1_BLOCK_KEY == "v1_block_key"


def test_a_bool_is_not_a_token_id() -> None:
    """``True`` packs as 1, but it is not a token id: the hashing refuses it, as kvcache does."""
    for tokens in ([1, True, 3], [False]):
        with pytest.raises(TypeError, match=r"bool|ints"):
            v1_block_hash(tokens)
        with pytest.raises(TypeError, match=r"bool|ints"):
            v1_chain(tokens, 1)
        with pytest.raises(TypeError, match=r"bool|ints"):
            chain_hashes(tokens, 1, ReuseScope())


# The names events.hashing and kvcache.keys exported before every block hash moved down to
# kvcache.hashing (and the token arrays to kvcache.tokens): old imports keep working.
OLD_EVENTS_HASHING = (
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
)
OLD_KVCACHE_KEYS = (
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
)


def test_old_modules_re_export_the_moved_names() -> None:
    import events.hashing
    import kvcache.hashing
    import kvcache.keys
    import kvcache.tokens

    for name in OLD_EVENTS_HASHING:
        assert getattr(events.hashing, name) is getattr(kvcache.hashing, name), name
    assert set(events.hashing.__all__) == set(OLD_EVENTS_HASHING)
    for name in OLD_KVCACHE_KEYS:
        home = kvcache.tokens if hasattr(kvcache.tokens, name) else kvcache.hashing
        assert getattr(kvcache.keys, name) is getattr(home, name), name
    assert set(kvcache.keys.__all__) == set(OLD_KVCACHE_KEYS)
    # every block hash is defined in the one module
    for name in ("root_key", "block_key", "chain_keys", "blockchain_keys", "chain_hashes"):
        assert getattr(kvcache.hashing, name).__module__ == "kvcache.hashing", name
    assert kvcache.hashing.HashAlgo.__module__ == "kvcache.hashing"

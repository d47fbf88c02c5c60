"""Chain keying (``kvcache.keys.chain_keys``): one call keys a run of blocks, natively where the
CPU has SHA-NI (``kvcache._tokens.chain_keys``) and with hashlib elsewhere
(``chain_keys_py``, the reference). Both must give WIRE.md's keys, SHA-256's published
vectors, and each other's results on any input, and refuse the same bad arguments."""

from __future__ import annotations

from array import array
from collections.abc import Callable
from hashlib import sha256
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcache.tree as tree_module
from kvcache import KVCacheManager, KVCacheManagerConfig, ReuseScope, TierConfig, root_key
from kvcache.keys import chain_keys, chain_keys_py
from kvcache.tree import Block, RadixTree

try:
    from kvcache._tokens import chain_keys as native_chain_keys
except ImportError:  # pragma: no cover - depends on the install and the CPU
    native_chain_keys = None  # type: ignore[assignment]

needs_native = pytest.mark.skipif(
    native_chain_keys is None, reason="kvcache._tokens.chain_keys needs the build and SHA-NI"
)
ChainKeys = Callable[[bytes, bytes, int, int, int], list[Any]]
IMPLS: list[Any] = [
    pytest.param(chain_keys_py, id="pure"),
    pytest.param(native_chain_keys, id="native", marks=needs_native),
]


def le(tokens: list[int]) -> bytes:
    return b"".join(t.to_bytes(4, "little") for t in tokens)


@pytest.mark.parametrize("impl", IMPLS)
def test_wire_md_block_key_vectors(impl: ChainKeys) -> None:
    """WIRE.md section 2, tokens_per_block = 4: two full blocks under the default scope."""
    root = root_key(ReuseScope())
    keys = impl(root, le(list(range(8))), 0, 16, 2)
    assert [k.hex() for k in keys] == [
        "7b894451a88bc03088bd0c44f01139922b089a1ab691d157c273185c78ca83b2",
        "181684b4f09a9fc1689624a565bc5c9ed96cede3e0863cf373463b1a93c45369",
    ]
    # the partial block [8, 9] chains from the second key: a run of one 8-byte block
    (partial,) = impl(keys[1], le([8, 9]), 0, 8, 1)
    assert partial.hex() == "bce38df8ba29204a4e3b070bd62b78b7ff8a60a3be4e57634620c537ca8fb069"
    scoped = impl(root_key(ReuseScope(7, 11)), le([0, 1, 2, 3]), 0, 16, 1)
    assert scoped[0].hex() == "9b0fd0e09150ccecc056c02607ac5a1102556d12560862529f46bd5fe9d443bb"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    ("message", "digest"),
    [
        # FIPS 180-2 appendix B: one block, two blocks (the padding spills over), many blocks
        (b"abc", "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"),
        (
            b"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq",
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1",
        ),
        (b"a" * 1_000_000, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0"),
    ],
)
def test_sha256_published_vectors(impl: ChainKeys, message: bytes, digest: str) -> None:
    """With an empty parent key the first key is plain SHA-256 of the block."""
    assert impl(b"", message, 0, len(message), 1)[0].hex() == digest
    # the same message cut at an odd offset of a longer buffer
    assert impl(b"", b"xyz" + message, 3, len(message), 1)[0].hex() == digest


def reference(parent: bytes, data: bytes, start: int, step: int, count: int) -> list[bytes]:
    """The chain written out from WIRE.md section 2 (hashlib over each concatenation)."""
    out = []
    for i in range(count):
        parent = sha256(parent + data[start + i * step : start + (i + 1) * step]).digest()
        out.append(parent)
    return out


@needs_native
@settings(max_examples=300, deadline=None)
@given(
    parent=st.binary(max_size=80),
    step=st.integers(1, 300),
    count=st.integers(0, 6),
    start=st.integers(0, 70),
    extra=st.integers(0, 70),
    seed=st.binary(min_size=1, max_size=64),
)
def test_native_equals_the_reference(
    parent: bytes, step: int, count: int, start: int, extra: int, seed: bytes
) -> None:
    """Every length around SHA-256's 64-byte blocks and its 56-byte padding limit, any parent
    key length, any offset (unaligned reads), data running past the run."""
    size = start + step * count + extra
    data = (seed * (size // len(seed) + 1))[:size]
    want = reference(parent, data, start, step, count)
    assert native_chain_keys(parent, data, start, step, count) == want
    assert chain_keys_py(parent, data, start, step, count) == want


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    ("start", "step", "count"),
    [(-1, 4, 1), (0, 0, 1), (0, 4, -1), (0, 4, 3), (5, 4, 2), (9, 1, 1), (0, 2**62, 2)],
)
def test_runs_past_the_data_are_refused(impl: ChainKeys, start: int, step: int, count: int) -> None:
    """Eight bytes of data: a run that does not fit, a negative offset or count, an empty
    block: ValueError, the same message on both paths (no read past the buffer)."""
    with pytest.raises(ValueError, match=rf"chain_keys: {count} blocks of {step} bytes"):
        impl(b"k" * 32, bytes(8), start, step, count)


@needs_native
def test_native_takes_any_bytes_like_and_nothing_else() -> None:
    data = le(list(range(8)))
    want = reference(b"p", data, 0, 16, 2)
    assert native_chain_keys(b"p", memoryview(data), 0, 16, 2) == want
    assert native_chain_keys(bytearray(b"p"), bytearray(data), 0, 16, 2) == want
    with pytest.raises(TypeError):
        native_chain_keys("p", data, 0, 16, 2)  # type: ignore[arg-type]


def test_the_tree_keys_committed_blocks_as_the_wire_format_says() -> None:
    """Through the manager (whichever path ``chain_keys`` is): a commit of three full blocks,
    a second commit extending the chain, and a partial block, each keyed from its parent."""
    cfg = KVCacheManagerConfig(tokens_per_block=4, tiers=[TierConfig(name="device", num_blocks=8)])
    mgr = KVCacheManager(cfg)
    seq = mgr.create_kv_cache([0, 1, 2, 3, 4])
    seq.commit(range(12))
    seq.commit(range(12, 18))
    seq.stop_committing()
    keys = {tuple(b.tokens): b.key for b in mgr.iter_blocks()}
    tokens = list(range(18))
    want = reference(root_key(ReuseScope()), le(tokens[:16]), 0, 16, 4)
    want += reference(want[-1], le(tokens[16:]), 0, 8, 1)
    assert [keys[tuple(tokens[i : i + 4])] for i in range(0, 18, 4)] == want
    assert chain_keys is (chain_keys_py if native_chain_keys is None else native_chain_keys)


def test_partial_blocks_are_keyed_over_their_tokens() -> None:
    """RadixTree.attach_partial: a partial block's key is the chain step over its actual
    tokens (WIRE.md section 2: no padding, no length); an empty block is refused before
    anything changes (a tree block holds at least one token)."""
    tree = RadixTree()
    root = tree.root(ReuseScope(), create=True)
    assert root is not None
    three = Block(1, ReuseScope(), 0, 0, 35)
    tree.attach_partial(three, root, array("i", [7, 8, 9]))
    assert three.key == sha256(root.key + le([7, 8, 9])).digest()
    empty = Block(2, ReuseScope(), 0, 1, 35)
    with pytest.raises(ValueError, match="chain_keys"):
        tree.attach_partial(empty, root, array("i"))
    assert tree.num_blocks == 1 and not empty.in_tree and root.partials == {three.key: three}


@needs_native
@settings(max_examples=40, deadline=None)
@given(
    prompts=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=40), min_size=1, max_size=8),
    tpb=st.integers(1, 5),
)
def test_a_cache_keyed_natively_equals_one_keyed_with_hashlib(
    prompts: list[list[int]], tpb: int
) -> None:
    """The same requests (shared prefixes, several commits each, partial tails) through a
    manager whose tree keys natively and one whose tree keys with ``chain_keys_py``: the same
    blocks under the same keys, the same reuse."""

    def replay() -> tuple[list[tuple[bytes, tuple[int, ...]]], list[int]]:
        cfg = KVCacheManagerConfig(
            tokens_per_block=tpb, tiers=[TierConfig(name="device", num_blocks=512)]
        )
        mgr = KVCacheManager(cfg)
        reused = []
        for prompt in prompts:
            seq = mgr.create_kv_cache(prompt)
            reused.append(seq.num_reused_tokens)
            rest = prompt[seq.num_reused_tokens :]
            seq.commit(rest[:3])
            seq.commit(rest[3:])
            seq.stop_committing()
            seq.close()
        mgr.verify()
        return sorted((b.key, tuple(b.tokens)) for b in mgr.iter_blocks()), reused

    native = replay()
    with pytest.MonkeyPatch.context() as m:
        m.setattr(tree_module, "chain_keys", chain_keys_py)
        pure = replay()
    assert native == pure
    # and every full block of every prompt is in the tree under WIRE.md's key
    in_tree = {key for key, _ in native[0]}
    root = root_key(ReuseScope())
    for p in prompts:
        assert set(reference(root, le(p), 0, 4 * tpb, len(p) // tpb)) <= in_tree

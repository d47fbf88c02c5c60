"""Chain keying (``kvcache.hashing.chain_keys``): one call keys a run of blocks with hashlib. It
must give WIRE.md's keys and SHA-256's published vectors, and refuse runs past its data."""

from __future__ import annotations

from array import array
from hashlib import sha256

import pytest

from kvcache import KVCacheManager, KVCacheManagerConfig, ReuseScope, TierConfig, root_key
from kvcache.hashing import chain_keys
from kvcache.tree import Block, RadixTree


def le(tokens: list[int]) -> bytes:
    return b"".join(t.to_bytes(4, "little") for t in tokens)


def test_wire_md_block_key_vectors() -> None:
    """WIRE.md section 2, tokens_per_block = 4: two full blocks under the default scope."""
    root = root_key(ReuseScope())
    keys = chain_keys(root, le(list(range(8))), 0, 16, 2)
    assert [k.hex() for k in keys] == [
        "7b894451a88bc03088bd0c44f01139922b089a1ab691d157c273185c78ca83b2",
        "181684b4f09a9fc1689624a565bc5c9ed96cede3e0863cf373463b1a93c45369",
    ]
    # the partial block [8, 9] chains from the second key: a run of one 8-byte block
    (partial,) = chain_keys(keys[1], le([8, 9]), 0, 8, 1)
    assert partial.hex() == "bce38df8ba29204a4e3b070bd62b78b7ff8a60a3be4e57634620c537ca8fb069"
    scoped = chain_keys(root_key(ReuseScope(7, 11)), le([0, 1, 2, 3]), 0, 16, 1)
    assert scoped[0].hex() == "9b0fd0e09150ccecc056c02607ac5a1102556d12560862529f46bd5fe9d443bb"


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
def test_sha256_published_vectors(message: bytes, digest: str) -> None:
    """With an empty parent key the first key is plain SHA-256 of the block."""
    assert chain_keys(b"", message, 0, len(message), 1)[0].hex() == digest
    # the same message cut at an odd offset of a longer buffer
    assert chain_keys(b"", b"xyz" + message, 3, len(message), 1)[0].hex() == digest


def reference(parent: bytes, data: bytes, start: int, step: int, count: int) -> list[bytes]:
    """The chain written out from WIRE.md section 2 (hashlib over each concatenation)."""
    out = []
    for i in range(count):
        parent = sha256(parent + data[start + i * step : start + (i + 1) * step]).digest()
        out.append(parent)
    return out


@pytest.mark.parametrize(
    ("start", "step", "count"),
    [(-1, 4, 1), (0, 0, 1), (0, 4, -1), (0, 4, 3), (5, 4, 2), (9, 1, 1), (0, 2**62, 2)],
)
def test_runs_past_the_data_are_refused(start: int, step: int, count: int) -> None:
    """Eight bytes of data: a run that does not fit, a negative offset or count, an empty
    block: ValueError, the same message on both paths (no read past the buffer)."""
    with pytest.raises(ValueError, match=rf"chain_keys: {count} blocks of {step} bytes"):
        chain_keys(b"k" * 32, bytes(8), start, step, count)


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

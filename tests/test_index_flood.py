"""Hash-flood resistance of the router's native index (router_sim/router/_match.c).

Workers choose the hashes they announce. A table that placed keys by a fixed, invertible
mix would let one announce keys that all share a home slot: each insertion then probes past
every earlier one (quadratic work: 40,000 such hashes cost 1.2 s in one ``apply_batch``, and
every later lookup of them as much). The table's placement is keyed by a random value drawn
when the extension loads, so keys crafted against the plain splitmix64 finalizer spread like
any others. Work is measured by the table's probe count (slots examined past home slots),
never by time.
"""

from __future__ import annotations

import random

from events.wire.model import DecodedBatch, KVCacheEvent, Stored, StoredBlock
from router_sim.router import _match
from router_sim.router.indexer import KvIndexer

N = 40_000
M64 = (1 << 64) - 1
C1, C2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # the splitmix64 finalizer's multipliers


def finalize(x: int) -> int:
    """The splitmix64 finalizer (Steele, Lea, Flood: "Fast splittable pseudorandom number
    generators", 2014; the constants of Stafford's variant 13)."""
    x ^= x >> 30
    x = (x * C1) & M64
    x ^= x >> 27
    x = (x * C2) & M64
    return x ^ (x >> 31)


def unfinalize(y: int) -> int:
    """Its inverse: each xor-shift undone by repeating it, each multiplication by the inverse."""
    y ^= (y >> 31) ^ (y >> 62)
    y = (y * pow(C2, -1, 1 << 64)) & M64
    y ^= (y >> 27) ^ (y >> 54)
    y = (y * pow(C1, -1, 1 << 64)) & M64
    y ^= (y >> 30) ^ (y >> 60)
    return y


def crafted(n: int) -> list[int]:
    """``n`` distinct keys whose plain-finalizer home slot is 0 in every table of up to 2**24
    slots: what a worker that knows an unkeyed placement would announce."""
    return [unfinalize((i + 1) << 24) for i in range(n)]


def test_the_crafted_keys_collide_under_the_plain_finalizer() -> None:
    keys = crafted(1000)
    assert len(set(keys)) == 1000
    assert all(finalize(k) & ((1 << 24) - 1) == 0 for k in keys)
    rng = random.Random(1)
    for x in (rng.getrandbits(64) for _ in range(100)):
        assert unfinalize(finalize(x)) == x


def _linear_bound(n: int) -> int:
    # linear probing at a load of at most 3/4 with keys placed at random: a few probes per
    # key on average, counting the re-insertions of every growth; the quadratic pile-up of
    # crafted keys under an unkeyed placement is about n * n / 2 (8e8 for 40,000)
    return 16 * n


def test_crafted_keys_cost_linear_probes_to_insert_and_to_find() -> None:
    table = _match.MaskTable()
    keys = crafted(N)
    table.set_bit(keys, 0)
    assert len(table) == N
    inserted = table.probes
    assert inserted <= _linear_bound(N), inserted
    for start in range(0, N, 100):
        assert table.runs(keys[start : start + 100], {0: 0}) is not None
    looked_up = table.probes - inserted
    assert looked_up <= _linear_bound(N), looked_up
    table.clear_bit(keys, 0)
    assert len(table) == 0
    assert table.probes - inserted - looked_up <= 2 * _linear_bound(N)


def test_crafted_keys_cost_about_what_random_keys_cost() -> None:
    """The same count for random keys: crafted ones are no worse than a few times it."""
    rng = random.Random(7)
    plain, bad = _match.MaskTable(), _match.MaskTable()
    plain.set_bit([rng.getrandbits(64) for _ in range(N)], 0)
    bad.set_bit(crafted(N), 0)
    assert bad.probes <= 3 * plain.probes + N


def test_an_indexer_applies_a_flood_of_crafted_hashes_in_linear_work() -> None:
    """Through the indexer: placeholder stores (no token ids) are keyed by the hashes the
    worker announces, the path a flood takes."""
    index = KvIndexer(16)
    table = index._table
    keys = crafted(N)
    blocks = [StoredBlock(k, [], None, 1) for k in keys]
    before = table.probes
    index.apply_batch(0, DecodedBatch(0.0, [KVCacheEvent(0, Stored(None, blocks, 16))]))
    assert index.block_count(0) == N
    assert table.probes - before <= _linear_bound(N)
    found = table.probes
    assert index.find_matches(keys[:50]) == {0: 50}
    assert table.probes - found <= _linear_bound(50)

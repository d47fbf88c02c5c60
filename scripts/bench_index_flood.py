"""The router's index under a hash flood: one ``apply_batch`` of N placeholder stores whose
hashes a worker crafted against the plain (unkeyed, invertible) splitmix64 finalizer, then
N / 100 lookups of 100 of them, against N random hashes; time and the native table's probe
count (``MaskTable.probes``: slots examined past home slots).

Run from the repository root:  python scripts/bench_index_flood.py [N]   (default 40,000)
"""

from __future__ import annotations

import random
import sys
import time

from events.wire.model import DecodedBatch, KVCacheEvent, Stored, StoredBlock
from router_sim.router.indexer import KvIndexer

M64 = (1 << 64) - 1
C1, C2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # the finalizer's multipliers


def unfinalize(y: int) -> int:
    """The inverse of the splitmix64 finalizer."""
    y ^= (y >> 31) ^ (y >> 62)
    y = (y * pow(C2, -1, 1 << 64)) & M64
    y ^= (y >> 27) ^ (y >> 54)
    y = (y * pow(C1, -1, 1 << 64)) & M64
    y ^= (y >> 30) ^ (y >> 60)
    return y


def run(label: str, keys: list[int]) -> None:
    index = KvIndexer(16)
    blocks = [StoredBlock(k, [], None, 1) for k in keys]  # CPU placeholders: keyed by hash
    batch = DecodedBatch(0.0, [KVCacheEvent(0, Stored(None, blocks, 16))])
    t = time.perf_counter()
    index.apply_batch(0, batch)
    applied = time.perf_counter() - t
    table = index._table
    probes = table.probes
    t = time.perf_counter()
    for i in range(0, len(keys), 100):
        index.find_matches(keys[i : i + 100])
    looked = time.perf_counter() - t
    print(
        f"{label:8}: apply_batch {applied * 1000:.1f} ms, lookups {looked * 1000:.1f} ms "
        f"({probes} probes, then {table.probes - probes})"
    )


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 40_000
    rng = random.Random(5)
    crafted = [unfinalize((i + 1) << 24) for i in range(n)]  # one home slot in tables <= 2**24
    for label, keys in (("random", [rng.getrandbits(64) for _ in range(n)]), ("crafted", crafted)):
        run(label, keys)


if __name__ == "__main__":
    main()

"""Per-block cost of the cache manager's hot paths against a bare hash-chain baseline.

Prints, from one run, side by side:

- baseline: ``sha256(parent + tokens as bytes).digest()`` + one dict lookup, per block;
- match: ``create_kv_cache`` on a fully cached prompt (every block reused), per block;
- commit: ``commit`` of a whole prompt into a fresh sequence, per block;
- metadata bytes per cached block (tracemalloc), with the 1 KiB target.

Usage: ``python scripts/bench_kvcache.py [--blocks 128] [--tpb 32] [--repeat 30]``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
import tracemalloc
from array import array
from hashlib import sha256

from kvcache import KVCacheManager, KVCacheManagerConfig, TierConfig


def _prompt(seed: int, n: int) -> array[int]:
    # Distinct per seed from the first token on, so prompts share nothing.
    return array("i", [(seed * 1_000_003 + i * 7919) % 100_000 for i in range(n)])


def baseline(prompt: array[int], tpb: int, repeat: int) -> float:
    data = prompt.tobytes()
    step = 4 * tpb
    nblocks = len(prompt) // tpb
    table: dict[bytes, int] = {}
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        parent = b"\x00" * 32
        for start in range(0, nblocks * step, step):
            parent = sha256(parent + data[start : start + step]).digest()
            table.get(parent)
        samples.append((time.perf_counter() - t0) / nblocks)
    return statistics.median(samples)


def match(manager: KVCacheManager, prompt: array[int], tpb: int, repeat: int) -> float:
    seq = manager.create_kv_cache(prompt)
    seq.commit(prompt)
    seq.close()
    query = array("i", prompt)
    query.append(1)  # one token past the cached prefix: every full block is reusable
    nblocks = len(prompt) // tpb
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        seq = manager.create_kv_cache(query)
        samples.append((time.perf_counter() - t0) / nblocks)
        assert seq.num_reused_tokens == len(prompt)
        seq.close()
    return statistics.median(samples)


def commit(manager: KVCacheManager, tpb: int, nblocks: int, repeat: int) -> float:
    samples = []
    for r in range(repeat):
        prompt = _prompt(10_000 + r, nblocks * tpb)
        seq = manager.create_kv_cache(prompt)
        t0 = time.perf_counter()
        seq.commit(prompt)
        samples.append((time.perf_counter() - t0) / nblocks)
        seq.close()
        manager.clear_reusable_blocks()
    return statistics.median(samples)


def memory_per_block(tpb: int, nblocks: int, prompts: int) -> float:
    cfg = KVCacheManagerConfig(
        tokens_per_block=tpb, tiers=[TierConfig(name="device", num_blocks=nblocks * prompts + 8)]
    )
    data = [_prompt(50_000 + i, nblocks * tpb) for i in range(prompts)]
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    manager = KVCacheManager(cfg)
    for prompt in data:
        with manager.create_kv_cache(prompt) as seq:
            seq.commit(prompt)
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert manager.num_cached_blocks == nblocks * prompts
    return (after - before) / manager.num_cached_blocks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=128, help="blocks per prompt")
    ap.add_argument("--tpb", type=int, default=32, help="tokens per block")
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--memory-prompts", type=int, default=50)
    args = ap.parse_args()
    tpb, nblocks = args.tpb, args.blocks
    cfg = KVCacheManagerConfig(
        tokens_per_block=tpb, tiers=[TierConfig(name="device", num_blocks=4 * nblocks)]
    )
    manager = KVCacheManager(cfg)
    prompt = _prompt(1, nblocks * tpb)
    base = baseline(prompt, tpb, args.repeat)
    m = match(manager, prompt, tpb, args.repeat)
    c = commit(manager, tpb, nblocks, args.repeat)
    mem = memory_per_block(tpb, nblocks, args.memory_prompts)
    print(f"tokens_per_block={tpb} blocks_per_prompt={nblocks} repeat={args.repeat} (medians)")
    print(f"{'path':<10}{'us/block':>10}{'x baseline':>12}{'target':>10}")
    print(f"{'baseline':<10}{base * 1e6:>10.3f}{1.0:>12.2f}{'':>10}")
    print(f"{'match':<10}{m * 1e6:>10.3f}{m / base:>12.2f}{'<= 2x':>10}")
    print(f"{'commit':<10}{c * 1e6:>10.3f}{c / base:>12.2f}{'<= 4x':>10}")
    print(f"metadata bytes per cached block: {mem:.0f} (target <= 1024)")


if __name__ == "__main__":
    main()

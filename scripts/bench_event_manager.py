"""Cost of the event manager on the engine thread, per stored block.

A real KVCacheManager (metadata-only pools) commits distinct 4,096-token prompts (32 tokens
per block) once, with a sink that keeps the blocks of every ``on_stored`` call. Those real
tree blocks are then replayed into fresh KVCacheEventManagers, one iteration per prompt
(``on_stored`` + ``flush`` + ``get_latest_events``, as an engine loop does), for each hash
algorithm; the figure is the best of ``--repeat`` runs, per block. Beside it, in the same run:
the wire encoding of one prompt's events (done by the ZeroMQ publisher on its own thread) and
the kvcache commit itself, for scale.

    python scripts/bench_event_manager.py [--prompts N] [--repeat R]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

from events.manager import KVCacheEventManager
from events.wire.codec import encode_batch
from kvcache.config import KVCacheManagerConfig, TierConfig
from kvcache.hashing import HashAlgo
from kvcache.manager import KVCacheManager
from kvcache.sink import BlockView

TOKENS_PER_BLOCK = 32
PROMPT_TOKENS = 4096


class KeepBlocks:
    """A sink that keeps the blocks of each on_stored call."""

    def __init__(self) -> None:
        self.calls: list[list[BlockView]] = []

    def on_stored(self, blocks: Sequence[BlockView]) -> None:
        self.calls.append(list(blocks))

    def on_removed(self, blocks: Sequence[BlockView]) -> None:
        pass

    def on_moved(self, blocks: Sequence[BlockView], old_tier: int, new_tier: int) -> None:
        pass

    def on_cleared(self) -> None:
        pass


def commit_all(prompts: list[list[int]]) -> tuple[float, KeepBlocks]:
    """Seconds to commit every prompt into a fresh cache, and the stored blocks."""
    sink = KeepBlocks()
    config = KVCacheManagerConfig(
        tokens_per_block=TOKENS_PER_BLOCK,
        tiers=[TierConfig(name="device", num_blocks=len(prompts) * PROMPT_TOKENS // 32 + 1)],
    )
    cache = KVCacheManager(config, event_sink=sink)
    start = time.perf_counter()
    for prompt in prompts:
        with cache.create_kv_cache(prompt) as seq:
            seq.commit(prompt)
    return time.perf_counter() - start, sink


def manager_seconds(calls: list[list[BlockView]], algo: HashAlgo, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        mgr = KVCacheEventManager(hash_algo=algo, max_entries=1 << 20)
        start = time.perf_counter()
        for blocks in calls:
            mgr.on_stored(blocks)
            mgr.flush()
            mgr.get_latest_events()
        best = min(best, time.perf_counter() - start)
    return best


def encode_seconds(calls: list[list[BlockView]], repeat: int) -> float:
    mgr = KVCacheEventManager(max_entries=1 << 20)
    mgr.on_stored(calls[0])
    mgr.flush()
    events = mgr.get_latest_events()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        encode_batch(events, ts=0.0)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=30)
    args = parser.parse_args()
    prompts = [[p * PROMPT_TOKENS + i for i in range(PROMPT_TOKENS)] for p in range(args.prompts)]
    commit = min(commit_all(prompts)[0] for _ in range(3))
    _, kept = commit_all(prompts)
    blocks = sum(len(c) for c in kept.calls)
    per_prompt = len(kept.calls[0])
    print(f"{blocks} blocks of {TOKENS_PER_BLOCK} tokens, "
          f"{len(kept.calls)} iterations; best of {args.repeat}")  # fmt: skip
    print(f"{'step':<52}{'us/block':>10}")
    for algo in HashAlgo:
        us = manager_seconds(kept.calls, algo, args.repeat) / blocks * 1e6
        print(f"{'KVCacheEventManager (' + algo.value + ')':<52}{us:>10.2f}")
    us = encode_seconds(kept.calls, args.repeat) / per_prompt * 1e6
    print(f"{'encode_batch (publisher sender thread)':<52}{us:>10.2f}")
    print(f"{'kvcache create + commit, for scale':<52}{commit / blocks * 1e6:>10.2f}")


if __name__ == "__main__":
    main()

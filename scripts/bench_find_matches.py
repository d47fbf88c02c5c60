"""find_matches at 1M (block, worker) entries over many distinct requests (cold caches).

Run: ``python scripts/bench_find_matches.py`` (about a minute). With ``--against-dynamo`` the
same state and requests also go through NVIDIA Dynamo's radix tree (``dynamo._core.RadixTree``,
``pip install ai-dynamo-runtime==1.6.1`` in an environment of its own, whose interpreter
``--dynamo-python`` or ``$DYNAMO_PYTHON`` names); never in CI. That side runs as a subprocess
of this script under the other interpreter and rebuilds the state from the same seed with the
standard library alone.

State: ``--workers`` workers, each holding its own sequences of 256 random 64-bit block hashes,
announced as Stored events of 64 blocks chained by ``parent_hash`` (a radix tree needs the
chain; the flat index does not care). Requests: ``--requests`` distinct whole sequences, each
of one random worker, so every lookup walks all 256 blocks. Figures: p50 / p99 microseconds
of one ``find_matches`` call from Python, the result converted by each binding as it comes
(KvIndexer: ``{worker: blocks}``; Dynamo: ``OverlapScores``). Beside KvIndexer, the tests'
plain model of the index (``tests/_reference.py``'s ``ModelIndex``: per worker a dict of the
blocks it holds, walked block by block) holds the same state in the same process, for scale.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

SEQ_BLOCKS = 256
EVENT_BLOCKS = 64


def workload(
    seed: int, entries: int, workers: int, n_requests: int
) -> tuple[list[list[list[int]]], list[tuple[int, int]]]:
    """Per worker its sequences; requests as (worker, sequence index), all distinct."""
    rng = random.Random(seed)
    per_worker = entries // workers // SEQ_BLOCKS
    seqs = [
        [[rng.getrandbits(64) for _ in range(SEQ_BLOCKS)] for _ in range(per_worker)]
        for _ in range(workers)
    ]
    picks = rng.sample(range(workers * per_worker), min(n_requests, workers * per_worker))
    return seqs, [divmod(p, per_worker) for p in picks]


def percentiles(fn: Callable[[Sequence[int]], object], requests: list[list[int]]) -> list[float]:
    times = []
    gc.collect()
    gc.freeze()  # the prepared input is not the index's: keep collections out of the timing
    for req in requests:
        t0 = time.perf_counter()
        fn(req)
        times.append((time.perf_counter() - t0) * 1e6)
    gc.unfreeze()
    times.sort()
    return [statistics.median(times), times[int(len(times) * 0.99) - 1]]


def run_ours(args: argparse.Namespace) -> dict[str, Any]:
    from events.wire.model import DecodedBatch, KVCacheEvent, Stored, StoredBlock
    from router_sim import KvIndexer

    seqs, picks = workload(args.seed, args.entries, args.workers, args.requests)
    ix = KvIndexer(16)
    t0 = time.perf_counter()
    for w, ws in enumerate(seqs):
        events = []
        for s in ws:
            for i in range(0, SEQ_BLOCKS, EVENT_BLOCKS):
                blocks = [StoredBlock(h, []) for h in s[i : i + EVENT_BLOCKS]]
                events.append(KVCacheEvent(0, Stored(s[i - 1] if i else None, blocks, 16)))
        ix.apply_batch(w, DecodedBatch(0.0, events))
    build = time.perf_counter() - t0
    requests = [list(seqs[w][j]) for w, j in picks]  # fresh lists: nothing shared with the index
    assert ix.find_matches(requests[0]) == {picks[0][0]: SEQ_BLOCKS}
    native = percentiles(ix.find_matches, requests)
    entries = ix.total_entries()
    del ix
    # the same holdings in the tests' model (every block on the device tier; one levels set
    # shared by all, as the model only reads it here)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from _reference import ModelIndex

    model = ModelIndex()
    device = {0}
    model.held = {w: dict.fromkeys((h for s in ws for h in s), device) for w, ws in enumerate(seqs)}
    assert model.find_matches(requests[0]) == {picks[0][0]: SEQ_BLOCKS}
    return {
        "entries": entries,
        "build_s": build,
        "native": native,
        "model": percentiles(model.find_matches, requests),
    }


def run_dynamo(args: argparse.Namespace) -> dict[str, Any]:
    """Runs under Dynamo's interpreter: the standard library and dynamo._core only."""
    from dynamo._core import RadixTree  # type: ignore[import-not-found]

    seqs, picks = workload(args.seed, args.entries, args.workers, args.requests)
    tree = RadixTree()
    t0 = time.perf_counter()
    event_id = 0
    for w, ws in enumerate(seqs):
        for s in ws:
            for i in range(0, SEQ_BLOCKS, EVENT_BLOCKS):
                # Dynamo's KvCacheEvent as JSON: block_hash is the worker's own hash (parent
                # links name it), tokens_hash what requests are matched by; here both the same
                blocks = [{"block_hash": h, "tokens_hash": h} for h in s[i : i + EVENT_BLOCKS]]
                stored = {"parent_hash": s[i - 1] if i else None, "blocks": blocks}
                event = {"event_id": event_id, "data": {"stored": stored}}
                tree.apply_event(w, json.dumps(event).encode())
                event_id += 1
    build = time.perf_counter() - t0
    requests = [list(seqs[w][j]) for w, j in picks]
    assert tree.find_matches(requests[0]).scores == {(picks[0][0], 0): SEQ_BLOCKS}
    return {
        "entries": args.entries // args.workers // SEQ_BLOCKS * SEQ_BLOCKS * args.workers,
        "build_s": build,
        "dynamo": percentiles(tree.find_matches, requests),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--entries", type=int, default=1_000_000)
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--against-dynamo", action="store_true")
    parser.add_argument(
        "--dynamo-python",
        default=os.environ.get("DYNAMO_PYTHON"),
        help="interpreter of the environment with ai-dynamo-runtime (default: $DYNAMO_PYTHON)",
    )
    parser.add_argument("--as-dynamo", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.against_dynamo and not args.dynamo_python:
        parser.error("--against-dynamo needs --dynamo-python (or $DYNAMO_PYTHON)")
    if args.as_dynamo:
        print(json.dumps(run_dynamo(args)))
        return
    ours = run_ours(args)
    rows: list[tuple[str, list[float]]] = [
        ("KvIndexer.find_matches (native loop)", ours["native"]),
        ("tests' ModelIndex.find_matches (plain per-worker walk)", ours["model"]),
    ]
    if args.against_dynamo:
        cmd = [args.dynamo_python, __file__, "--as-dynamo"]
        cmd += ["--entries", str(args.entries), "--workers", str(args.workers)]
        cmd += ["--requests", str(args.requests), "--seed", str(args.seed)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False)
        if done.returncode:
            sys.exit(f"the Dynamo side failed:\n{done.stderr}")
        theirs = json.loads(done.stdout.splitlines()[-1])
        rows.append(("Dynamo 1.6.1 RadixTree.find_matches", theirs["dynamo"]))
    print(
        f"{ours['entries']:,} (block, worker) entries, {args.workers} workers, "
        f"{args.requests:,} distinct {SEQ_BLOCKS}-block requests"
    )
    width = max(len(r[0]) for r in rows)
    for name, (p50, p99) in rows:
        print(f"{name:<{width}}  p50 {p50:6.1f} us   p99 {p99:6.1f} us")
    print("target: p50 <= 20 us")


if __name__ == "__main__":
    main()

"""The event writer (``encode_batch``), this tree beside another checkout, in one run.

Four sets of events, each written as one batch: an event-path store (one ``Stored`` of 128
blocks of 32 packed tokens, what ``bench_event_path.py`` publishes per prompt), a simulator's
(8 stores of 8 blocks of 512 tokens), small events (a decode step's one-block stores and
single-hash removals, alternating) and tier moves (a removal plus a placeholder store each).
This tree's writer runs in this process; with ``--reference DIR`` (a checkout of another commit,
its extension built) that checkout's runs in a child process on the same events, round by round
in turn (the order alternating), and the two must write the same bytes. CPU time of the writing
thread, best of the rounds, in microseconds per event.

    python scripts/bench_encoder.py [--reference DIR] [--rounds N]
"""

from __future__ import annotations

import argparse
import time
from array import array
from pathlib import Path

from bench_decoder import ReferenceDecoder  # scripts/ is on sys.path when run as a script

from events.wire.codec import encode_batch
from events.wire.model import EventDiff, KVCacheEvent, Removed, Stored, StoredBlock, Updated

ENCODE = (
    "from events.wire.codec import encode_batch\nrun = lambda events: encode_batch(events, 1.5)"
)
ITEMS_PER_ROUND = 20_000  # events written per set and round


def _stored(blocks: int, tpb: int, first: int) -> Stored:
    parent = first - 1 if first else None
    return Stored(
        parent,
        [StoredBlock(first + i, array("i", range(i * tpb, (i + 1) * tpb))) for i in range(blocks)],
        tpb,
    )


def event_sets() -> dict[str, list[KVCacheEvent]]:
    return {
        "event path: 1 store x 128 blocks of 32": [KVCacheEvent(0, _stored(128, 32, 0))],
        "simulator: 8 stores x 8 blocks of 512": [
            KVCacheEvent(i, _stored(8, 512, 100 * i + 1)) for i in range(8)
        ],
        "small: 1-block stores and removals": [
            KVCacheEvent(i, _stored(1, 32, 1000 + i) if i % 2 else Removed([i], 0))
            for i in range(128)
        ],
        "tier moves": [KVCacheEvent(i, Updated(i, EventDiff(0, 1))) for i in range(64)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reference", type=Path, help="a checkout to compare with")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    events = event_sets()
    # a set item is one batch; each round writes it enough times to be timed
    sets = {name: [evs] * max(1, ITEMS_PER_ROUND // len(evs)) for name, evs in events.items()}
    child = None if args.reference is None else ReferenceDecoder(args.reference, sets, ENCODE)
    header = f"{'events':<42}{'this tree':>12}"
    print(f"CPU us per event, best of {args.rounds} rounds")
    print(header + (f"{'reference':>12}{'ratio':>8}" if child else ""))
    for name, batches in sets.items():
        n = len(batches) * len(batches[0])
        if child is not None:
            assert child.batches[name][0] == encode_batch(batches[0], 1.5), f"{name}: bytes differ"
        best = {"this": 1e9, "reference": 1e9}
        for r in range(args.rounds):
            order = ["this", "reference"] if r % 2 == 0 else ["reference", "this"]
            for which in order:
                if which == "reference":
                    if child is not None:
                        best[which] = min(best[which], child.seconds(name, cpu=True))
                    continue
                t = time.thread_time()
                for batch in batches:
                    encode_batch(batch, 1.5)
                best[which] = min(best[which], time.thread_time() - t)
        line = f"{name:<42}{best['this'] / n * 1e6:>12.2f}"
        if child is not None:
            ref = best["reference"] / n * 1e6
            line += f"{ref:>12.2f}{ref / (best['this'] / n * 1e6):>8.2f}"
        print(line)
    if child is not None:
        child.close()
        print("ratio: reference / this tree (above 1: this tree is faster); bytes checked equal")


if __name__ == "__main__":
    main()

"""One engine as a process for the fault soak: a real cache, its event manager and a publisher
that answers snapshots, driven by a random workload, with injected faults.

    python tests/soak_worker.py LIVE_PORT REPLAY_PORT CONTROL_PORT SEED

Faults it injects itself (seeded): live frames withheld from the network (replay fills them),
iterations whose events are not drained for a while (the event buffer overflows: a visible gap),
and bursts that overflow the publisher's queue. The control socket (REP) answers ``pause``
(stop the workload; keep answering snapshot requests), ``resume``, ``state`` (the announced
blocks and their tiers as JSON: the truth the router must match) and ``exit``.
"""

from __future__ import annotations

import json
import random
import sys
import time

import zmq

from events.manager import KVCacheEventManager
from events.stream.publisher import ZmqEventPublisher
from kvcache.config import KVCacheManagerConfig, TierConfig
from kvcache.errors import KVCacheError
from kvcache.manager import KVCacheManager

TPB = 4


def main(live_port: int, replay_port: int, control_port: int, seed: int) -> None:
    rng = random.Random(seed)
    events = KVCacheEventManager(max_entries=24, moves_as="removed_stored")
    config = KVCacheManagerConfig(
        tokens_per_block=TPB,
        tiers=[TierConfig(name="device", num_blocks=24), TierConfig(name="host", num_blocks=24)],
    )
    cache = KVCacheManager(config, event_sink=events)
    drop_rate = rng.choice([0.0, 0.05, 0.2])
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pub = ZmqEventPublisher(
        f"tcp://127.0.0.1:{live_port}",
        f"tcp://127.0.0.1:{replay_port}",
        context=ctx,
        bind=True,
        max_queue=64,
        buffer_steps=rng.choice([16, 256]),
        drop_live=lambda seq: rng.random() < drop_rate,
        snapshot_provider=lambda: events.snapshot(cache.iter_blocks()),
    )
    control = ctx.socket(zmq.REP)
    control.setsockopt(zmq.LINGER, 0)
    control.bind(f"tcp://127.0.0.1:{control_port}")
    prefixes = [[rng.randrange(1000) for _ in range(8)] for _ in range(6)]
    paused = False
    hold = 0  # iterations left without draining the event buffer
    try:
        while True:
            if control.poll(0 if not paused else 10):
                command = control.recv_string()
                if command == "pause":
                    paused = True
                    pub.publish_drained(events, empty=True)
                    control.send_string("ok")
                elif command == "resume":
                    paused = False
                    control.send_string("ok")
                elif command == "state":
                    state = {
                        str(h): b.tier
                        for b in cache.iter_blocks()
                        if (h := events.hash_of(b)) is not None
                    }
                    control.send_string(json.dumps(state))
                else:
                    control.send_string("bye")
                    return
            if paused:
                pub.serve_snapshots()
                continue
            tokens = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randint(1, 12))]
            try:
                with cache.create_kv_cache(tokens) as seq:
                    seq.commit(tokens[seq.num_tokens :])
            except KVCacheError:
                pass
            if rng.random() < 0.01:
                cache.clear_reusable_blocks()
            events.flush()
            if hold == 0 and rng.random() < 0.02:
                hold = rng.randint(5, 40)  # the buffer of 24 events overflows
            if hold:
                hold -= 1
                continue
            pub.publish_drained(events, empty=True)
            if rng.random() < 0.01:  # a burst past the queue: dropped batches, seqs consumed
                for _ in range(100):
                    pub.publish([])
            time.sleep(rng.choice([0, 0.001, 0.003]))
    finally:
        pub.close(timeout_s=1.0)
        control.close(linger=0)
        ctx.term()


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:5]))

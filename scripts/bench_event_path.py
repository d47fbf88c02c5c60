"""Event path end to end: event manager -> encode -> ZeroMQ -> decode, in blocks per second.

Real tree blocks come from a KVCacheManager (metadata-only pools) that commits distinct
4,096-token prompts (32 tokens per block) once, outside the timing. The timed run replays
them as an engine loop does, one iteration per prompt: ``KVCacheEventManager.on_stored`` +
``flush`` + ``get_latest_events`` + ``ZmqEventPublisher.publish`` on the publishing thread;
the publisher encodes and sends on its own thread; a ``ZmqEventSubscriber`` polls and decodes.

* each step alone, in CPU time per block: the event manager, encode, decode, and the two
  ZeroMQ legs (publisher hand-over + send of pre-encoded payloads; subscriber poll + decode);
* throughput: stored blocks delivered (decoded) per second, from the first publish to the
  delivery of the last batch;
* publishing-thread cost: CPU time of the publishing thread (``time.thread_time``) spent in
  the manager calls and ``publish``, per block (what an engine step pays).

Three set-ups from one run, printed side by side: inproc (one process), tcp loopback (one
process) and tcp loopback with the subscriber in its own process (the router's usual place),
with the cache's long-lived objects frozen out of the cyclic garbage collector (``gc.freeze()``,
as a server does after start-up), plus inproc without the freeze for comparison.

With ``--reference DIR`` (a checkout of another commit, its extension built), the decode step
is also timed (CPU time) with that checkout's ``decode_batch`` in a child process, alternating
with this tree's on the same payloads (see ``bench_decoder.py``), and printed beside it.

With ``--against-structs N``, the three set-ups instead run N times each way, alternating in
this process: with the native batch reader (``events.wire.fast.decode_native``) and without it
(every batch read by the strict event Structs, as a payload the native reader leaves is), and
the medians are printed with their ratio: what ``events/wire/_wire.c`` pays on this job.

    python scripts/bench_event_path.py [--prompts N] [--reference DIR] [--against-structs N]
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import zmq
from bench_decoder import ReferenceDecoder  # scripts/ is on sys.path when run as a script
from bench_event_manager import KeepBlocks

import events.wire.fast as wire_fast
from events.manager import KVCacheEventManager
from events.stream.publisher import ZmqEventPublisher
from events.stream.subscriber import BatchDelivery, ResyncRequired, ZmqEventSubscriber
from events.wire.codec import decode_batch, encode_batch
from events.wire.model import Stored
from kvcache.config import KVCacheManagerConfig, TierConfig
from kvcache.manager import KVCacheManager
from kvcache.sink import BlockView

TOKENS_PER_BLOCK = 32
PROMPT_TOKENS = 4096
DEADLINE_S = 120.0
LEGEND = """\
blocks/s: wall clock, first publish to last delivery (shares the machine's cores)
pub us/blk: publishing-thread CPU per block (event manager + publish)
publish(): CPU of the publish call alone, per block
cpu us/blk: CPU of all the process's threads (manager, encode, ZeroMQ, decode)"""


def tree_blocks(prompts: int) -> tuple[KVCacheManager, list[list[BlockView]]]:
    """Commit ``prompts`` distinct prompts; return the cache (it owns the blocks) and the
    blocks of each iteration."""
    sink = KeepBlocks()
    config = KVCacheManagerConfig(
        tokens_per_block=TOKENS_PER_BLOCK,
        tiers=[TierConfig(name="device", num_blocks=prompts * PROMPT_TOKENS // 32 + 1)],
    )
    cache = KVCacheManager(config, event_sink=sink)
    for p in range(prompts):
        prompt = [p * PROMPT_TOKENS + i for i in range(PROMPT_TOKENS)]
        with cache.create_kv_cache(prompt) as seq:
            seq.commit(prompt)
    return cache, sink.calls


@dataclass(slots=True)
class Result:
    blocks: int
    seconds: float
    publish_cpu_s: float
    publish_only_cpu_s: float
    dropped: int
    resyncs: int
    process_cpu_s: float | None = None  # all threads of the process, one-process set-ups

    @property
    def blocks_per_s(self) -> float:
        return self.blocks / self.seconds

    @property
    def us_per_block(self) -> float:
        return self.publish_cpu_s / self.blocks * 1e6

    @property
    def publish_us_per_block(self) -> float:
        return self.publish_only_cpu_s / self.blocks * 1e6


def consume(
    sub: ZmqEventSubscriber, last_seq: int, started: threading.Event | None = None
) -> tuple[int, int, float]:
    """Poll until ``last_seq`` is delivered: (stored blocks, resyncs, monotonic end time)."""
    blocks = resyncs = 0
    if started is not None:
        started.set()
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        for m in sub.poll(100):
            if isinstance(m, ResyncRequired):
                resyncs += 1
                continue
            assert isinstance(m, BatchDelivery)
            for e in m.batch.events:
                if isinstance(e.data, Stored):
                    blocks += len(e.data.blocks)
            if m.seq == last_seq:
                return blocks, resyncs, time.monotonic()
    raise TimeoutError(f"seq {last_seq} not delivered within {DEADLINE_S} s")


def produce(
    pub: ZmqEventPublisher, calls: list[list[BlockView]]
) -> tuple[float, float, float, int]:
    """The engine loop: (start time, manager+publish CPU s, publish-only CPU s, last seq)."""
    mgr = KVCacheEventManager(max_entries=1 << 20)
    cpu = cpu_publish = 0.0
    seq = -1
    start = time.monotonic()
    for blocks in calls:
        t0 = time.thread_time()
        mgr.on_stored(blocks)
        mgr.flush()
        events = mgr.get_latest_events()
        t1 = time.thread_time()
        seq = pub.publish(events)
        t2 = time.thread_time()
        cpu += t2 - t0
        cpu_publish += t2 - t1
    return start, cpu, cpu_publish, seq


def run_in_process(transport: str, calls: list[list[BlockView]]) -> Result:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    live = "inproc://bench" if transport == "inproc" else "tcp://127.0.0.1:*"
    replay = "inproc://bench-replay" if transport == "inproc" else "tcp://127.0.0.1:*"
    pub = ZmqEventPublisher(live, replay, context=ctx, max_queue=1 << 20, hwm=1 << 20)
    sub = ZmqEventSubscriber(context=ctx, rcvhwm=1 << 20)
    sub.add_worker(0, pub.endpoint, pub.replay_endpoint)
    if not pub.wait_for_subscribers(1, 5):
        raise RuntimeError("subscriber did not connect")
    out: list[tuple[int, int, float]] = []
    # the consumer must know the last seq up front: one batch per iteration, from seq 0
    consumer = threading.Thread(target=lambda: out.append(consume(sub, len(calls) - 1)))
    consumer.start()
    cpu0 = time.process_time()
    start, cpu, cpu_pub, _ = produce(pub, calls)
    consumer.join(DEADLINE_S)
    process_cpu = time.process_time() - cpu0
    blocks, resyncs, end = out[0]
    dropped = pub.stats.dropped_batches
    sub.close()
    pub.close()
    ctx.term()
    return Result(blocks, end - start, cpu, cpu_pub, dropped, resyncs, process_cpu)


def _child(endpoint: str, replay: str, last_seq: int, conn: object) -> None:
    sub = ZmqEventSubscriber(rcvhwm=1 << 20)
    sub.add_worker(0, endpoint, replay)
    conn.send("ready")  # type: ignore[attr-defined]
    # poll while the parent waits for the subscription: ZeroMQ completes it on socket use
    blocks, resyncs, end = consume(sub, last_seq)
    conn.send((blocks, resyncs, end))  # type: ignore[attr-defined]
    sub.close()


def run_subscriber_process(calls: list[list[BlockView]]) -> Result:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pub = ZmqEventPublisher(
        "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", context=ctx, max_queue=1 << 20, hwm=1 << 20
    )
    parent, child = mp.Pipe()
    proc = mp.get_context("fork").Process(
        target=_child, args=(pub.endpoint, pub.replay_endpoint, len(calls) - 1, child)
    )
    proc.start()
    if parent.recv() != "ready" or not pub.wait_for_subscribers(1, 10):
        raise RuntimeError("subscriber process did not connect")
    start, cpu, cpu_pub, _ = produce(pub, calls)
    if not parent.poll(DEADLINE_S):
        raise TimeoutError("subscriber process did not finish")
    blocks, resyncs, end = parent.recv()  # CLOCK_MONOTONIC is shared by both processes
    proc.join(DEADLINE_S)
    dropped = pub.stats.dropped_batches
    pub.close()
    ctx.term()
    return Result(blocks, end - start, cpu, cpu_pub, dropped, resyncs)


def component_costs(
    calls: list[list[BlockView]], reference: Path | None = None
) -> dict[str, float]:
    """CPU seconds per block of each step alone (thread CPU time, so other load on the machine
    does not inflate it), best of 3, in this run; with ``reference``, that checkout's decode
    of the same payloads (CPU time in its own process, alternating with this one's)."""
    best = {"event manager": 1e9, "encode_batch": 1e9, "decode_batch": 1e9}
    total = sum(len(c) for c in calls)
    child = None
    for _ in range(3):
        mgr = KVCacheEventManager(max_entries=1 << 20)
        t0 = time.thread_time()
        batches = []
        for blocks in calls:
            mgr.on_stored(blocks)
            mgr.flush()
            batches.append(mgr.get_latest_events())
        t1 = time.thread_time()
        payloads = [encode_batch(events, 0.0, 0) for events in batches]
        t2 = time.thread_time()
        for payload in payloads:
            decode_batch(payload)
        t3 = time.thread_time()
        steps = ("event manager", "encode_batch", "decode_batch")
        for name, sec in zip(steps, (t1 - t0, t2 - t1, t3 - t2), strict=True):
            best[name] = min(best[name], sec / total)
        if reference is not None:
            if child is None:
                child = ReferenceDecoder(reference, {"path": payloads})
                assert child.batches["path"] == [decode_batch(p) for p in payloads]
            key = f"decode_batch of {reference}"
            best[key] = min(best.get(key, 1e9), child.seconds("path", cpu=True) / total)
    if child is not None:
        child.close()
    return best


def transport_costs(calls: list[list[BlockView]]) -> dict[str, float]:
    """CPU seconds per block of the ZeroMQ legs alone (inproc, one process, no overlap): the
    publisher handing pre-encoded payloads to its thread and socket, then the subscriber
    receiving and decoding them."""
    mgr = KVCacheEventManager(max_entries=1 << 20)
    payloads = []
    for blocks in calls:
        mgr.on_stored(blocks)
        mgr.flush()
        payloads.append(encode_batch(mgr.get_latest_events(), 0.0, 0))
    total = sum(len(c) for c in calls)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pub = ZmqEventPublisher(
        "inproc://legs", "inproc://legs-r", context=ctx, max_queue=1 << 20, hwm=1 << 20
    )
    sub = ZmqEventSubscriber(context=ctx, rcvhwm=1 << 20)
    sub.add_worker(0, pub.endpoint, pub.replay_endpoint)
    if not pub.wait_for_subscribers(1, 5):
        raise RuntimeError("subscriber did not connect")
    t0 = time.process_time()
    for payload in payloads:
        pub.publish_payload(payload)
    if not pub.flush(DEADLINE_S):
        raise TimeoutError("publisher did not drain")
    t1 = time.process_time()
    consume(sub, len(payloads) - 1)
    t2 = time.process_time()
    sub.close()
    pub.close()
    ctx.term()
    return {
        "publisher: publish_payload + send": (t1 - t0) / total,
        "subscriber: poll (decode included)": (t2 - t1) / total,
    }


def against_structs(calls: list[list[BlockView]], repeats: int) -> None:
    """The three set-ups with and without the native batch reader, alternating, medians."""
    native = wire_fast.decode_native
    runs: dict[tuple[str, bool], list[Result]] = {}
    try:
        for _ in range(repeats):
            for on in (True, False):
                wire_fast.decode_native = native if on else (lambda payload: None)
                for name, run in (
                    ("inproc, 1 process", lambda: run_in_process("inproc", calls)),
                    ("tcp loopback, 1 process", lambda: run_in_process("tcp", calls)),
                    ("tcp loopback, subscriber process", lambda: run_subscriber_process(calls)),
                ):
                    runs.setdefault((name, on), []).append(run())
    finally:
        wire_fast.decode_native = native
    print(f"medians of {repeats}, native batch reader on / off (the strict Structs read all)")
    head = ("blocks/s on", "off", "ratio", "cpu on", "off")
    print(f"{'set-up':<34}" + "".join(f"{h:>12}" for h in head))
    for name in dict.fromkeys(k for k, _ in runs):
        rate = [statistics.median(r.blocks_per_s for r in runs[(name, on)]) for on in (True, False)]
        cpus = [
            [r.process_cpu_s / r.blocks * 1e6 for r in runs[(name, on)] if r.process_cpu_s]
            for on in (True, False)
        ]
        cpu = "".join(f"{statistics.median(c):>12.2f}" if c else f"{'-':>12}" for c in cpus)
        print(f"{name:<34}{rate[0]:>12,.0f}{rate[1]:>12,.0f}{rate[0] / rate[1]:>12.2f}{cpu}")
    print("cpu: CPU us per block of all the process's threads (one-process set-ups)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=400)
    parser.add_argument(
        "--reference", type=Path, help="a checkout whose decode_batch is timed beside this one"
    )
    parser.add_argument(
        "--against-structs",
        type=int,
        metavar="N",
        help="N alternating runs with and without the native batch reader",
    )
    args = parser.parse_args()
    cache, calls = tree_blocks(args.prompts)
    if args.against_structs:
        gc.freeze()
        against_structs(calls, args.against_structs)
        del cache
        return
    total = sum(len(c) for c in calls)
    print(f"{total} blocks of {TOKENS_PER_BLOCK} tokens in {len(calls)} batches "
          f"({len(calls[0])} blocks per batch)")  # fmt: skip
    unfrozen = run_in_process("inproc", calls)
    # The tree's blocks are long-lived objects; a server freezes them out of the cyclic
    # collector after start-up so that collections do not keep traversing them.
    gc.freeze()
    costs = component_costs(calls, args.reference)
    print(f"{'step alone (same run, CPU time)':<34}{'us/block':>11}")
    for name, sec in costs.items():
        print(f"{name:<34}{sec * 1e6:>11.2f}")
    serial = sum(costs[k] for k in ("event manager", "encode_batch", "decode_batch"))
    print(
        f"{'sum of the three':<34}{serial * 1e6:>11.2f}   = {1 / serial:,.0f} blocks/s on one core"
    )
    for name, sec in transport_costs(calls).items():
        print(f"{name:<34}{sec * 1e6:>11.2f}")
    results = {
        "inproc, 1 process": run_in_process("inproc", calls),
        "tcp loopback, 1 process": run_in_process("tcp", calls),
        "tcp loopback, subscriber process": run_subscriber_process(calls),
        "inproc, 1 process, gc not frozen": unfrozen,
    }
    print(f"{'set-up':<34}{'blocks/s':>11}{'pub us/blk':>12}{'publish()':>11}"
          f"{'cpu us/blk':>12}{'dropped':>9}{'resyncs':>9}")  # fmt: skip
    for name, r in results.items():
        cpu = "-" if r.process_cpu_s is None else f"{r.process_cpu_s / r.blocks * 1e6:.2f}"
        print(f"{name:<34}{r.blocks_per_s:>11,.0f}{r.us_per_block:>12.2f}"
              f"{r.publish_us_per_block:>11.3f}{cpu:>12}{r.dropped:>9}{r.resyncs:>9}")  # fmt: skip
    print(LEGEND)
    del cache


if __name__ == "__main__":
    main()

"""End to end: real kvcache workers announce blocks over ZeroMQ (inproc), the router listens.

Each worker is a ``KVCacheManager`` whose event sink is a ``KVCacheEventManager``; after every
engine step its events go out through a ``ZmqEventPublisher``. The router only sees what
arrives through a ``ZmqEventSubscriber``. Every wait polls with a deadline.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq

from events.manager import KVCacheEventManager
from events.stream.publisher import ZmqEventPublisher
from events.stream.subscriber import ZmqEventSubscriber
from kvcache.config import KVCacheManagerConfig, TierConfig
from kvcache.manager import KVCacheManager
from kvcache.scope import ReuseScope
from router_sim import Router, StaticLoadSource, WorkerLoad

pytestmark = pytest.mark.timeout(60)

TPB = 4
DEADLINE_S = 10.0
_ids = itertools.count()

Ctx = zmq.Context[zmq.Socket[bytes]]


@pytest.fixture
def ctx() -> Iterator[Ctx]:
    context: Ctx = zmq.Context()
    yield context
    done = threading.Thread(target=context.term, daemon=True)
    done.start()
    done.join(DEADLINE_S)
    assert not done.is_alive(), "zmq context did not terminate: a socket was left open"


class LiveWorker:
    """A cache manager, its event manager and its publisher; ``step`` ends an iteration."""

    def __init__(
        self,
        ctx: Ctx,
        tiers: list[int],
        drop_live: Callable[[int], bool] | None = None,
        buffer_steps: int = 1000,
        base: str | None = None,
    ) -> None:
        base = f"inproc://router-e2e-{next(_ids)}" if base is None else base
        self.endpoint = base
        self.replay_endpoint = f"{base}-replay"
        self.ctx = ctx
        self.drop_live = drop_live
        self.buffer_steps = buffer_steps
        self.tiers = tiers
        self._start()

    def _start(self) -> None:
        self.events = KVCacheEventManager(moves_as="removed_stored")
        config = KVCacheManagerConfig(
            tokens_per_block=TPB,
            tiers=[TierConfig(name=f"tier{i}", num_blocks=n) for i, n in enumerate(self.tiers)],
        )
        self.cache = KVCacheManager(config, event_sink=self.events)
        self.publisher = ZmqEventPublisher(
            self.endpoint,
            self.replay_endpoint,
            context=self.ctx,
            buffer_steps=self.buffer_steps,
            drop_live=self.drop_live,
        )

    def restart(self) -> None:
        """The worker process restarts: empty cache, publisher seqs from 0 again."""
        self.publisher.close(timeout_s=0)
        self._start()

    def prefill(self, tokens: list[int], scope: ReuseScope | None = None) -> None:
        """Run a request to the end of its prefill, release it, and publish the events."""
        with self.cache.create_kv_cache(tokens, scope) as seq:
            seq.commit(tokens[seq.num_tokens :])
        self.step()

    def step(self) -> None:
        self.events.flush()
        batch = self.events.get_latest_events()
        if batch:
            self.publisher.publish(batch)

    def close(self) -> None:
        self.publisher.close()


def connect(ctx: Ctx, workers: dict[int, LiveWorker]) -> tuple[Router, ZmqEventSubscriber]:
    sub = ZmqEventSubscriber(context=ctx, replay_timeout_ms=2000)
    for w, live in workers.items():
        sub.add_worker(w, live.endpoint, live.replay_endpoint)
    assert sub.wait_connected(DEADLINE_S)
    for live in workers.values():
        assert live.publisher.wait_for_subscribers(1, DEADLINE_S)
    source = StaticLoadSource({w: WorkerLoad() for w in workers})
    return Router(TPB, "kv_overlap", source, subscriber=sub), sub


def poll_until(router: Router, cond: Callable[[], bool]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not cond():
        assert time.monotonic() < deadline, "the router's view never reached the expected state"
        router.poll_events(timeout_ms=20)


def prompt(base: int, blocks: int) -> list[int]:
    return list(range(base, base + blocks * TPB))


def test_scoped_prefix_earns_overlap_only_in_its_scope(ctx: Ctx) -> None:
    workers = {0: LiveWorker(ctx, [32]), 1: LiveWorker(ctx, [32])}
    router, sub = connect(ctx, workers)
    try:
        tenant_a = ReuseScope.for_request(cache_salt="tenant-a")
        p = [*prompt(100, 4), 7, 7]  # 4 full blocks and a partial one
        workers[1].prefill(p, tenant_a)
        poll_until(router, lambda: router.route(p, cache_salt="tenant-a").overlaps[1] == 4)
        decision = router.route(p, cache_salt="tenant-a")
        assert decision.worker == 1 and decision.overlaps == {0: 0, 1: 4}
        # same tokens, other scopes: nothing cached anywhere
        assert router.route(p).overlaps == {0: 0, 1: 0}
        assert router.route(p, cache_salt="tenant-b").overlaps == {0: 0, 1: 0}
        assert router.route(p, lora_id=5, cache_salt="tenant-a").overlaps == {0: 0, 1: 0}
        # and the worker agrees: its cache reuses the prefix only in that scope
        assert workers[1].cache.probe_reuse(p, tenant_a) >= 16
        assert workers[1].cache.probe_reuse(p) == 0
        assert router.indexer.flagged_workers == {}
        assert sum(router.indexer.anomalies.values()) == 0
    finally:
        sub.close()
        for live in workers.values():
            live.close()


def test_eviction_and_offload_are_followed(ctx: Ctx) -> None:
    # worker 0: device only (evicted blocks are dropped); worker 1: device + host (offloaded)
    workers = {0: LiveWorker(ctx, [8]), 1: LiveWorker(ctx, [8, 8])}
    router, sub = connect(ctx, workers)
    try:
        a, b = prompt(100, 4), prompt(500, 8)
        for live in workers.values():
            live.prefill(a)
        poll_until(router, lambda: router.route(a).overlaps == {0: 4, 1: 4})
        for live in workers.values():
            live.prefill(b)  # needs all 8 device pages: a's blocks must leave the device
        poll_until(router, lambda: router.route(b).overlaps == {0: 8, 1: 8})
        assert workers[0].cache.probe_reuse(a) == 0
        assert workers[1].cache.probe_reuse(a) >= 3 * TPB  # from the host tier
        after = router.route(a)
        assert after.overlaps == {0: 0, 1: 4}
        assert after.device_overlaps == {0: 0, 1: 0}
        # offloaded blocks still count (credited 0.75 each): worker 1 wins
        assert after.worker == 1 and after.costs[1] < after.costs[0]
        assert router.indexer.anomalies["unknown_removal"] == 0
    finally:
        sub.close()
        for live in workers.values():
            live.close()


def test_publisher_restart_resets_then_rebuilds_the_worker(ctx: Ctx, tmp_path: Path) -> None:
    # ipc for the restarting worker: an inproc name is released asynchronously after close,
    # so binding it again at once fails
    workers = {0: LiveWorker(ctx, [32], base=f"ipc://{tmp_path}/w0"), 1: LiveWorker(ctx, [32])}
    router, sub = connect(ctx, workers)
    try:
        a, c = prompt(100, 4), prompt(900, 3)
        for live in workers.values():
            live.prefill(a)
        poll_until(router, lambda: router.route(a).overlaps == {0: 4, 1: 4})
        workers[0].restart()
        # the subscriber's socket resubscribes when its owner thread next uses it: keep polling
        poll_until(router, lambda: workers[0].publisher.stats.subscribers >= 1)
        workers[0].prefill(c)
        poll_until(router, lambda: router.route(c).overlaps[0] == 3)
        # the old contents of worker 0 are gone from the view; worker 1 is untouched
        assert router.route(a).overlaps == {0: 0, 1: 4}
        assert router.stats.resyncs_by_worker[0] >= 1
        assert router.stats.resyncs_by_worker[1] == 0
        assert sub.status(0).restarts >= 1
    finally:
        sub.close()
        for live in workers.values():
            live.close()


def test_unrecoverable_gap_resets_then_rebuilds_the_worker(ctx: Ctx) -> None:
    lost: set[int] = set()
    # a 1-batch replay ring and a lost live frame: the gap cannot be replayed
    workers = {0: LiveWorker(ctx, [32], drop_live=lambda seq: seq in lost, buffer_steps=1)}
    router, sub = connect(ctx, workers)
    try:
        a, b, c = prompt(100, 4), prompt(300, 2), prompt(600, 3)
        workers[0].prefill(a)  # seq 0
        poll_until(router, lambda: router.route(a).overlaps[0] == 4)
        lost.add(1)
        workers[0].prefill(b)  # seq 1: lost on the wire
        workers[0].prefill(c)  # seq 2: evicts seq 1 from the 1-batch ring
        poll_until(router, lambda: router.stats.resyncs_by_worker[0] >= 1)
        poll_until(router, lambda: router.route(c).overlaps[0] == 3)
        # after the reset only what came after the gap is known: a was dropped with the
        # worker's state (it is still cached, but the router cannot prove it), b never arrived
        assert router.route(a).overlaps[0] == 0
        assert router.route(b).overlaps[0] == 0
        assert sub.status(0).state == "degraded"
        # a later AllBlocksCleared makes the view complete again
        workers[0].cache.clear_reusable_blocks()
        workers[0].prefill(a)
        poll_until(router, lambda: router.route(a).overlaps[0] == 4)
        assert router.route(c).overlaps[0] == 0
        assert sub.status(0).state == "ok"
    finally:
        sub.close()
        for live in workers.values():
            live.close()

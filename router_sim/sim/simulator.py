"""The discrete-event simulator: workers, the event stream in between, the router on the other side.

Time is simulated (milliseconds). Requests arrive in trace order; before routing a request at
time ``t`` every busy worker runs the engine steps that start before ``t`` (publishing its KV
events with the step's end time as timestamp), every frame the workers sent is delivered, and
the router applies the batches whose publish time + ``event_delay_ms`` is at most ``t``. Then
the router decides from its index and the workers' load, and the chosen worker queues the
request.

Delivery: with the ``memory`` transport (the default of offline runs) each worker's batches
are handed over in process: this project's stores, removals and clears as the records the
wire would carry (never written), anything else written and decoded with the wire codec, so
the router still sees only what the wire carries, without a socket round trip or a write per
frame. With ``inproc`` or ``tcp`` each worker runs a real ZeroMQ publisher and the subscriber
is drained until every frame sent live has arrived (a dropped frame is recovered through
replay when the next frame reveals the gap; the simulator never sleeps, it polls with a
deadline). Both give the same report, but for the wire bytes, which only the ZeroMQ
transports write (None with the memory transport).

Determinism: workers, policies and fault injection draw from seeded generators, the order of
operations depends only on simulated time, and delivery is gated by simulated time, not by
when a frame happened to arrive; so equal inputs and seed give equal results. Only the routing
decision time (wall clock) differs between runs.
"""

from __future__ import annotations

import gc
import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Final, cast

import zmq

from events.stream.subscriber import (
    BatchDelivery,
    ResyncRequired,
    SubscriberMessage,
    ZmqEventSubscriber,
)
from events.wire.codec import decode_batch
from events.wire.model import BlockHash
from kvcache.hashing import HashAlgo, blockchain_keys
from router_sim.build_info import warn_if_stale
from router_sim.errors import SimulationError as SimulationError
from router_sim.router.load import WorkerLoad
from router_sim.router.policies import EVENT_FREE, make_policy
from router_sim.router.routing import Router
from router_sim.sim.dialects import (
    KvGroup,
    check_engine,
    check_kv_groups,
    clear_scope,
    request_scope,
)
from router_sim.sim.metrics import PolicySummary, RequestRecord, WireStats
from router_sim.sim.prefetch import prompt_source
from router_sim.sim.timing import default_step_timing
from router_sim.sim.timing_model import PolynomialTiming
from router_sim.sim.worker import TRANSPORTS, SimWorker, WorkerConfig
from router_sim.sim.workloads import Request

ALL_POLICIES: Final[tuple[str, ...]] = (
    "round_robin",
    "random",
    "least_loaded",
    "kv_overlap",
    "cache_aware",
    "approximate",
    "predicted_ttft",
    "oracle",
)
EVENT_MODES: Final = ("auto", "on", "off")
"""The values of ``SimConfig.events``."""
_READS_TRUTH: Final = frozenset({"oracle"})
"""Policies given the fleet as their ``CacheOracle`` (see build_policy)."""
# policies that draw random numbers (sampling, or tie-breaks among equal costs)
_SEEDED: Final = frozenset({"random", "kv_overlap", "predicted_ttft", "approximate", "oracle"})
_run_ids = itertools.count()


@contextmanager
def _without_cyclic_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector for a run, then restore its state.

    A run builds hundreds of thousands of long-lived objects (the workers' cache trees, the
    router's index) and almost no reference cycles: everything it drops is freed by reference
    counting. Each full collection still walks every live object, and as the caches grow the
    collector runs such walks over and over (about a sixth of a Mooncake replay's CPU time).
    Pausing it changes nothing a run computes; cycles made meanwhile, by this thread or another,
    wait for the next collection after the run.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def needs_event_stream(drop_rate: float, restarts: bool, transport: str) -> bool:
    """Whether a run exercises the event stream itself: dropped frames, restarts or a ZeroMQ
    transport asked for by name (``SimConfig.needs_events``)."""
    return drop_rate > 0 or restarts or transport in ("inproc", "tcp")


def check_events(
    events: str,
    policies: Sequence[str],
    needs_events: bool,
    exercised_by: str = "dropped frames, restarts and a ZeroMQ transport",
) -> None:
    """``ValueError`` for an ``events`` setting (``SimConfig.events``) that is not one of
    :data:`EVENT_MODES`, or ``off`` with one of ``policies`` that reads the router's index or
    with a run that exercises the stream (``needs_events``; ``exercised_by`` names what does,
    in the caller's words). The command line and sweeps check their settings with it before
    any run."""
    if events not in EVENT_MODES:
        raise ValueError(f"events must be one of {', '.join(EVENT_MODES)}, got {events!r}")
    if events != "off":
        return
    blind = [p for p in policies if p not in EVENT_FREE]
    if blind:
        raise ValueError(
            f"events off: {', '.join(blind)} route(s) by the router's index, which only the "
            f"event stream fills (event-free policies: {', '.join(sorted(EVENT_FREE))})"
        )
    if needs_events:
        raise ValueError(f"events off leaves out the event stream that {exercised_by} exercise")


@dataclass(slots=True)
class Restart:
    """Fault: restart ``worker`` at simulated time ``at_ms``."""

    worker: int
    at_ms: float


@dataclass(slots=True)
class SimConfig:
    """Everything a simulation run needs besides the requests and the policy."""

    workers: int = 4
    tokens_per_block: int = 32
    device_blocks: int = 4096
    host_blocks: int = 0
    max_batch_tokens: int = 8192
    max_running: int = 256
    transport: str = "auto"
    """``memory`` (frames handed over in process, through the real codec), ``inproc`` or
    ``tcp`` (real ZeroMQ sockets); ``auto``: memory unless frames are dropped on purpose."""
    event_delay_ms: float = 0.0
    seed: int = 0
    hash_algo: str = "v1_block_key"
    drop_rate: float = 0.0
    """Fraction of live event frames lost (fault injection; replay recovers them)."""
    restarts: list[Restart] = field(default_factory=list)
    timing_speedup: float = 1.0
    """Divides every step time (a faster engine)."""
    policy_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    fast_forward: bool = True
    """Workers take stretches of pure decoding in one go (False: step by step, the reference
    the fast path is tested against)."""
    drain_timeout_s: float = 30.0
    """Longest wall-clock wait for frames already sent (a stall means a transport bug)."""
    event_buffer: int = 1_000_000
    """Events each worker's event manager buffers between publishes; past it the oldest are
    lost, which subscribers see as a gap and repair with a snapshot of the worker's cache."""
    engine: str = "native"
    """Whose KV events the workers publish (router_sim.sim.dialects.ENGINES): the router keys
    every engine's blocks by their token ids, so routing is the same for all."""
    kv_groups: tuple[KvGroup, ...] | None = None
    """The KV-cache groups ``engine`` ``vllm``'s workers publish, as a hybrid model's vLLM
    does (None: one full-attention group; router_sim.sim.dialects.parse_kv_groups). Every
    group holds the blocks its worker holds (the simulated cache has no sliding window)."""
    events: str = "auto"
    """``on``: the workers publish KV events and the router's index applies them; ``off``: no
    event stream (the wire figures and the index check are then not measured), only for a
    policy that never reads the index (``reads_index = False``: round_robin, random,
    least_loaded, approximate, oracle); ``auto``: off for such a policy unless the run injects
    faults or names a ZeroMQ transport, on otherwise. Routing, caching and timing are the
    same either way."""

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        check_engine(self.engine)
        check_kv_groups(self.engine, self.kv_groups)
        if self.engine != "native" and self.hash_algo != "v1_block_key":
            raise ValueError(f"engine {self.engine!r} needs hash_algo 'v1_block_key'")
        if self.event_buffer < 1:
            raise ValueError(f"event_buffer must be >= 1, got {self.event_buffer}")
        if self.event_delay_ms < 0:
            raise ValueError(f"event_delay_ms must be >= 0, got {self.event_delay_ms}")
        if not 0.0 <= self.drop_rate < 1.0:
            raise ValueError(f"drop_rate must be in [0, 1), got {self.drop_rate}")
        if self.transport != "auto" and self.transport not in TRANSPORTS:
            raise ValueError(
                f"transport must be auto or one of {TRANSPORTS}, got {self.transport!r}"
            )
        check_events(self.events, (), self.needs_events)
        if self.transport == "memory" and self.drop_rate > 0:
            # a lost frame is recovered by the subscriber's replay, which needs real sockets
            raise ValueError("drop_rate needs a ZeroMQ transport (inproc or tcp), not memory")
        for r in self.restarts:
            # a negative id would index the fleet from the end and restart the wrong worker
            if not 0 <= r.worker < self.workers:
                raise ValueError(
                    f"restart names worker {r.worker} but the workers are 0..{self.workers - 1}"
                )

    @property
    def needs_events(self) -> bool:
        """Whether the run exercises the event stream itself (injected faults, or a ZeroMQ
        transport asked for by name)."""
        return needs_event_stream(self.drop_rate, bool(self.restarts), self.transport)

    def events_for(self, policy: str) -> bool:
        """Whether a run of the named policy has the event stream (``events`` resolved);
        raises ``ValueError`` for ``off`` with a policy that reads the index."""
        check_events(self.events, (policy,), self.needs_events)
        reads = policy not in EVENT_FREE
        return self.events == "on" or (self.events == "auto" and (reads or self.needs_events))

    @property
    def resolved_transport(self) -> str:
        """The transport a run really uses (``auto`` resolved)."""
        if self.transport != "auto":
            return self.transport
        return "inproc" if self.drop_rate > 0 else "memory"

    def worker_config(self, events: str = "publish", held: bool = True) -> WorkerConfig:
        """The workers' shape; ``events`` and ``held`` as in :class:`WorkerConfig` (a
        :class:`Simulation` picks them for its policy)."""
        return WorkerConfig(
            tokens_per_block=self.tokens_per_block,
            device_blocks=self.device_blocks,
            host_blocks=self.host_blocks,
            max_batch_tokens=self.max_batch_tokens,
            max_running=self.max_running,
            hash_algo=self.hash_algo,
            transport=self.resolved_transport,
            fast_forward=self.fast_forward,
            event_buffer=self.event_buffer,
            engine=self.engine,
            kv_groups=self.kv_groups,
            events=events,
            held=held,
        )


class Fleet:
    """The workers as the router's :class:`LoadSource` and the oracle's ``CacheOracle``."""

    def __init__(self, workers: Sequence[SimWorker]) -> None:
        self._workers = list(workers)
        self._ids = [w.worker_id for w in workers]

    def workers(self) -> list[int]:
        return list(self._ids)

    def load(self, worker: int) -> WorkerLoad:
        return self._workers[worker].load()

    def true_overlap(self, worker: int, block_hashes: Sequence[BlockHash]) -> int:
        return self._workers[worker].true_overlap(block_hashes)


def build_policy(name: str, config: SimConfig, fleet: Fleet) -> Any:
    """The named policy with the run's seed, timing and oracle wired in."""
    opts = dict(config.policy_options.get(name, {}))
    if name in _SEEDED:
        opts.setdefault("seed", config.seed)
    if name == "predicted_ttft":
        opts.setdefault("timing", PolynomialTiming(speedup=config.timing_speedup))
        # price the queue in the steps the simulated workers really take
        opts.setdefault("chunk_tokens", config.max_batch_tokens)
    if name in _READS_TRUTH:
        opts.setdefault("oracle", fleet)
    return make_policy(name, **opts)


class Simulation:
    """One policy on one workload; :func:`simulate` is the usual entry point."""

    def __init__(self, policy: str, config: SimConfig) -> None:
        self.config = config
        self.policy_name = policy
        self.events = config.events_for(policy)
        """Whether the workers publish KV events and the router applies them."""
        # The report's true overlaps come from each cache's tree by the prompt's keys; only
        # a policy that reads the workers' true caches by the router's hashes (the oracle:
        # Fleet.true_overlap) needs each worker's held set, kept from its event batches.
        # Without the stream and that set, a worker runs no event manager at all.
        self._held = policy in _READS_TRUTH
        wcfg = config.worker_config(
            "publish" if self.events else "track" if self._held else "none", self._held
        )
        self._memory = wcfg.transport == "memory"
        timing = default_step_timing(config.timing_speedup)
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        # opens no socket until add_worker, so close() can always reach it
        self.subscriber = ZmqEventSubscriber(context=self._ctx, replay_timeout_ms=5000)
        self.workers: list[SimWorker] = []
        tag = f"-r{next(_run_ids)}"
        try:
            for i in range(config.workers):
                self.workers.append(
                    SimWorker(
                        i,
                        wcfg,
                        context=self._ctx,
                        timing=timing,
                        drop_rate=config.drop_rate,
                        fault_seed=config.seed,
                        run_tag=tag,
                    )
                )
            self.fleet = Fleet(self.workers)
            self.router = Router(
                config.tokens_per_block,
                build_policy(policy, config, self.fleet),
                self.fleet,
                hash_algo=config.hash_algo,
            )
            self._queues: list[deque[tuple[float, SubscriberMessage]]] = [
                deque() for _ in self.workers
            ]
            self._queued: set[int] = set()
            self._delivered: list[int] = [-1] * len(self.workers)
            self._last_due: list[float] = [0.0] * len(self.workers)
            self._restarts = sorted(config.restarts, key=lambda r: r.at_ms)
            self._carried = WireStats()
            self.index_mismatch = -1
            """After a run: |index blocks - true blocks| summed over workers (0: fully
            recovered; -1: not measured, the run had no event stream)."""
            for w in self.workers:
                self._attach(w)
        except BaseException:
            # the workers built so far run publisher threads on this context
            self.close()
            raise

    # ------------------------------------------------------------------- transport

    def _attach(self, w: SimWorker) -> None:
        # what the worker's AllBlocksCleared empties, as its engine dialect means it
        self.router.indexer.set_clear_scope(w.worker_id, clear_scope(self.config.engine))
        if self._memory:
            w.announce()
            return
        self.subscriber.add_worker(w.worker_id, w.endpoint, w.replay_endpoint)
        publisher = w.publisher
        assert publisher is not None  # a ZeroMQ transport
        if not publisher.wait_for_subscribers(1, timeout_s=self.config.drain_timeout_s):
            raise SimulationError(f"worker {w.worker_id}: subscriber never attached")
        self._delivered[w.worker_id] = -1
        # the subscriber asked the replay for the worker's history when it joined; its answer
        # (nothing yet) comes before the first batch, so that batch always arrives live and a
        # run's counters do not depend on which of the two came first
        deadline = time.monotonic() + self.config.drain_timeout_s
        while self.subscriber.status(w.worker_id).replaying:
            left = deadline - time.monotonic()
            if left <= 0:
                raise SimulationError(f"worker {w.worker_id}: its replay never answered the join")
            self._receive(left)
        w.announce()

    def _receive(self, left_s: float) -> None:
        """Poll the subscriber once (at most ``left_s``, and 200 ms) and queue what it gives."""
        for msg in self.subscriber.poll(timeout_ms=max(1, min(200, math.ceil(left_s * 1000)))):
            self._enqueue(msg)

    def _drain(self) -> None:
        """Receive until every frame the workers sent live has been delivered."""
        if self._memory:
            for w in self.workers:
                if w.has_frames:
                    wid = w.worker_id
                    for seq, payload, kind, batch in w.take_frames():
                        if kind == "resync":
                            self._enqueue(ResyncRequired(wid, "event buffer overflow"))
                            continue
                        if batch is None:  # an engine's payload: what the router would read
                            batch = decode_batch(payload)
                        self._enqueue(BatchDelivery(wid, seq, batch, kind == "snapshot"))
            return
        deadline = time.monotonic() + self.config.drain_timeout_s
        while True:
            behind = [
                w
                for w in self.workers
                if (w.sent_seqs and self._delivered[w.worker_id] < w.sent_seqs[-1])
                or self.subscriber.status(w.worker_id).state == "degraded"
            ]
            if not behind:
                return
            for w in behind:  # an idle worker answers a snapshot request between steps
                if w.publisher is not None:
                    w.publisher.serve_snapshots()
            left = deadline - time.monotonic()
            if left <= 0:
                detail = "; ".join(
                    f"worker {w.worker_id}: sent up to seq {w.sent_seqs[-1]}, delivered "
                    f"{self._delivered[w.worker_id]}, {self.subscriber.status(w.worker_id)}"
                    f", {w.publisher.stats if w.publisher is not None else ''}"
                    for w in behind
                )
                raise SimulationError(
                    f"event stream stalled for {self.config.drain_timeout_s} s ({detail}); "
                    "check the transport and the publisher logs"
                )
            self._receive(left)

    def _enqueue(self, msg: SubscriberMessage) -> None:
        wid = msg.worker
        if isinstance(msg, BatchDelivery):
            # a snapshot part stands for every seq up to its own (those frames never come)
            self._delivered[wid] = max(self._delivered[wid], msg.seq)
        if isinstance(msg, BatchDelivery) and not msg.snapshot:
            due = msg.batch.ts * 1000.0 + self.config.event_delay_ms
            self._last_due[wid] = max(self._last_due[wid], due)
        else:  # a resync or a snapshot part (stamped with the publisher's wall clock)
            due = self._last_due[wid]  # in order: right after what came before it
        self._queues[wid].append((due, msg))
        self._queued.add(wid)

    def _apply_due(self, now_ms: float) -> None:
        # only the workers with something queued: O(active workers), not O(fleet)
        for wid in sorted(self._queued):
            q = self._queues[wid]
            while q and q[0][0] <= now_ms:
                _, msg = q.popleft()
                if isinstance(msg, BatchDelivery):
                    self.router.apply(wid, msg.batch)
                elif isinstance(msg, ResyncRequired):
                    self.router.reset_worker(wid)
            if not q:
                self._queued.discard(wid)

    def _advance(self, t_ms: float) -> None:
        for w in self.workers:
            if not w.idle:  # an idle worker's clock catches up when a request arrives
                w.run_until(t_ms)
        self._drain()
        self._apply_due(t_ms)

    def _restart_due(self, t_ms: float) -> None:
        while self._restarts and self._restarts[0].at_ms <= t_ms:
            fault = self._restarts.pop(0)
            self._advance(fault.at_ms)
            w = self.workers[fault.worker]
            w.run_until(fault.at_ms)  # an idle worker's clock: the restart's time
            if not self._memory:
                st = self.subscriber.status(w.worker_id)  # its counters end with this connection
                self._carried.gaps += st.gaps
                self._carried.replayed += st.replayed
                self._carried.recovered += st.recovered
                self._carried.resyncs += st.resyncs
                self._carried.decode_errors += st.decode_errors
                self.subscriber.remove_worker(w.worker_id)
            w.restart()
            if self.config.engine != "native":
                # An engine's AllBlocksCleared resets its device tier only; its restart loses
                # every tier, which a deployment learns from the worker re-registering.
                self._enqueue(ResyncRequired(w.worker_id, "engine restarted"))
            self._attach(w)

    # ------------------------------------------------------------------------- run

    def run(
        self, requests: Sequence[Request], progress: Callable[[int, int], None] | None = None
    ) -> PolicySummary:
        """Route and serve ``requests`` (in arrival order); returns the run's figures."""
        with _without_cyclic_gc():
            return self._run(requests, progress)

    def _run(
        self, requests: Sequence[Request], progress: Callable[[int, int], None] | None
    ) -> PolicySummary:
        started = time.perf_counter()
        records: list[RequestRecord] = []
        tpb = self.config.tokens_per_block
        ordered = sorted(requests, key=lambda r: r.arrival_ms)
        engine = self.config.engine
        native = engine == "native"
        scopes = [req.scope if native else request_scope(engine, req) for req in ordered]
        # prompts (and the router's V1 keys of them) made ahead on a second thread
        hashed = self.router.hash_algo is HashAlgo.V1_BLOCK_KEY
        source = prompt_source(ordered, scopes, tpb, hashed)
        try:
            for i, req in enumerate(ordered):
                t = req.arrival_ms
                self._restart_due(t)
                self._advance(t)
                scope = scopes[i]
                prompt = req.tokens()
                made = source.take() if source is not None else None
                hashes, keys = made if made is not None else (None, None)
                # V1 hashes are ints, which the router's keys (BlockHash) may be
                known = cast("list[BlockHash] | None", hashes)
                decision = self.router.route(prompt, scope, now_ms=t, block_hashes=known)
                if self._held:
                    true = self._true_overlaps(decision.block_hashes)
                else:
                    # each cache's tree, by the prompt's cache keys
                    n = len(decision.block_hashes)
                    made_keys = keys if keys is not None else blockchain_keys(scope, prompt, tpb)
                    lookup = made_keys[:n]
                    true = [w.prefix_blocks(lookup, scope) for w in self.workers]
                record = RequestRecord(
                    request_id=req.request_id,
                    worker=decision.worker,
                    arrival_ms=t,
                    input_length=req.input_length,
                    output_length=req.output_length,
                    best_overlap_tokens=max(true) * tpb,
                    chosen_overlap_tokens=true[decision.worker] * tpb,
                    predicted_overlap_blocks=decision.chosen_overlap,
                    decision_us=decision.decision_us,
                )
                records.append(record)
                self.workers[decision.worker].enqueue(req, record, t, prompt, keys, hashes)
                if progress is not None:
                    progress(i + 1, len(ordered))
            self._restart_due(math.inf)
            for w in self.workers:
                w.run_until(math.inf)
                w.heartbeat_until_heard()  # a lost last frame shows as a gap
            self._drain()
            self._apply_due(math.inf)
            # After everything arrived, the index must equal the workers' caches (the event
            # manager's announced blocks, whatever reached the wire): this is how a run shows
            # that replay, resync and snapshots recovered from injected faults.
            if self.events:
                self.index_mismatch = sum(
                    abs(self.router.indexer.block_count(w.worker_id) - self._index_blocks(w))
                    for w in self.workers
                )
        finally:
            if source is not None:
                source.close()
            wire = self._wire_stats()
            self.close()
        return PolicySummary(
            records=records,
            workers=len(self.workers),
            busy_ms=[w.busy_ms for w in self.workers],
            wire=wire,
            index_mismatch=self.index_mismatch,
            events=self.events,
            wall_s=time.perf_counter() - started,
        )

    def _index_blocks(self, w: SimWorker) -> int:
        """The index entries ``w``'s announced blocks make: one per block, plus, with several
        KV-cache groups, one per further group for each device-tier block (host-tier events
        name no group)."""
        groups = self.config.kv_groups
        n = w.num_announced
        if groups is None or len(groups) == 1 or w.events is None:
            return n
        announced = w.events.hash_of
        on_device = sum(
            1 for b in w.manager.iter_blocks() if b.tier == 0 and announced(b) is not None
        )
        return n + (len(groups) - 1) * on_device

    def _true_overlaps(self, hashes: list[BlockHash]) -> list[int]:
        """Per worker, the leading blocks of ``hashes`` its cache holds right now (what the
        report's best and chosen overlaps are made of; each worker's held set is read at the
        call: a restart or snapshot replaces it)."""
        return [w.true_overlap(hashes) for w in self.workers]

    def _wire_stats(self) -> WireStats:
        stats = WireStats(
            bytes=None if self._memory else 0,  # the memory transport writes no bytes
            gaps=self._carried.gaps,
            replayed=self._carried.replayed,
            recovered=self._carried.recovered,
            resyncs=self._carried.resyncs,
            decode_errors=self._carried.decode_errors,
        )
        for w in self.workers:
            stats.batches += w.published
            stats.events += w.events_published
            if stats.bytes is not None:
                stats.bytes += w.bytes_published
            stats.dropped_frames += w.dropped_frames
            if w.events is not None:
                stats.overflowed_events += w.events.dropped_events
            stats.restarts += w.restarts
            if self._memory:
                continue
            try:
                st = self.subscriber.status(w.worker_id)
            except Exception:  # the worker was being re-attached when the run failed
                continue
            stats.gaps += st.gaps
            stats.replayed += st.replayed
            stats.recovered += st.recovered
            stats.resyncs += st.resyncs
            stats.decode_errors += st.decode_errors
        return stats

    def close(self) -> None:
        """Close every socket and the ZeroMQ context."""
        for w in self.workers:
            w.close()
        self.subscriber.close()
        self._ctx.term()


def simulate(
    requests: Sequence[Request],
    policy: str,
    config: SimConfig,
    progress: Callable[[int, int], None] | None = None,
    *,
    exit_after: bool = False,
) -> PolicySummary:
    """Run ``policy`` on ``requests`` with fresh workers and a fresh router.

    ``exit_after``: the process ends soon after this run (the ``router-sim`` command's last
    one), so what the run built is left for the exit to reclaim instead of being freed now:
    freeing the workers' cache trees took ~0.25 s after a Mooncake replay (deallocation, not
    the collector's walk), ~5 % of the command's wall time. The run's leftover cycles are
    moved out of the collector's reach (``gc.freeze``) and never freed in this process: a
    process that goes on running simulations must leave this False.
    """
    warn_if_stale()  # an edited source whose compiled module would run instead
    # the collector resumes once the simulation is gone: its one walk over what the run built
    # then also frees the workers' caches (cyclic trees), instead of a walk that finds them
    # alive and a later full one that frees them
    with _without_cyclic_gc():
        summary = Simulation(policy, config).run(requests, progress)
        if exit_after:
            gc.freeze()  # before the collector resumes (it would walk and free them at once)
        return summary

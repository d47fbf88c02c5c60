"""A simulated inference worker: real KV cache manager, real event manager, real wire codec.

Each worker embeds a metadata-only :class:`kvcache.manager.KVCacheManager` (a device tier and an
optional host tier), a :class:`events.manager.KVCacheEventManager` that turns the cache's
changes into KV events (tier moves as Removed + Stored, as on the wire), and encodes each
step's events with the wire codec; the frames go out through a
:class:`events.stream.publisher.ZmqEventPublisher` (``inproc`` / ``tcp`` transports) or wait in
memory for the simulator to take them (``memory``). It models continuous batching in
simulated time:

- a FIFO waiting queue; admission while the whole prompt's KV fits (the cached prefix is reused
  and pinned, the rest reserved), at most ``max_running`` requests;
- one step = one decode token for every decoding request plus prompt chunks (chunked prefill)
  under a ``max_batch_tokens`` budget; its duration comes from a :class:`StepTiming`;
- prompt chunks are committed as they are computed, so events flow during prefill; generated
  tokens are committed block by block; at completion the trailing partial block joins the
  tree and the sequence is released (its blocks stay cached and evictable);
- when a decoding request needs a new page and none is left, the most recently admitted request
  is preempted (its pages released, its committed blocks stay cached) and re-queued first; it
  later recomputes whatever was evicted meanwhile.

Stretches of pure decoding are fast-forwarded: when nothing can change but the token counts
(no prefill, no admission possible, step time constant because KV usage is), the worker jumps
to the next completion, page boundary or deadline in one go, with the exact same outcome as
stepping one token at a time.
"""

from __future__ import annotations

import logging
import math
from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Final, TypeAlias

import zmq

from events.manager import KVCacheEventManager
from events.stream.publisher import ZmqEventPublisher
from events.stream.snapshot import split_parts
from events.wire.codec import WRITTEN_AS_IS
from events.wire.model import (
    AllBlocksCleared,
    BlockHash,
    DecodedBatch,
    KVCacheEvent,
    Removed,
    Stored,
)
from kvcache.config import KVCacheManagerConfig, TierConfig
from kvcache.errors import OutOfPagesError
from kvcache.hashing import BlockKey
from kvcache.manager import KVCacheManager
from kvcache.scope import ReuseScope
from kvcache.sequence import KVCache
from kvcache.tree import RadixTree
from router_sim.errors import WorkerError as WorkerError
from router_sim.router.load import WorkerLoad
from router_sim.sim.dialects import (
    Dialect,
    KvGroup,
    check_engine,
    check_kv_groups,
    make_dialect,
)
from router_sim.sim.metrics import RequestRecord
from router_sim.sim.timing import StepTiming, default_step_timing
from router_sim.sim.workloads import Request

log = logging.getLogger(__name__)

Frame: TypeAlias = tuple[int, bytes, str, "DecodedBatch | None"]
"""A memory-transport frame: seq, payload, kind, and the decoded batch when known (see
:meth:`SimWorker.take_frames`)."""

TRANSPORTS: Final[tuple[str, ...]] = ("memory", "inproc", "tcp")
"""``memory``: encoded frames are handed over in process (offline runs, no sockets);
``inproc`` / ``tcp``: a real :class:`ZmqEventPublisher` per worker."""
WORKER_EVENTS: Final[tuple[str, ...]] = ("publish", "track", "none")
"""The values of :attr:`WorkerConfig.events`."""


@dataclass(slots=True)
class WorkerConfig:
    """Shape of every simulated worker of a run."""

    tokens_per_block: int
    device_blocks: int
    host_blocks: int = 0
    max_batch_tokens: int = 8192
    """Token budget of one step (decode tokens + prefill chunks)."""
    max_running: int = 256
    hash_algo: str = "v1_block_key"
    transport: str = "memory"
    replay_steps: int = 100_000
    """Batches kept by each publisher for replay."""
    event_buffer: int = 1_000_000
    """Capacity of the event manager's buffer (drained every step, so rarely used)."""
    fast_forward: bool = True
    """Take stretches of pure decoding in one go (False: one step at a time, the reference)."""
    engine: str = "native"
    """Whose events the worker publishes: ``native``, ``vllm``, ``sglang`` or ``trtllm``
    (hashes, fields and media as that engine sends them; router_sim.sim.dialects)."""
    kv_groups: tuple[KvGroup, ...] | None = None
    """The KV-cache groups a ``vllm`` worker publishes (None: the engine's default, one
    full-attention group; router_sim.sim.dialects.parse_kv_groups)."""
    events: str = "publish"
    """``publish``: the event manager's batches go out on the transport; ``track``: they only
    keep :attr:`SimWorker.held`, nothing is published; ``none``: no event manager at all. The
    last two take the memory transport only."""
    held: bool = True
    """Keep :attr:`SimWorker.held` (the true contents by the router's hashes, which
    :meth:`SimWorker.true_overlap` and the oracle read) from the event manager's batches;
    without it :meth:`SimWorker.prefix_blocks` answers from the cache's own tree."""

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.tokens_per_block < 1 or self.device_blocks < 1 or self.host_blocks < 0:
            raise ValueError(
                "need tokens_per_block >= 1, device_blocks >= 1, host_blocks >= 0; got "
                f"{self.tokens_per_block}, {self.device_blocks}, {self.host_blocks}"
            )
        if self.max_batch_tokens < 1 or self.max_running < 1:
            raise ValueError("max_batch_tokens and max_running must be >= 1")
        check_engine(self.engine)
        check_kv_groups(self.engine, self.kv_groups)
        if self.events not in WORKER_EVENTS:
            raise ValueError(f"events must be one of {WORKER_EVENTS}, got {self.events!r}")
        if self.events == "track" and not self.held:
            raise ValueError("events 'track' keeps the held set: it needs held=True")
        if self.events == "none" and self.held:
            raise ValueError("events 'none' has no event manager to keep the held set from")
        if self.events != "publish" and self.transport != "memory":
            raise ValueError(f"a worker that publishes no events has no {self.transport} transport")


@dataclass(slots=True, eq=False)
class _Seq:
    """A request inside a worker (compared by identity: list lookups and removals must not
    compare field by field, and no two sequences are ever alike)."""

    req: Request
    record: RequestRecord
    order: int
    prompt: array[int] = field(default_factory=lambda: array("i"))
    output: array[int] = field(default_factory=lambda: array("i"))
    """The sequence is the prompt followed by the answer (kept apart: a 10k-token prompt is
    not copied to append its answer, nor to be looked up whole)."""
    keys: list[BlockKey] | None = None
    """The cache keys of the prompt's full blocks, when made already (router_sim.sim.prefetch)."""
    hashes: list[int] | None = None
    """Their V1 hashes, likewise (what the event manager announces them under)."""
    cache: KVCache | None = None
    target: int = 0
    """Tokens whose KV must exist before decoding (re)starts."""
    computed: int = 0
    """Tokens of the sequence whose KV exists (reused or computed)."""
    in_cache: int = 0
    """Tokens committed to the cache (``computed`` minus generated tokens not yet committed)."""
    generated: int = 0
    admitted_once: bool = False
    decoding: bool = False
    """Whether the sequence decodes: it holds a cache, its KV reaches ``target`` and it has
    generated a token (set where any of these changes, read every step)."""
    cap: int = 0
    """``cache.capacity`` (tokens its pages hold), kept here by the worker after each call
    that may change it: the step compares it with every decoding sequence's position."""

    def span(self, start: int, stop: int) -> array[int]:
        """Tokens ``[start, stop)`` of the sequence (the prompt itself when that is all of it:
        arrays given to the cache are never changed)."""
        prompt = self.prompt
        n = len(prompt)
        if stop <= n:
            return prompt if start == 0 and stop == n else prompt[start:stop]
        if start >= n:
            return self.output[start - n : stop - n]
        return prompt[start:] + self.output[: stop - n]


_block_hash: Final = attrgetter("block_hash")


_UNLIMITED_REPLAYS: Final = 1e12
"""Replay requests per second the workers' publishers allow (no limit that a run reaches)."""

_MAX_HEARTBEATS: Final = 10_000
"""End-of-run heartbeats a worker sends at most (at the highest drop rate, 0.99, all 10,000
are lost with probability ~2e-44)."""


def _frame_dropped(seed: int, worker: int, seq: int, rate: float) -> bool:
    """Deterministic coin for fault injection: a pure function of (seed, worker, seq).

    Seq 0 (the Created announcement) is never dropped: it anchors the subscriber's numbering.
    """
    if rate <= 0.0 or seq == 0:
        return False
    x = (seed * 0x9E3779B97F4A7C15 + worker * 0xBF58476D1CE4E5B9 + seq) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    x ^= x >> 31
    return x / 2.0**64 < rate


def leading_held(held: set[BlockHash], block_hashes: Sequence[BlockHash]) -> int:
    """How many of ``block_hashes``, first first, ``held`` holds before the first it does not
    (a worker's true overlap with a request's blocks)."""
    n = 0
    for h in block_hashes:
        if h not in held:
            break
        n += 1
    return n


class SimWorker:
    """One simulated worker; see the module docstring."""

    def __init__(
        self,
        worker_id: int,
        config: WorkerConfig,
        *,
        context: zmq.Context[zmq.Socket[bytes]],
        timing: StepTiming | None = None,
        drop_rate: float = 0.0,
        fault_seed: int = 0,
        run_tag: str = "",
    ) -> None:
        self.worker_id = worker_id
        self.config = config
        self.timing: StepTiming = timing if timing is not None else default_step_timing()
        self.drop_rate = drop_rate
        self.fault_seed = fault_seed
        self._context = context
        self._tag = run_tag
        self.clock_ms = 0.0
        self.busy_ms = 0.0
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        self._admission_blocked = False
        self._order = 0
        self.held: set[BlockHash] = set()
        """Block hashes this worker announced and has not removed: its true cache contents
        (this project's hashes, the router's keys, whatever engine's hashes the wire carries)."""
        self.sent_seqs: list[int] = []
        """Seqs of the current publisher sent live (not dropped), in order."""
        self.publisher: ZmqEventPublisher | None = None
        self._load: WorkerLoad | None = None
        # memory transport: (seq, payload, kind) with kind "batch", "resync" or "snapshot"
        self._outbox: list[Frame] = []
        self._next_seq = 0
        self.published = 0
        self.restarts = 0
        self.events_published = 0
        self.bytes_published = 0
        self.dropped_frames = 0
        # the engine whose events this worker publishes (its hashes are a function of ours)
        self.dialect = make_dialect(
            config.engine, worker_id, config.tokens_per_block, config.kv_groups
        )
        self._native_wire = type(self.dialect) is Dialect  # its payloads are encode_batch's
        self._start_engine()

    # ------------------------------------------------------------------ engine lifecycle

    def _endpoints(self) -> tuple[str, str]:
        if self.config.transport == "tcp":
            return "tcp://127.0.0.1:*", "tcp://127.0.0.1:*"
        base = f"inproc://router-sim{self._tag}-w{self.worker_id}-g{self.restarts}"
        return base, base + "-replay"

    def _start_engine(self) -> None:
        cfg = self.config
        tiers = [TierConfig(name="device", num_blocks=cfg.device_blocks)]
        if cfg.host_blocks:
            tiers.append(TierConfig(name="host", num_blocks=cfg.host_blocks))
        self.events: KVCacheEventManager | None = None
        if cfg.events != "none":
            self.events = KVCacheEventManager(
                hash_algo=cfg.hash_algo,
                max_entries=cfg.event_buffer,
                moves_as="removed_stored",
                tokens_per_block=cfg.tokens_per_block,
            )
        self.manager = KVCacheManager(
            KVCacheManagerConfig(tokens_per_block=cfg.tokens_per_block, tiers=tiers),
            event_sink=self.events,
        )
        self.tree: RadixTree = self.manager.tree
        """The cache's tree (read only): :meth:`prefix_blocks`."""
        self._moves = 0
        """``manager.block_moves`` at the last publish (see _step)."""
        self.sent_seqs = []
        self.held = set()
        self._tiers = [t.num_blocks for t in tiers]
        self._outbox = []
        self._next_seq = 0
        if cfg.transport == "memory":
            self.publisher = None
            return
        live, replay = self._endpoints()
        wid, seed, rate = self.worker_id, self.fault_seed, self.drop_rate
        self.publisher = ZmqEventPublisher(
            live,
            replay_endpoint=replay,
            buffer_steps=cfg.replay_steps,
            max_queue=1_000_000,
            context=self._context,
            drop_live=(lambda seq: _frame_dropped(seed, wid, seq, rate)) if rate > 0 else None,
            snapshot_provider=self._engine_snapshot,
            # A per-second request limit guards a live publisher against floods; here its one
            # client is the simulator's, which runs faster than the clock (a drain can fill
            # gap after gap in a few milliseconds): a request over the limit would go
            # unanswered and end in a resync, after a wait, as the host's speed decides.
            replay_rate=_UNLIMITED_REPLAYS,
        )

    def announce(self) -> None:
        """Publish the engine's start: its capacity (Created) and an empty cache
        (AllBlocksCleared, so a router that knew a previous incarnation drops it). Call once a
        subscriber is attached."""
        if self.events is not None:
            self.events.created(self._tiers)
            self.events.on_cleared()
        self._publish()

    def _zmq(self) -> ZmqEventPublisher:
        if self.publisher is None:
            raise WorkerError(f"worker {self.worker_id}: the memory transport has no endpoints")
        return self.publisher

    @property
    def endpoint(self) -> str:
        return self._zmq().endpoint

    @property
    def replay_endpoint(self) -> str | None:
        return self._zmq().replay_endpoint

    def heartbeat_until_heard(self) -> int:
        """Empty batches, as an idle engine worker publishes them (``router-sim worker
        --heartbeat``), until one is not lost; returns how many were sent.

        Without it a run whose last frame was lost would end with the router none the wiser:
        no later frame shows the gap, so nothing asks for the replay. The router learns of the
        loss only from the wire (a heartbeat's seq past the lost one), as it would live; the
        count depends on the fault seed alone, so the run stays deterministic. A no-op without
        injected loss or ZeroMQ transport.
        """
        if self.publisher is None or self.drop_rate <= 0.0:
            return 0
        for sent in range(1, _MAX_HEARTBEATS + 1):
            if self._publish_zmq(self.publisher, self.dialect.encode([], self.clock_ms / 1000.0)):
                return sent
        raise WorkerError(
            f"worker {self.worker_id}: {_MAX_HEARTBEATS} heartbeats in a row were lost "
            f"(drop rate {self.drop_rate})"
        )

    @property
    def has_frames(self) -> bool:
        """Memory transport: frames are waiting for :meth:`take_frames`."""
        return bool(self._outbox)

    def take_frames(self) -> list[Frame]:
        """Memory transport: the (seq, payload, kind, batch) frames published since the last
        call, in order. kind is ``"batch"``, or, after the event buffer lost events,
        ``"resync"`` (empty payload) followed by the ``"snapshot"`` parts that a subscriber
        would receive. ``batch``: the batch itself where the worker knows what decoding its
        payload would give (this project's own stores, removals and clears, whose records are
        the wire's), with an empty payload (it is never written); else None, and the payload
        is the bytes a ZeroMQ subscriber would receive (less topic and seq)."""
        frames, self._outbox = self._outbox, []
        return frames

    def restart(self) -> None:
        """Crash and restart the engine: the KV cache is lost, a new publisher starts again at
        seq 0 on a new endpoint, and in-flight requests are re-queued (they recompute from
        scratch). The caller re-subscribes and then calls :meth:`announce`."""
        requeue = sorted(self.running, key=lambda s: s.order) + list(self.waiting)
        for s in self.running:
            s.cache = None  # the pool dies with the engine; nothing to release
            s.decoding = False
        self.running = []
        for s in requeue:
            s.computed = s.in_cache = 0
            s.record.preemptions += 1
        self.waiting = deque(requeue)
        self._admission_blocked = False
        self._load = None
        if self.publisher is not None:
            self.publisher.close(timeout_s=5.0)
        self.restarts += 1
        self._start_engine()

    def close(self) -> None:
        for s in self.running:
            if s.cache is not None:
                s.cache.close()
        self.running = []
        if self.publisher is not None:
            self.publisher.close(timeout_s=5.0)

    # ----------------------------------------------------------------------- events

    def _engine_snapshot(self) -> list[KVCacheEvent] | None:
        """The snapshot the publisher encodes itself: named with the engine's hashes."""
        snapshot = self._snapshot()
        return None if snapshot is None else self.dialect.renamed(snapshot)

    def _snapshot(self) -> list[KVCacheEvent] | None:
        """The cache's announced state (the publisher's snapshot provider)."""
        if self.events is None:
            return None
        return self.events.snapshot(self.manager.iter_blocks())

    def _publish(self) -> None:
        self._moves = self.manager.block_moves
        if self.events is None:
            return
        batch, lost = self.events.end_step()
        if lost and self.publisher is not None:
            self.publisher.skip()  # a seq no batch carries: subscribers see the loss
        if batch:
            self._send(batch)
        if lost:
            self._resync()

    def _resync(self) -> None:
        """The event buffer lost events: the published history no longer adds up to the
        cache. A ZeroMQ subscriber sees the burnt seq, and its snapshot request is answered by
        the publisher from :meth:`_snapshot`; the memory transport hands over the same: a
        resync, then the snapshot's parts, through the codec."""
        snapshot = self._snapshot()
        assert snapshot is not None  # just drained: nothing is pending
        if self.config.held:
            self.held = {b.block_hash for ev in snapshot for b in getattr(ev.data, "blocks", ())}
        if self.publisher is not None or self.config.events != "publish":
            return
        seq = self._next_seq - 1
        self._outbox.append((seq, b"", "resync", None))
        for part in split_parts(snapshot):
            payload = self.dialect.encode(part, self.clock_ms / 1000.0, snapshot=True)
            self._outbox.append((seq, payload, "snapshot", None))

    def _send(self, batch: list[KVCacheEvent]) -> None:
        if self.config.held:
            self._track(batch)
        if self.config.events != "publish":
            return
        ts = self.clock_ms / 1000.0
        self.published += 1
        self.events_published += len(batch)
        if self.publisher is None:
            # this project's stores, removals and clears travel as they are, never written
            # (what the payload would decode to: tests/test_dialects.py); tier moves and an
            # engine dialect's events only through their bytes
            if self._native_wire and all(type(e.data) in WRITTEN_AS_IS for e in batch):
                self._outbox.append((self._next_seq, b"", "batch", DecodedBatch(ts, list(batch))))
            else:
                self._outbox.append((self._next_seq, self.dialect.encode(batch, ts), "batch", None))
            self._next_seq += 1
            return
        self._publish_zmq(self.publisher, self.dialect.encode(batch, ts))

    def _publish_zmq(self, publisher: ZmqEventPublisher, payload: bytes) -> bool:
        """Publish ``payload`` on ZeroMQ, counting its wire bytes; False when the injected
        fault loses the frame (its seq is then never delivered live)."""
        seq = publisher.publish_payload(payload)
        self.bytes_published += len(payload) + len(publisher.topic) + 8
        if _frame_dropped(self.fault_seed, self.worker_id, seq, self.drop_rate):
            self.dropped_frames += 1
            return False
        self.sent_seqs.append(seq)
        return True

    def _track(self, batch: Sequence[KVCacheEvent]) -> None:
        held = self.held
        for ev in batch:
            data = ev.data
            if isinstance(data, Stored):
                held.update(map(_block_hash, data.blocks))
            elif isinstance(data, Removed):
                held.difference_update(data.block_hashes)
            elif isinstance(data, AllBlocksCleared):
                held.clear()

    @property
    def num_announced(self) -> int:
        """Blocks the worker's event manager announced and has not removed (0 without one)."""
        return 0 if self.events is None else self.events.num_announced

    def prefix_blocks(self, keys: Sequence[BlockKey], scope: ReuseScope) -> int:
        """Leading blocks of ``keys`` (the cache's keys of a prompt's full blocks in
        ``scope``) the cache holds right now (any tier): :meth:`true_overlap` read from the
        cache itself, for a worker that keeps no held set."""
        return self.tree.prefix_blocks(scope, keys)

    def true_overlap(self, block_hashes: Sequence[BlockHash]) -> int:
        """Leading blocks of ``block_hashes`` this worker holds right now (any tier)."""
        return leading_held(self.held, block_hashes)

    # ------------------------------------------------------------------------- load

    def load(self) -> WorkerLoad:
        """The load snapshot the router sees (kept until the worker next changes: a fleet of
        mostly idle workers costs the router one lookup per worker, not a walk of queues)."""
        if self._load is not None:
            return self._load
        pending = 0
        decode_blocks = 0
        tpb = self.config.tokens_per_block
        for s in self.waiting:
            # the prefix the worker held when the request was routed will not be recomputed
            cached = 0 if s.admitted_once else s.record.chosen_overlap_tokens
            pending += max(0, s.req.input_length + s.generated - s.computed - cached)
        for s in self.running:
            if s.decoding:
                decode_blocks += -(-(s.req.input_length + s.generated) // tpb)
            else:
                pending += s.target - s.computed
        self._load = WorkerLoad(
            active_requests=len(self.waiting) + len(self.running),
            pending_prefill_tokens=pending,
            kv_usage=min(1.0, max(0.0, self.manager.kv_usage(0))),
            decode_blocks=decode_blocks,
        )
        return self._load

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    # --------------------------------------------------------------------- requests

    def enqueue(
        self,
        req: Request,
        record: RequestRecord,
        now_ms: float,
        prompt: array[int] | None = None,
        keys: list[BlockKey] | None = None,
        hashes: list[int] | None = None,
    ) -> None:
        """A routed request arrives at ``now_ms`` (``prompt``: its tokens, if already built;
        ``keys``: the cache keys of its full blocks, ``hashes`` their V1 hashes in the
        request's scope, if already made)."""
        if self.idle:
            self.clock_ms = max(self.clock_ms, now_ms)
        self._load = None
        seq = _Seq(req, record, self._order)
        if prompt is not None:
            seq.prompt, seq.output = prompt, req.output_tokens()
        seq.keys = keys
        seq.hashes = hashes
        self.dialect.learn(req)
        self.waiting.append(seq)
        self._order += 1

    def _admit(self, s: _Seq) -> bool:
        req = s.req
        if not s.prompt:
            s.prompt, s.output = req.tokens(), req.output_tokens()
        target = req.input_length + s.generated
        ctx = s.span(0, target)
        try:
            cache = self.manager.create_kv_cache(
                ctx,
                reuse_scope=self.dialect.scope(req),
                block_keys=s.keys,
                sink_hashes=s.hashes,  # V1 ones: the event manager ignores them under v2_*
            )
        except OutOfPagesError:
            return False
        try:
            cache.resize(target + 1)
        except OutOfPagesError:
            cache.close()
            return False
        s.cache = cache
        s.cap = cache.capacity
        s.target = target
        s.computed = s.in_cache = cache.num_reused_tokens
        s.decoding = s.computed >= target and s.generated > 0  # never: one token is computed
        if not s.admitted_once:
            s.admitted_once = True
            s.record.reused_tokens = min(cache.num_reused_tokens, req.input_length)
        return True

    def _fits_alone(self, s: _Seq) -> bool:
        need = -(-(s.req.input_length + s.req.output_length) // self.config.tokens_per_block)
        return need <= self.config.device_blocks

    def _admit_waiting(self) -> None:
        while (
            self.waiting
            and not self._admission_blocked
            and len(self.running) < self.config.max_running
        ):
            s = self.waiting[0]
            if not self._fits_alone(s):
                self.waiting.popleft()
                log.warning(
                    "worker %d: request %d needs more KV than the whole device tier; dropped",
                    self.worker_id,
                    s.req.request_id,
                )
                continue
            if not self._admit(s):
                self._admission_blocked = True
                return
            self.waiting.popleft()
            self.running.append(s)

    def _release(self, s: _Seq) -> None:
        if s.cache is not None:
            s.cache.close()
            s.cache = None
        s.decoding = False
        self._admission_blocked = False

    def _preempt_for(self, needy: _Seq) -> bool:
        """Free pages by preempting the most recently admitted request; False if ``needy``
        itself was the victim.

        ``running`` stays sorted by ``order`` (admission order) and every waiting request
        comes after it: requests are admitted from the head of the FIFO, which holds the
        oldest, and the victim, the newest running request, goes back to that head."""
        victim = self.running.pop()
        assert not self.running or self.running[-1].order < victim.order
        self._release(victim)
        victim.computed = victim.in_cache = 0
        victim.record.preemptions += 1
        self.waiting.appendleft(victim)
        return victim is not needy

    def _ensure_capacity(self, s: _Seq, tokens: int) -> bool:
        """Make ``s``'s cache hold ``tokens`` tokens, preempting others if needed; False when
        ``s`` had to be preempted itself."""
        cache = s.cache
        assert cache is not None
        tpb = self.config.tokens_per_block
        while cache.capacity < tokens:
            try:
                cache.resize(-(-tokens // tpb) * tpb)
            except OutOfPagesError:
                if not self._preempt_for(s):
                    return False
        s.cap = cache.capacity
        return True

    def _commit(self, s: _Seq, upto: int) -> None:
        cache = s.cache
        assert cache is not None
        if upto > s.in_cache:
            cache.commit(s.span(s.in_cache, upto))
            s.in_cache = upto
            if upto > s.cap:  # the commit took pages (the worker reserves them first)
                s.cap = cache.capacity

    def _finish(self, s: _Seq) -> None:
        self._commit(s, s.req.input_length + s.req.output_length)
        assert s.cache is not None
        s.cache.stop_committing()
        s.record.finish_ms = self.clock_ms
        self.running.remove(s)
        self._release(s)

    # -------------------------------------------------------------------------- steps

    def run_until(self, t_ms: float) -> None:
        """Run every step that starts before ``t_ms``."""
        while self.clock_ms < t_ms and (self.waiting or self.running):
            if not self._step(t_ms):
                break
        if self.idle and self.clock_ms < t_ms and math.isfinite(t_ms):
            self.clock_ms = t_ms

    def _step(self, t_ms: float) -> bool:
        self._load = None
        running = self.running
        cfg = self.config
        if self.waiting and not self._admission_blocked and len(running) < cfg.max_running:
            self._admit_waiting()
        tpb = cfg.tokens_per_block
        # One pass, oldest request first (``running`` is in admission order, see
        # _preempt_for): a decoding request gets the page for this step's token when it has
        # reached the end of its pages; taking one may preempt the newest requests, which
        # leave the end of ``running`` before the pass reaches them (or ``s`` itself, the last
        # one then).
        decodes: list[_Seq] = []
        prefills: list[_Seq] = []
        for s in running:
            if s.decoding:
                need = s.req.input_length + s.generated + 1
                if need > s.cap and not self._ensure_capacity(s, need):
                    break
                decodes.append(s)
            else:
                prefills.append(s)
        budget = cfg.max_batch_tokens - len(decodes)
        chunks: list[tuple[_Seq, int]] = []
        prefill_tokens = 0
        for s in prefills:
            if budget <= 0:
                break
            n = min(max(1, s.target - s.computed), budget)
            chunks.append((s, n))
            budget -= n
            prefill_tokens += n
        if not decodes and not chunks:
            if self.waiting and not running:
                raise WorkerError(
                    f"worker {self.worker_id}: nothing runs but request "
                    f"{self.waiting[0].req.request_id} cannot be admitted"
                )
            return False
        dt = self.timing.step_ms(prefill_tokens, len(decodes), self.manager.kv_usage(0))
        k = 1
        if (
            not chunks
            and cfg.fast_forward
            and (not self.waiting or self._admission_blocked)
            and dt > 0
            # a page taken for this step may have evicted or moved a block: its events carry
            # this step's end time, not the stretch's (the cache's own count, so that a run
            # with and without the event manager take the same stretches)
            and self.manager.block_moves == self._moves
        ):
            k = self._fast_forward_steps(decodes, dt, t_ms)
        self.clock_ms += k * dt
        self.busy_ms += k * dt
        for s, n in chunks:
            s.computed = min(s.target, s.computed + n)
            self._commit(s, s.computed)
            if s.computed >= s.target:
                s.generated += 1  # the step that completes a prefill yields a token
                if s.record.first_token_ms is None:
                    s.record.first_token_ms = self.clock_ms
                if s.generated >= s.req.output_length:
                    self._finish(s)
                else:
                    s.decoding = True
        for s in decodes:
            s.generated += k
            req = s.req
            if s.generated >= req.output_length:
                self._finish(s)
            elif (req.input_length + s.generated) % tpb == 0:
                self._commit(s, req.input_length + s.generated)
        self._publish()
        return True

    def _fast_forward_steps(self, decodes: list[_Seq], dt: float, t_ms: float) -> int:
        """Decode steps that can run as one: up to the first completion, the first page
        boundary, or the first step starting at or after ``t_ms``."""
        k = math.ceil((t_ms - self.clock_ms) / dt) if math.isfinite(t_ms) else 1 << 62
        for s in decodes:
            req = s.req
            left = req.output_length - s.generated
            if left < k:
                k = left
            room = s.cap - (req.input_length + s.generated)  # ``cap``: the cache's capacity
            if room < k:
                k = room
        return max(1, k)

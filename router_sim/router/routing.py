"""The router: event subscriber -> index -> policy, with an explanation per decision.

``Router.route(tokens, scope)`` hashes the prompt with ``kvcache.hashing.chain_hashes`` (the
very function the workers' event manager uses, so scope, algorithm and block size agree by
construction), asks the index which workers hold how much of the chain, reads each candidate's
load from the :class:`~router_sim.router.load.LoadSource`, and lets the policy choose. The returned
:class:`RoutingDecision` says why.

Time is injected: pass ``now_ms`` to ``route`` or a ``clock`` (returning milliseconds) to the
constructor; without either the router's time stands still at 0 (policies with a TTL then never
expire anything). The only clock the router reads itself is ``time.perf_counter``, to measure
its own decision time.

Live use::

    sub = ZmqEventSubscriber()
    sub.add_worker(0, "tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558")
    router = Router(16, "kv_overlap", my_load_source, subscriber=sub)
    router.poll_events(timeout_ms=10)           # call regularly (or from a loop)
    decision = router.route(prompt_tokens, lora_id=None, cache_salt="tenant-a")
"""

from __future__ import annotations

import struct
import time
from array import array
from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from statistics import median
from typing import Protocol

from events.stream.subscriber import BatchDelivery, ResyncRequired, SubscriberMessage
from events.wire.model import BlockHash, DecodedBatch
from kvcache.hashing import HashAlgo, chain_hashes, v1_chain_ints
from kvcache.scope import ReuseScope
from router_sim.router.indexer import KvIndexer, MatchDetail, lora_name_id
from router_sim.router.load import LoadSource, WorkerLoad
from router_sim.router.policies import RouteRequest, RoutingPolicy, make_policy


def _packed(tokens: Sequence[int]) -> Sequence[int] | bytes:
    """Token ids as packed native int32s: what :meth:`Router.hash_request` hashes for a
    sequence other than a list (packed in C by ``struct``), and for a list the hashing
    refused, so that the error is the documented one.

    Packed input (``array('i')``, bytes) passes through. Ids outside int32 raise here;
    negative ids are rejected by the hashing.
    """
    if isinstance(tokens, (array, bytes, bytearray, memoryview)):
        return tokens
    try:
        return struct.pack(f"{len(tokens)}i", *tokens)
    except struct.error as exc:
        raise ValueError(f"token ids must be ints in [0, 2**31): {exc}") from exc


class LazyLoads(Mapping[int, WorkerLoad]):
    """The candidates' loads for a policy that declares ``reads_loads = False`` (it picks
    among the candidates by their ids alone: round robin, random): each load is read from the
    source only when asked for, then kept. A source's load can cost a walk of the worker's
    queues, every decision, for every worker; such a policy asks for none. The keys are the
    source's workers, in its order."""

    __slots__ = ("_ids", "_known", "_source")

    def __init__(self, source: LoadSource, workers: list[int]) -> None:
        self._source = source
        self._ids = dict.fromkeys(workers)  # ordered, with O(1) membership
        self._known: dict[int, WorkerLoad] = {}

    def __getitem__(self, worker: int) -> WorkerLoad:
        load = self._known.get(worker)
        if load is None:
            if worker not in self._ids:
                raise KeyError(worker)
            load = self._known[worker] = self._source.load(worker)
        return load

    def __contains__(self, worker: object) -> bool:
        return worker in self._ids

    def __iter__(self) -> Iterator[int]:
        return iter(self._ids)

    def __len__(self) -> int:
        return len(self._ids)


class EventSource(Protocol):
    """What the router needs of ``events.stream.subscriber.ZmqEventSubscriber``."""

    def poll(self, timeout_ms: int = 0) -> list[SubscriberMessage]:
        """Messages in order per worker: batch deliveries and resync signals."""
        ...


@dataclass(frozen=True, slots=True)
class RoutingDecision:
    """A routing decision and its explanation.

    ``overlaps`` / ``device_overlaps``: per candidate, leading request blocks the index says
    it holds on any tier / on the device tier (0 when none). ``costs``: the policy's scores
    (lower is better; empty for cache-blind policies). ``best_overlap``: the most any candidate
    holds per the index; ``chosen_overlap``: what the chosen one holds; their difference is the
    locality this decision gave up (for load balance, or because the policy does not look).
    """

    worker: int
    policy: str
    reason: str
    num_tokens: int
    block_hashes: list[BlockHash]
    overlaps: dict[int, int]
    device_overlaps: dict[int, int]
    costs: dict[int, float]
    predicted_overlap: dict[int, float]
    best_overlap: int
    chosen_overlap: int
    decision_us: float
    limited_by: dict[int, int] = field(default_factory=dict)
    """Per candidate whose overlap a KV-cache group other than 0 cut short (a hybrid model's
    sliding-window group, as vLLM counts a prefix hit): that group."""

    @property
    def locality_given_up(self) -> int:
        return self.best_overlap - self.chosen_overlap


@dataclass(slots=True)
class RouterStats:
    """Counters of a router's life. Decision times are wall-clock microseconds."""

    decisions: int = 0
    decision_us_total: float = 0.0
    recent_decision_us: deque[float] = field(default_factory=lambda: deque(maxlen=100_000))
    locality_given_up_blocks: int = 0
    decisions_below_best: int = 0
    chosen: Counter[int] = field(default_factory=Counter)
    batches_applied: int = 0
    resyncs: int = 0
    resyncs_by_worker: Counter[int] = field(default_factory=Counter)

    def decision_us_p50(self) -> float:
        """Median decision time over the recent decisions (0 before any)."""
        return median(self.recent_decision_us) if self.recent_decision_us else 0.0

    def decision_us_mean(self) -> float:
        return self.decision_us_total / self.decisions if self.decisions else 0.0


class Router:
    """Routes requests by prefix overlap and load; see the module docstring."""

    def __init__(
        self,
        tokens_per_block: int,
        policy: RoutingPolicy | str,
        load_source: LoadSource,
        hash_algo: HashAlgo | str = "v1_block_key",
        subscriber: EventSource | None = None,
        indexer: KvIndexer | None = None,
        *,
        clock: Callable[[], float] | None = None,
    ) -> None:
        if tokens_per_block <= 0:
            raise ValueError(f"tokens_per_block must be > 0, got {tokens_per_block}")
        if indexer is not None and indexer.tokens_per_block != tokens_per_block:
            raise ValueError(
                f"the indexer counts {indexer.tokens_per_block} tokens per block but the router "
                f"{tokens_per_block}: build both with the same tokens_per_block"
            )
        self.tokens_per_block = tokens_per_block
        self.policy: RoutingPolicy = make_policy(policy) if isinstance(policy, str) else policy
        self.load_source = load_source
        self.hash_algo = HashAlgo.parse(hash_algo)
        self.subscriber = subscriber
        # With V1 keys (the default) the index keys every block by the router's own hash of
        # the token ids its worker announced, so any engine's workers route (see indexer).
        self.indexer = (
            KvIndexer(tokens_per_block, key_by_tokens=self.hash_algo is HashAlgo.V1_BLOCK_KEY)
            if indexer is None
            else indexer
        )
        self.clock = clock
        self.stats = RouterStats()

    # ------------------------------------------------------------------ events

    def apply(self, worker: int, batch: DecodedBatch) -> None:
        """Apply one decoded event batch from ``worker`` to the index."""
        self.indexer.apply_batch(worker, batch)
        self.stats.batches_applied += 1

    def reset_worker(self, worker: int) -> None:
        """Forget ``worker``'s cache contents (its events were lost); later batches rebuild."""
        self.indexer.reset_worker(worker)
        self.stats.resyncs += 1
        self.stats.resyncs_by_worker[worker] += 1

    def remove_worker(self, worker: int) -> None:
        """Forget ``worker`` entirely (it left the fleet)."""
        self.indexer.remove_worker(worker)
        forget = getattr(self.policy, "forget_worker", None)
        if callable(forget):
            forget(worker)

    def poll_events(self, timeout_ms: int = 0) -> int:
        """Pull what the subscriber has (waiting at most ``timeout_ms``), apply deliveries and
        reset workers that need a resync. Returns the number of messages handled."""
        if self.subscriber is None:
            return 0
        handled = 0
        for msg in self.subscriber.poll(timeout_ms):
            if isinstance(msg, BatchDelivery):
                self.apply(msg.worker, msg.batch)
            elif isinstance(msg, ResyncRequired):
                self.reset_worker(msg.worker)
            else:
                continue
            handled += 1
        return handled

    # ----------------------------------------------------------------- routing

    def hash_request(
        self,
        tokens: Sequence[int],
        scope: ReuseScope | None = None,
        *,
        lora_id: int | None = None,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> list[BlockHash]:
        """The request's full-block keys: as its worker announces them (V1 hashes), and as
        the index keys any engine's blocks by their tokens. An adapter may be named by its id
        or, as engines that send ``lora_name`` know it, by its name."""
        if scope is not None and lora_id is None and cache_salt is None and lora_name is None:
            if (
                type(tokens) is array
                and tokens.typecode == "i"
                and self.hash_algo is HashAlgo.V1_BLOCK_KEY
            ):
                # the common case in one native call: a packed prompt under a scope (the
                # extension checks the ids' sign and raises what the general path would)
                return v1_chain_ints(  # type: ignore[return-value]  # ints are BlockHashes
                    tokens, self.tokens_per_block, scope.lora_id, scope.salt
                )
        elif scope is not None:
            raise ValueError(
                "give either a ReuseScope or lora_id/lora_name/cache_salt, not both (the scope "
                "already holds the LoRA id and salt)"
            )
        if lora_name is not None:
            if lora_id is not None:
                raise ValueError("give the adapter's lora_id or its lora_name, not both")
            lora_id = lora_name_id(lora_name)
        if scope is None:
            scope = ReuseScope.for_request(lora_id=lora_id, cache_salt=cache_salt)
        if isinstance(tokens, list):
            # the extension validates and hashes a list in one pass (packing it first would
            # double the cost); on bad ids, the packed path below gives the documented error
            try:
                return chain_hashes(tokens, self.tokens_per_block, scope, self.hash_algo)
            except (TypeError, ValueError):
                pass
        return chain_hashes(_packed(tokens), self.tokens_per_block, scope, self.hash_algo)

    def route(
        self,
        tokens: Sequence[int],
        scope: ReuseScope | None = None,
        *,
        lora_id: int | None = None,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        now_ms: float | None = None,
        block_hashes: list[BlockHash] | None = None,
    ) -> RoutingDecision:
        """Choose a worker for a prompt under a scope (or a LoRA id + cache salt string).

        ``block_hashes``: the prompt's keys when the caller has them already, exactly as
        :meth:`hash_request` gives them for this prompt and scope (not checked: the simulator
        passes those its prompt thread made, see :mod:`router_sim.sim.prefetch`).
        Raises ``router_sim.router.policies.NoWorkersError`` when the load source offers no worker.
        """
        start = time.perf_counter()
        if block_hashes is not None:
            hashes = block_hashes
        else:
            hashes = self.hash_request(
                tokens, scope, lora_id=lora_id, cache_salt=cache_salt, lora_name=lora_name
            )
        if now_ms is None:
            now_ms = self.clock() if self.clock is not None else 0.0
        source = self.load_source
        loads: Mapping[int, WorkerLoad]
        if getattr(self.policy, "reads_loads", True):
            loads = {w: source.load(w) for w in source.workers()}
        else:  # the policy picks by id: no load is read unless it asks (see LazyLoads)
            loads = LazyLoads(source, source.workers())
        matches: dict[int, MatchDetail] = self.indexer.find_matches_detailed(hashes)
        # the prompt itself, not its content key: the key is only made when a tie needs it
        request = RouteRequest(
            hashes, len(tokens), self.tokens_per_block, matches, loads, now_ms, None, tokens
        )
        choice = self.policy.choose(request)
        # every candidate at 0, then the few the index matched (no lookup per candidate)
        overlaps = dict.fromkeys(loads, 0)
        device = dict.fromkeys(loads, 0)
        best = 0  # the most any candidate holds (0 when none holds anything)
        for w, detail in matches.items():
            if w in overlaps:
                held = overlaps[w] = detail.matched_blocks
                device[w] = detail.device_run
                if held > best:
                    best = held
        chosen_overlap = overlaps.get(choice.worker, 0)
        index = self.indexer
        limited = index.limiting_groups(hashes) if index.has_groups else {}
        elapsed_us = (time.perf_counter() - start) * 1e6
        stats = self.stats
        stats.decisions += 1
        stats.decision_us_total += elapsed_us
        stats.recent_decision_us.append(elapsed_us)
        stats.chosen[choice.worker] += 1
        if chosen_overlap < best:
            stats.decisions_below_best += 1
            stats.locality_given_up_blocks += best - chosen_overlap
        return RoutingDecision(
            worker=choice.worker,
            policy=self.policy.name,
            reason=choice.reason,
            num_tokens=len(tokens),
            block_hashes=hashes,
            overlaps=overlaps,
            device_overlaps=device,
            costs=choice.costs,
            predicted_overlap=choice.predicted_overlap,
            best_overlap=best,
            chosen_overlap=chosen_overlap,
            decision_us=elapsed_us,
            limited_by={w: g for w, g in limited.items() if w in overlaps},
        )

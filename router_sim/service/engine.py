"""A simulated inference engine that runs in wall time: the heart of ``router-sim worker``.

It is the simulator's worker model (:mod:`router_sim.sim.worker`) turned inside out: instead of a
discrete-event loop over a trace, an asyncio task steps whenever requests are running and
*sleeps* for each step's duration as the timing model gives it (divided by ``speedup``), so
that a router in front of it sees real latencies, real queueing and real KV events.

What is real: the :class:`kvcache.manager.KVCacheManager` (metadata-only pages) decides the
prefix reuse, the :class:`events.manager.KVCacheEventManager` turns its changes into KV events
and the :class:`events.stream.publisher.ZmqEventPublisher` sends them with seq numbers and replay.
One
published batch per step, like an engine that drains its events every iteration.

The schedule is continuous batching kept deliberately simple: FIFO admission while the prompt
plus the requested output fits in free pages (the whole reservation is taken at admission, so
nothing is ever preempted), one decode token per running request per step plus prompt chunks
under ``max_batch_tokens``. The step that completes a prompt yields the first token.
Generated token ids are a deterministic function of the previous one, so two equal requests
produce equal answers (and equal cache blocks).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Final

from events.manager import KVCacheEventManager
from events.stream.publisher import ZmqEventPublisher
from events.wire.model import KVCacheEvent
from kvcache.config import KVCacheManagerConfig, TierConfig
from kvcache.errors import OutOfPagesError
from kvcache.manager import KVCacheManager
from kvcache.scope import ReuseScope
from kvcache.sequence import KVCache
from router_sim.router.load import WorkerLoad
from router_sim.sim.timing import StepTiming

log = logging.getLogger(__name__)

VOCAB: Final = 32_000


def next_token(prev: int) -> int:
    """The token generated after ``prev`` (a fixed LCG step: deterministic answers)."""
    return (prev * 1_103_515_245 + 12_345) % VOCAB


class RequestTooLarge(ValueError):
    """The prompt plus the requested output can never fit in this engine's device pages."""


@dataclass(eq=False, slots=True)
class LiveRequest:
    """One request inside the engine; ``tokens`` receives each generated id, then None."""

    prompt: list[int]
    max_tokens: int
    scope: ReuseScope
    tokens: asyncio.Queue[int | None] = field(default_factory=asyncio.Queue)
    cache: KVCache | None = None
    computed: int = 0
    """Prompt tokens whose KV exists (reused or computed)."""
    committed: int = 0
    """Tokens of prompt + output committed to the cache."""
    output: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    cancelled: bool = False
    finished: bool = False
    error: str | None = None
    """Why the engine gave up on this request (None: it was served or cancelled)."""

    @property
    def decoding(self) -> bool:
        return self.computed >= len(self.prompt)


@dataclass(slots=True)
class EngineStats:
    """Counters of one engine's life, as ``GET /stats`` reports them."""

    requests: int = 0
    finished: int = 0
    cancelled: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    batches_published: int = 0
    events_published: int = 0


class LiveEngine:
    """See the module docstring. Not thread-safe: use it from its event loop only."""

    def __init__(
        self,
        *,
        tokens_per_block: int,
        device_blocks: int,
        timing: StepTiming,
        publisher: ZmqEventPublisher,
        hash_algo: str = "v1_block_key",
        max_batch_tokens: int = 8192,
        max_running: int = 256,
    ) -> None:
        if tokens_per_block < 1 or device_blocks < 1 or max_batch_tokens < 1 or max_running < 1:
            raise ValueError(
                "tokens_per_block, device_blocks, max_batch_tokens and max_running must be >= 1"
            )
        self.tokens_per_block = tokens_per_block
        self.device_blocks = device_blocks
        self.timing = timing
        self.publisher = publisher
        self.max_batch_tokens = max_batch_tokens
        self.max_running = max_running
        self.events = KVCacheEventManager(
            hash_algo=hash_algo,
            max_entries=1_000_000,
            moves_as="removed_stored",
            tokens_per_block=tokens_per_block,
        )
        tiers = [TierConfig(name="device", num_blocks=device_blocks)]
        self.manager = KVCacheManager(
            KVCacheManagerConfig(tokens_per_block=tokens_per_block, tiers=tiers),
            event_sink=self.events,
        )
        self.waiting: deque[LiveRequest] = deque()
        self.running: list[LiveRequest] = []
        self.stats = EngineStats()
        self._work = asyncio.Event()
        self.last_publish = time.monotonic()

    def announce(self) -> None:
        """Publish the engine's start (Created + AllBlocksCleared as seq 0): a router that
        replays this stream from seq 0 knows the cache was empty, whatever it held before."""
        self.events.created([self.device_blocks])
        self.events.on_cleared()
        self._publish()

    def heartbeat(self) -> None:
        """Publish an empty batch. A subscriber that joins late learns the current seq from
        it and replays the history it missed, instead of waiting for the next real batch."""
        self._publish(empty=True)

    # ----------------------------------------------------------------- requests

    def submit(self, request: LiveRequest) -> None:
        """Queue a request; :class:`RequestTooLarge` when it could never be admitted."""
        need = -(-(len(request.prompt) + request.max_tokens) // self.tokens_per_block)
        if need > self.device_blocks:
            raise RequestTooLarge(
                f"prompt ({len(request.prompt)} tokens) + max_tokens ({request.max_tokens}) "
                f"need {need} KV blocks; this worker has {self.device_blocks}"
            )
        self.stats.requests += 1
        self.stats.prompt_tokens += len(request.prompt)
        self.waiting.append(request)
        self._work.set()

    def cancel(self, request: LiveRequest) -> None:
        """The client went away: stop working on ``request`` at the next step."""
        request.cancelled = True
        if request in self.waiting:
            self.waiting.remove(request)
            self.stats.cancelled += 1

    def load(self) -> WorkerLoad:
        """This engine's load in the router's terms."""
        tpb = self.tokens_per_block
        pending = sum(len(r.prompt) for r in self.waiting)
        pending += sum(len(r.prompt) - r.computed for r in self.running if not r.decoding)
        decode = sum(-(-(len(r.prompt) + len(r.output)) // tpb) for r in self.running if r.decoding)
        return WorkerLoad(
            active_requests=len(self.waiting) + len(self.running),
            pending_prefill_tokens=pending,
            kv_usage=min(1.0, max(0.0, self.manager.kv_usage(0))),
            decode_blocks=decode,
        )

    # --------------------------------------------------------------------- loop

    async def run(self) -> None:
        """Step forever (cancel the task to stop); idles without spinning when empty."""
        while True:
            self._admit()
            if not self.running:
                self._work.clear()
                await self._work.wait()
                continue
            try:
                await self._step()
            except Exception as exc:  # a bug must not wedge every later request
                log.exception("engine step failed; failing the running requests")
                self._fail_running(f"{type(exc).__name__}: {exc}")

    def _fail_running(self, why: str) -> None:
        for r in list(self.running):
            r.error = why
            r.cancelled = True
            try:
                self._finish(r)
            except Exception:
                log.exception("releasing a failed request")
                r.cache = None
                r.finished = True
                self.running.remove(r)
                r.tokens.put_nowait(None)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_running:
            r = self.waiting[0]
            try:
                cache = self.manager.create_kv_cache(r.prompt, reuse_scope=r.scope)
            except OutOfPagesError:
                return
            try:
                cache.resize(len(r.prompt) + r.max_tokens)
            except OutOfPagesError:
                cache.close()
                return  # FIFO: wait until running requests free pages
            self.waiting.popleft()
            r.cache = cache
            r.computed = r.committed = r.cached_tokens = cache.num_reused_tokens
            self.stats.cached_tokens += r.cached_tokens
            self.running.append(r)

    async def _step(self) -> None:
        for r in [r for r in self.running if r.cancelled]:
            self.stats.cancelled += 1
            self._finish(r)
        decodes = [r for r in self.running if r.decoding]
        budget = self.max_batch_tokens - len(decodes)
        chunks: list[tuple[LiveRequest, int]] = []
        for r in self.running:
            if r.decoding or budget <= 0:
                continue
            n = min(len(r.prompt) - r.computed, budget)
            chunks.append((r, n))
            budget -= n
        if not decodes and not chunks:
            return
        prefill = sum(n for _, n in chunks)
        ms = self.timing.step_ms(prefill, len(decodes), self.manager.kv_usage(0))
        await asyncio.sleep(ms / 1000.0)  # the step's compute time
        self.stats.steps += 1
        for r, n in chunks:
            r.computed += n
            self._commit(r, r.computed)
            if r.decoding:
                self._emit(r)
        for r in decodes:
            self._emit(r)
        self._publish()

    def _emit(self, r: LiveRequest) -> None:
        if r.cancelled or r.finished:
            return
        prev = r.output[-1] if r.output else (r.prompt[-1] if r.prompt else 0)
        token = next_token(prev)
        r.output.append(token)
        self.stats.generated_tokens += 1
        r.tokens.put_nowait(token)
        total = len(r.prompt) + len(r.output)
        if len(r.output) >= r.max_tokens:
            self._commit(r, total)
            self.stats.finished += 1
            self._finish(r)
        else:
            # the blocks that became full join the tree (the last token's KV comes next step)
            self._commit(r, (total - 1) // self.tokens_per_block * self.tokens_per_block)

    def _commit(self, r: LiveRequest, upto: int) -> None:
        if r.cache is None or upto <= r.committed:
            return
        seq = r.prompt if upto <= len(r.prompt) else r.prompt + r.output
        r.cache.commit(seq[r.committed : upto])
        r.committed = upto

    def _finish(self, r: LiveRequest) -> None:
        if r.cache is not None:
            if not r.cancelled:
                r.cache.stop_committing()
            r.cache.close()
            r.cache = None
        r.finished = True
        if r in self.running:
            self.running.remove(r)
        r.tokens.put_nowait(None)

    def snapshot(self) -> list[KVCacheEvent] | None:
        """The cache's announced state as Stored events (the publisher's snapshot provider):
        a router that lost this worker's stream rebuilds its view from it in one round trip."""
        return self.events.snapshot(self.manager.iter_blocks())

    def _publish(self, *, empty: bool = False) -> None:
        # events the buffer dropped become a gap (then a snapshot), never a silent loss
        batch = self.publisher.publish_drained(self.events, ts=time.time(), empty=empty)
        if batch is not None:
            self.stats.batches_published += 1
            self.stats.events_published += len(batch)
            self.last_publish = time.monotonic()

    def close(self) -> None:
        """Release every sequence (no events are published after this)."""
        for r in list(self.running):
            r.cancelled = True
            self._finish(r)
        self.waiting.clear()

"""The KV cache event manager: kvcache's event sink, producing KV cache events.

``KVCacheEventManager`` turns the cache's sink calls (stored, removed, moved, cleared) into
:class:`~events.wire.model.KVCacheEvent` records a publisher can send and a router can replay:

- each block gets an event hash derived from its tokens, its parent's event hash and the scope of
  its root (``hash_algo``, WIRE.md section 3); the hash is cached per block key and forgotten on
  removal, so a removal names exactly what was announced;
- events accumulate per iteration; :meth:`KVCacheEventManager.flush` ends the iteration,
  coalesces the pending events and moves them into a bounded buffer (oldest dropped first, every
  drop counted) with monotonically increasing event ids;
- :meth:`KVCacheEventManager.get_latest_events` drains that buffer, optionally waiting for events;
  after an overflow its first item is a loss marker (:mod:`events.loss`), so the loss shows on
  every path the drained events take.

The manager does no I/O and reads no clock; it is safe to call from several threads.

Coalescing rules (order between events is always preserved)::

    Stored(p, [A]) + Stored(A, [B])      -> Stored(p, [A, B])   same level, LoRA, salt, priority
    Removed([X], lvl) + Removed([Y], lvl) -> Removed([X, Y], lvl)
    Removed([X]) + Stored(...)            -> kept as two events, in that order
"""

from __future__ import annotations

import threading
from array import array
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final, Literal

from events.loss import loss_marker
from events.wire._records import v1_stored_block, v1_stored_chain
from events.wire.model import (
    AllBlocksCleared,
    BlockHash,
    Created,
    EventData,
    EventDiff,
    KVCacheEvent,
    Removed,
    Stored,
    StoredBlock,
    TokenIds,
    Updated,
    wire_runs,
)
from kvcache.hashing import KEY_HASHES, BlockKey, HashAlgo, v1_block_hash
from kvcache.scope import ReuseScope
from kvcache.sink import BlockView
from kvcache.tree import Block

MovesAs = Literal["updated", "removed_stored"]
_MOVES_AS: Final[tuple[str, ...]] = ("updated", "removed_stored")


def _token_ids(tokens: Sequence[int]) -> TokenIds:
    """A block's token ids for its record: the cache's ``array('i')`` itself (it never changes a
    block's array in place; records hold packed ids end to end, see ``events.wire._records``), any
    other sequence as a list."""
    return tokens if type(tokens) is array and tokens.typecode == "i" else list(tokens)


def _continues(tail: StoredBlock, parent_hash: BlockHash | None, sb: StoredBlock) -> bool:
    """Whether ``sb`` extends the Stored chain ending in ``tail``: it is ``tail``'s child and
    alike in all but tokens (tier, LoRA, salt, priority), so one event can carry both
    (:func:`events.wire.model.wire_runs`: ``tail`` is a full block of its own length)."""
    return (
        parent_hash is not None
        and tail.block_hash == parent_hash
        and wire_runs((tail, sb), len(tail.tokens)) == [2]
    )


def _no_key_hash(key: bytes) -> BlockHash:
    raise AssertionError("v1_block_key is computed from tokens, not keys")


def _parents_first(
    moved: list[tuple[BlockView, BlockHash]],
) -> list[tuple[BlockView, BlockHash]]:
    """Order moved blocks so each comes after its parent when both moved.

    The cache moves subtrees leaf first; re-storing in that order would announce a child
    whose parent was just removed and not yet stored again.
    """
    by_key = {b.key: (b, h) for b, h in moved}
    placed: set[BlockKey] = set()
    ordered: list[tuple[BlockView, BlockHash]] = []
    for block, _ in moved:
        run: list[tuple[BlockView, BlockHash]] = []
        node: BlockView | None = block
        while node is not None and node.key in by_key and node.key not in placed:
            placed.add(node.key)
            run.append(by_key[node.key])
            node = node.parent
        ordered.extend(reversed(run))
    return ordered


@dataclass(slots=True)
class _PendingStored:
    """A Stored event still open for extension within the current iteration."""

    parent_hash: BlockHash | None
    blocks: list[StoredBlock]


@dataclass(slots=True)
class _PendingRemoved:
    """A Removed event still open for merging within the current iteration."""

    block_hashes: list[BlockHash]
    cache_level: int


_Pending = _PendingStored | _PendingRemoved | EventData


def _build_events(
    pending: list[_Pending],
    first_id: int,
    block_size: int | None,
    window_size: int,
    hash_algo: str,
    dp_rank: int | None,
) -> list[KVCacheEvent]:
    """An iteration's pending items as events numbered from ``first_id``: an open Stored
    becomes a ``Stored`` of its chain, an open Removed a ``Removed``, anything else is the
    event's data as it is."""
    ready: list[KVCacheEvent] = []
    event_id = first_id
    for item in pending:
        data: EventData
        if isinstance(item, _PendingStored):
            data = Stored(item.parent_hash, item.blocks, block_size)
        elif isinstance(item, _PendingRemoved):
            data = Removed(item.block_hashes, item.cache_level)
        else:
            data = item
        ready.append(KVCacheEvent(event_id, data, window_size, hash_algo, dp_rank))
        event_id += 1
    return ready


def _chain_link(
    nxt: BlockView,
    prev: BlockView,
    tier: int,
    priority: int,
    scope: ReuseScope,
    announced: dict[BlockKey, BlockHash],
) -> array[int] | None:
    """``nxt``'s tokens when it continues the chain that ends at ``prev`` (``prev``'s child,
    full, in the same scope, tier and priority, not announced yet, its tokens packed int32s),
    else None. kvcache's own blocks (the usual ones) have their fields read natively, and
    their tokens are always an ``array('i')``."""
    if type(nxt) is Block:
        b = nxt  # narrowed to Block: its fields are read natively
        if (
            b.parent is not prev
            or not b.is_full
            or b.tier != tier
            or b.priority != priority
            or (b.scope is not scope and b.scope != scope)
            or b.key in announced
        ):
            return None
        return b.tokens
    tokens = nxt.tokens
    if (
        type(tokens) is not array
        or nxt.parent is not prev
        or not nxt.is_full
        or tokens.typecode != "i"
        or nxt.tier != tier
        or nxt.priority != priority
        or (nxt.scope is not scope and nxt.scope != scope)
        or nxt.key in announced
    ):
        return None
    return tokens


class KVCacheEventManager:
    """kvcache's :class:`~kvcache.sink.EventSink` that produces KV cache events.

    Args:
        hash_algo: ``"v1_block_key"`` (default, TensorRT-LLM V1 64-bit hashes), ``"v2_sha256"``
            (hex of the block key) or ``"v2_sha256_64"`` (first 8 bytes of the key, big-endian).
        max_entries: capacity of the event buffer; on overflow the oldest events are dropped
            and counted in :attr:`dropped_events`.
        window_size: the attention window stamped on every event (0: full attention).
        dp_rank: the attention data-parallel rank stamped on every event.
        announce_partial: also announce blocks holding fewer than ``tokens_per_block`` tokens.
        moves_as: ``"updated"`` turns a tier move into ``Updated(cache_level=EventDiff(old,
            new))``; ``"removed_stored"`` into ``Removed(old level)`` + ``Stored(new level)``
            with the same hash, tokens and parent (what the wire format expects).
        tokens_per_block: the cache's block size, stamped on Stored events as ``block_size``;
            when omitted it is learned from the first full block.
    """

    def __init__(
        self,
        hash_algo: HashAlgo | str = HashAlgo.V1_BLOCK_KEY,
        max_entries: int = 10000,
        window_size: int = 0,
        dp_rank: int | None = None,
        announce_partial: bool = False,
        moves_as: MovesAs = "updated",
        tokens_per_block: int | None = None,
    ) -> None:
        try:
            algo = HashAlgo(hash_algo)
        except ValueError:
            names = ", ".join(a.value for a in HashAlgo)
            raise ValueError(f"unknown hash_algo {hash_algo!r}; use one of: {names}") from None
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 1:
            raise ValueError(f"max_entries must be an int >= 1, got {max_entries!r}")
        if moves_as not in _MOVES_AS:
            raise ValueError(f"moves_as must be one of {_MOVES_AS}, got {moves_as!r}")
        if tokens_per_block is not None and tokens_per_block < 1:
            raise ValueError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
        self.hash_algo: Final[HashAlgo] = algo
        self.max_entries: Final[int] = max_entries
        self.window_size: Final[int] = window_size
        self.dp_rank: Final[int | None] = dp_rank
        self.announce_partial: Final[bool] = announce_partial
        self.moves_as: Final[MovesAs] = moves_as
        self._algo_name: str = algo.value
        self._v1 = algo is HashAlgo.V1_BLOCK_KEY
        # unchecked: hash_from_key's argument checks would cost more than the hash per block
        self._key_hash = KEY_HASHES.get(algo, _no_key_hash)
        self._block_size = tokens_per_block
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        # threads blocked in get_latest_events: flush notifies only when there are any
        # (Condition.notify_all checks ownership and its waiters in Python, once per flush)
        self._waiters = 0
        self._hashes: dict[BlockKey, BlockHash] = {}
        self._pending: list[_Pending] = []
        self._buffer: deque[KVCacheEvent] = deque(maxlen=max_entries)
        self._next_id = 0
        self.dropped_events = 0
        """Events dropped from the buffer because it was full (oldest first)."""
        self._dropped_untaken = 0
        self.duplicate_stores = 0
        """Stored calls for blocks already announced (ignored; a cache bug if ever non-zero)."""

    # ----------------------------------------------------------------------------- hashing

    def _hash_block(self, block: BlockView, parent_hash: BlockHash | None) -> BlockHash:
        if self._v1:
            scope = block.scope
            parent = 0 if parent_hash is None else int(parent_hash)
            return v1_block_hash(block.tokens, parent, lora_id=scope.lora_id, salt_id=scope.salt)
        return self._key_hash(block.key)

    def _record(self, block: BlockView, parent_hash: BlockHash | None) -> StoredBlock:
        """The Stored record announcing ``block``, hashed under ``parent_hash``."""
        scope = block.scope
        tokens = block.tokens
        # Blocks in the tree hold token ids kvcache validated on entry, packed as int32s, and
        # parent hashes are values computed here: one native call hashes such a block and
        # builds its record, skipping v1_block_hash's per-call checks (they would triple the
        # cost of the hash).
        if self._v1 and type(tokens) is array and tokens.typecode == "i":
            parent = 0 if parent_hash is None else int(parent_hash)
            return v1_stored_block(
                tokens, parent, scope.lora_id, scope.salt, block.tier, block.priority
            )
        h = self._hash_block(block, parent_hash)
        return StoredBlock(
            h, _token_ids(tokens), scope.lora_id, block.tier, block.priority, scope.salt
        )

    def _parent_hash(self, block: BlockView) -> BlockHash | None:
        """The event hash of ``block``'s parent; None for a first block.

        A parent that was never announced (the sink was attached after it was stored) is hashed
        from its own chain, without caching it: its removal must not be announced either.
        """
        parent = block.parent
        if parent is None:
            return None
        known = self._hashes.get(parent.key)
        if known is not None:
            return known
        chain: list[BlockView] = []
        node: BlockView | None = parent
        h: BlockHash | None = None
        while node is not None:
            known = self._hashes.get(node.key)
            if known is not None:
                h = known
                break
            chain.append(node)
            node = node.parent
        for missing in reversed(chain):
            h = self._hash_block(missing, h)
        return h

    def hash_of(self, block: BlockView) -> BlockHash | None:
        """The event hash announced for ``block``, or None if it is not announced now."""
        with self._lock:
            return self._hashes.get(block.key)

    @property
    def num_announced(self) -> int:
        """Blocks announced as stored and not removed since."""
        with self._lock:
            return len(self._hashes)

    # ------------------------------------------------------------------------- sink calls

    def _append_stored(
        self, parent_hash: BlockHash | None, sb: StoredBlock, pending: list[_Pending]
    ) -> None:
        """Extend the last pending Stored when ``sb`` continues its chain, else open a new one."""
        if pending:
            last = pending[-1]
            if isinstance(last, _PendingStored) and _continues(last.blocks[-1], parent_hash, sb):
                last.blocks.append(sb)
                return
        pending.append(_PendingStored(parent_hash, [sb]))

    def _append_removed(self, h: BlockHash, cache_level: int, pending: list[_Pending]) -> None:
        if pending:
            last = pending[-1]
            if isinstance(last, _PendingRemoved) and last.cache_level == cache_level:
                last.block_hashes.append(h)
                return
        pending.append(_PendingRemoved([h], cache_level))

    def on_stored(self, blocks: Sequence[BlockView], hashes: Sequence[int] | None = None) -> None:
        """Announce blocks that joined the tree (partial ones only with ``announce_partial``).

        ``hashes``: the V1 hashes of the first blocks when the cache was given them
        (``create_kv_cache(sink_hashes=...)``), taken as they are under ``v1_block_key`` and
        ignored under the other algorithms."""
        chains = self._v1  # v2_* hash block keys: one record per block
        known_all = hashes if chains and hashes else None
        with self._lock:
            announced = self._hashes
            pending = self._pending
            # The open chain: the last pending Stored's blocks, which a block extends when it
            # is the next link with the same attributes (_continues, as _append_stored).
            last = pending[-1] if pending else None
            run = last.blocks if isinstance(last, _PendingStored) else None
            tail = run[-1] if run else None
            i, count = 0, len(blocks)
            while i < count:
                block = blocks[i]
                i += 1
                if not block.is_full:
                    if not self.announce_partial:
                        continue
                elif self._block_size is None:
                    self._block_size = len(block.tokens)
                key = block.key
                if key in announced:
                    self.duplicate_stores += 1
                    continue
                # the usual case inline: the parent was announced (by this call, mostly)
                parent = block.parent
                parent_hash = None if parent is None else announced.get(parent.key)
                if parent_hash is None and parent is not None:
                    parent_hash = self._parent_hash(block)
                tokens = block.tokens
                records: list[StoredBlock] | None = None
                if chains and type(tokens) is array and tokens.typecode == "i":
                    # A commit lists a chain: each next block is the previous one's child, in
                    # the same scope, tier and priority. One native call hashes such a run of
                    # blocks (packed int32 tokens, validated by kvcache on entry) and builds
                    # its records, skipping v1_block_hash's per-call checks.
                    scope, tier, priority = block.scope, block.tier, block.priority
                    prev = block
                    chain_keys = [key]
                    arrays: list[array[int]] = [tokens]
                    while i < count:
                        nxt = blocks[i]
                        nxt_tokens = _chain_link(nxt, prev, tier, priority, scope, announced)
                        if nxt_tokens is None:
                            break  # the outer loop takes it from here
                        prev = nxt
                        chain_keys.append(nxt.key)
                        arrays.append(nxt_tokens)
                        i += 1
                    parent_int = 0 if parent_hash is None else int(parent_hash)
                    start = i - len(chain_keys)
                    known = (
                        list(known_all[start:i])
                        if known_all is not None and start < len(known_all)
                        else None
                    )
                    records = v1_stored_chain(
                        arrays, parent_int, scope.lora_id, scope.salt, tier, priority, known
                    )
                    for k, rec in zip(chain_keys, records, strict=True):
                        announced[k] = rec.block_hash
                    sb = records[0]
                else:
                    sb = self._record(block, parent_hash)
                    announced[key] = sb.block_hash
                # the records of one chain continue each other: only its first one is checked
                if tail is not None and run is not None and _continues(tail, parent_hash, sb):
                    if records is None:
                        run.append(sb)
                    else:
                        run.extend(records)
                else:
                    run = [sb] if records is None else records
                    pending.append(_PendingStored(parent_hash, run))
                tail = sb if records is None else records[-1]

    def on_removed(self, blocks: Sequence[BlockView]) -> None:
        """Announce blocks that left the tree; blocks never announced stay silent."""
        with self._lock:
            hashes = self._hashes
            pending = self._pending
            for block in blocks:
                h = hashes.pop(block.key, None)
                if h is not None:
                    self._append_removed(h, block.tier, pending)

    def on_moved(self, blocks: Sequence[BlockView], old_tier: int, new_tier: int) -> None:
        """Announce a tier move as Updated events or as a Removed + Stored pair (``moves_as``)."""
        with self._lock:
            hashes = self._hashes
            pending = self._pending
            moved = [(b, hashes[b.key]) for b in blocks if b.key in hashes]
            if not moved:
                return
            if self.moves_as == "updated":
                diff = EventDiff(old_tier, new_tier)
                for _, h in moved:
                    pending.append(Updated(h, cache_level=diff))
                return
            for _, h in moved:
                self._append_removed(h, old_tier, pending)
            for block, h in _parents_first(moved):
                scope = block.scope
                sb = StoredBlock(
                    h,
                    _token_ids(block.tokens),
                    scope.lora_id,
                    new_tier,
                    block.priority,
                    scope.salt,
                )
                self._append_stored(self._parent_hash(block), sb, pending)

    def on_cleared(self) -> None:
        """Announce that every reusable block was dropped, and forget all hashes."""
        with self._lock:
            self._hashes.clear()
            self._pending.append(AllBlocksCleared())

    def created(self, num_blocks_per_level: Sequence[int]) -> None:
        """Queue a Created event announcing the cache's capacity per cache level."""
        with self._lock:
            self._pending.append(Created(list(num_blocks_per_level)))

    # ------------------------------------------------------------------- buffer and drain

    def flush(self) -> int:
        """End the current iteration: move its coalesced events into the buffer.

        Returns the number of events produced. When the buffer overflows, the oldest events are
        dropped and counted in :attr:`dropped_events`; their event ids are not reused.
        """
        with self._lock:
            return self._flush()

    def _take_pending(self, pending: list[_Pending]) -> list[KVCacheEvent]:
        """The iteration's ``pending`` items as numbered events; the iteration ends."""
        self._pending = []
        ready = _build_events(
            pending,
            self._next_id,
            self._block_size,
            self.window_size,
            self._algo_name,
            self.dp_rank,
        )
        self._next_id += len(ready)
        return ready

    def _flush(self) -> int:
        """:meth:`flush`'s work; the caller holds the lock."""
        pending = self._pending
        if not pending:
            return 0
        ready = self._take_pending(pending)
        overflow = len(self._buffer) + len(ready) - self.max_entries
        if overflow > 0:
            self.dropped_events += overflow
            self._dropped_untaken += overflow
        self._buffer.extend(ready)  # the deque's maxlen discards the oldest
        if self._waiters:
            self._ready.notify_all()
        return len(ready)

    def end_step(self) -> tuple[list[KVCacheEvent], int]:
        """:meth:`flush`, then :meth:`take_dropped` and :meth:`get_latest_events` (without
        waiting) in one call: an engine's end of iteration, once per step (three calls took
        the lock three times, mostly to find nothing). Returns (events, dropped)."""
        with self._lock:
            pending = self._pending
            if pending:
                if (
                    not self._buffer
                    and not self._dropped_untaken
                    and len(pending) <= self.max_entries
                ):
                    # the usual step: nothing is buffered and nothing overflows, so the events
                    # go straight out (the buffer would hand back just them, and a waiter in
                    # get_latest_events would find it drained again)
                    return self._take_pending(pending), 0
                self._flush()
            elif not self._buffer and not self._dropped_untaken:
                return [], 0
            dropped, self._dropped_untaken = self._dropped_untaken, 0
            events = list(self._buffer)
            self._buffer.clear()
            return events, dropped

    def get_latest_events(self, timeout_ms: float = 0) -> list[KVCacheEvent]:
        """Drain the buffer, oldest first.

        With ``timeout_ms > 0`` and an empty buffer, wait until :meth:`flush` produces events or
        the timeout passes (then return an empty list).

        When the full buffer dropped events since the last drain (and :meth:`take_dropped` did
        not take the count), the first item is a loss marker standing for them
        (:mod:`events.loss`), not an event: ``ZmqEventPublisher.publish`` turns it into a gap
        and the codec refuses it, so what follows never passes for a complete history.
        """
        with self._lock:  # the condition's own lock (its __enter__ is a Python-level call)
            if not self._buffer and timeout_ms > 0:
                self._waiters += 1
                try:
                    self._ready.wait_for(lambda: bool(self._buffer), timeout_ms / 1000.0)
                finally:
                    self._waiters -= 1
            events = list(self._buffer)
            self._buffer.clear()
            lost = self._dropped_untaken
            if lost:
                self._dropped_untaken = 0
                # the dropped events are the ones just before the oldest kept (drops take the
                # oldest, and a drain takes everything): their ids are contiguous
                first = (events[0].event_id if events else self._next_id) - lost
                marker = loss_marker(first, lost, self.window_size, self._algo_name, self.dp_rank)
                events.insert(0, marker)
            return events

    def take_dropped(self) -> int:
        """Events dropped by the full buffer since the last call or drain (0: the drained
        history is whole). A publisher must make such a loss visible before it publishes what
        is drained next (``ZmqEventPublisher.publish_drained`` does: ``if mgr.take_dropped():
        publisher.skip()``): subscribers then see a gap that no replay fills, and recover by
        snapshot instead of keeping a silently wrong view. The count taken here is no longer
        marked in what :meth:`get_latest_events` drains next."""
        with self._lock:
            dropped, self._dropped_untaken = self._dropped_untaken, 0
            return dropped

    def snapshot(self, blocks: Iterable[BlockView]) -> list[KVCacheEvent] | None:
        """The announced state as ``Stored`` events, one chain per run of the tree; None when it
        would not match the events handed out so far (some are pending or still buffered).

        ``blocks`` is the cache's content, each block after its parent
        (``KVCacheManager.iter_blocks()``): the tree is the truth, so blocks whose Stored
        events were dropped by a full buffer are included and blocks whose removal was
        dropped are not. Only announced blocks appear (partial ones only with
        ``announce_partial``), under the hashes and tiers they have now. Call it on the thread
        that drives the cache, right after draining and publishing: the result is then the
        state every published batch adds up to.
        """
        with self._lock:
            if self._pending or self._buffer:
                return None
            hashes = self._hashes
            runs: list[tuple[BlockHash | None, list[StoredBlock]]] = []
            run: list[StoredBlock] = []
            tail: StoredBlock | None = None
            for block in blocks:
                h = hashes.get(block.key)
                if h is None:
                    continue
                parent = block.parent
                parent_hash = None if parent is None else hashes.get(parent.key)
                if parent_hash is None and parent is not None:
                    parent_hash = self._parent_hash(block)
                scope = block.scope
                # the block's hash is known and its packed tokens are shared, not converted
                sb = StoredBlock(
                    h,
                    _token_ids(block.tokens),
                    scope.lora_id,
                    block.tier,
                    block.priority,
                    scope.salt,
                )
                if tail is not None and _continues(tail, parent_hash, sb):
                    run.append(sb)
                else:
                    run = [sb]
                    runs.append((parent_hash, run))
                tail = sb
            block_size = self._block_size
            return [
                KVCacheEvent(
                    i,
                    Stored(parent_hash, chain, block_size),
                    self.window_size,
                    self._algo_name,
                    self.dp_rank,
                )
                for i, (parent_hash, chain) in enumerate(runs)
            ]

    @property
    def num_pending(self) -> int:
        """Events of the current iteration, before coalescing is final (not yet flushed)."""
        with self._lock:
            return len(self._pending)

    @property
    def next_event_id(self) -> int:
        """The id the next flushed event will get."""
        with self._lock:
            return self._next_id

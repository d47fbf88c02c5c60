"""The router's picture of every worker's KV cache, rebuilt from KV cache events alone.

Layout (chosen for memory and for a matching loop that runs in C)::

    device mask of h -> bitmask of workers holding block h on the device tier (cache_level 0)
    _slower[h]   -> bitmask of workers holding block h on any slower tier (cache_level >= 1)
    _held[w][h]  -> bitmask of the cache levels at which worker w holds block h

The device masks live in the native table for int keys in [0, 2**64) (every key a worker or
the router hashes), and in ``_device`` (a dict) for the others (hex strings, out-of-range ints,
group-scoped pairs).

``_held`` is the source of truth (it makes ``reset_worker`` O(that worker's blocks) and lets
removals and moves be checked); the two global maps are derived from it so that matching a
request touches one or two dict lookups per block whatever the number of workers. Each worker
gets a bit; bits are recycled when a worker is removed.

At a million entries those lookups miss the CPU caches several times each (index slot, entry,
key object, value object), one after the other. So ``find_matches`` runs natively, in the
extension ``router_sim.router._match``: ``_table`` holds, for every int key, the
mask of workers holding it on any tier (bit w set iff the key is in ``_held`` of the worker
whose bit is w) and its device mask, one slot per key in an open-addressing table whose
masks are as many 64-bit words as the fleet's highest bit needs (24 bytes a slot up to 64
workers, 48 up to 128, ...), and a request's slots are fetched ahead so their misses overlap
(89 -> 14 us p50 over distinct 256-block requests at 1M entries, bench_router.py). The Python
matching loop (``_find_matches_general``) serves requests naming keys the table does not hold
(strings, ints outside [0, 2**64)).

Updates are Python, and the two that dominate a busy stream run as passes over each
event's blocks in C (dict methods, ``map``, one table call per event): storing blocks on the
device tier (``_store_device``) and evicting blocks held on the device tier only (the common
case of ``_evict``). A store's block at another level goes through ``_store_deeper``; a
removal naming anything else (a slower tier, a copy kept elsewhere, an unknown block, a
block twice) takes the per-block removal loop whole, as do removals naming a KV-cache group
or a slower tier only. (Native store and eviction loops were measured at 1.28-1.33x on the
keyed index updates of ``scripts/bench_router.py``: below the bar for native code.) The tests
check all of it against a plain model of who holds what (``tests/_reference.py``).

Matching exploits that a prefix-AND of worker bitmasks is numerically non-increasing (a
subset of a set of bits is never a larger integer): ``accumulate(masks, and_)`` gives, at
position i, the workers holding every block up to i, ``takewhile`` stops when nobody is left,
and a bisection finds where each worker drops out.

Engine-agnostic keys: engines announce their own block hashes (vLLM: sha256 of CBOR with a
process seed, or xxhash; SGLang: its own chain), which no router can recompute from a prompt.
So the index is keyed by the router's own key of each block, the V1 hash (``kvcache.hashing``)
of the token ids the ``BlockStored`` carries, chained through its parent's key, under the
scope the event carries: the LoRA (its name when sent, else its id), the cache salt (this
project's ``cache_salt_id``, SGLang's ``cache_salt``, vLLM's salt in ``extra_keys``), and the
KV-cache group (``group_idx``; a group other than 0 is its own key space). Each worker keeps a
map engine hash -> key for the blocks whose keys differ from their hashes (removals, parents and
placeholder stores name engine hashes); a worker that hashes as the router does (this
project's workers, TensorRT-LLM's V1 hashes) needs no map. Blocks announced without token ids
(placeholders, masked stores) take the key their hash already has, else their engine hash,
and :meth:`KvIndexer.worker_status` says how a worker's blocks are keyed.

Anomalies (removal of an unknown block, a block size other than the router's, a stored chain
whose parent the worker does not hold, a move of an unknown block, a block with no tokens and
no known key) are counted per kind and per worker and never abort the rest of a batch.
"""

from __future__ import annotations

import dataclasses
import logging
from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import accumulate, compress, islice, repeat, takewhile
from operator import and_, attrgetter, is_not, neg, or_
from typing import Final, TypeAlias, cast

from events.wire.model import (
    AllBlocksCleared,
    BlockHash,
    Created,
    DecodedBatch,
    KVCacheEvent,
    Removed,
    Stored,
    StoredBlock,
    Updated,
)
from kvcache import hashing
from kvcache.scope import cache_salt_id
from router_sim.router._match import MaskTable

log = logging.getLogger(__name__)

#: anomaly kinds (keys of :attr:`KvIndexer.anomalies`)
UNKNOWN_REMOVAL: Final = "unknown_removal"
BLOCK_SIZE_MISMATCH: Final = "block_size_mismatch"
UNKNOWN_PARENT: Final = "unknown_parent"
UNKNOWN_UPDATE: Final = "unknown_update"
UNKEYED_BLOCK: Final = "unkeyed_block"
LEVEL_OUT_OF_RANGE: Final = "level_out_of_range"
ANOMALY_KINDS: Final[tuple[str, ...]] = (
    UNKNOWN_REMOVAL,
    BLOCK_SIZE_MISMATCH,
    UNKNOWN_PARENT,
    UNKNOWN_UPDATE,
    UNKEYED_BLOCK,
    LEVEL_OUT_OF_RANGE,
)
#: what an engine's ``AllBlocksCleared`` empties (:meth:`KvIndexer.set_clear_scope`)
CLEAR_SCOPES: Final[tuple[str, ...]] = ("device", "all")
#: the scope each engine means (engines not named: by the worker's keying). vLLM emits
#: AllBlocksCleared from BlockPool.reset_prefix_cache, its GPU prefix cache (the offloading
#: connector's copies stay); SGLang's cache reset rebuilds its radix tree and clears the host
#: pool (mem_pool_host.clear()) before it records the event.
ENGINE_CLEAR_SCOPES: Final[dict[str, str]] = {"vllm": "device", "sglang": "all"}


def engine_clear_scope(engine: str) -> str | None:
    """What ``engine``'s AllBlocksCleared empties (None: decided by the worker's keying)."""
    return ENGINE_CLEAR_SCOPES.get(engine)


MAX_CACHE_LEVEL: Final = 2047
"""Highest cache level the index keeps: every level events.wire.model hands out fits (ours 0-2,
engines' media 64-68, other names 96-1120). A level is a bit of a per-block mask, so a stream
saying ``TIER9999999`` or level 2**64-1 would cost megabytes per block or raise MemoryError;
such a block (or removal, or update) is counted as ``level_out_of_range`` and skipped."""
_MASK64: Final = (1 << 64) - 1
#: per worker, how many dropped blocks keep their engine hash -> key mapping (see _recent)
RECENT_KEYS: Final = 4096
_GROUP_MUL: Final = 0x9E3779B97F4A7C15  # odd: distinct groups give distinct masks


def lora_name_id(name: str) -> int:
    """The LoRA id a router uses for an adapter known by name (engines that send
    ``lora_name`` key by it; requests name the adapter the same way): ``cache_salt_id(name)``."""
    return cache_salt_id(name)


#: vLLM's KV-cache spec kinds (kv_cache_spec_kind) of sliding-window groups: a store names only
#: the blocks inside the window (the ones before it are null), its token ids cover them all
SLIDING_KINDS: Final = frozenset({"sliding_window", "sliding_window_mla"})
#: kinds whose groups must hold the whole prefix, as vLLM's full-attention groups
FULL_KINDS: Final = frozenset({"full_attention", "mla_attention", "sink_full_attention"})


def sliding_hit(held: Callable[[int], bool], length: int, window_blocks: int) -> int:
    """vLLM's prefix hit of a sliding-window group (``SlidingWindowManager.
    find_longest_cache_hit``) within the first ``length`` blocks: scanning from the end, the
    end of the first run of ``window_blocks`` blocks it holds; if there is none, the run it
    holds from the first block. ``held(i)``: whether it holds block ``i``."""
    run = 0
    for i in range(length - 1, -1, -1):
        if held(i):
            run += 1
            if run >= window_blocks:
                return i + run
        else:
            run = 0
    return run


def _group_mask(group: int | None) -> int:
    """XORed into the keys of a KV-cache group other than 0, so that the same block in two
    groups is two entries (and undone to chain a child to its parent)."""
    return 0 if not group else (group * _GROUP_MUL) & _MASK64 or 1


# the V1 key of each block's token ids in turn, chained from a parent, in one native call;
# stops before the first block without tokens (token ids as lists or arrays)
_chain_lists = cast(
    "Callable[[list[Sequence[int]], int, int | None, int | None], list[int]]",
    hashing.v1_chain_blocks,
)


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    """How a worker's blocks are keyed.

    ``keying``: ``"tokens"`` (every block keyed from its token ids, so requests find them),
    ``"engine_hashes"`` (its events carry no token ids: its blocks are keyed by its own hashes
    and only requests hashed as it hashes can find them), ``"mixed"``, or ``"none"`` (nothing
    stored yet). ``native``: its hashes equal the router's keys (no map needed).
    """

    keying: str
    keyed_by_tokens: int
    keyed_by_engine_hash: int
    native: bool
    mapped: int


_ZEROS: Final = repeat(0)
_ONES: Final = repeat(1)
_NONES: Final = repeat(None)
_SINK: Final[deque[object]] = deque(maxlen=0)
_consume: Final = _SINK.extend  # runs an iterator to its end in C
_BLOCK_HASH: Final = attrgetter("block_hash")
_CACHE_LEVEL: Final = attrgetter("cache_level")
_TOKENS: Final = attrgetter("tokens")

#: what the index is keyed by: the router's key of a block (an int), or a worker's own hash
#: (an int or hex string; with its group when not 0) where no key could be computed
IndexKey: TypeAlias = BlockHash | tuple[BlockHash, int]


@dataclass(frozen=True, slots=True)
class MatchDetail:
    """How much of a request's block chain one worker holds.

    ``matched_blocks``: longest run of the request's blocks from the first that the worker
    holds on any tier. ``device_run``: the same run counted on the device tier only.
    ``device_blocks`` / ``slower_blocks``: within the ``matched_blocks`` run, blocks whose
    fastest copy is on the device tier / on a slower tier (they sum to ``matched_blocks``).
    """

    matched_blocks: int
    device_run: int
    device_blocks: int
    slower_blocks: int


_MATCH_DETAIL_FIELDS: Final = tuple(
    getattr(MatchDetail, f.name) for f in dataclasses.fields(MatchDetail)
)
"""MatchDetail's slots (data descriptors), in its ``__init__``'s order: the native table sets
them as that ``__init__`` does (it does nothing else), without a Python call per worker."""


class KvIndexer:
    """Block hash -> workers (with tier), fed by decoded event batches per worker."""

    def __init__(self, tokens_per_block: int, *, key_by_tokens: bool = False) -> None:
        """``key_by_tokens``: key blocks by the router's own hash of the token ids each store
        carries (engine-agnostic; what :class:`~router_sim.router.routing.Router` uses by default);
        False keys them by the hashes the workers announce, which requests must then be
        hashed as (this project's workers, V1-hashing engines)."""
        if tokens_per_block <= 0:
            raise ValueError(f"tokens_per_block must be > 0, got {tokens_per_block}")
        self.tokens_per_block: Final = tokens_per_block
        self.key_by_tokens: Final = key_by_tokens
        self._device: dict[IndexKey, int] = {}
        self._slower: dict[IndexKey, int] = {}
        self._held: dict[int, dict[IndexKey, int]] = {}
        self._bit_of: dict[int, int] = {}
        self._worker_of_bit: dict[int, int] = {}
        self._free_bits: list[int] = []
        self._anomalies: dict[str, int] = dict.fromkeys(ANOMALY_KINDS, 0)
        self._worker_anomalies: dict[int, dict[str, int]] = {}
        self._flagged: dict[int, int] = {}  # worker -> the block size it announced
        # worker -> {engine hash (or (hash, group)) -> key}, only where the two differ
        self._keys: dict[int, dict[IndexKey, int]] = {}
        # worker -> the same for its most recently dropped blocks (bounded): engines announce
        # a tier move as removed-then-stored, the store a placeholder naming the hash only
        self._recent: dict[int, dict[IndexKey, int]] = {}
        # worker -> {(key, level) -> announcements beyond the first} (slower tiers count)
        self._refs: dict[int, dict[tuple[IndexKey, int], int]] = {}
        # worker -> [blocks keyed by tokens, by engine hash, blocks whose key equals the hash]
        self._keying: dict[int, list[int]] = {}
        # worker -> what its AllBlocksCleared empties, where its engine says (set_clear_scope)
        self._clear_scope: dict[int, str] = {}
        # worker -> {KV-cache group other than 0 -> (its spec kind, blocks a hit needs in it:
        # 0 for a full-attention group)}: the groups that also decide a prefix hit (hybrid)
        self._groups: dict[int, dict[int, tuple[str, int]]] = {}
        # the native table of which workers hold each int key, on any tier and on the device
        # tier (the device masks of other keys: in _device, which it reads and writes)
        self._table: Final = MaskTable(self._device)
        self.batches_applied = 0
        self.events_applied = 0

    # ------------------------------------------------------------------ workers

    def _bit(self, worker: int) -> int:
        bit = self._bit_of.get(worker)
        if bit is None:
            bit = self._free_bits.pop() if self._free_bits else len(self._bit_of)
            self._bit_of[worker] = bit
            self._worker_of_bit[bit] = worker
            self._held[worker] = {}
            self._keys[worker] = {}
            self._recent[worker] = {}
            self._refs[worker] = {}
            self._keying[worker] = [0, 0, 0]
        return bit

    @property
    def workers(self) -> list[int]:
        """Workers that have sent at least one batch and were not removed since."""
        return list(self._bit_of)

    def block_count(self, worker: int) -> int:
        """Distinct blocks ``worker`` holds on any tier (0 for an unknown worker)."""
        held = self._held.get(worker)
        return 0 if held is None else len(held)

    def total_entries(self) -> int:
        """(block, worker) pairs indexed: the unit of the memory budget."""
        return sum(len(h) for h in self._held.values())

    def reset_worker(self, worker: int) -> None:
        """Forget everything ``worker`` holds (after lost events), keeping it known.

        O(that worker's blocks). Later batches rebuild its view from scratch.
        """
        held = self._held.get(worker)
        if not held:
            return
        bit = 1 << self._bit_of[worker]
        keep = ~bit
        slower = self._slower
        for h, levels in held.items():
            if levels >> 1:
                m = slower[h] & keep
                if m:
                    slower[h] = m
                else:
                    del slower[h]
        self._device_bit([h for h, levels in held.items() if levels & 1], bit, False)
        self._table.clear_bit(list(held), self._bit_of[worker])
        held.clear()
        self._keys[worker].clear()
        self._recent[worker].clear()
        self._refs[worker].clear()

    def set_clear_scope(self, worker: int, scope: str | None) -> None:
        """What an ``AllBlocksCleared`` from ``worker`` empties, as its engine means it:
        ``"device"``, its device tier only (vLLM: ``BlockPool.reset_prefix_cache`` resets the
        GPU prefix cache; offloaded copies stay), or ``"all"``, every tier (SGLang: its cache
        reset rebuilds the radix tree and clears the host pool; this project's cache manager).
        None (the default): by how the worker keys its blocks, ``"all"`` for one that hashes
        as the router does (this project's workers, V1-hashing engines), else ``"device"``.
        The setting outlives :meth:`remove_worker` (it describes the worker's engine)."""
        if scope is None:
            self._clear_scope.pop(worker, None)
        elif scope in CLEAR_SCOPES:
            self._clear_scope[worker] = scope
        else:
            raise ValueError(f"clear scope must be one of {CLEAR_SCOPES} or None, got {scope!r}")

    def clear_scope(self, worker: int) -> str | None:
        """The scope set by :meth:`set_clear_scope` (None: decided by the worker's keying)."""
        return self._clear_scope.get(worker)

    def remove_worker(self, worker: int) -> None:
        """Drop ``worker`` and all it holds; its bit is recycled. O(that worker's blocks)."""
        if worker not in self._bit_of:
            return
        self.reset_worker(worker)
        bit = self._bit_of.pop(worker)
        del self._worker_of_bit[bit]
        del self._held[worker]
        del self._keys[worker]
        del self._recent[worker]
        del self._refs[worker]
        del self._keying[worker]
        self._groups.pop(worker, None)
        self._free_bits.append(bit)
        self._flagged.pop(worker, None)

    def key_of(self, worker: int, block_hash: BlockHash, group: int | None = None) -> IndexKey:
        """The index key under which ``worker``'s block ``block_hash`` (an engine hash) is held
        (the hash itself where the worker's hash is the key)."""
        return self._key_of(self._keys.get(worker, {}), block_hash, group)

    def worker_status(self, worker: int) -> WorkerStatus:
        """How ``worker``'s blocks are keyed (see :class:`WorkerStatus`)."""
        by_tokens, by_hash, same = self._keying.get(worker, [0, 0, 0])
        if by_tokens and by_hash:
            keying = "mixed"
        elif by_tokens:
            keying = "tokens"
        elif by_hash:
            keying = "engine_hashes"
        else:
            keying = "none"
        mapped = len(self._keys.get(worker, {}))
        return WorkerStatus(keying, by_tokens, by_hash, by_tokens > 0 and same == by_tokens, mapped)

    # ---------------------------------------------------------------- anomalies

    @property
    def anomalies(self) -> dict[str, int]:
        """Anomaly counts by kind, over all workers (a copy)."""
        return dict(self._anomalies)

    def worker_anomalies(self, worker: int) -> dict[str, int]:
        """Anomaly counts by kind for one worker (a copy; zeros for a clean worker)."""
        counts = dict.fromkeys(ANOMALY_KINDS, 0)
        counts.update(self._worker_anomalies.get(worker, {}))
        return counts

    @property
    def flagged_workers(self) -> dict[int, int]:
        """Workers whose events carry another block size -> the size they announced.

        Their blocks never match the router's request hashes: fix the worker's or the
        router's ``tokens_per_block``.
        """
        return dict(self._flagged)

    def _anomaly(self, worker: int, kind: str, count: int = 1) -> None:
        self._anomalies[kind] += count
        per = self._worker_anomalies.setdefault(worker, {})
        per[kind] = per.get(kind, 0) + count

    # ------------------------------------------------------------------ updates

    def apply_batch(self, worker: int, batch: DecodedBatch) -> None:
        """Apply one decoded batch from ``worker``, in order. Never raises on odd content."""
        self.apply_events(worker, batch.events)
        self.batches_applied += 1

    def apply_events(self, worker: int, events: Sequence[KVCacheEvent]) -> None:
        """Apply events from ``worker`` in order (what :meth:`apply_batch` does)."""
        bit = 1 << self._bit(worker)
        held = self._held[worker]
        for event in events:
            data = event.data
            if isinstance(data, Stored):
                if self.key_by_tokens:
                    self._stored_by_key(worker, bit, held, data)
                else:
                    self._stored_by_hash(worker, bit, held, data)
            elif isinstance(data, Removed):
                # a worker with no mapped hashes, no counted copies and no groups (this
                # project's, a V1 engine's) removes as by hash
                keyed = self.key_by_tokens and bool(
                    data.group or self._keys[worker] or self._refs[worker]
                )
                self._removed(worker, bit, held, data, keyed)
            elif isinstance(data, Updated):
                self._updated(worker, bit, held, data)
            elif isinstance(data, AllBlocksCleared):
                self._cleared(worker)
            elif isinstance(data, Created):
                pass  # capacity announcement: nothing cached yet
            self.events_applied += 1

    def _cleared(self, worker: int) -> None:
        """An ``AllBlocksCleared`` empties what the worker's engine means by it
        (:meth:`set_clear_scope`): vLLM resets its device prefix cache, slower-tier copies
        stay; SGLang and this project's manager clear every tier, so the whole view goes. Not
        set: a worker that hashes as the router does clears every tier, others the device."""
        scope = self._clear_scope.get(worker)
        if scope is None:
            by_tokens, _, same = self._keying[worker]
            everything = not self.key_by_tokens or (by_tokens > 0 and same == by_tokens)
            scope = "all" if everything else "device"
        if scope == "all":
            self.reset_worker(worker)
            return
        held = self._held[worker]
        bit = 1 << self._bit_of[worker]
        keys = self._keys[worker]
        on_device = [h for h, levels in held.items() if levels & 1]
        for h in on_device:
            self._drop_levels(bit, held, h, held[h], 1)
        self._mirror(on_device, bit, held)
        if keys:
            recent = self._recent[worker]
            for ek, k in list(keys.items()):
                if k not in held:
                    self._retire(recent, ek, keys.pop(ek))

    @staticmethod
    def _retire(recent: dict[IndexKey, int], ek: IndexKey, key: int) -> None:
        """Remember the key of a block a worker no longer holds, for a while: the newest
        RECENT_KEYS to RECENT_KEYS * 2 memories are kept (the oldest half goes at once, so each
        removal costs one insertion plus an amortized deletion)."""
        recent[ek] = key
        if len(recent) > 2 * RECENT_KEYS:
            KvIndexer._trim(recent)

    @staticmethod
    def _trim(recent: dict[IndexKey, int]) -> None:
        """Keep the newest RECENT_KEYS memories of dropped blocks (the oldest deleted in
        place: no copy of the pairs kept)."""
        for ek in list(islice(recent, len(recent) - RECENT_KEYS)):
            del recent[ek]

    def _check_block_size(self, worker: int, data: Stored) -> None:
        size = data.block_size
        first = len(data.blocks[0].tokens)
        if not first:
            return  # a placeholder or masked store: its block_size says nothing of ours
        if size is None or (size == first and len(data.blocks) == 1):
            # Without an announced size (or with one that is only this lone block's length,
            # as engines send for a trailing partial page), only a chain of several blocks,
            # or one too long, proves a different size.
            size = None
            if first > self.tokens_per_block or (
                len(data.blocks) > 1 and first != self.tokens_per_block
            ):
                size = first
        if size is None or size == self.tokens_per_block:
            return
        self._anomaly(worker, BLOCK_SIZE_MISMATCH)
        if worker not in self._flagged:
            self._flagged[worker] = size
            log.warning(
                "worker %d sends blocks of %d tokens but this router hashes requests in blocks "
                "of %d tokens: none of its blocks can ever match; configure both with the same "
                "tokens_per_block",
                worker,
                size,
                self.tokens_per_block,
            )

    def _key_of(self, keys: dict[IndexKey, int], h: BlockHash, group: int | None) -> IndexKey:
        """The index key of engine hash ``h`` in ``group`` for one worker (its own value when
        the worker's hash is the key)."""
        if not keys:
            return h if not group else (h, group)
        k = keys.get(h if not group else (h, group))
        if k is not None:
            return k
        return h if not group else (h, group)

    def _stored_keys(self, worker: int, held: dict[IndexKey, int], data: Stored) -> list[IndexKey]:
        """The index keys of a Stored event's blocks (see the module docstring); records the
        engine hash -> key mapping where they differ."""
        keys = self._keys[worker]
        group = data.group
        gmask = _group_mask(group)
        counts = self._keying[worker]
        parent = data.parent_hash
        if parent is None:
            chain: int | None = 0
        else:
            raw: IndexKey = parent if not group else (parent, group)
            pk = self._key_of(keys, parent, group)
            if pk == raw:
                # a parent dropped a moment ago still has its key
                pk = self._recent[worker].get(raw, pk)
            if pk == raw and group:
                # vLLM names a block by one hash in every group: a parent this group never
                # announced (a sliding window's null block) has group 0's key, in this group
                k0 = self._key_of(keys, parent, None)
                if type(k0) is int and (k0 != parent or k0 in held):
                    pk = k0 ^ gmask
            if pk not in held:
                self._anomaly(worker, UNKNOWN_PARENT)
            # A known key chains (the parent's key is its content's, held or not); an unmapped
            # hash chains only for a worker whose hashes have been the keys so far.
            native = counts[0] > 0 and counts[2] == counts[0]
            chains_from = type(pk) is int and (pk != raw or pk in held or native)
            chain = pk ^ gmask if chains_from else None  # type: ignore[operator]
        first = data.blocks[0]
        lora = first.lora_id if data.lora_name is None else lora_name_id(data.lora_name)
        salt = first.cache_salt_id
        if salt is None and data.salt is not None:
            salt = cache_salt_id(data.salt)
        computed: list[int] = []
        blocks = data.blocks
        if data.group_kind is not None or data.sliding_window is not None:
            self._learn_group(worker, data)
        if data.masked and chain is not None and data.group_kind in SLIDING_KINDS:
            return self._sliding_keys(worker, data, chain, lora, salt, gmask)
        if (
            chain is not None
            and not group
            and counts[0] > 0
            and counts[2] == counts[0]
            and first.tokens
            and all(map(_TOKENS, blocks))
        ):
            # A worker whose hashes have been the router's keys so far (this project's, a V1
            # engine's): when the first block's key is its hash, the chain's are too (one
            # function chains them), so its hashes are taken as they come.
            try:
                head = _chain_lists([first.tokens], chain, lora, salt)
            except (TypeError, ValueError, OverflowError):
                head = []
            if head and head[0] == first.block_hash:
                hashes: list[BlockHash] = list(map(_BLOCK_HASH, blocks))
                counts[0] += len(blocks)
                counts[2] += len(blocks)
                return hashes  # type: ignore[return-value]
        if chain is not None:
            try:
                computed = _chain_lists([b.tokens for b in blocks], chain, lora, salt)
            except (TypeError, ValueError, OverflowError):
                computed = []
        n = len(computed)
        if n == len(blocks):  # the common case: every block keyed from its tokens at once
            hashes = list(map(_BLOCK_HASH, blocks))
            counts[0] += n
            if gmask:
                computed = [k ^ gmask for k in computed]
            elif computed == hashes:  # the worker hashes as the router does: no map
                counts[2] += n
                return computed  # type: ignore[return-value]
            keys.update(
                zip(hashes if not group else [(h, group) for h in hashes], computed, strict=True)
            )
            return computed  # type: ignore[return-value]
        out: list[IndexKey] = []
        for i, block in enumerate(blocks):
            h = block.block_hash
            if i >= n:
                # No tokens (placeholder, masked store) or a chain cut short: the block keeps
                # the key its hash already has, else its engine hash.
                ek = h if not group else (h, group)
                k = self._key_of(keys, h, group)
                if k == ek:
                    back = self._recent[worker].pop(ek, None)
                    if back is not None:  # a block dropped a moment ago comes back
                        keys[ek] = k = back
                if k == ek and k not in held:
                    if not data.masked:  # a masked store's worker does send token ids
                        counts[1] += 1
                    if not block.tokens:
                        self._anomaly(worker, UNKEYED_BLOCK)
                out.append(k)
                continue
            key = computed[i] ^ gmask
            counts[0] += 1
            if key == h and not group:
                counts[2] += 1
            else:
                keys[h if not group else (h, group)] = key
            out.append(key)
        return out

    def _learn_group(self, worker: int, data: Stored) -> None:
        """Remember the spec of a KV-cache group other than 0 (group 0 is vLLM's first,
        full-attention group when the model has one): what a prefix hit needs in it."""
        group = data.group
        if not group:
            return
        kind = data.group_kind or ""
        window = data.sliding_window
        if kind in SLIDING_KINDS and window:
            # vLLM: cdiv(window - 1, size) blocks, checked after counting each one (so 0
            # needs one, as 1 does)
            need = max(-(-(window - 1) // self.tokens_per_block), 1)
        elif kind in FULL_KINDS:
            need = 0
        else:
            return  # another kind (Mamba, chunked local, ...): its rule is not modelled
        self._groups.setdefault(worker, {})[group] = (kind, need)

    def _sliding_keys(
        self,
        worker: int,
        data: Stored,
        chain: int,
        lora: int | None,
        salt: int | None,
        gmask: int,
    ) -> list[IndexKey]:
        """A sliding-window group's masked store: its token ids cover every block from the
        chain's start, its hashes name the trailing ones (vLLM nulls the blocks that fell out
        of the window, and leaves them out): those get the keys of the trailing blocks."""
        tokens = data.masked_tokens
        blocks = data.blocks
        size = data.block_size or self.tokens_per_block
        assert tokens is not None
        covered = len(tokens) // size
        try:
            chained = _chain_lists(
                [list(tokens[i * size : (i + 1) * size]) for i in range(covered)],
                chain,
                lora,
                salt,
            )
        except (TypeError, ValueError, OverflowError):
            chained = []
        keys = self._keys[worker]
        if len(chained) < len(blocks):
            self._anomaly(worker, UNKEYED_BLOCK, len(blocks))
            return [self._key_of(keys, b.block_hash, data.group) for b in blocks]
        out: list[IndexKey] = []
        for block, key in zip(blocks, chained[len(chained) - len(blocks) :], strict=True):
            k = key ^ gmask
            keys[(block.block_hash, data.group) if data.group else block.block_hash] = k
            out.append(k)
        self._keying[worker][0] += len(out)
        return out

    def _stored_by_key(
        self, worker: int, bit: int, held: dict[IndexKey, int], data: Stored
    ) -> None:
        if not data.blocks:
            return
        if data.block_size != self.tokens_per_block:  # the router's own size: nothing to check
            self._check_block_size(worker, data)
        self._store(worker, bit, held, data.blocks, self._stored_keys(worker, held, data), True)

    def _stored_by_hash(
        self, worker: int, bit: int, held: dict[IndexKey, int], data: Stored
    ) -> None:
        if not data.blocks:
            return
        if data.block_size != self.tokens_per_block:  # the router's own size: nothing to check
            self._check_block_size(worker, data)
        parent = data.parent_hash
        if parent is not None and parent not in held:
            self._anomaly(worker, UNKNOWN_PARENT)
        self._store(worker, bit, held, data.blocks, None, False)

    def _store(
        self,
        worker: int,
        bit: int,
        held: dict[IndexKey, int],
        blocks: Sequence[StoredBlock],
        keys: list[IndexKey] | None,
        counting: bool,
    ) -> None:
        """Store ``blocks`` under ``keys`` (None: their own hashes); ``counting``: repeated
        announcements on a slower tier are counted (keyed streams: vLLM's offload chunks)."""
        if keys is None:
            keys = list(map(_BLOCK_HASH, blocks))
        levels = list(map(_CACHE_LEVEL, blocks))
        if not any(levels):  # the common case: every block on the device tier
            self._store_device(bit, held, keys)
            return
        # runs of device-tier blocks in one call each; a block at another level (a slower
        # tier, or a negative level read as the device tier) through _store_deeper, mirrored
        start = 0
        for i, level in enumerate(levels):
            if level:
                if start < i:
                    self._store_device(bit, held, keys[start:i])
                h = keys[i]
                self._store_deeper(worker, bit, held, level, h, counting)
                self._mirror([h], bit, held)
                start = i + 1
        if start < len(keys):
            self._store_device(bit, held, keys[start:])

    def _store_device(self, bit: int, held: dict[IndexKey, int], keys: list[IndexKey]) -> None:
        """Store blocks ``keys`` on the worker's device tier: level bit 1 in ``held``, the
        worker's device bit (with its any-tier bit) in the table, or in ``_device`` for keys
        the table does not hold. Passes over the keys in C (dict and table calls), one each."""
        olds = list(map(held.get, keys, _ZEROS))
        if any(olds):  # some the worker knew (on any tier): their levels kept
            held.update(zip(keys, map(or_, olds, _ONES), strict=True))
        else:
            held.update(dict.fromkeys(keys, 1))
        self._table.device_bit(keys, bit.bit_length() - 1, True)

    def _store_deeper(
        self,
        worker: int,
        bit: int,
        held: dict[IndexKey, int],
        level: int,
        h: IndexKey,
        counting: bool,
    ) -> None:
        """Store one block at a cache level other than 0 (a slower tier, or a negative level
        read as the device tier)."""
        if level > MAX_CACHE_LEVEL:
            self._anomaly(worker, LEVEL_OUT_OF_RANGE)
            return
        lbit = 1 << level if level > 0 else 1
        old = held.get(h, 0)
        if old & lbit:
            if counting and lbit != 1:  # slower tiers count announcements
                rk = (h, level)
                refs = self._refs[worker]
                refs[rk] = refs.get(rk, 0) + 1
            return
        held[h] = old | lbit
        if lbit == 1:
            self._device_bit([h], bit, True)
        elif not old >> 1:
            self._slower[h] = self._slower.get(h, 0) | bit

    def _mirror(self, keys: Sequence[IndexKey], bit: int, held: dict[IndexKey, int] | bool) -> None:
        """Bring the native table in line with ``held`` for ``keys`` (one call per event);
        True / False where every key is / none is held (no lookups)."""
        t = self._table
        if held is True:
            t.set_bit(keys, bit.bit_length() - 1)
        elif held is False:
            t.clear_bit(keys, bit.bit_length() - 1)
        else:
            t.sync(keys, bit.bit_length() - 1, held)

    def _device_bit(self, keys: list[IndexKey], bit: int, on: bool) -> None:
        """Set (``on``) or clear worker bit ``bit`` (a mask) in the device masks of ``keys``:
        in the native table for the keys it holds, else in ``_device``."""
        self._table.device_bit(keys, bit.bit_length() - 1, on)

    def _device_masks(self, keys: Sequence[IndexKey]) -> Iterator[int]:
        """The device mask of each key (0 where no worker holds it there)."""
        return map(self._table.device_get, keys)

    def _drop_levels(
        self, bit: int, held: dict[IndexKey, int], h: IndexKey, old: int, gone: int
    ) -> None:
        """Clear level bits ``gone`` (a subset of ``old``) of block ``h`` for one worker."""
        new = old & ~gone
        if new:
            held[h] = new
        else:
            del held[h]
        if gone & 1:
            self._device_bit([h], bit, False)
        if old >> 1 and not new >> 1:
            m = self._slower[h] & ~bit
            if m:
                self._slower[h] = m
            else:
                del self._slower[h]

    def _removed(
        self, worker: int, bit: int, held: dict[IndexKey, int], data: Removed, keyed: bool
    ) -> None:
        """A Removed event, by key (``keyed``: hashes through the worker's key map, groups
        apart) or by hash (the worker's hashes are the keys)."""
        # A removal without a level drops every copy; with a level, only that tier's copy
        # (a GPU -> CPU offload travels as Removed(GPU) + Stored(CPU)).
        level = data.cache_level
        if level is not None and level > MAX_CACHE_LEVEL:
            self._anomaly(worker, LEVEL_OUT_OF_RANGE, len(data.block_hashes))
            return
        hashes = data.block_hashes
        group = data.group if keyed else None
        if group or not (level is None or level <= 0):
            # the Python loops: a KV-cache group, or a slower tier only
            remove = self._remove_keys if keyed else self._remove_hashes
            unknown = remove(worker, bit, held, hashes, level, group)
        else:
            unknown = self._evict(worker, bit, held, hashes, level, keyed)
        if unknown:
            self._anomaly(worker, UNKNOWN_REMOVAL, unknown)

    def _evict(
        self,
        worker: int,
        bit: int,
        held: dict[IndexKey, int],
        hashes: Sequence[BlockHash],
        level: int | None,
        keyed: bool,
    ) -> int:
        """A removal covering the device tier. The common one, where every block named is
        held on the device tier only (each once), in passes over the blocks in C (dict and
        table calls); any other through the removal loop. Returns the count of unknown
        blocks."""
        n = len(hashes)
        keys = self._keys[worker] if keyed else None
        hs: Sequence[IndexKey] = hashes if not keys else list(map(keys.get, hashes, hashes))
        if list(map(held.get, hs)).count(1) == n and len(set(hs)) == n:
            t = self._table
            b = bit.bit_length() - 1
            _consume(map(held.__delitem__, hs))
            t.clear_bit(hs, b)  # the table's device bits with the any-tier ones
            if self._device:  # keys the table does not hold have their device masks there
                t.device_bit(hs, b, False)
            if keys:
                recent = self._recent[worker]
                moved = list(compress(zip(hashes, hs, strict=True), map(is_not, hashes, hs)))
                _consume(map(keys.pop, hashes, _NONES))
                if len(recent) + len(moved) <= 2 * RECENT_KEYS:
                    recent.update(moved)  # type: ignore[arg-type]
                else:
                    for ek, h in moved:
                        self._retire(recent, ek, h)  # type: ignore[arg-type]
            return 0
        remove = self._remove_keys if keyed else self._remove_hashes
        return remove(worker, bit, held, hashes, level, None)

    def _remove_keys(
        self,
        worker: int,
        bit: int,
        held: dict[IndexKey, int],
        hashes: Sequence[BlockHash],
        level: int | None,
        group: int | None,
    ) -> int:
        """The removal loop of a keyed worker, engine hashes mapped to keys (mirrored);
        returns the count of unknown blocks."""
        mask = -1 if level is None else 1 << max(0, level)
        unknown = 0
        keys = self._keys[worker]
        refs = self._refs[worker]
        t = self._table
        b = bit.bit_length() - 1
        kpop = keys.pop
        recent = self._recent[worker]
        size = len(held)
        touched: list[IndexKey] = []
        for eh in hashes:
            ek: IndexKey = eh if not group else (eh, group)
            h: IndexKey = kpop(ek, ek)  # taken out of the map; put back below if still held
            touched.append(h)
            old = held.get(h, 0)
            if old == 1 and mask & 1:
                # the common eviction: the only copy was on the device tier
                del held[h]
                t.device_bit([h], b, False)
                if ek is not h:
                    self._retire(recent, ek, h)  # type: ignore[arg-type]
                continue
            if ek is not h:
                keys[ek] = h  # type: ignore[assignment]
            gone = old & mask
            if not gone:
                unknown += 1
                continue
            if refs and level is not None and level > 0:
                rk = (h, level)
                n = refs.get(rk)
                if n:  # one announcement of several released: the copy stays
                    if n == 1:
                        del refs[rk]
                    else:
                        refs[rk] = n - 1
                    continue
            self._drop_levels(bit, held, h, old, gone)
            if ek is not h and h not in held:
                del keys[ek]
                self._retire(recent, ek, h)  # type: ignore[arg-type]
        self._mirror(touched, bit, False if size - len(held) == len(touched) else held)
        return unknown

    def _remove_hashes(
        self,
        worker: int,
        bit: int,
        held: dict[IndexKey, int],
        hashes: Sequence[BlockHash],
        level: int | None,
        group: int | None,
    ) -> int:
        """The removal loop of a worker whose hashes are the keys (mirrored); returns the
        count of unknown blocks."""
        mask = -1 if level is None else 1 << max(0, level)
        unknown = 0
        t = self._table
        b = bit.bit_length() - 1
        held_pop = held.pop
        size = len(held)
        for h in hashes:
            old = held_pop(h, 0)
            if old == 1 and mask & 1:
                # the common eviction: the only copy was on the device tier
                t.device_bit([h], b, False)
                continue
            if old:
                held[h] = old  # put back: _drop_levels works on the held entry
            gone = old & mask
            if not gone:
                unknown += 1
                continue
            self._drop_levels(bit, held, h, old, gone)
        # as many entries gone as keys named: each key was dropped (a removal adds none)
        gone_all = size - len(held) == len(hashes)
        self._mirror(hashes, bit, False if gone_all else held)
        return unknown

    def _updated(self, worker: int, bit: int, held: dict[IndexKey, int], data: Updated) -> None:
        diff = data.cache_level
        if diff is None:
            return  # a priority change does not affect routing
        if max(diff.old_value, diff.new_value) > MAX_CACHE_LEVEL:
            self._anomaly(worker, LEVEL_OUT_OF_RANGE)
            return
        h = self._key_of(self._keys[worker], data.block_hash, None)
        old = held.get(h, 0)
        if not old:
            self._anomaly(worker, UNKNOWN_UPDATE)
            return
        old_bit = 1 << max(0, diff.old_value)
        new_bit = 1 << max(0, diff.new_value)
        if old_bit & old and old_bit != new_bit:
            self._drop_levels(bit, held, h, old, old_bit)
            old = held.get(h, 0)
        if not old & new_bit:
            held[h] = old | new_bit
            if new_bit == 1:
                self._device_bit([h], bit, True)
            elif not old >> 1:
                self._slower[h] = self._slower.get(h, 0) | bit
        self._mirror([h], bit, held)

    # ----------------------------------------------------------------- matching

    def _prefix_masks(self, block_hashes: Sequence[BlockHash], device_only: bool) -> list[int]:
        """Prefix-AND of worker masks, cut where it becomes empty (non-increasing ints)."""
        if device_only or not self._slower:
            masks = self._device_masks(block_hashes)
        else:
            masks = map(
                or_,
                self._device_masks(block_hashes),
                map(self._slower.get, block_hashes, _ZEROS),
            )
        return list(takewhile(bool, accumulate(masks, and_)))

    def _run_lengths(self, prefix: list[int]) -> dict[int, int]:
        result: dict[int, int] = {}
        n = len(prefix)
        i = 0
        worker_of_bit = self._worker_of_bit
        while i < n:
            v = prefix[i]
            # First position whose mask is smaller: workers in v but not there stop at j.
            j = bisect_right(prefix, -v, lo=i, key=neg)
            lost = v & ~prefix[j] if j < n else v
            while lost:
                low = lost & -lost
                result[worker_of_bit[low.bit_length() - 1]] = j
                lost ^= low
            i = j
        return result

    def find_matches(self, block_hashes: Sequence[BlockHash]) -> dict[int, int]:
        """Per worker holding the request's first block (any tier), the length of the longest
        run of the request's blocks from the first that it holds. Workers with no match are
        absent."""
        if not block_hashes:
            return {}
        runs = self._table.runs(block_hashes, self._worker_of_bit)
        if runs is None:  # a key the table does not hold, before the match ends
            return self._find_matches_general(block_hashes)
        return self._hybrid_runs(block_hashes, runs) if self._groups else runs

    def _find_matches_general(self, block_hashes: Sequence[BlockHash]) -> dict[int, int]:
        """:meth:`find_matches` for any keys (strings, ints outside [0, 2**64)), in Python:
        the prefix-AND of the device and slower-tier masks, cut by bisection."""
        runs = self._run_lengths(self._prefix_masks(block_hashes, device_only=False))
        return self._hybrid_runs(block_hashes, runs) if self._groups else runs

    def prefix_hit(self, worker: int, block_hashes: Sequence[BlockHash]) -> tuple[int, int | None]:
        """How many leading blocks of the request ``worker``'s engine can reuse, and the
        KV-cache group that limited it (None: group 0's run, the plain prefix match). What
        the ``find_matches`` family counts for a worker with such groups.

        vLLM's hybrid rule (``HybridKVCacheCoordinator.find_longest_cache_hit``): starting from
        group 0's run, every full-attention group must hold the whole prefix, and a
        sliding-window group needs only the ``cdiv(window - 1, block_size)`` blocks before the
        hit's end (:func:`sliding_hit`); any group that shortens the hit makes all look again,
        until none does."""
        runs = self._run_lengths(self._prefix_masks(block_hashes, device_only=False))
        return self._hybrid_hit(worker, block_hashes, runs.get(worker, 0))

    @property
    def has_groups(self) -> bool:
        """Whether any worker announced KV-cache groups that decide its prefix hits."""
        return bool(self._groups)

    def limiting_groups(self, block_hashes: Sequence[BlockHash]) -> dict[int, int]:
        """Per worker whose hit a KV-cache group other than 0 cut short: that group (see
        :meth:`prefix_hit`; workers whose group 0 run stands are absent)."""
        if not self._groups or not block_hashes:
            return {}
        runs = self._run_lengths(self._prefix_masks(block_hashes, device_only=False))
        out: dict[int, int] = {}
        for worker, run in runs.items():
            if worker in self._groups:
                _, limit = self._hybrid_hit(worker, block_hashes, run)
                if limit is not None:
                    out[worker] = limit
        return out

    def _hybrid_hit(
        self, worker: int, block_hashes: Sequence[BlockHash], length: int
    ) -> tuple[int, int | None]:
        groups = self._groups.get(worker)
        if not groups or not length:
            return length, None
        held = self._held[worker]
        hit, limit = length, None
        changed = True
        while changed and hit:
            changed = False
            for group in sorted(groups):
                _, need = groups[group]
                mask = _group_mask(group)

                def has(i: int, mask: int = mask) -> bool:
                    k = block_hashes[i]
                    return type(k) is int and (k ^ mask) in held

                if need == 0:  # full attention: the whole prefix
                    new = next((i for i in range(hit) if not has(i)), hit)
                else:
                    new = sliding_hit(has, hit, need)
                if new < hit:
                    hit, limit, changed = new, group, True
        return hit, limit

    def _hybrid_runs(
        self, block_hashes: Sequence[BlockHash], runs: dict[int, int]
    ) -> dict[int, int]:
        """``runs`` with each hybrid worker's cut to what its engine reuses (a worker left
        with nothing is absent, as an unmatched one is)."""
        for worker in [w for w in runs if w in self._groups]:
            hit, _ = self._hybrid_hit(worker, block_hashes, runs[worker])
            if hit:
                runs[worker] = hit
            else:
                del runs[worker]
        return runs

    def _hybrid_details(
        self, block_hashes: Sequence[BlockHash], details: dict[int, MatchDetail]
    ) -> dict[int, MatchDetail]:
        """:meth:`_hybrid_runs` for match details: a cut run counts its tiers again."""
        for worker in [w for w in details if w in self._groups]:
            d = details[worker]
            hit, _ = self._hybrid_hit(worker, block_hashes, d.matched_blocks)
            if hit == d.matched_blocks:
                continue
            if not hit:
                del details[worker]
                continue
            held = self._held[worker]
            on_device = sum(1 for k in block_hashes[:hit] if held.get(k, 0) & 1)
            details[worker] = MatchDetail(hit, min(d.device_run, hit), on_device, hit - on_device)
        return details

    def find_matches_detailed(self, block_hashes: Sequence[BlockHash]) -> dict[int, MatchDetail]:
        """Like :meth:`find_matches` with the device-tier run and per-tier counts."""
        if not block_hashes:
            return {}
        details = self._table.detailed(
            block_hashes, self._worker_of_bit, MatchDetail, _MATCH_DETAIL_FIELDS
        )
        if details is None:  # a key the table does not hold, before the match ends
            return self._find_matches_detailed_general(block_hashes)
        return self._hybrid_details(block_hashes, details) if self._groups else details

    def _find_matches_detailed_general(
        self, block_hashes: Sequence[BlockHash]
    ) -> dict[int, MatchDetail]:
        """:meth:`find_matches_detailed` for any keys, in Python (as
        :meth:`_find_matches_general` is :meth:`find_matches`')."""
        any_runs = self._run_lengths(self._prefix_masks(block_hashes, device_only=False))
        if not self._slower:
            result = {w: MatchDetail(n, n, n, 0) for w, n in any_runs.items()}
            return self._hybrid_details(block_hashes, result) if self._groups else result
        dev_runs = self._run_lengths(self._prefix_masks(block_hashes, device_only=True))
        result = {}
        dev_masks: list[int] | None = None
        for w, n in any_runs.items():
            d = dev_runs.get(w, 0)
            on_device = d
            if n > d:
                # Past the device run the chain mixes tiers: count device copies one by one.
                if dev_masks is None:
                    longest = max(any_runs.values())
                    dev_masks = list(self._device_masks(block_hashes[:longest]))
                bit = 1 << self._bit_of[w]
                on_device += sum(1 for m in dev_masks[d:n] if m & bit)
            result[w] = MatchDetail(n, d, on_device, n - on_device)
        return self._hybrid_details(block_hashes, result) if self._groups else result

    def holds(self, worker: int, block_hash: BlockHash) -> tuple[int, ...]:
        """The cache levels at which ``worker`` holds ``block_hash`` (empty if none)."""
        levels = self._held.get(worker, {}).get(block_hash, 0)
        return tuple(i for i in range(levels.bit_length()) if levels >> i & 1)

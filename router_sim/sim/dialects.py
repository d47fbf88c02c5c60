"""Engine dialects: a simulated worker publishes its KV events as vLLM, SGLang or TensorRT-LLM do.

A simulated worker's event manager announces this project's events: V1 block hashes, the LoRA
id and cache salt id of each block, tier moves as a removal plus a store. A real fleet runs
engines that announce their own hashes, which no router can recompute, and put the scope
where each engine puts it. A :class:`Dialect` turns one native batch into the payload that
engine would publish, so ``router-sim run --engine vllm`` measures the router against what
vLLM workers send, not against a router-friendly stream:

- ``native``: this project's encoder as it is (``events.wire.codec.encode_batch``).
- ``trtllm``: TensorRT-LLM's hashes are the V1 hashes (WIRE.md 3) and its LLM-API events carry
  ``lora_id`` and ``cache_salt_id`` as ours do; TensorRT-LLM ships no ZeroMQ publisher, so its
  events travel as a framework relays them, in the map form of ``encode_batch``, with its
  attention data-parallel rank (0) in the envelope.
- ``vllm`` (0.26-0.33 map events, tests/data/engines/vllm-*; written as vLLM 0.33.0's Structs):
  64-bit block hashes of its own
  (stand-in: the last 8 bytes, big-endian, of a sha256 over a per-process seed and the block's
  content key, which already chains the parent, the token ids and the scope; vLLM's own are a
  sha256 of the parent hash, token ids and extra keys under a per-process seed, converted to
  an int from the digest's last 8 bytes), ``lora_id`` plus ``lora_name``, the adapter's name
  in every block's ``extra_keys`` and the cache salt in the first block's, ``group_idx`` 0,
  a trailing partial block as its own store, and host-tier copies announced as CPU-offload
  placeholders (no token ids, ``block_size`` 0) on medium ``CPU``. With KV-cache groups
  (``router-sim run --kv-groups full,sliding_window:4096``, :func:`parse_kv_groups`), as a
  hybrid model's vLLM 0.33 sends them: every GPU store and every GPU removal once per group,
  in the group's order, with its ``group_idx``; a store names its group's spec after
  ``group_idx`` (``kv_cache_spec_kind``, and ``kv_cache_spec_sliding_window`` in tokens for
  a sliding window), except a full-attention group 0, whose stores carry ``group_idx`` only,
  as in the capture (tests/data/engines/vllm-0.33.0). Host-tier events stay as they are (vLLM's
  offload connector names no group). The simulated worker's cache has no sliding window: every
  group holds every block the worker holds, so a sliding-window group's store names all its
  blocks with their own token ids (where vLLM would leave the blocks before the window out) and
  the router's per-group bookkeeping and its decoding of a hybrid stream are what such a run
  measures, not a sliding-window eviction model (the hits are those of one group).
- ``sglang`` (0.5.23, tests/data/engines/sglang-0.5.23): signed int64 hashes (stand-in: the
  first 8 bytes of a sha256 of the content key, as SGLang's recorder folds its sha256 page
  hashes to int64, with no per-process seed), ``lora_name`` with ``lora_id`` nil,
  ``cache_salt`` on each store, a partial page as its own store, medium ``CPU_PINNED`` for its
  host tier (with token ids).

Each engine's events are written as that engine's own Structs
(``events.wire.structs.writer_types``: its fields, in its order, its header form), so a frame
is byte for byte what the engine writes for the same values (tests/test_wire_writers.py, against
the captures).

The engine hash is a pure function of the native hash (per worker), so removals and parents
are renamed without any state. vLLM and SGLang name adapters: a router keys their blocks by
the name (``router_sim.router.indexer.lora_name_id``), so under those dialects a request's scope
uses
the name's id (:func:`request_scope`), in the worker's cache and in the router's route alike,
and the engine's own LoRA int id still travels in ``lora_id`` (vLLM).

Snapshots (this project's extension, which engines lack) are sent in the dialect too, with every
block's token ids (vLLM's host copies included), so a router that resyncs keys each block; with
KV-cache groups, the device blocks once per group as the live stream sends them. That is the
memory transport's snapshot (:meth:`Dialect.encode` with ``snapshot``); over ZeroMQ the
publisher encodes its snapshot replies itself (:meth:`Dialect.renamed`, this project's codec),
which has no ``group_idx``: such a snapshot restores group 0 only.

Where engines disagree on what an event means, the dialect decides: an ``AllBlocksCleared``
empties vLLM's device tier only and every tier of SGLang (:func:`clear_scope`, which the
simulator hands its router per worker); SGLang's host medium ``CPU_PINNED`` is the host tier
vLLM calls ``CPU``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import msgspec

from events.wire.codec import encode_batch, encode_payload, join_tokens, wire_tokens
from events.wire.model import (
    AllBlocksCleared,
    BlockHash,
    KVCacheEvent,
    Removed,
    Stored,
    StoredBlock,
    cache_level_of,
    medium_of,
    wire_runs,
)
from events.wire.structs import writer_types
from kvcache.scope import ReuseScope, cache_salt_id
from router_sim.router.indexer import engine_clear_scope
from router_sim.sim.workloads import Request

ENGINES: Final[tuple[str, ...]] = ("native", "vllm", "sglang", "trtllm")
"""Values of ``router-sim run --engine``."""

FULL_ATTENTION: Final = "full_attention"
SLIDING_WINDOW: Final = "sliding_window"
MAX_KV_GROUPS: Final = 64
MAX_SLIDING_WINDOW: Final = 2**31 - 1  # tokens


@dataclass(frozen=True, slots=True)
class KvGroup:
    """One vLLM KV-cache group: its spec kind (vLLM's ``kv_cache_spec_kind``) and, for a
    sliding window, the window in tokens (``kv_cache_spec_sliding_window``)."""

    kind: str = FULL_ATTENTION
    sliding_window: int | None = None


DEFAULT_KV_GROUPS: Final[tuple[KvGroup, ...]] = (KvGroup(),)
"""One full-attention group (``group_idx`` 0): what ``--engine vllm`` sends by default."""


def parse_kv_groups(text: str) -> tuple[KvGroup, ...]:
    """``--kv-groups``: comma-separated groups in ``group_idx`` order, each ``full`` (or
    ``full_attention``) or ``sliding_window:TOKENS``; raises ``ValueError`` for anything else."""
    items = [item.strip() for item in text.split(",")]
    if not text.strip() or any(not item for item in items):
        raise ValueError(
            f"--kv-groups: expected comma-separated full or sliding_window:TOKENS; got {text!r}"
        )
    if len(items) > MAX_KV_GROUPS:
        raise ValueError(f"--kv-groups: at most {MAX_KV_GROUPS} groups; got {len(items)}")
    groups: list[KvGroup] = []
    for item in items:
        kind, sep, value = item.partition(":")
        if kind in ("full", FULL_ATTENTION) and not sep:
            groups.append(KvGroup())
            continue
        if kind == SLIDING_WINDOW and sep:
            try:
                window = int(value)
            except ValueError:
                window = 0
            if 1 <= window <= MAX_SLIDING_WINDOW and value.isdigit():
                groups.append(KvGroup(SLIDING_WINDOW, window))
                continue
            raise ValueError(
                f"--kv-groups: a sliding window is a whole number of tokens from 1 to "
                f"{MAX_SLIDING_WINDOW}; got {item!r}"
            )
        raise ValueError(f"--kv-groups: each group is full or sliding_window:TOKENS; got {item!r}")
    return tuple(groups)


def check_kv_groups(engine: str, groups: Sequence[KvGroup] | None) -> None:
    """KV-cache groups other than the default are vLLM's: ``ValueError`` for another engine."""
    if groups is None:
        return
    if not groups:
        raise ValueError("kv_groups needs at least one group")
    if engine != "vllm":
        raise ValueError(f"KV-cache groups are published by engine 'vllm' only, not {engine!r}")


_NAMING: Final = frozenset({"vllm", "sglang"})  # engines that announce adapters by name
_DP_RANK: Final = 0  # engines put their data-parallel rank in the envelope


def clear_scope(engine: str) -> str | None:
    """What ``engine``'s AllBlocksCleared empties on a worker, for
    ``KvIndexer.set_clear_scope``: ``"device"`` (vLLM), ``"all"`` (SGLang), None (this
    project's and TensorRT-LLM's workers: keyed as the router keys, so every tier)."""
    check_engine(engine)
    return engine_clear_scope(engine)


def check_engine(engine: str) -> None:
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}; got {engine!r}")


def adapter_name(lora_id: int) -> str:
    """The name a simulated engine gives LoRA adapter ``lora_id`` (vLLM's ``lora_name``)."""
    return f"adapter-{lora_id}"


def request_scope(engine: str, req: Request) -> ReuseScope:
    """The scope ``req`` is cached and routed under when workers speak ``engine``: its own,
    except that engines which announce adapters by name are routed by that name."""
    if req.lora_id is None or engine not in _NAMING:
        return req.scope
    return ReuseScope(lora_id=cache_salt_id(adapter_name(req.lora_id)), salt=req.scope.salt)


def _hash_bytes(h: BlockHash) -> bytes:
    return h.to_bytes(8, "big") if type(h) is int else bytes.fromhex(str(h))


class Dialect:
    """``native``: the payload of ``events.wire.codec.encode_batch``; subclasses speak an
    engine's."""

    engine = "native"

    def __init__(self, worker_id: int, tokens_per_block: int) -> None:
        self.worker_id = worker_id
        self.tokens_per_block = tokens_per_block
        # native LoRA id -> (the engine's LoRA int id, its name); salt id -> the salt string
        self._adapters: dict[int, tuple[int, str]] = {}
        self._salts: dict[int, str] = {}

    def learn(self, req: Request) -> None:
        """Remember ``req``'s adapter name and salt string (an engine knows its requests')."""
        if req.cache_salt is not None and req.scope.salt is not None:
            self._salts[req.scope.salt] = req.cache_salt
        if req.lora_id is not None:
            native = request_scope(self.engine, req).lora_id
            assert native is not None
            self._adapters[native] = (req.lora_id, adapter_name(req.lora_id))

    def scope(self, req: Request) -> ReuseScope:
        return request_scope(self.engine, req)

    def engine_hash(self, h: BlockHash) -> BlockHash:
        """The hash the engine announces for the block this project hashes to ``h``."""
        return h

    def _medium(self, level: int | None) -> str:
        return medium_of(level or 0)

    def renamed(self, events: Sequence[KVCacheEvent]) -> list[KVCacheEvent]:
        """``events`` with the engine's hashes (as uint64) in place of this project's, for
        a publisher that encodes them itself (its snapshot replies): the blocks keep their
        token ids and the scope as ids, from which a router derives the same keys as from
        the engine's own fields."""
        if type(self).engine_hash is Dialect.engine_hash:
            return list(events)

        def name(h: BlockHash) -> BlockHash:
            e = self.engine_hash(h)
            return e % 2**64 if type(e) is int else e

        def level(cache_level: int | None) -> int | None:
            return None if cache_level is None else cache_level_of(self._medium(cache_level))

        out: list[KVCacheEvent] = []
        for ev in events:
            data = ev.data
            if isinstance(data, Stored):
                blocks = [
                    msgspec.structs.replace(
                        b, block_hash=name(b.block_hash), cache_level=level(b.cache_level) or 0
                    )
                    for b in data.blocks
                ]
                parent = None if data.parent_hash is None else name(data.parent_hash)
                data = msgspec.structs.replace(data, parent_hash=parent, blocks=blocks)
            elif isinstance(data, Removed):
                hashes = [name(h) for h in data.block_hashes]
                data = msgspec.structs.replace(
                    data, block_hashes=hashes, cache_level=level(data.cache_level)
                )
            out.append(msgspec.structs.replace(ev, data=data))
        return out

    def encode(self, batch: Sequence[KVCacheEvent], ts: float, snapshot: bool = False) -> bytes:
        """The payload the engine publishes for ``batch``. ``snapshot``: the batch is a part of
        this project's snapshot (an extension engines lack): every block travels with its
        token ids, so a router rebuilding the worker's view can key each one."""
        return encode_batch(batch, ts)


class TrtllmDialect(Dialect):
    """V1 hashes and this project's fields (they are TensorRT-LLM's), dp rank 0."""

    engine = "trtllm"

    def encode(self, batch: Sequence[KVCacheEvent], ts: float, snapshot: bool = False) -> bytes:
        return encode_batch(batch, ts, _DP_RANK)


class _EngineDialect(Dialect):
    """vLLM and SGLang: their own hashes, their scope fields and media, map events."""

    host_medium = "CPU"

    def _lora(self, lora_id: int | None) -> tuple[int | None, str | None]:
        if lora_id is None:
            return None, None
        found = self._adapters.get(lora_id)
        if found is None:
            raise ValueError(f"worker {self.worker_id}: LoRA id {lora_id} of no known request")
        return found

    def _salt(self, salt_id: int | None) -> str | None:
        if salt_id is None:
            return None
        found = self._salts.get(salt_id)
        if found is None:
            raise ValueError(f"worker {self.worker_id}: cache salt {salt_id} of no known request")
        return found

    def _medium(self, level: int | None) -> str:
        return "GPU" if not level else self.host_medium

    def __init__(self, worker_id: int, tokens_per_block: int) -> None:
        super().__init__(worker_id, tokens_per_block)
        # the engine's own event Structs (events.wire.structs.WRITERS), so its frames are
        # byte for byte the engine's: its fields, in its order, its header form
        types = writer_types(self.engine).map
        self._stored_type = types["BlockStored"]
        self._removed_type = types["BlockRemoved"]
        self._cleared_type = types["AllBlocksCleared"]

    def encode(self, batch: Sequence[KVCacheEvent], ts: float, snapshot: bool = False) -> bytes:
        out: list[Any] = []
        for event in batch:
            data = event.data
            if isinstance(data, Stored):
                self._stored(data, out, snapshot)
            elif isinstance(data, Removed):
                if data.block_hashes:
                    out.extend(self._removals(data))
            elif isinstance(data, AllBlocksCleared):
                out.append(self._cleared_type())
            # Created and Updated: engines announce neither (moves come as Removed + Stored)
        return encode_payload(out, ts, _DP_RANK)

    def _removed(self, data: Removed, **fields: Any) -> Any:
        return self._removed_type(
            block_hashes=[self.engine_hash(h) for h in data.block_hashes],
            medium=self._medium(data.cache_level),
            **fields,
        )

    def _removals(self, data: Removed) -> list[Any]:
        """The engine's removal events for one removal (one, unless the engine splits it)."""
        return [self._removed(data)]

    def _runs(self, blocks: list[StoredBlock]) -> list[list[StoredBlock]]:
        """Blocks as the engine's stores: this project's wire events
        (:func:`events.wire.model.wire_runs`), a trailing partial block in one of its own (the
        engines send it with its own length as ``block_size``: vLLM 0.33's and SGLang's
        captures)."""
        tpb = self.tokens_per_block
        runs: list[list[StoredBlock]] = []
        start = 0
        for end in wire_runs(blocks, tpb):
            if end - start > 1 and len(blocks[end - 1].tokens) < tpb:
                runs.append(blocks[start : end - 1])
                start = end - 1
            runs.append(blocks[start:end])
            start = end
        return runs

    def _stored(self, data: Stored, out: list[Any], snapshot: bool) -> None:
        parent = data.parent_hash
        for run in self._runs(data.blocks):
            out.append(self._store(run, parent, snapshot))
            parent = run[-1].block_hash

    def _store(self, run: list[StoredBlock], parent: BlockHash | None, snapshot: bool) -> Any:
        """The engine's BlockStored Struct for one run of blocks."""
        raise NotImplementedError

    def _tokens(self, run: list[StoredBlock]) -> Any:
        """The run's token ids as msgspec writes them, joined as this project's writer joins a
        run's (``events.wire.codec.join_tokens``, ``wire_tokens``)."""
        return wire_tokens(join_tokens([b.tokens for b in run]))


class VllmDialect(_EngineDialect):
    engine = "vllm"

    def __init__(
        self,
        worker_id: int,
        tokens_per_block: int,
        kv_groups: Sequence[KvGroup] = DEFAULT_KV_GROUPS,
    ) -> None:
        super().__init__(worker_id, tokens_per_block)
        # vLLM seeds its hash chain per process (NONE_HASH); a worker is a process
        self._seed = hashlib.sha256(b"vllm-none-hash:%d" % worker_id).digest()
        if not kv_groups:
            raise ValueError("kv_groups needs at least one group")
        # per group: its group_idx and the spec fields its stores carry after it (none for a
        # full-attention group 0, as vLLM 0.33's capture of a hybrid model sends it)
        self._specs: list[tuple[int, dict[str, Any]]] = []
        for idx, group in enumerate(kv_groups):
            spec: dict[str, Any] = {}
            if idx or group.kind != FULL_ATTENTION:
                spec["kv_cache_spec_kind"] = group.kind
                if group.sliding_window is not None:
                    spec["kv_cache_spec_sliding_window"] = group.sliding_window
            self._specs.append((idx, spec))
        self._group = 0  # the group of the store being written (_store)

    def engine_hash(self, h: BlockHash) -> int:
        return int.from_bytes(hashlib.sha256(self._seed + _hash_bytes(h)).digest()[-8:], "big")

    def _removals(self, data: Removed) -> list[Any]:
        if data.cache_level:
            return [self._removed(data)]  # an offload tier: no group
        return [self._removed(data, group_idx=idx) for idx, _ in self._specs]  # per group

    def _stored(self, data: Stored, out: list[Any], snapshot: bool) -> None:
        """A store once per group (vLLM caches a request's blocks group by group); the host
        tier's runs, which name no group, once."""
        runs = self._runs(data.blocks)
        for idx, _ in self._specs:
            self._group = idx
            parent = data.parent_hash
            for run in runs:
                if not idx or not run[0].cache_level:
                    out.append(self._store(run, parent, snapshot))
                parent = run[-1].block_hash
        self._group = 0

    def _store(self, run: list[StoredBlock], parent: BlockHash | None, snapshot: bool) -> Any:
        first = run[0]
        hashes = [self.engine_hash(b.block_hash) for b in run]
        if first.cache_level and not snapshot:
            # what vLLM's CPU offload announces: hashes only
            return self._stored_type(
                block_hashes=hashes,
                parent_block_hash=None,
                token_ids=[],
                block_size=0,
                lora_id=None,
                medium=self.host_medium,
                lora_name=None,
            )
        lora_id, name = self._lora(first.lora_id)
        salt = self._salt(first.cache_salt_id) if parent is None else None
        extra_keys: list[list[str] | None] | None = None
        if name is not None or salt is not None:
            # per block: the adapter's name, then (first block of a sequence) the salt
            extra_keys = []
            for i in range(len(run)):
                entry = ([name] if name is not None else []) + (
                    [salt] if salt is not None and i == 0 else []
                )
                extra_keys.append(entry or None)
        # a snapshot's host copy is in group 0, as ever, and names no spec
        idx, spec = (0, {}) if first.cache_level else self._specs[self._group]
        return self._stored_type(
            block_hashes=hashes,
            parent_block_hash=None if parent is None else self.engine_hash(parent),
            token_ids=self._tokens(run),
            block_size=len(first.tokens),
            lora_id=lora_id,
            medium=self._medium(first.cache_level),
            lora_name=name,
            extra_keys=extra_keys,
            group_idx=idx,
            **spec,
        )


class SglangDialect(_EngineDialect):
    engine = "sglang"
    host_medium = "CPU_PINNED"

    def engine_hash(self, h: BlockHash) -> int:
        digest = hashlib.sha256(b"sglang-page:" + _hash_bytes(h)).digest()
        return int.from_bytes(digest[:8], "big", signed=True)

    def _store(self, run: list[StoredBlock], parent: BlockHash | None, snapshot: bool) -> Any:
        first = run[0]
        _, name = self._lora(first.lora_id)
        return self._stored_type(
            block_hashes=[self.engine_hash(b.block_hash) for b in run],
            parent_block_hash=None if parent is None else self.engine_hash(parent),
            token_ids=self._tokens(run),
            block_size=len(first.tokens),
            lora_id=None,
            medium=self._medium(first.cache_level),
            cache_salt=self._salt(first.cache_salt_id),
            lora_name=name,
        )


_DIALECTS: Final[dict[str, type[Dialect]]] = {
    "native": Dialect,
    "trtllm": TrtllmDialect,
    "vllm": VllmDialect,
    "sglang": SglangDialect,
}


def make_dialect(
    engine: str,
    worker_id: int,
    tokens_per_block: int,
    kv_groups: Sequence[KvGroup] | None = None,
) -> Dialect:
    """The dialect of ``engine`` (one of :data:`ENGINES`) for one worker; ``kv_groups``: the
    KV-cache groups a ``vllm`` worker publishes (None: :data:`DEFAULT_KV_GROUPS`)."""
    check_engine(engine)
    check_kv_groups(engine, kv_groups)
    if kv_groups is not None:
        return VllmDialect(worker_id, tokens_per_block, kv_groups)
    return _DIALECTS[engine](worker_id, tokens_per_block)

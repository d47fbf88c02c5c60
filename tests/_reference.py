"""Plain Python references of what the C extensions compute, for the tests to check them against.

Each is written from the documented behaviour, independent of the native code (none of it calls
an extension): the V1 block hash from WIRE.md 3 (TensorRT-LLM's ``BlockKeyHasher``, as the
hash-drift diagnosis states it in plain Python), the simulator's
prompt expansion from its per-token formula (``router_sim.sim.workloads.expand_hash_ids``), the
router's index (``router_sim.router.indexer.KvIndexer`` over ``router_sim.router._match``'s
table) as who holds which block on which tier, matched block by block.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Final, NamedTuple

from events.tools.diagnosis import v1_variant
from events.wire.model import AllBlocksCleared, EventData, Removed, Stored, Updated
from kvcache.scope import ReuseScope

# --- the V1 block hash (WIRE.md 3) -----------------------------------------------------------


def v1_block_hash(
    tokens: Sequence[int],
    parent_hash: int = 0,
    lora_id: int | None = None,
    salt_id: int | None = None,
) -> int:
    """The V1 hash of one block (no input checks: give ids in [0, 2**31)): the drift-free form
    of ``events.tools.diagnosis.v1_variant``, plain Python written from WIRE.md 3 (the one
    statement of its mixing steps outside the C loop and the golden-vector generator)."""
    return v1_variant(tokens, parent_hash, lora_id, salt_id)


def v1_chain(tokens: Sequence[int], tokens_per_block: int, scope: ReuseScope) -> list[int]:
    """The V1 hashes of the full blocks of ``tokens`` under ``scope``."""
    hashes: list[int] = []
    parent = 0
    for start in range(0, len(tokens) - tokens_per_block + 1, tokens_per_block):
        parent = v1_block_hash(
            tokens[start : start + tokens_per_block], parent, scope.lora_id, scope.salt
        )
        hashes.append(parent)
    return hashes


# --- the simulator's prompts (router_sim.sim._prefetch's expand_array) -----------------------

_PROMPT_TOKEN_BITS: Final = 30  # router_sim.sim.workloads.PROMPT_TOKEN_BITS
_OR_TABLES: Final = [bytes(x | c for x in range(256)) for c in range(256)]
"""``_OR_TABLES[c]`` maps a byte ``x`` to ``x | c`` (for ``bytes.translate``)."""


def expand_hash_ids(hash_ids: tuple[int, ...], input_length: int, n: int) -> array[int]:
    """The prompt of ``hash_ids`` (``n`` tokens each) cut to ``input_length`` tokens: token
    ``j`` of id ``h`` is ``j << b | (h mod 2**b)``, ``b = 30 - max(1, bit_length(n - 1))``.

    Written by byte lanes, not per token: the id part and the position part of a token occupy
    disjoint bits, so each byte lane of the little-endian prompt (byte ``i`` of every token) is
    one block's position lane with the id's byte OR-ed in (``bytes.translate``)."""
    k = -(-input_length // n)
    if k > len(hash_ids):
        raise ValueError(f"input_length {input_length} needs more than {len(hash_ids)} hash ids")
    pos_bits = max(1, (n - 1).bit_length())
    shift = _PROMPT_TOKEN_BITS - pos_bits
    mask = (1 << shift) - 1
    ids = [h & mask for h in hash_ids[:k]]
    words = b"".join((j << shift).to_bytes(4, "little") for j in range(n))
    raw = bytearray(4 * n * k)
    for lane in range(4):
        pattern = words[lane::4]
        byte = 8 * lane
        if any(pattern):
            raw[lane::4] = b"".join(
                [pattern.translate(_OR_TABLES[(h >> byte) & 0xFF]) for h in ids]
            )
        else:  # this lane holds id bits only
            raw[lane::4] = b"".join([bytes(((h >> byte) & 0xFF,)) * n for h in ids])
    out: array[int] = array("i")
    out.frombytes(raw)
    if sys.byteorder == "big":
        out.byteswap()
    del out[input_length:]
    return out


# --- the router's index (router_sim.router.indexer.KvIndexer) ---------------------------------

MAX_LEVEL: Final = 2047  # router_sim.router.indexer.MAX_CACHE_LEVEL


class Detail(NamedTuple):
    """What ``KvIndexer.find_matches_detailed`` reports for one worker (``MatchDetail``'s
    fields, in its order)."""

    matched_blocks: int  # leading blocks of the request held on any tier
    device_run: int  # leading blocks held on the device tier
    device_blocks: int  # of the matched ones, those with a copy on the device tier
    slower_blocks: int  # of the matched ones, those on slower tiers only


class ModelIndex:
    """Who holds which block key at which cache levels (0: the device tier), per worker, and
    what a router's index reports for a request, by brute force: a worker's match is the count
    of the request's leading blocks it holds on any tier, and workers holding none are left
    out. A worker is known from its first store on (or any other update), as the index knows
    a worker from its first batch."""

    def __init__(self) -> None:
        self.held: dict[int, dict[Hashable, set[int]]] = {}
        # what KvIndexer.anomalies counts, for the updates apply_by_hash reads
        self.anomalies: dict[str, int] = dict.fromkeys(
            ("unknown_removal", "unknown_parent", "unknown_update", "level_out_of_range"), 0
        )

    @classmethod
    def of(cls, holdings: Mapping[int, Mapping[Hashable, Iterable[int]]]) -> ModelIndex:
        """The model of ``holdings``: worker -> key -> the levels it holds the key at."""
        model = cls()
        for worker, keys in holdings.items():
            held = model.held.setdefault(worker, {})
            for key, levels in keys.items():
                if set(levels):
                    held[key] = set(levels)
        return model

    # ----------------------------------------------------------------- holdings

    def store(self, worker: int, key: Hashable, level: int) -> None:
        self.held.setdefault(worker, {}).setdefault(key, set()).add(level)

    def drop(self, worker: int, key: Hashable, level: int | None) -> bool:
        """Drop ``key``'s copy at ``level`` (None: every copy); whether there was one."""
        levels = self.held.setdefault(worker, {}).get(key, set())
        gone = set(levels) if level is None else levels & {level}
        if not gone:
            return False
        levels -= gone
        if not levels:
            del self.held[worker][key]
        return True

    def clear(self, worker: int) -> None:
        self.held.setdefault(worker, {}).clear()

    def remove_worker(self, worker: int) -> None:
        self.held.pop(worker, None)

    def holds(self, worker: int, key: Hashable) -> tuple[int, ...]:
        return tuple(sorted(self.held.get(worker, {}).get(key, ())))

    def block_count(self, worker: int) -> int:
        return len(self.held.get(worker, {}))

    def total_entries(self) -> int:
        return sum(len(held) for held in self.held.values())

    # ------------------------------------------------------------------ updates

    def apply_by_hash(self, worker: int, data: EventData) -> None:
        """One event of a worker whose block hashes are the index's keys (an index not keyed
        by tokens), as the indexer's docs state it: a level above ``MAX_LEVEL`` is skipped and
        counted; a level below 0 is the device tier; a removal without a level drops every
        copy, with one that tier's copy; a move drops the old tier's copy (if held) and adds
        the new; a clear (this project's workers, V1 engines) empties every tier. KV-cache
        groups do not scope such a worker's hashes."""
        held = self.held.setdefault(worker, {})
        if isinstance(data, Stored):
            if not data.blocks:
                return
            if data.parent_hash is not None and data.parent_hash not in held:
                self.anomalies["unknown_parent"] += 1
            for block in data.blocks:
                if block.cache_level > MAX_LEVEL:
                    self.anomalies["level_out_of_range"] += 1
                else:
                    self.store(worker, block.block_hash, max(0, block.cache_level))
        elif isinstance(data, Removed):
            level = data.cache_level
            if level is not None and level > MAX_LEVEL:
                self.anomalies["level_out_of_range"] += len(data.block_hashes)
                return
            for h in data.block_hashes:
                if not self.drop(worker, h, None if level is None else max(0, level)):
                    self.anomalies["unknown_removal"] += 1
        elif isinstance(data, Updated):
            diff = data.cache_level
            if diff is None:
                return
            if max(diff.old_value, diff.new_value) > MAX_LEVEL:
                self.anomalies["level_out_of_range"] += 1
            elif data.block_hash not in held:
                self.anomalies["unknown_update"] += 1
            else:
                old, new = max(0, diff.old_value), max(0, diff.new_value)
                self.drop(worker, data.block_hash, old)
                self.store(worker, data.block_hash, new)
        elif isinstance(data, AllBlocksCleared):
            self.clear(worker)

    # ----------------------------------------------------------------- matching

    def find_matches(self, keys: Sequence[Hashable]) -> dict[int, int]:
        return {w: d.matched_blocks for w, d in self.find_matches_detailed(keys).items()}

    def find_matches_detailed(self, keys: Sequence[Hashable]) -> dict[int, Detail]:
        out: dict[int, Detail] = {}
        for worker, held in self.held.items():
            matched = 0
            while matched < len(keys) and keys[matched] in held:
                matched += 1
            if not matched:
                continue
            device_run = 0
            while device_run < matched and 0 in held[keys[device_run]]:
                device_run += 1
            on_device = sum(1 for k in keys[:matched] if 0 in held[k])
            out[worker] = Detail(matched, device_run, on_device, matched - on_device)
        return out

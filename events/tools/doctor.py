"""``kv-events doctor``: checks a KV event stream the way a router depends on it.

Fed the raw ZeroMQ messages of one or more workers (live or from a capture), :class:`Doctor`
checks, per worker:

- framing and decoding (three frames, an 8-byte sequence number, a payload that decodes);
- sequence numbers: gaps, duplicates, publisher restarts, a stream joined mid-way;
- parent chaining: every stored chain's parent was stored before (when the history is complete);
- block size: token counts against the event's ``block_size`` and the router's ``--block-size``;
- hashes: every block's hash, for the whole stream, is recomputed from its tokens, its parent's
  hash and its scope. A mismatch is replayed against the known drifts
  (:mod:`events.tools.diagnosis`); one that a drift explains is a problem naming the drift.

Every block ends in one of these counts (:class:`WorkerSummary`): verified; mismatched (a
problem); unverifiable because its scope is unknown (a salted first block in a stream that
announces no salt ids, unless ``--cache-salt`` names the salts); not recomputable (a v2 chain
whose start was not seen); or engine-native (a worker none of whose blocks ever verifies and
whose mismatches no drift explains, in a stream that names no algorithm: vLLM's or SGLang's own
hashes). :meth:`Doctor.verdict` is OK only when every block verified; "engine-native" and
"not verified" are outcomes of their own, which ``--require-verified`` refuses.

Findings are aggregated (one line per worker and cause, with a count and the first sequence
number) so a long capture gives a short report. Problems make the CLI exit with status 1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import msgpack

from events.stream.sequencer import Deliver, Lost, Output, StreamSequencer
from events.tools.diagnosis import (
    UNEXPLAINED,
    Cause,
    EventContext,
    explain_event,
    salt_cause,
    salt_variants,
    signed_output,
)
from events.wire.codec import DecodeError, decode_batch, encode_payload
from events.wire.model import (
    AllBlocksCleared,
    BlockHash,
    Created,
    KVCacheEvent,
    Removed,
    Stored,
    Updated,
)
from kvcache.hashing import BlockKey, HashAlgo, block_key, hash_from_key, root_key, v1_block_hash
from kvcache.scope import ReuseScope, cache_salt_id

Severity = Literal["problem", "warning", "info"]
Verdict = Literal["OK", "PROBLEMS FOUND", "ENGINE-NATIVE HASHES, NOT CHECKED", "NOT VERIFIED"]


@dataclass(frozen=True, slots=True)
class DoctorOptions:
    """What the router expects; None means "take the stream's own value"."""

    block_size: int | None = None
    #: the router's algorithm: every block is then checked against it, as when the stream
    #: declares ``hash_algo`` on its events
    hash_algo: HashAlgo | None = None
    #: the router's scope, imposed on every block (``--lora-id`` / ``--salt-id``)
    scope: ReuseScope | None = None
    #: the ``cache_salt`` strings the requests used (``--cache-salt``, several allowed): a
    #: stream that announces no salt ids becomes checkable, and announced salt ids are checked
    #: against the ids these strings derive to
    salts: tuple[str, ...] = ()


@dataclass(slots=True)
class Finding:
    """One aggregated finding: ``count`` occurrences, the first at ``first_seq``."""

    severity: Severity
    worker: int
    kind: str
    message: str
    count: int = 1
    first_seq: int | None = None


@dataclass(slots=True)
class WorkerSummary:
    """Per-worker totals shown in the report."""

    batches: int = 0
    events: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0
    hashes_checked: int = 0  # recomputed: hashes_ok of them matched, the rest are problems
    hashes_ok: int = 0
    hashes_unverifiable: int = 0  # scope unknown (a salt the stream does not announce)
    hashes_unrecomputable: int = 0  # a v2 chain whose parent's key is unknown
    hashes_engine: int = 0  # engine-native hashes: not checked
    first_seq: int | None = None
    last_seq: int | None = None


#: frames held back behind a gap before the doctor gives the gap up (bounded memory)
_HOLD_MAX: Final = 4096


def _raw(payload: bytes) -> bytes:
    return payload


#: stored events with unexplained mismatches, on a worker nothing verified on yet, after which
#: the doctor stops replaying drifts for it (engine-native hashes would cost every replay on
#: every block); every block is still recomputed and counted
_EXPLAIN_BUDGET: Final = 64


@dataclass(frozen=True, slots=True)
class _WireFlags:
    """What one BlockStored event carried on the wire, beyond what the decoder keeps."""

    declared: bool = False  # a hash_algo field
    salt_announced: bool = False  # a cache_salt_id (or cache_salt) field, even nil
    signed: bool = False  # a hash sent as a negative int64


_NO_FLAGS: Final = _WireFlags()


@dataclass(slots=True)
class _Pending:
    """Unexplained mismatches of one worker, decided at :meth:`Doctor.finish`: problems, or
    engine-native hashes when nothing of the worker ever verified."""

    algo: str
    seq: int
    count: int = 0


@dataclass(slots=True)
class _WorkerState:
    complete: bool = True  # history seen from seq 0 (or a clear) without an unfilled gap
    known: dict[BlockHash, BlockKey | None] = field(default_factory=dict)
    partial: set[BlockHash] = field(default_factory=set)  # announced with < block_size tokens
    unknown_scope: set[BlockHash] = field(default_factory=set)  # v2 blocks of an unknown scope
    declared: bool = False  # some event declared its hash_algo
    explained: int = 0  # mismatched blocks a known drift explained
    cause: Cause | None = None  # the drift that explained the last explained event
    budget: int = _EXPLAIN_BUDGET
    pending: _Pending | None = None
    salts_seen: set[int] = field(default_factory=set)  # announced salt ids already checked


# ------------------------------------------------------------------------- the doctor


class Doctor:
    """Checks messages fed in receive order; :meth:`report` renders what it found."""

    def __init__(self, options: DoctorOptions | None = None, endpoints: Sequence[str] = ()):
        self.options = options or DoctorOptions()
        self.endpoints = list(endpoints)
        self.summaries: dict[int, WorkerSummary] = {}
        self._states: dict[int, _WorkerState] = {}
        self._findings: dict[tuple[int, str, str], Finding] = {}
        self._topics: dict[int, bytes] = {}
        self._streams: dict[int, StreamSequencer[bytes]] = {}
        self._highest: dict[int, int] = {}
        self._late: dict[int, dict[int, bool]] = {}  # seq -> replayed, for batches that came late
        self._announced: dict[BlockHash, int] = {}  # first hash -> block_size as sent
        self._salt_ids = {cache_salt_id(s): s for s in self.options.salts}
        self._resolved = False

    # ---------------------------------------------------------------- findings

    def _note(
        self,
        severity: Severity,
        worker: int,
        kind: str,
        message: str,
        seq: int | None,
        count: int = 1,
        group: str | None = None,
    ) -> None:
        """Record a finding; findings with the same worker, kind and ``group`` (default: the
        message) aggregate into one, keeping the first message and sequence number."""
        key = (worker, kind, message if group is None else group)
        found = self._findings.get(key)
        if found is None:
            self._findings[key] = Finding(severity, worker, kind, message, count, seq)
        else:
            found.count += count

    @property
    def findings(self) -> list[Finding]:
        """All findings, problems first."""
        order = {"problem": 0, "warning": 1, "info": 2}
        return sorted(self._findings.values(), key=lambda f: (order[f.severity], f.worker))

    @property
    def problems(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "problem"]

    # ---------------------------------------------------------------- sequence

    def feed(self, worker: int, frames: Sequence[bytes], replay: bool = False) -> None:
        """Check one received multipart message of ``worker``.

        Well-formed messages go through the stream sequencer the subscriber uses, so batches
        are checked in seq order whatever order they arrived in (a replayed or late batch
        fills its gap first); gaps still open at :meth:`finish` are reported there.
        """
        self.summaries.setdefault(worker, WorkerSummary())
        if len(frames) != 3 or len(frames[1]) != 8:
            sizes = [len(f) for f in frames]
            self._note(
                "problem",
                worker,
                "frame",
                f"malformed message: frame sizes {sizes} (expected topic, 8-byte seq, payload)",
                None,
            )
            return
        topic, seq_bytes, payload = frames
        seq = int.from_bytes(seq_bytes, "big")
        previous_topic = self._topics.setdefault(worker, topic)
        if topic != previous_topic:
            self._note("warning", worker, "topic", f"topic changed to {topic!r}", seq)
        stream = self._streams.get(worker)
        if stream is None:
            # replay=True: a gap waits for the replayed (or late) frames of the capture; no
            # clock runs, so it stays open until finish() or until too much is held behind it
            stream = self._streams[worker] = StreamSequencer(_raw, replay=True)
        highest = self._highest.get(worker, -1)
        if seq < highest:
            self._late.setdefault(worker, {})[seq] = replay
        self._highest[worker] = max(highest, seq)
        duplicates = stream.duplicates
        outputs = stream.live(seq, payload, 0.0)
        if stream.held > _HOLD_MAX:
            outputs += stream.tick(math.inf)
        if stream.duplicates > duplicates:
            self._note("warning", worker, "duplicate", "duplicate batch (same seq twice)", seq)
        self._consume(worker, stream, outputs)

    def _consume(
        self, worker: int, stream: StreamSequencer[bytes], outputs: list[Output[bytes]]
    ) -> None:
        for o in outputs:
            if isinstance(o, Deliver):
                self._check(worker, stream, o.seq, o.item)
            elif isinstance(o, Lost):
                self._lost(worker, o)

    def _lost(self, worker: int, lost: Lost) -> None:
        if lost.restart:
            self._note(
                "warning",
                worker,
                "restart",
                "publisher restarted (seq went backwards): the router must drop this "
                "worker's blocks and rebuild from the new stream",
                None,
            )
            old = self._states.get(worker)
            fresh = self._states[worker] = _WorkerState()
            if old is not None:  # what is decided over the whole stream carries over
                fresh.declared, fresh.explained, fresh.cause = (
                    old.declared,
                    old.explained,
                    old.cause,
                )
                fresh.budget, fresh.pending, fresh.salts_seen = (
                    old.budget,
                    old.pending,
                    old.salts_seen,
                )
            return
        state = self._states.setdefault(worker, _WorkerState())
        state.complete = False
        if lost.span is None:
            return
        lo, hi = lost.span
        if lo == 0 and self.summaries[worker].batches == 0:
            self._note(
                "info",
                worker,
                "seq",
                f"stream joined at seq {hi + 1}: earlier batches were not seen, so unknown "
                "parents are not counted as broken chains",
                hi + 1,
            )
            return
        span = f"seq {lo}" if lo == hi else f"seqs {lo}..{hi}"
        self._note(
            "problem",
            worker,
            "gap",
            f"sequence gap: {span} never arrived ({hi - lo + 1} batch(es) lost); a "
            "router would miss their events unless it replays or resynchronizes",
            lo,
        )

    def _check(self, worker: int, stream: StreamSequencer[bytes], seq: int, payload: bytes) -> None:
        """Check one batch, delivered in seq order."""
        summary = self.summaries[worker]
        state = self._states.setdefault(worker, _WorkerState())
        state.complete = stream.complete
        late = self._late.get(worker, {}).pop(seq, None)
        if late is not None:
            how = "replayed" if late else "arrived late (reordered)"
            self._note("info", worker, "filled", f"a missing batch {how}", seq)
        summary.batches += 1
        summary.first_seq = seq if summary.first_seq is None else summary.first_seq
        summary.last_seq = seq
        try:
            batch = decode_batch(payload)
            events = batch.events
            if batch.malformed:  # the decoder left those events out: say so, then look closer
                raise DecodeError(batch.malformed[0])
        except DecodeError as exc:
            self._note(
                "problem", worker, "decode", f"payload does not decode: {exc}", seq, group=""
            )
            events = self._lenient_events(payload)
        flags = _wire_flags(payload, sum(isinstance(e.data, Stored) for e in events))
        stored = 0
        for event in events:
            summary.events += 1
            if isinstance(event.data, Stored):
                stored += 1
            self._event(worker, state, summary, seq, event, flags[stored - 1] if stored else None)

    def _lenient_events(self, payload: bytes) -> list[KVCacheEvent]:
        """Decode a payload whose only fault is stored events with a block_size that does not
        fit their token counts: re-split those by the size the hash count implies, remembering
        the announced size for the block-size check. Anything else malformed gives nothing."""
        try:
            top = msgpack.unpackb(payload, raw=False, strict_map_key=False, max_bin_len=1 << 16)
            for raw in top[1]:
                if isinstance(raw, dict) and raw.get("type") == "BlockStored":
                    fields: dict[Any, Any] = raw
                    names: dict[str, Any] = {"h": "block_hashes", "t": "token_ids"}
                    names["b"] = "block_size"
                elif isinstance(raw, list) and raw and raw[0] == "BlockStored" and len(raw) > 4:
                    fields = dict(enumerate(raw))
                    names = {"h": 1, "t": 3, "b": 4}
                else:
                    continue
                hashes, tokens = fields[names["h"]], fields[names["t"]]
                announced = fields[names["b"]]
                if hashes and len(tokens) % len(hashes) == 0:
                    implied = len(tokens) // len(hashes)
                    if implied != announced and implied > 0:
                        first = hashes[0] + (1 << 64) if hashes[0] < 0 else hashes[0]
                        self._announced[first] = announced
                        if isinstance(raw, dict):
                            raw["block_size"] = implied
                        else:
                            raw[4] = implied
            rank = top[2] if len(top) > 2 else None
            return decode_batch(encode_payload(top[1], top[0], rank)).events
        except (DecodeError, ValueError, TypeError, KeyError, IndexError, AttributeError):
            return []

    # ---------------------------------------------------------------- events

    def _event(
        self,
        worker: int,
        state: _WorkerState,
        summary: WorkerSummary,
        seq: int,
        event: KVCacheEvent,
        flags: _WireFlags | None = None,
    ) -> None:
        data = event.data
        if isinstance(data, Stored):
            self._stored(worker, state, summary, seq, event.hash_algo, data, flags or _NO_FLAGS)
        elif isinstance(data, Removed):
            for h in data.block_hashes:
                summary.blocks_removed += 1
                state.partial.discard(h)
                state.unknown_scope.discard(h)
                if h in state.known:
                    del state.known[h]
                elif state.complete:
                    self._note(
                        "warning", worker, "removed", "removed a block that was never stored", seq
                    )
        elif isinstance(data, Updated):
            if data.block_hash not in state.known and state.complete:
                self._note(
                    "warning", worker, "updated", "updated a block that was never stored", seq
                )
        elif isinstance(data, AllBlocksCleared):
            state.known.clear()
            state.partial.clear()
            state.unknown_scope.clear()
        elif isinstance(data, Created):
            self._note("info", worker, "created", f"cache created: {data}", seq)

    def _stored(
        self,
        worker: int,
        state: _WorkerState,
        summary: WorkerSummary,
        seq: int,
        algo_name: str,
        data: Stored,
        flags: _WireFlags,
    ) -> None:
        opts = self.options
        state.declared = state.declared or flags.declared
        named = flags.declared or opts.hash_algo is not None
        try:
            stream_algo: HashAlgo | None = HashAlgo(algo_name)
        except ValueError:
            stream_algo = None
            self._note("problem", worker, "algo", f"unknown hash_algo {algo_name!r}", seq)
        algo = opts.hash_algo or stream_algo or HashAlgo.V1_BLOCK_KEY
        if stream_algo is not None and opts.hash_algo is not None and stream_algo != algo:
            self._note(
                "problem",
                worker,
                "algo",
                f"events say hash_algo {stream_algo.value}, the router uses {algo.value}",
                seq,
            )
        blocks = data.blocks
        summary.blocks_stored += len(blocks)
        if not blocks:
            self._note("problem", worker, "empty", "stored event without blocks", seq)
            return
        sizes = [len(b.tokens) for b in blocks]
        announced = self._announced.pop(blocks[0].block_hash, data.block_size)
        if announced != data.block_size:
            self._note(
                "problem",
                worker,
                "block_size",
                f"events say block_size {announced} but their hashes cover blocks of "
                f"{data.block_size} tokens (re-split at that size for the checks below): "
                "the engine announces the wrong block size",
                seq,
            )
            announced = data.block_size
        if opts.block_size is not None and announced is not None and announced != opts.block_size:
            self._note(
                "problem",
                worker,
                "block_size",
                f"events carry block_size {announced} but the router uses {opts.block_size}: "
                "no request hash can match; configure both sides with one block size",
                seq,
            )
        expected = announced or opts.block_size
        if data.masked or not any(sizes):
            # a placeholder (CPU offload) or masked (sliding-window) store: its blocks' tokens
            # are not on the wire, so there is nothing to size-check or recompute
            for blk in blocks:
                state.known.setdefault(blk.block_hash, None)
            return
        if expected is not None:
            if any(s != expected for s in sizes[:-1]) or sizes[-1] > expected:
                self._note(
                    "problem",
                    worker,
                    "block_size",
                    f"blocks hold {sorted(set(sizes))} tokens but block_size is {expected}",
                    seq,
                )
            elif sizes[-1] < expected:
                state.partial.add(blocks[-1].block_hash)
                cause = Cause(
                    f"the engine announces a trailing partial block ({sizes[-1]} of {expected} "
                    "tokens), which routers never hash",
                    "announce full blocks only",
                    "the engine's loop over the blocks it announces",
                )
                self._note(
                    # an engine's own stream may announce them (vLLM 0.33): a problem only
                    # where the stream or the user names the algorithm routers recompute
                    "problem" if named else "warning",
                    worker,
                    "partial",
                    f"a partial block was announced: {cause}",
                    seq,
                )
        parent = data.parent_hash
        if parent is not None and parent in state.partial:
            self._note(
                "problem",
                worker,
                "block_size",
                f"a block announced as partial (fewer than {expected} tokens) has children: "
                "partial blocks are always leaves, so the blocks really hold fewer tokens than "
                "the announced block_size",
                seq,
            )
        if parent is not None and parent not in state.known:
            if state.complete:
                self._note(
                    "problem",
                    worker,
                    "parent",
                    "broken parent chain: a stored chain's parent was never stored (or was "
                    "already removed)",
                    seq,
                )
            else:
                self._note(
                    "warning",
                    worker,
                    "parent",
                    "stored chain with an unknown parent (the history before it was not seen)",
                    seq,
                )
        if flags.signed:
            self._note(
                "warning" if named else "info",
                worker,
                "signed",
                "hashes travel as negative (signed) int64s; WIRE.md 4 decoders (and this "
                "doctor) read them as unsigned, strict uint64 readers reject the batch: "
                f"{signed_output()}",
                seq,
            )
        self._check_salts(worker, state, seq, data, flags)
        self._verify_hashes(worker, state, summary, seq, algo, data, flags, named)

    # ---------------------------------------------------------------- hashes

    def _salt_strings(self, data: Stored) -> list[str]:
        return [*self.options.salts, *([] if data.salt is None else [data.salt])]

    def _check_salts(
        self, worker: int, state: _WorkerState, seq: int, data: Stored, flags: _WireFlags
    ) -> None:
        """Announced salt ids against the ids of the given ``cache_salt`` strings (and of the
        event's own salt string): an engine that derives them another way hashes consistently
        with itself, and no request a router hashes ever matches its blocks."""
        strings = self._salt_strings(data)
        if not strings or not flags.salt_announced:
            return
        own = None if data.salt is None else cache_salt_id(data.salt)
        for blk in data.blocks:
            salt = blk.cache_salt_id
            if salt is None or salt in state.salts_seen or len(state.salts_seen) >= _HOLD_MAX:
                continue
            state.salts_seen.add(salt)
            if salt in self._salt_ids or salt == own:
                continue
            cause = next(
                (
                    salt_cause(text, name, what, value)
                    for text in strings
                    for name, what, value in salt_variants(text)
                    if value == salt
                ),
                None,
            )
            if cause is None:
                self._note(
                    "info",
                    worker,
                    "salt",
                    f"salt id {salt} is announced but is not the id of any --cache-salt given "
                    "(another tenant?)",
                    seq,
                    group="unknown",
                )
            else:
                self._note(
                    "problem",
                    worker,
                    "salt",
                    f"announced salt ids are not the ones routers derive: {cause}",
                    seq,
                )

    def _candidates(
        self, data: Stored, root: bool, salt_known: bool, flags: _WireFlags
    ) -> list[list[ReuseScope]]:
        """The scopes to recompute an event's blocks under, one list per candidate: the
        router's, or the blocks' own; for a chain from the root of a stream that announces no
        salt, no salt and each salt the user gave."""
        blocks = data.blocks
        if self.options.scope is not None:
            return [[self.options.scope] * len(blocks)]
        string_salt = None
        if data.salt is not None and not flags.salt_announced:
            string_salt = cache_salt_id(data.salt)
        own = [
            ReuseScope(b.lora_id, b.cache_salt_id if string_salt is None else string_salt)
            for b in blocks
        ]
        if salt_known or not root:
            return [own]
        return [own] + [[ReuseScope(b.lora_id, s) for b in blocks] for s in self._salt_ids]

    def _recompute(
        self,
        algo: HashAlgo,
        data: Stored,
        scopes: list[ReuseScope],
        parent_key: BlockKey | None,
    ) -> tuple[list[BlockHash | None], list[BlockKey | None]]:
        """Each block's expected hash and block key under ``scopes``; V1 chains from the
        parent hashes as published, v2 from the keys (None where the parent key is unknown)."""
        want: list[BlockHash | None] = []
        keys: list[BlockKey | None] = []
        parent = data.parent_hash
        key = root_key(scopes[0]) if parent is None else parent_key
        for i, blk in enumerate(data.blocks):
            key = None if key is None else block_key(key, blk.tokens)
            keys.append(key)
            if algo is HashAlgo.V1_BLOCK_KEY:
                if isinstance(parent, int | None):
                    scope = scopes[i]
                    want.append(v1_block_hash(blk.tokens, parent or 0, scope.lora_id, scope.salt))
                else:
                    want.append(None)  # a hex parent cannot chain a V1 hash
            else:
                want.append(None if key is None else hash_from_key(algo, key))
            parent = blk.block_hash
        return want, keys

    def _verify_hashes(
        self,
        worker: int,
        state: _WorkerState,
        summary: WorkerSummary,
        seq: int,
        algo: HashAlgo,
        data: Stored,
        flags: _WireFlags,
        named: bool,
    ) -> None:
        """Recompute every block of one stored event and count each in one of the summary's
        outcomes; mismatches are replayed against the known drifts."""
        opts = self.options
        blocks = data.blocks
        v1 = algo is HashAlgo.V1_BLOCK_KEY
        parent_hash = data.parent_hash
        root = parent_hash is None
        salt_known = opts.scope is not None or flags.salt_announced or data.salt is not None
        parent_key = None if parent_hash is None else state.known.get(parent_hash)
        if not v1 and not root and parent_key is None:
            inherited = parent_hash in state.unknown_scope
            for blk in blocks:
                state.known[blk.block_hash] = None
                if inherited:
                    state.unknown_scope.add(blk.block_hash)
            if inherited:
                summary.hashes_unverifiable += len(blocks)
                self._note_unverifiable(worker, seq, len(blocks))
            else:
                summary.hashes_unrecomputable += len(blocks)
                self._note(
                    "info",
                    worker,
                    "unverified",
                    f"{algo.value} hashes chain block keys; a block whose parent key is "
                    "unknown (its chain's start was not seen) cannot be recomputed",
                    seq,
                    count=len(blocks),
                )
            return
        tried: list[tuple[list[ReuseScope], list[BlockKey | None], list[int]]] = []
        for scopes in self._candidates(data, root, salt_known, flags):
            want, keys = self._recompute(algo, data, scopes, parent_key)
            bad = [i for i, blk in enumerate(blocks) if want[i] != blk.block_hash]
            tried.append((scopes, keys, bad))
            if not bad:
                break
        scopes, keys, mismatched = min(tried, key=lambda t: len(t[2]))
        summary.hashes_checked += len(blocks) - len(mismatched)
        summary.hashes_ok += len(blocks) - len(mismatched)
        for blk, key in zip(blocks, keys, strict=True):
            state.known[blk.block_hash] = key
        if not mismatched:
            return
        cause = self._explain(state, summary, algo, data, tried, parent_key)
        if cause is not None:
            summary.hashes_checked += len(mismatched)
            state.explained += len(mismatched)
            state.cause = cause
            self._note(
                "problem",
                worker,
                "hash",
                f"block hashes do not match {algo.value} recomputed from tokens, parent and "
                f"scope; explained by: {cause}",
                seq,
                count=len(mismatched),
            )
            return
        if summary.hashes_ok == 0 and state.explained == 0:
            state.budget -= 1
        # blocks whose hash depends on a salt nobody announced or named: not drift
        scope_unknown = not salt_known and root and not self._salt_ids
        dependent = [i for i in mismatched if scope_unknown and (not v1 or i == 0)]
        others = [i for i in mismatched if i not in dependent]
        if dependent:
            summary.hashes_unverifiable += len(dependent)
            if not v1:
                state.unknown_scope.update(blocks[i].block_hash for i in dependent)
            self._note_unverifiable(worker, seq, len(dependent))
        if others:
            summary.hashes_checked += len(others)
            if state.pending is None:
                state.pending = _Pending(algo.value, seq)
            state.pending.count += len(others)

    def _explain(
        self,
        state: _WorkerState,
        summary: WorkerSummary,
        algo: HashAlgo,
        data: Stored,
        tried: list[tuple[list[ReuseScope], list[BlockKey | None], list[int]]],
        parent_key: BlockKey | None,
    ) -> Cause | None:
        """The known drift that explains the mismatches under one of the scopes tried."""
        if state.budget <= 0 and summary.hashes_ok == 0 and state.explained == 0:
            return None  # nothing of this worker ever verified or was explained: not replayed
        announced = [ReuseScope(b.lora_id, b.cache_salt_id) for b in data.blocks]
        for scopes, _keys, bad in tried:
            ctx = EventContext(
                algo,
                data,
                bad,
                scopes,
                parent_key,
                router_scope=self.options.scope is not None,
                salts=self._salt_strings(data),
                expected_size=data.block_size or self.options.block_size,
                announced=announced,
            )
            cause = explain_event(ctx, state.cause)
            if cause is not None:
                return cause
        return None

    def _note_unverifiable(self, worker: int, seq: int, count: int) -> None:
        self._note(
            "warning",
            worker,
            "unverifiable",
            "unverifiable: scope unknown (a salt the stream does not announce?): blocks that "
            "no known scope recomputes and no known drift explains, in a stream without salt "
            "ids; name the requests' salts with --cache-salt (several allowed) to check them",
            seq,
            count=count,
            group="unverifiable",
        )

    def _resolve(self) -> None:
        """Decide each worker's unexplained mismatches: engine-native hashes when nothing of
        the worker verified, no drift explained anything and no algorithm was named;
        problems otherwise."""
        for worker, state in self._states.items():
            summary = self.summaries[worker]
            pending = state.pending
            state.pending = None
            unverifiable = self._findings.get((worker, "unverifiable", "unverifiable"))
            native = (
                not state.declared
                and self.options.hash_algo is None
                and summary.hashes_ok == 0
                and state.explained == 0
                and (pending is not None or summary.hashes_unverifiable > 0)
            )
            if native:
                checked = 0 if pending is None else pending.count
                summary.hashes_engine += checked + summary.hashes_unverifiable
                summary.hashes_checked -= checked
                summary.hashes_unverifiable = 0
                self._findings.pop((worker, "unverifiable", "unverifiable"), None)
                first = pending.seq if pending is not None else None
                if unverifiable is not None and unverifiable.first_seq is not None:
                    first = (
                        unverifiable.first_seq
                        if first is None
                        else min(first, unverifiable.first_seq)
                    )
                self._note(
                    "info",
                    worker,
                    "engine-hashes",
                    "block hashes are the engine's own (no V1/V2 recomputation under any "
                    "scope and no known drift reproduces any of them, as with vLLM's or "
                    "SGLang's): engine-native hashes, not checked; sequence, parent chains, "
                    "block sizes and token counts are; a router keys these blocks by their "
                    "token ids",
                    first,
                    count=summary.hashes_engine,
                )
            elif pending is not None:
                seen = f" (this worker's other mismatches: {state.cause})" if state.cause else ""
                self._note(
                    "problem",
                    worker,
                    "hash",
                    f"block hashes do not match {pending.algo} recomputed from tokens, parent "
                    f"and scope; explained by: {UNEXPLAINED}{seen}",
                    pending.seq,
                    count=pending.count,
                )

    # ---------------------------------------------------------------- report

    def finish(self) -> list[Finding]:
        """End of input: report the gaps nothing filled and decide the mismatches no drift
        explained; returns all findings."""
        for worker, stream in self._streams.items():
            for _ in range(64):  # each tick closes one gap; the held frames behind it follow
                if stream.deadline is None:
                    break
                self._consume(worker, stream, stream.tick(math.inf))
        if not self._resolved:
            self._resolved = True
            self._resolve()
        return self.findings

    def totals(self) -> WorkerSummary:
        """Every worker's summary added up."""
        total = WorkerSummary()
        for s in self.summaries.values():
            for name in WorkerSummary.__dataclass_fields__:
                if name not in ("first_seq", "last_seq"):
                    setattr(total, name, getattr(total, name) + getattr(s, name))
        return total

    def verdict(self) -> Verdict:
        """OK only when there is no problem and every block with tokens verified (call
        :meth:`finish` first); engine-native hashes and unverifiable blocks are their own
        outcomes, never OK."""
        if self.problems:
            return "PROBLEMS FOUND"
        t = self.totals()
        unverified = t.hashes_unverifiable + t.hashes_unrecomputable
        if t.hashes_engine and not unverified and not t.hashes_ok:
            return "ENGINE-NATIVE HASHES, NOT CHECKED"
        if t.hashes_engine or unverified:
            return "NOT VERIFIED"
        return "OK"

    def fully_verified(self) -> bool:
        """What ``--require-verified`` asks: verdict OK and at least one block verified."""
        return self.verdict() == "OK" and self.totals().hashes_ok > 0

    def render(self) -> str:
        """The human-readable report (call :meth:`finish` first)."""
        lines: list[str] = []
        total = self.totals()
        lines.append(
            f"kv-events doctor: {len(self.summaries)} worker(s), {total.batches} batches, "
            f"{total.events} events, {total.blocks_stored} blocks stored, "
            f"{total.blocks_removed} removed"
        )
        for worker in sorted(self.summaries):
            s = self.summaries[worker]
            where = f" ({self.endpoints[worker]})" if worker < len(self.endpoints) else ""
            span = "no valid batch" if s.first_seq is None else f"seq {s.first_seq}..{s.last_seq}"
            lines.append(
                f"  worker {worker}{where}: {span}, {s.batches} batches, hashes verified "
                f"{s.hashes_ok}/{s.hashes_checked}{_unverified(s)}"
            )
        findings = self.findings
        for f in findings:
            times = f" (x{f.count})" if f.count > 1 else ""
            at = "" if f.first_seq is None else f" seq {f.first_seq}"
            lines.append(f"{f.severity.upper():8} worker {f.worker}{at}: {f.message}{times}")
        problems = sum(1 for f in findings if f.severity == "problem")
        warnings = sum(1 for f in findings if f.severity == "warning")
        lines.append(
            f"result: {self.verdict()}: {problems} problem(s), {warnings} warning(s)"
            + _unverified(total, "; not verified:")
        )
        return "\n".join(lines)


def _unverified(s: WorkerSummary, lead: str = ",") -> str:
    parts = [
        f"{s.hashes_engine} engine-native (not checked)" if s.hashes_engine else "",
        f"{s.hashes_unverifiable} unverifiable (scope unknown)" if s.hashes_unverifiable else "",
        f"{s.hashes_unrecomputable} not recomputable (chain start unseen)"
        if s.hashes_unrecomputable
        else "",
    ]
    shown = [p for p in parts if p]
    return f"{lead} {', '.join(shown)}" if shown else ""


def _wire_flags(payload: bytes, stored: int) -> list[_WireFlags]:
    """Per BlockStored event of ``payload``, in order, what the decoder does not keep: whether
    it declared ``hash_algo``, announced a salt field, sent a negative hash. All False when
    the raw events cannot be lined up with the ``stored`` decoded ones."""
    if not stored:
        return []
    try:
        top = msgpack.unpackb(payload, raw=False, strict_map_key=False, max_bin_len=1 << 16)
    except Exception:  # anything the decoder took but this cannot read: nothing to add
        return [_NO_FLAGS] * stored
    events = top[1] if isinstance(top, list) and len(top) > 1 else None
    flags: list[_WireFlags] = []
    for raw in events if isinstance(events, list) else []:
        if isinstance(raw, dict) and raw.get("type") == "BlockStored":
            hashes, parent = raw.get("block_hashes"), raw.get("parent_block_hash")
            declared = "hash_algo" in raw
            salted = "cache_salt_id" in raw or "cache_salt" in raw
        elif isinstance(raw, list) and raw and raw[0] == "BlockStored":
            hashes = raw[1] if len(raw) > 1 else None
            parent = raw[2] if len(raw) > 2 else None
            declared = salted = False
        else:
            continue
        values = [*(hashes if isinstance(hashes, list) else []), parent]
        signed = any(isinstance(h, int) and h < 0 for h in values)
        flags.append(_WireFlags(declared, salted, signed))
    return flags if len(flags) == stored else [_NO_FLAGS] * stored

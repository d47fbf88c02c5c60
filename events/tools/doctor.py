"""``kv-events doctor``: checks a KV event stream the way a router depends on it.

Fed the raw ZeroMQ messages of one or more workers (live or from a capture), :class:`Doctor`
checks, per worker:

- framing and decoding (three frames, an 8-byte sequence number, a payload that decodes);
- sequence numbers: gaps, duplicates, publisher restarts, a stream joined mid-way;
- parent chaining: every stored chain's parent was stored before (when the history is complete);
- block size: token counts against the event's ``block_size`` and the router's ``--block-size``;
- hashes: each block's hash is recomputed from its tokens, its parent's hash and the scope. A
  mismatch is tried against the usual causes (salt or LoRA not mixed, salt mixed on every
  block, parent not chained, another scope, another block size, another algorithm) and the
  report says which one explains it.

Findings are aggregated (one line per worker and cause, with a count and the first sequence
number) so a long capture gives a short report. Problems make the CLI exit with status 1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import msgpack

from events.hashing import HashAlgo, hash_from_key, v1_block_hash
from events.stream.sequencer import Deliver, Lost, Output, StreamSequencer
from events.tools.diagnosis import explain_mismatch
from events.wire.codec import DecodeError, decode_batch
from events.wire.model import (
    AllBlocksCleared,
    BlockHash,
    Created,
    KVCacheEvent,
    Removed,
    Stored,
    Updated,
)
from kvcache.keys import BlockKey, block_key, root_key
from kvcache.scope import ReuseScope

Severity = Literal["problem", "warning", "info"]


@dataclass(frozen=True, slots=True)
class DoctorOptions:
    """What the router expects; None means "take the stream's own value"."""

    block_size: int | None = None
    hash_algo: HashAlgo | None = None
    scope: ReuseScope | None = None


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
    hashes_checked: int = 0
    hashes_ok: int = 0
    first_seq: int | None = None
    last_seq: int | None = None


#: frames held back behind a gap before the doctor gives the gap up (bounded memory)
_HOLD_MAX: Final = 4096


def _raw(payload: bytes) -> bytes:
    return payload


@dataclass(slots=True)
class _WorkerState:
    complete: bool = True  # history seen from seq 0 (or a clear) without an unfilled gap
    known: dict[BlockHash, BlockKey | None] = field(default_factory=dict)
    partial: set[BlockHash] = field(default_factory=set)  # announced with < block_size tokens
    # the worker publishes its engine's own block hashes (vLLM, SGLang): no algorithm this
    # project knows recomputes them, so the hash check stops and the other checks go on
    engine_hashes: bool = False


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
            self._states[worker] = _WorkerState()
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
        for event in events:
            summary.events += 1
            self._event(worker, state, summary, seq, event)

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
            return decode_batch(msgpack.packb(top)).events
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
    ) -> None:
        data = event.data
        if isinstance(data, Stored):
            self._stored(worker, state, summary, seq, event.hash_algo, data)
        elif isinstance(data, Removed):
            for h in data.block_hashes:
                summary.blocks_removed += 1
                state.partial.discard(h)
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
    ) -> None:
        opts = self.options
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
                self._note(
                    "warning",
                    worker,
                    "partial",
                    f"a partial block ({sizes[-1]} of {expected} tokens) was announced; "
                    "routers only hash full blocks",
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
        self._verify_hashes(worker, state, summary, seq, algo, data)

    # ---------------------------------------------------------------- hashes

    def _scope_of(self, lora_id: int | None, salt_id: int | None) -> ReuseScope:
        if self.options.scope is not None:
            return self.options.scope
        return ReuseScope(lora_id, salt_id)

    def _verify_hashes(
        self,
        worker: int,
        state: _WorkerState,
        summary: WorkerSummary,
        seq: int,
        algo: HashAlgo,
        data: Stored,
    ) -> None:
        blocks = data.blocks
        if state.engine_hashes:
            for blk in blocks:
                state.known[blk.block_hash] = None
            return
        parent_hash = data.parent_hash
        parent_key: BlockKey | None
        first = blocks[0]
        scope = self._scope_of(first.lora_id, first.cache_salt_id)
        parent_key = root_key(scope) if parent_hash is None else state.known.get(parent_hash)
        mismatched: list[int] = []
        keys: list[BlockKey | None] = []
        for i, blk in enumerate(blocks):
            scope = self._scope_of(blk.lora_id, blk.cache_salt_id)
            key = None if parent_key is None else block_key(parent_key, blk.tokens)
            keys.append(key)
            summary.hashes_checked += 1
            want = self._expected(algo, blk.tokens, parent_hash, scope, key)
            if want is None:
                summary.hashes_checked -= 1
                self._note(
                    "info",
                    worker,
                    "unverified",
                    f"{algo.value} hashes chain block keys; a block whose parent key is "
                    "unknown cannot be recomputed",
                    seq,
                )
            elif want == blk.block_hash:
                summary.hashes_ok += 1
            else:
                mismatched.append(i)
            state.known[blk.block_hash] = key
            parent_hash, parent_key = blk.block_hash, key
        if mismatched and self._engine_hashes(worker, state, summary, seq, algo, data, keys):
            return
        if mismatched:
            self._explain(worker, seq, algo, data, mismatched, keys)

    def _engine_hashes(
        self,
        worker: int,
        state: _WorkerState,
        summary: WorkerSummary,
        seq: int,
        algo: HashAlgo,
        data: Stored,
        keys: list[BlockKey | None],
    ) -> bool:
        """Recognize a worker that publishes its engine's own hashes: a first stored chain
        (no parent) whose hashes no known algorithm recomputes under any scope, with no usual
        cause explaining them (vLLM's sha256 of CBOR with a process seed, SGLang's namespaced
        page hashes, bin hashes of other lengths). Says so once and stops checking hashes."""
        if self.options.hash_algo is not None or data.parent_hash is not None:
            return False  # the router's algorithm was named, or the chain's start is unseen
        first = data.blocks[0]
        for candidate in HashAlgo:
            key = keys[0]
            want = self._expected(
                candidate,
                first.tokens,
                None,
                self._scope_of(first.lora_id, first.cache_salt_id),
                key,
            )
            if want == first.block_hash:
                return False  # a known algorithm, mis-declared or mis-scoped: explain it
        explanation = explain_mismatch(
            algo, data, [0], keys[:1], self._scope_of, self.options.scope is not None
        )
        if not explanation.startswith(("unexplained", "another algorithm")):
            return False
        state.engine_hashes = True
        summary.hashes_checked -= len(data.blocks)
        for blk in data.blocks:
            state.known[blk.block_hash] = None
        self._note(
            "info",
            worker,
            "engine-hashes",
            "block hashes are the engine's own (no V1/V2 recomputation under any scope "
            "matches, as with vLLM's or SGLang's): not recomputable, so not checked; sequence, "
            "parent chains, block sizes and token counts are; a router keys these blocks by "
            "their token ids",
            seq,
        )
        return True

    def _expected(
        self,
        algo: HashAlgo,
        tokens: Sequence[int],
        parent_hash: BlockHash | None,
        scope: ReuseScope,
        key: BlockKey | None,
    ) -> BlockHash | None:
        if algo is HashAlgo.V1_BLOCK_KEY:
            if not isinstance(parent_hash, int | None):
                return -1  # a hex parent cannot chain a V1 hash: a mismatch to explain
            return v1_block_hash(tokens, parent_hash or 0, scope.lora_id, scope.salt)
        return None if key is None else hash_from_key(algo, key)

    def _explain(
        self,
        worker: int,
        seq: int,
        algo: HashAlgo,
        data: Stored,
        mismatched: list[int],
        keys: list[BlockKey | None],
    ) -> None:
        """Say which usual cause explains the mismatched blocks of one stored event."""
        explanation = explain_mismatch(
            algo, data, mismatched, keys, self._scope_of, self.options.scope is not None
        )
        self._note(
            "problem",
            worker,
            "hash",
            f"block hashes do not match {algo.value} recomputed from tokens, parent and scope; "
            f"explained by: {explanation}",
            seq,
            count=len(mismatched),
        )

    # ---------------------------------------------------------------- report

    def finish(self) -> list[Finding]:
        """End of input: report the gaps nothing filled; returns all findings."""
        for worker, stream in self._streams.items():
            for _ in range(64):  # each tick closes one gap; the held frames behind it follow
                if stream.deadline is None:
                    break
                self._consume(worker, stream, stream.tick(math.inf))
        return self.findings

    def render(self) -> str:
        """The human-readable report (call :meth:`finish` first)."""
        lines: list[str] = []
        total = WorkerSummary()
        for s in self.summaries.values():
            total.batches += s.batches
            total.events += s.events
            total.blocks_stored += s.blocks_stored
            total.blocks_removed += s.blocks_removed
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
                f"{s.hashes_ok}/{s.hashes_checked}"
            )
        findings = self.findings
        for f in findings:
            times = f" (x{f.count})" if f.count > 1 else ""
            at = "" if f.first_seq is None else f" seq {f.first_seq}"
            lines.append(f"{f.severity.upper():8} worker {f.worker}{at}: {f.message}{times}")
        problems = sum(1 for f in findings if f.severity == "problem")
        warnings = sum(1 for f in findings if f.severity == "warning")
        verdict = "OK" if problems == 0 else "PROBLEMS FOUND"
        lines.append(f"result: {verdict}: {problems} problem(s), {warnings} warning(s)")
        return "\n".join(lines)

"""The hashes an engine published for known prompts, read back from a capture.

Any engine that publishes KV events can be checked against a golden file without running its
hashing in-process: record its event stream while it serves the corpus's prompts (``kv-events
listen --record``), then look each prompt up among the announced blocks. A prompt's blocks are
found by walking from the root: the first block is an announced block without a parent whose
tokens start the prompt, each next one a block announced with the previous one as its parent
and the next tokens. Blocks of any size are followed, so an engine configured with another block
size is found and named, and a block whose tokens match but whose announced parent is not its
predecessor's hash is reported as a broken parent chain. Announced LoRA ids and salt ids (when
the engine sends them) must agree with the case's scope.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from events.tools.capture import CaptureError, read_capture
from events.tools.diagnosis import explain_chain, salt_cause, salt_variants
from events.tools.hashcheck import Case, Drift, Golden, GoldenError
from events.wire.codec import DecodeError, decode_batch
from events.wire.model import BlockHash, Stored
from kvcache.scope import ReuseScope


@dataclass(frozen=True, slots=True)
class _Announced:
    block_hash: BlockHash
    parent: BlockHash | None
    tokens: tuple[int, ...]
    lora_id: int | None
    salt_id: int | None


@dataclass(frozen=True, slots=True)
class Walk:
    """What a capture holds for one prompt."""

    hashes: list[BlockHash]  # the full blocks' hashes, in prompt order
    sizes: list[int]  # tokens of every block found (a trailing partial one included)
    broken: tuple[int, BlockHash | None, BlockHash | None] | None  # (block, announced, wanted)


def _short(h: BlockHash | None) -> str:
    return "none" if h is None else str(h)


class CaptureHashes:
    """Every block a capture announced, indexed by (parent, tokens) and by tokens alone."""

    def __init__(self, path: str | Path) -> None:
        try:
            capture = read_capture(path)
        except OSError as exc:
            raise GoldenError(f"cannot read capture {path}: {exc.strerror}") from None
        except CaptureError as exc:
            raise GoldenError(f"{path}: {exc}") from None
        self.undecodable = 0  # messages and events that did not decode
        self._by_link: dict[tuple[BlockHash | None, tuple[int, ...]], list[_Announced]]
        self._by_link = defaultdict(list)
        self._by_tokens: dict[tuple[int, ...], list[_Announced]] = defaultdict(list)
        for message in capture.messages:
            # live [topic, seq, payload]; replay [b"", topic, seq, payload] or, from engines
            # that omit the topic, [b"", seq, payload]; a replay's end marker has no payload
            payload = message.frames[-1] if len(message.frames) in (3, 4) else b""
            if not payload:
                self.undecodable += int(len(message.frames) not in (3, 4))
                continue
            try:
                batch = decode_batch(payload)
            except DecodeError:
                self.undecodable += 1
                continue
            self.undecodable += len(batch.malformed)
            for event in batch.events:
                if isinstance(event.data, Stored):
                    self._add(event.data)
        self._sizes = sorted({len(t) for t in self._by_tokens}, reverse=True)

    def _add(self, data: Stored) -> None:
        parent = data.parent_hash
        for b in data.blocks:
            if not b.tokens:  # a placeholder store (offload) announces no tokens
                continue
            block = _Announced(b.block_hash, parent, tuple(b.tokens), b.lora_id, b.cache_salt_id)
            self._by_link[(parent, block.tokens)].append(block)
            self._by_tokens[block.tokens].append(block)
            parent = b.block_hash

    @property
    def blocks(self) -> int:
        """How many block announcements the capture holds."""
        return sum(len(v) for v in self._by_tokens.values())

    @staticmethod
    def _pick(found: list[_Announced], scope: ReuseScope) -> _Announced | None:
        """The announcement under ``scope``: an absent id (an engine that does not send it)
        is accepted, a different one is not; exact matches first."""
        fits = [
            b
            for b in found
            if b.lora_id in (None, scope.lora_id) and b.salt_id in (None, scope.salt)
        ]
        fits.sort(key=lambda b: (b.lora_id != scope.lora_id) + (b.salt_id != scope.salt))
        return fits[0] if fits else None

    def walk(self, tokens: Sequence[int], scope: ReuseScope) -> Walk:
        """The announced blocks of ``tokens`` under ``scope``, from the root."""
        hashes: list[BlockHash] = []
        sizes: list[int] = []
        broken: tuple[int, BlockHash | None, BlockHash | None] | None = None
        parent: BlockHash | None = None
        pos = 0
        while pos < len(tokens):
            found: _Announced | None = None
            for link in (True, False):
                for n in self._sizes:
                    key = tuple(tokens[pos : pos + n])
                    if len(key) != n:
                        continue
                    index = self._by_link.get((parent, key)) if link else self._by_tokens.get(key)
                    found = self._pick(index or [], scope)
                    if found is not None:
                        break
                if found is not None:
                    if not link and broken is None:
                        broken = (len(sizes), found.parent, parent)
                    break
            if found is None:
                break
            hashes.append(found.block_hash)
            sizes.append(len(found.tokens))
            parent, pos = found.block_hash, pos + len(found.tokens)
        return Walk(hashes, sizes, broken)

    def hasher(
        self, tokens: list[int], tokens_per_block: int, scope: ReuseScope, algo: str
    ) -> list[BlockHash]:
        """A :data:`events.tools.hashcheck.Hasher` for recording: the prompt's announced full-block
        hashes; raises :class:`GoldenError` unless every full block was announced, at the
        expected size and properly chained."""
        walk = self.walk(tokens, scope)
        full = len(tokens) // tokens_per_block
        sizes = walk.sizes[:full]
        if len(sizes) < full or any(s != tokens_per_block for s in sizes) or walk.broken:
            raise GoldenError(
                f"the capture does not announce all {full} blocks of {tokens_per_block} tokens "
                f"of a prompt of {len(tokens)} tokens under {scope} with a sound parent chain "
                f"(found blocks of {sizes} tokens)"
            )
        return walk.hashes[:full]

    def drift(self, case: Case, algo: str) -> Drift | None:
        """How the capture's hashes for ``case`` differ from its golden ``algo`` hashes."""
        expected = case.hashes.get(algo)
        if expected is None:
            raise GoldenError(f"case {case.name!r} has no {algo} hashes: record them first")
        tpb = case.tokens_per_block
        walk = self.walk(case.tokens, case.scope)
        full = len(case.tokens) // tpb
        sized = all(size == tpb for size in walk.sizes[:full])
        # a trailing partial block some engines announce is not part of the golden chain
        actual = walk.hashes[:full] if sized else walk.hashes
        if not walk.hashes and case.cache_salt is not None:
            # announced under the salt id another derivation of the case's cache_salt gives
            for name, what, value in salt_variants(case.cache_salt):
                other = self.walk(case.tokens, ReuseScope(case.scope.lora_id, value))
                if other.hashes:
                    cause = str(salt_cause(case.cache_salt, name, what, value))
                    return Drift(case, algo, expected, other.hashes[:full], cause)
        if not walk.hashes:
            cause = (
                "the prompt is not in the capture: no block announced without a parent holds "
                "its first tokens under its scope (was it served while recording?)"
            )
            if self.undecodable:
                cause += (
                    f"; {self.undecodable} message(s) or event(s) of the capture did not decode"
                )
        elif walk.broken is not None:
            i, announced, wanted = walk.broken
            cause = (
                f"the parent chain is broken: block {i} was announced with parent "
                f"{_short(announced)}, not {_short(wanted)}"
                + (" (the previous block's hash)" if i else " (a first block has none)")
            )
            return Drift(case, algo, expected, actual, cause, at=i)
        elif not sized:
            cause = (
                f"another block size: the engine's blocks hold {sorted(set(walk.sizes))} "
                f"tokens, not {tpb}"
            )
        elif actual == expected:
            return None
        else:
            cause = explain_chain(
                algo, case.tokens, tpb, case.scope, expected, actual, case.cache_salt
            )
        return Drift(case, algo, expected, actual, cause)


def compare_capture(golden: Golden, capture: CaptureHashes, algo: str) -> list[Drift]:
    """Every case whose hashes in ``capture`` differ from the golden ``algo`` hashes."""
    return [d for case in golden.cases if (d := capture.drift(case, algo)) is not None]

"""The event sink protocol: how the cache tells the outside world what it stored and evicted.

kvcache knows nothing of wire formats; ``events.KVCacheEventManager`` implements this protocol
and turns the calls into KV cache events. The sink is called synchronously, in the order things
happen, with the blocks themselves (read them during the call; a removed block is detached from
the tree afterwards but keeps its key, tokens, parent and scope).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvcache.hashing import BlockKey
from kvcache.scope import ReuseScope


class BlockView(Protocol):
    """What a sink may read of a block (the radix tree's node satisfies it)."""

    @property
    def key(self) -> BlockKey: ...

    @property
    def tokens(self) -> Sequence[int]: ...

    @property
    def parent(self) -> BlockView | None:
        """The previous block of the chain; None for the first block under a scope root."""
        ...

    @property
    def scope(self) -> ReuseScope: ...

    @property
    def tier(self) -> int:
        """Index of the tier holding the block's page (0 = fastest, the device tier)."""
        ...

    @property
    def priority(self) -> int: ...

    @property
    def is_full(self) -> bool:
        """True when the block holds exactly ``tokens_per_block`` tokens."""
        ...


class EventSink(Protocol):
    """Told, in order, about every change of the set of reusable blocks."""

    def on_stored(self, blocks: Sequence[BlockView], hashes: Sequence[int] | None = None) -> None:
        """Blocks joined the tree; each one's parent is None, earlier in the list, or stored
        before. ``hashes``: what the caller of ``create_kv_cache(sink_hashes=...)`` gave for
        the first of them (the hashes this sink announces them under, made ahead of time); a
        sink that computes its own ignores them. Passed only when there are some."""

    def on_removed(self, blocks: Sequence[BlockView]) -> None:
        """Blocks left the tree (a subtree is reported descendants first)."""

    def on_moved(self, blocks: Sequence[BlockView], old_tier: int, new_tier: int) -> None:
        """Blocks' pages moved between tiers (offload or onboard); ``block.tier`` is new_tier."""

    def on_cleared(self) -> None:
        """Every reusable block was dropped at once."""


@dataclass(frozen=True, slots=True)
class SinkRecord:
    """One call received by :class:`RecordingSink`, with the facts read during the call."""

    kind: str  # "stored" | "removed" | "moved" | "cleared"
    keys: tuple[BlockKey, ...] = ()
    tokens: tuple[tuple[int, ...], ...] = ()
    parents: tuple[BlockKey | None, ...] = ()
    scopes: tuple[ReuseScope, ...] = ()
    tiers: tuple[int, ...] = ()
    priorities: tuple[int, ...] = ()
    old_tier: int | None = None
    new_tier: int | None = None
    hashes: tuple[int, ...] = ()  # what on_stored was handed with the blocks, if anything


@dataclass
class RecordingSink:
    """An :class:`EventSink` that records every call; for tests and debugging."""

    records: list[SinkRecord] = field(default_factory=list)

    def _record(
        self,
        kind: str,
        blocks: Sequence[BlockView],
        old_tier: int | None = None,
        new_tier: int | None = None,
        hashes: Sequence[int] | None = None,
    ) -> None:
        self.records.append(
            SinkRecord(
                kind=kind,
                keys=tuple(b.key for b in blocks),
                tokens=tuple(tuple(b.tokens) for b in blocks),
                parents=tuple(None if b.parent is None else b.parent.key for b in blocks),
                scopes=tuple(b.scope for b in blocks),
                tiers=tuple(b.tier for b in blocks),
                priorities=tuple(b.priority for b in blocks),
                old_tier=old_tier,
                new_tier=new_tier,
                hashes=tuple(hashes or ()),
            )
        )

    def on_stored(self, blocks: Sequence[BlockView], hashes: Sequence[int] | None = None) -> None:
        self._record("stored", blocks, hashes=hashes)

    def on_removed(self, blocks: Sequence[BlockView]) -> None:
        self._record("removed", blocks)

    def on_moved(self, blocks: Sequence[BlockView], old_tier: int, new_tier: int) -> None:
        self._record("moved", blocks, old_tier, new_tier)

    def on_cleared(self) -> None:
        self.records.append(SinkRecord(kind="cleared"))

    def kinds(self) -> list[str]:
        return [r.kind for r in self.records]

    def clear(self) -> None:
        self.records.clear()

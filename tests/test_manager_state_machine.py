"""Property test: the manager against a naive model of scoped prefixes.

The model keeps, per scope, every token prefix that was committed at a block boundary and every
whole sequence that stopped on a partial block. While nothing was ever dropped (no eviction
drop, no clear) the manager must reuse exactly what the model predicts; afterwards the model is
an upper bound. After every step the manager's books are rechecked from scratch
(``KVCacheManager.verify``: no page leaked, none owned twice, reference counts right), and an
``OutOfPagesError`` must leave the cache exactly as it was.
"""

from __future__ import annotations

from collections.abc import Sequence

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

from kvcache import (
    CacheStateError,
    KVCache,
    KVCacheManager,
    KVCacheManagerConfig,
    OutOfPagesError,
    ReuseScope,
    TierConfig,
)


class TokenStorage:
    """A page storage whose "KV" is the token ids themselves, so a page's content says whether
    every copy the manager asked for was issued, in an order that kept the data."""

    def __init__(self, tpb: int) -> None:
        self.tpb = tpb
        self.pages: dict[tuple[int, int], list[int | None]] = {}

    def page(self, tier: int, page: int) -> list[int | None]:
        return self.pages.setdefault((tier, page), [None] * self.tpb)

    def copy_pages(
        self,
        src_tier: int,
        src_pages: Sequence[int],
        dst_tier: int,
        dst_pages: Sequence[int],
        num_tokens: Sequence[int] | None = None,
    ) -> None:
        assert len(src_pages) == len(dst_pages) == len(set(dst_pages))
        counts = list(num_tokens) if num_tokens is not None else [self.tpb] * len(src_pages)
        data = [self.page(src_tier, p)[:n] for p, n in zip(src_pages, counts, strict=True)]
        for p, d in zip(dst_pages, data, strict=True):  # all reads before any write
            self.page(dst_tier, p)[: len(d)] = d

    def write(self, page: int, offset: int, tokens: list[int]) -> None:
        self.page(0, page)[offset : offset + len(tokens)] = tokens

    def page_nbytes(self) -> int:
        return 4 * self.tpb

    def synchronize(self) -> None:
        pass


SCOPES = [ReuseScope(), ReuseScope(lora_id=1), ReuseScope(salt=1), ReuseScope(1, 1)]
# Prompts share prefixes often: a prefix of one of a few base documents, then a short tail.
BASES = [[0, 1, 2, 0, 1, 2, 0, 1, 2], [0, 1, 2, 2, 1, 0, 0, 1, 1], [1, 1, 1, 1, 0, 0, 2, 2, 2]]
tokens_st = st.builds(
    lambda base, n, tail: BASES[base][:n] + tail,
    st.integers(0, len(BASES) - 1),
    st.integers(0, 9),
    st.lists(st.integers(0, 2), max_size=3),
)
FINISH = ["created", "open", "stop", "close"]


class Model:
    def __init__(self, tpb: int, partial: bool) -> None:
        self.tpb = tpb
        self.partial = partial
        self.full: dict[ReuseScope, set[tuple[int, ...]]] = {s: {()} for s in SCOPES}
        self.chains: dict[ReuseScope, set[tuple[int, ...]]] = {s: set() for s in SCOPES}

    def add(self, scope: ReuseScope, tokens: list[int], stopped: bool) -> None:
        tpb = self.tpb
        for end in range(tpb, len(tokens) + 1, tpb):
            self.full[scope].add(tuple(tokens[:end]))
            self.chains[scope].add(tuple(tokens[:end]))
        if stopped and len(tokens) % tpb:
            self.chains[scope].add(tuple(tokens))

    def reuse(self, scope: ReuseScope, tokens: list[int]) -> int:
        tpb, n = self.tpb, len(tokens)
        if n < 2:
            return 0
        k = 0
        while (k + 1) * tpb <= n - 1 and tuple(tokens[: (k + 1) * tpb]) in self.full[scope]:
            k += 1
        if not self.partial:
            return k * tpb
        start = k * tpb
        limit = min(tpb, n - 1 - start)
        best = 0
        for chain in self.chains[scope]:
            if len(chain) > start and chain[:start] == tuple(tokens[:start]):
                block = chain[start : start + tpb]
                m = 0
                while m < min(limit, len(block)) and block[m] == tokens[start + m]:
                    m += 1
                best = max(best, m)
        return start + best


def snapshot(manager: KVCacheManager) -> object:
    tree = sorted(
        (b.key, b.tier, b.page, b.refs, b.susp, len(b.tokens)) for b in manager._tree.iter_blocks()
    )
    return tree, [p.num_free for p in manager._pool.pools], manager.stats


class CacheMachine(RuleBasedStateMachine):
    seqs = Bundle("seqs")

    @initialize(
        tpb=st.sampled_from([2, 3]),
        device=st.integers(4, 8),
        host=st.integers(0, 4),
        partial=st.booleans(),
    )
    def setup(self, tpb: int, device: int, host: int, partial: bool) -> None:
        tiers = [TierConfig(name="device", num_blocks=device)]
        if host:
            tiers.append(TierConfig(name="host", num_blocks=host))
        cfg = KVCacheManagerConfig(tokens_per_block=tpb, tiers=tiers, enable_partial_reuse=partial)
        self.storage = TokenStorage(tpb)
        self.manager = KVCacheManager(cfg, storage=self.storage)
        self.model = Model(tpb, partial)
        self.tokens: dict[KVCache, list[int]] = {}
        self.exact = True

    def _exact(self) -> bool:
        return self.exact and self.manager.stats.drops == 0

    def _expect_unchanged(self, before: object) -> None:
        assert snapshot(self.manager) == before, "OutOfPagesError changed the cache"

    def _create(self, tokens: list[int], scope: ReuseScope, prio: int) -> KVCache | None:
        expected = self.model.reuse(scope, tokens)
        probed = self.manager.probe_reuse(tokens, scope)
        before = snapshot(self.manager)
        assert probed <= expected
        if self._exact():
            assert probed == expected, (probed, expected)
        try:
            seq = self.manager.create_kv_cache(tokens, scope, prio)
        except OutOfPagesError:
            self._expect_unchanged(before)
            return None
        assert seq.num_reused_tokens == probed
        assert seq.tokens == tokens[:probed]
        self.tokens[seq] = list(tokens)
        return seq

    def _compute(self, seq: KVCache, extra: list[int]) -> bool:
        """What an engine does: write the KV of ``extra`` into held pages, then commit it.
        False (and nothing changed) when the pages cannot be had."""
        before = snapshot(self.manager)
        try:
            start = seq.num_tokens
            seq.resize(start + len(extra))
            table = seq.page_indices()
            tpb = self.model.tpb
            for pos, tok in enumerate(extra, start):
                self.storage.write(table[pos // tpb], pos % tpb, [tok])
            seq.commit(extra)
        except OutOfPagesError:
            self._expect_unchanged(before)
            return False
        self.model.add(seq.scope, seq.tokens, stopped=False)
        return True

    def _request(self, tokens: list[int], scope: ReuseScope, prio: int, finish: str) -> object:
        """Create, compute the prompt, then leave the sequence open, stopped or closed."""
        seq = self._create(tokens, scope, prio)
        if seq is None:
            return multiple()
        if finish != "created" and self._compute(seq, tokens[seq.num_tokens :]):
            if finish in ("stop", "close"):
                seq.stop_committing()
                self.model.add(seq.scope, seq.tokens, stopped=True)
            if finish == "close":
                seq.close()
        return seq

    @rule(
        target=seqs,
        tokens=tokens_st,
        scope=st.sampled_from(SCOPES),
        prio=st.integers(0, 100),
        finish=st.sampled_from(FINISH),
    )
    def request(self, tokens: list[int], scope: ReuseScope, prio: int, finish: str) -> object:
        return self._request(tokens, scope, prio, finish)

    @rule(
        target=seqs,
        seq=seqs,
        extra=st.lists(st.integers(0, 2), max_size=3),
        same_scope=st.booleans(),
        prio=st.integers(0, 100),
        finish=st.sampled_from(FINISH),
    )
    def recreate(
        self, seq: KVCache, extra: list[int], same_scope: bool, prio: int, finish: str
    ) -> object:
        """Ask again for what a sequence holds (plus a little): the reuse paths."""
        scope = seq.scope if same_scope else SCOPES[(SCOPES.index(seq.scope) + 1) % len(SCOPES)]
        return self._request([*seq.tokens, *extra], scope, prio, finish)

    @rule(target=seqs, seq=seqs, finish=st.sampled_from(FINISH))
    def reask_aligned(self, seq: KVCache, finish: str) -> object:
        """Ask for exactly the full blocks a sequence holds: at most all but one token is
        reused, the engine must still compute the last one."""
        tpb = self.model.tpb
        return self._request(seq.tokens[: len(seq.tokens) // tpb * tpb], seq.scope, 35, finish)

    @rule(seq=seqs, n=st.integers(1, 9))
    def commit(self, seq: KVCache, n: int) -> None:
        if seq.closed:
            return
        wanted = self.tokens[seq]
        extra = wanted[seq.num_tokens : seq.num_tokens + n] or [0] * n
        if seq.suspended or self._stopped(seq):
            with pytest.raises(CacheStateError):
                seq.commit(extra)
            return
        self._compute(seq, extra)

    def _stopped(self, seq: KVCache) -> bool:
        return bool(seq._stopped)

    @rule(seq=seqs)
    def stop(self, seq: KVCache) -> None:
        if seq.closed:
            return
        try:
            seq.stop_committing()
        except CacheStateError:
            assert seq.suspended
            return
        self.model.add(seq.scope, seq.tokens, stopped=True)

    @rule(seq=seqs, cap=st.integers(0, 12))
    def resize(self, seq: KVCache, cap: int) -> None:
        if seq.closed or seq.suspended or self._stopped(seq):
            return
        before = snapshot(self.manager)
        try:
            seq.resize(cap)
        except OutOfPagesError:
            self._expect_unchanged(before)
            return
        assert seq.capacity >= max(cap, seq.num_tokens)

    @rule(seq=seqs)
    def suspend_or_resume(self, seq: KVCache) -> None:
        if seq.closed:
            return
        if not seq.suspended:
            seq.suspend()
            return
        before = snapshot(self.manager)
        try:
            seq.resume()
        except OutOfPagesError:
            assert seq.suspended
            self._expect_unchanged(before)
            return
        assert len(seq.page_indices()) * self.model.tpb == seq.capacity

    @rule(seq=consumes(seqs))
    def close(self, seq: KVCache) -> None:
        seq.close()
        seq.close()

    @precondition(lambda self: self.manager.num_cached_blocks > 0)
    @rule(really=st.booleans())
    def clear(self, really: bool) -> None:
        if not really:
            return
        self.manager.clear_reusable_blocks()
        self.exact = False

    @precondition(lambda self: self.manager.num_cached_blocks > 0)
    @rule(really=st.booleans())
    def evict(self, really: bool) -> None:
        """Fill the device tier with a private sequence, which evicts every cached page."""
        if not really:
            return
        avail = self.manager.num_available_pages(0)
        tpb = self.model.tpb
        with self.manager.create_kv_cache([], ReuseScope(lora_id=99)) as filler:
            filler.resize(avail * tpb)
            assert self.manager.num_available_pages(0) == 0

    @invariant()
    def pages_hold_their_tokens(self) -> None:
        if not hasattr(self, "manager"):
            return
        tpb = self.model.tpb
        for b in self.manager._tree.iter_blocks():
            assert self.storage.page(b.tier, b.page)[: len(b.tokens)] == list(b.tokens), b
        for seq in self.tokens:
            if seq.closed:
                continue
            toks = seq.tokens
            for i, b in enumerate(seq.held_blocks()):
                held = toks[i * tpb : (i + 1) * tpb]
                assert self.storage.page(b.tier, b.page)[: len(held)] == held, (seq, b)

    @invariant()
    def books_balance(self) -> None:
        if hasattr(self, "manager"):
            self.manager.verify()
            for seq in self.tokens:
                if not seq.closed and not seq.suspended:
                    assert len(seq.page_indices()) == -(-seq.capacity // self.model.tpb)


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(
    max_examples=200,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

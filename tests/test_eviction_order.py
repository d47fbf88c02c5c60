"""Property test: the exact eviction order against a naive model, with up to three tiers.

The model is written from the documented policy alone (ARCHITECTURE.md, ``kvcache.eviction``),
with no heaps, no counters kept up to date and nothing read from the manager:

- a candidate is a page no live sequence holds, whose block has no child on its own tier
  (leaves first); private pages of a suspended sequence are candidates too;
- the first candidate is the smallest (priority, release time, creation order), where the release
  time is the last ``close``/``suspend`` that let go of the block;
- a tier that needs a page evicts its first candidate: it moves one tier down when that tier has
  room now (free + cached + what its own slower tiers can take of its suspended pages), else it
  is dropped with its subtree; a suspended page is never dropped, so it is a candidate only
  while the slower tiers have room;
- an operation that cannot get its device pages raises ``OutOfPagesError`` and changes nothing.

Observed from outside only: the sink's calls, compared call for call (stored blocks, moves told
once per tier pair at the end of an operation or before anything else is told, drops with their
subtrees), the map prefix -> tier rebuilt from them, the stats counters and per-tier usage, and
whether ``OutOfPagesError`` was raised. One block per token keeps prompts short; partial reuse
is off (copy-on-write is covered elsewhere).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    multiple,
    rule,
)

from kvcache import (
    KVCache,
    KVCacheManager,
    KVCacheManagerConfig,
    OutOfPagesError,
    RecordingSink,
    TierConfig,
)

Prefix = tuple[int, ...]
# ("stored", prefixes) | ("moved", prefixes, (old tier, new tier)) | ("removed", victim, subtree)
Told = tuple[object, ...]
NAMES = ["device", "host", "disk"]


@dataclass(eq=False)
class Node:
    """A page in the model: a cached prefix (``prefix``) or a sequence's private page (None)."""

    prefix: Prefix | None
    tier: int
    priority: int
    age: int
    released: int = 0
    live: int = 1
    suspended: int = 0


@dataclass(eq=False)
class Seq:
    priority: int
    nodes: list[Node] = field(default_factory=list)
    is_suspended: bool = False


class OutOfPages(Exception):
    pass


class Model:
    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sizes
        self.free = list(sizes)
        self.tree: dict[Prefix, Node] = {}
        self.private: list[Node] = []
        self.ages = 0
        self.clock = 0
        self.counts = {"evictions": 0, "offloads": 0, "onboards": 0, "drops": 0}
        self.told: list[Told] = []  # what the sink must have heard, in order
        self.moved: dict[Prefix, int] = {}  # blocks moved since the sink last heard: old tier

    # ---------------------------------------------------------------- the policy, naively

    def nodes(self) -> list[Node]:
        return [*self.tree.values(), *self.private]

    def room(self, tier: int) -> int:
        if tier >= len(self.sizes):
            return 0
        here = [n for n in self.nodes() if n.tier == tier and not n.live]
        cached = sum(1 for n in here if not n.suspended)
        suspended = len(here) - cached
        return self.free[tier] + cached + min(suspended, self.room(tier + 1))

    def is_leaf_on_its_tier(self, n: Node) -> bool:
        if n.prefix is None:
            return True
        k = len(n.prefix)
        return not any(
            len(p) == k + 1 and p[:k] == n.prefix and c.tier == n.tier for p, c in self.tree.items()
        )

    def move(self, n: Node, tier: int) -> None:
        if n.prefix is not None:
            self.moved.setdefault(n.prefix, n.tier)
        n.tier = tier

    def tell_moves(self) -> None:
        """Moves are told in one call per (old, new) tier pair, before anything else is told
        and at the end of each operation: downward pairs first, slowest source first."""
        pairs: dict[tuple[int, int], list[Prefix]] = {}
        for p, old in self.moved.items():
            if p in self.tree and self.tree[p].tier != old:
                pairs.setdefault((old, self.tree[p].tier), []).append(p)
        self.moved = {}
        order = sorted(pairs, key=lambda pair: (0, -pair[0]) if pair[1] > pair[0] else (1, pair[0]))
        self.told += [("moved", tuple(pairs[pair]), pair) for pair in order]

    def take_page(self, tier: int) -> None:
        while self.free[tier] == 0:
            self.evict(tier)
        self.free[tier] -= 1

    def evict(self, tier: int) -> None:
        below = self.room(tier + 1)
        candidates = [
            n
            for n in self.nodes()
            if n.tier == tier
            and not n.live
            and (below > 0 or not n.suspended)
            and self.is_leaf_on_its_tier(n)
        ]
        assert candidates, f"model: tier {tier} has nothing to evict although room was checked"
        victim = min(candidates, key=lambda n: (n.priority, n.released, n.age))
        self.counts["evictions"] += 1
        if below > 0:
            self.take_page(tier + 1)
            self.free[tier] += 1
            self.move(victim, tier + 1)
            self.counts["offloads"] += 1
            return
        assert victim.prefix is not None
        root = victim.prefix
        gone = [p for p in self.tree if p[: len(root)] == root]
        self.tell_moves()
        for p in gone:
            self.free[self.tree.pop(p).tier] += 1
        self.counts["drops"] += len(gone)
        self.told.append(("removed", root, frozenset(gone)))

    def bring_to_device(self, nodes: list[Node]) -> None:
        """Every device page is had first (evicting), then the blocks move up."""
        for _ in nodes:
            self.take_page(0)
        for n in nodes:
            self.free[n.tier] += 1
            self.move(n, 0)
        self.counts["onboards"] += len(nodes)

    # ------------------------------------------------------------------------- operations

    def create(self, prompt: list[int], priority: int) -> Seq:
        seq = Seq(priority)
        k = 0
        while k < len(prompt) - 1 and tuple(prompt[: k + 1]) in self.tree:
            k += 1
        reused = [self.tree[tuple(prompt[: j + 1])] for j in range(k)]
        for n in reused:
            n.live += 1
        away = [n for n in reused if n.tier != 0]
        if away and self.room(0) < len(away):
            for n in reused:
                n.live -= 1
            raise OutOfPages
        self.bring_to_device(away)
        self.tell_moves()  # the end of the operation
        seq.nodes = reused
        return seq

    def commit(self, seq: Seq, prompt: list[int]) -> None:
        start = len(seq.nodes)
        extra = len(prompt) - start
        if extra > self.room(0):
            raise OutOfPages
        ages = []
        for _ in range(extra):
            self.take_page(0)
        for _ in range(extra):
            self.ages += 1
            ages.append(self.ages)
        stored = []
        for i, age in zip(range(start, len(prompt)), ages, strict=True):
            p = tuple(prompt[: i + 1])
            old = self.tree.get(p)
            if old is None:
                self.tree[p] = node = Node(p, 0, seq.priority, age)
                stored.append(p)
            else:  # the same block is cached: the sequence takes it (and its page goes)
                node = old
                node.live += 1
                self.free[node.tier] += 1
                self.move(node, 0)
            seq.nodes.append(node)
        if stored:
            self.tell_moves()
            self.told.append(("stored", tuple(stored)))

    def hold(self, seq: Seq, pages: int) -> None:
        if pages > self.room(0):
            raise OutOfPages
        for _ in range(pages):
            self.take_page(0)
        for _ in range(pages):
            self.ages += 1
            node = Node(None, 0, seq.priority, self.ages)
            self.private.append(node)
            seq.nodes.append(node)

    def close(self, seq: Seq) -> None:
        self.clock += 1
        for n in seq.nodes:
            if n.prefix is None:
                self.private.remove(n)
                self.free[n.tier] += 1
                continue
            if seq.is_suspended:
                n.suspended -= 1
            else:
                n.live -= 1
            if not n.live:
                n.released = self.clock
        seq.nodes = []

    def suspend(self, seq: Seq) -> None:
        self.clock += 1
        for n in seq.nodes:
            n.live -= 1
            n.suspended += 1
            n.released = self.clock
        seq.is_suspended = True

    def resume(self, seq: Seq) -> None:
        for n in seq.nodes:
            n.live += 1
            n.suspended -= 1
        away = [n for n in seq.nodes if n.tier != 0]
        if self.room(0) < len(away):
            for n in seq.nodes:
                n.live -= 1
                n.suspended += 1
            raise OutOfPages
        self.bring_to_device(away)
        seq.is_suspended = False


class SinkView:
    """The cache's contents as the sink told them: prefix -> tier, and the drops in order."""

    def __init__(self, sink: RecordingSink) -> None:
        self.sink = sink
        self.seen = 0
        self.prefix_of: dict[bytes, Prefix] = {}
        self.tier: dict[Prefix, int] = {}

    def update(self) -> list[Told]:
        told: list[Told] = []
        for r in self.sink.records[self.seen :]:
            if r.kind == "stored":
                stored = []
                for key, toks, parent, tier in zip(
                    r.keys, r.tokens, r.parents, r.tiers, strict=True
                ):
                    p = (() if parent is None else self.prefix_of[parent]) + toks
                    self.prefix_of[key] = p
                    self.tier[p] = tier
                    stored.append(p)
                told.append(("stored", tuple(stored)))
            elif r.kind == "moved":
                assert r.old_tier is not None and r.new_tier is not None
                moved = tuple(self.prefix_of[key] for key in r.keys)
                for p in moved:
                    assert self.tier[p] == r.old_tier
                    self.tier[p] = r.new_tier
                told.append(("moved", moved, (r.old_tier, r.new_tier)))
            elif r.kind == "removed":
                gone = [self.prefix_of.pop(key) for key in r.keys]
                for p in gone:
                    del self.tier[p]
                told.append(("removed", gone[-1], frozenset(gone)))  # the victim comes last
            else:
                raise AssertionError(f"unexpected sink call {r.kind}")
        self.seen = len(self.sink.records)
        return told


@dataclass(eq=False)
class Pair:
    real: KVCache
    model: Seq


prompts = st.lists(st.integers(0, 3), min_size=1, max_size=4)
priorities = st.sampled_from([10, 35, 60])
FINISH = ["open", "suspend", "close", "close"]


class EvictionOrder(RuleBasedStateMachine):
    seqs = Bundle("seqs")

    @initialize(sizes=st.lists(st.integers(1, 3), min_size=1, max_size=3))
    def setup(self, sizes: list[int]) -> None:
        tiers = [TierConfig(name=NAMES[i], num_blocks=n) for i, n in enumerate(sizes)]
        cfg = KVCacheManagerConfig(tokens_per_block=1, tiers=tiers, enable_partial_reuse=False)
        self.sink = RecordingSink()
        self.manager = KVCacheManager(cfg, self.sink)
        self.view = SinkView(self.sink)
        self.model = Model(sizes)

    def check(self, raised: bool, predicted: bool) -> None:
        assert raised == predicted, f"OutOfPagesError raised: {raised}, model: {predicted}"
        model, m = self.model, self.manager
        model.tell_moves()  # the end of the operation
        assert self.view.update() == model.told
        model.told = []
        assert self.view.tier == {p: n.tier for p, n in model.tree.items()}
        s = m.stats
        assert (s.evictions, s.offloads, s.onboards, s.drops) == tuple(model.counts.values())
        for t, size in enumerate(model.sizes):
            usage = s.tiers[NAMES[t]]
            assert usage.used == size - model.free[t], NAMES[t]
            pinned = sum(1 for n in model.nodes() if n.tier == t and n.live)
            assert usage.pinned == pinned, NAMES[t]
        m.verify()

    def predict(self, op: Callable[..., object], *args: object) -> bool:
        try:
            op(*args)
        except OutOfPages:
            return True
        return False

    @rule(target=seqs, prompt=prompts, priority=priorities, then=st.sampled_from(FINISH))
    def request(self, prompt: list[int], priority: int, then: str) -> object:
        """A prompt is matched, onboarded, computed and committed; then the sequence stays
        open, is suspended, or is closed."""
        try:
            real = self.manager.create_kv_cache(prompt, priority=priority)
        except OutOfPagesError:
            self.check(True, self.predict(self.model.create, prompt, priority))
            return multiple()
        seq = self.model.create(prompt, priority)
        assert real.num_reused_tokens == len(seq.nodes)
        raised = False
        try:
            real.commit(prompt[real.num_reused_tokens :])
        except OutOfPagesError:
            raised = True
        self.check(raised, self.predict(self.model.commit, seq, prompt))
        pair = Pair(real, seq)
        if then == "close":
            self.close(pair)
            return multiple()
        if then == "suspend":
            self.suspend_or_resume(pair)
        return pair

    @rule(target=seqs, pages=st.integers(1, 4), priority=priorities)
    def hold_pages(self, pages: int, priority: int) -> object:
        """A sequence that only holds private pages (reserved ahead of its tokens)."""
        real = self.manager.create_kv_cache([], priority=priority)
        seq = Seq(priority)
        raised = False
        try:
            real.resize(pages)
        except OutOfPagesError:
            raised = True
        self.check(raised, self.predict(self.model.hold, seq, pages))
        return Pair(real, seq)

    @rule(pair=consumes(seqs))
    def close(self, pair: Pair) -> None:
        pair.real.close()
        self.model.close(pair.model)
        self.check(False, False)

    @rule(pair=seqs)
    def suspend_or_resume(self, pair: Pair) -> None:
        if not pair.real.suspended:
            pair.real.suspend()
            self.model.suspend(pair.model)
            self.check(False, False)
            return
        raised = False
        try:
            pair.real.resume()
        except OutOfPagesError:
            raised = True
        self.check(raised, self.predict(self.model.resume, pair.model))


TestEvictionOrder = EvictionOrder.TestCase
TestEvictionOrder.settings = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_the_model_knows_the_documented_scenarios() -> None:
    """The model itself, on a case worked out by hand: priority first, then release, then age;
    a parent waits for its children on the same tier."""
    model = Model([3])
    a = model.create([1], 60)
    model.commit(a, [1, 2])  # (1,) and (1, 2), priority 60
    b = model.create([3], 10)
    model.commit(b, [3])  # (3,), priority 10
    model.close(a)
    model.close(b)
    c = model.create([4], 35)
    model.commit(c, [4, 5])  # needs 2 pages: (3,) goes (lowest priority), then (1, 2) (leaf)
    model.tell_moves()
    assert model.told[-3:] == [
        ("removed", (3,), frozenset({(3,)})),
        ("removed", (1, 2), frozenset({(1, 2)})),
        ("stored", ((4,), (4, 5))),
    ]
    assert set(model.tree) == {(1,), (4,), (4, 5)}
    with pytest.raises(OutOfPages):
        model.hold(Seq(35), 2)


def test_a_suspended_page_goes_down_before_a_newer_cached_one() -> None:
    """The suspended-versus-cached choice, by hand: the suspended block has the lower priority
    and the older release, so it is the one offloaded while the host has room; once the host
    cannot take it, the cached block is dropped instead."""
    sink = RecordingSink()
    cfg = KVCacheManagerConfig(
        tokens_per_block=1,
        tiers=[TierConfig(name="device", num_blocks=2), TierConfig(name="host", num_blocks=1)],
        enable_partial_reuse=False,
    )
    m = KVCacheManager(cfg, sink)
    a = m.create_kv_cache([0], priority=10)
    a.commit([0])
    a.suspend()
    with m.create_kv_cache([1], priority=60) as b:
        b.commit([1])
    sink.clear()
    c = m.create_kv_cache([2])
    c.commit([2])  # one page: (0,) (suspended, priority 10) moves to the host
    assert [(r.kind, r.tokens, r.old_tier, r.new_tier) for r in sink.records[:1]] == [
        ("moved", ((0,),), 0, 1)
    ]
    sink.clear()
    d = m.create_kv_cache([3])
    d.commit([3])  # the host is full of a suspended page: (1,) is dropped, never (0,)
    assert [(r.kind, r.tokens) for r in sink.records[:1]] == [("removed", ((1,),))]
    assert m.stats.tiers["host"].used == 1 and m.probe_reuse([0, 9]) == 1
    for seq in (a, c, d):
        seq.close()
    m.verify()

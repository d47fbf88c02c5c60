"""What the KvIndexer tests read from an index's internals: its holdings as the plain model of
``_reference.py``, and the check that its native table and tier masks say what the holdings
say."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from _reference import ModelIndex

from router_sim.router.indexer import KvIndexer, MatchDetail


def levels(mask: int) -> tuple[int, ...]:
    """The cache levels of a held-levels mask (bit i: level i)."""
    return tuple(i for i in range(mask.bit_length()) if mask >> i & 1)


def model_of(ix: KvIndexer) -> ModelIndex:
    """The model holding what ``ix``'s workers hold (``_held``, the index's source of truth:
    per worker, key -> mask of the levels it holds the key at)."""
    return ModelIndex.of(
        {w: {k: levels(m) for k, m in held.items()} for w, held in ix._held.items()}
    )


def holdings(model: ModelIndex) -> dict[int, dict[Hashable, tuple[int, ...]]]:
    """Worker -> key -> levels, for the workers holding anything."""
    return {w: {k: model.holds(w, k) for k in held} for w, held in model.held.items() if held}


def model_details(model: ModelIndex, keys: Sequence[Hashable]) -> dict[int, MatchDetail]:
    """The model's match details as the index reports them."""
    return {w: MatchDetail(*d) for w, d in model.find_matches_detailed(keys).items()}


def in_table(key: object) -> bool:
    """Whether the native table holds ``key``'s masks (an int in [0, 2**64))."""
    return type(key) is int and 0 <= key < 2**64


def check_mirror(ix: KvIndexer) -> None:
    """The native table holds, for each int key in [0, 2**64) some worker holds, the mask of
    those workers (any tier) and of those holding it on the device tier, and nothing else;
    ``_device`` the device masks of the other keys; ``_slower`` each key's mask of workers
    holding it on a slower tier."""
    masks: dict[object, tuple[int, int, int]] = {}  # key -> any tier, device, slower
    for w, held in ix._held.items():
        bit = 1 << ix._bit_of[w]
        for k, levels in held.items():
            assert levels, f"worker {w} keeps {k!r} at no level"
            a, d, s = masks.get(k, (0, 0, 0))
            masks[k] = (a | bit, d | bit * (levels & 1), s | bit * bool(levels >> 1))
    t = ix._table
    assert ix._slower == {k: s for k, (_, _, s) in masks.items() if s}
    assert ix._device == {k: d for k, (_, d, _) in masks.items() if d and not in_table(k)}
    assert len(t) == sum(1 for k in masks if in_table(k))
    for k, (a, d, _) in masks.items():
        assert t.device_get(k) == d, k
        if in_table(k):
            holders = {ix._worker_of_bit[b]: 1 for b in range(a.bit_length()) if a >> b & 1}
            assert t.runs([k], ix._worker_of_bit) == holders, k

"""KV data through the manager: what a sequence reads as reused is exactly the KV that was
written for that prefix under that scope, after reuse of full and partial blocks, offload and
onboarding, suspend/resume, copy-on-write, and page recycling.

A fake engine writes, for each position, KV that is a deterministic function of the scope and
the token prefix up to that position (as a real model's KV is), so any page that holds the
wrong data (stale, another tenant's, a lost copy) shows as a mismatch.
"""

from __future__ import annotations

import hashlib
import random
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
import torch

from kvcache import KVCacheManager, ReuseScope
from kvcache.config import KVCacheManagerConfig, KVLayout, TierConfig
from kvcache.sequence import KVCache
from kvcache.storage import TorchPageStorage, gather_kv, read_kv, storage_of, write_kv

TPB = 4
LAYERS, HEADS, HEAD_DIM = 2, 2, 3
DTYPES = ["float32", "float16", "bfloat16"]
_REF: dict[tuple[ReuseScope, tuple[int, ...]], torch.Tensor] = {}


def ref_kv(scope: ReuseScope | None, tokens: Sequence[int]) -> torch.Tensor:
    """[layers, 2, len(tokens), heads, head_dim]: position i depends on scope and tokens[:i+1]."""
    scope = scope or ReuseScope()
    rows = []
    for i in range(len(tokens)):
        prefix = tuple(tokens[: i + 1])
        row = _REF.get((scope, prefix))
        if row is None:
            digest = hashlib.sha256(scope.to_bytes() + repr(prefix).encode()).digest()
            gen = torch.Generator().manual_seed(int.from_bytes(digest[:7], "little"))
            row = torch.randn(LAYERS, 2, HEADS, HEAD_DIM, generator=gen)
            _REF[(scope, prefix)] = row
        rows.append(row)
    if not rows:
        return torch.empty(LAYERS, 2, 0, HEADS, HEAD_DIM)
    return torch.stack(rows, dim=2)


def make_manager(
    dtype: str = "float32", device_blocks: int = 6, host_blocks: int | None = 12
) -> KVCacheManager:
    tiers = [TierConfig(name="device", num_blocks=device_blocks)]
    if host_blocks:
        tiers.append(TierConfig(name="host", num_blocks=host_blocks))
    config = KVCacheManagerConfig(
        tokens_per_block=TPB,
        tiers=tiers,
        kv_layout=KVLayout(
            num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM, dtype=dtype, device="cpu"
        ),
    )
    return KVCacheManager(config)


def assert_holds(
    manager: KVCacheManager, cache: KVCache, scope: ReuseScope | None, tokens: Sequence[int]
) -> None:
    """The sequence's KV at positions [0, len(tokens)) is the reference KV of ``tokens``."""
    got = gather_kv(manager, cache, len(tokens))
    want = ref_kv(scope, tokens).to(storage_of(manager).dtype)
    assert torch.equal(got, want), "the pages do not hold the KV written for this prefix"


def engine_step(
    manager: KVCacheManager,
    tokens: Sequence[int],
    scope: ReuseScope | None = None,
    *,
    close: bool = True,
    stop: bool = False,
) -> KVCache:
    """What an engine does: create, check the reused KV, compute the rest, write, commit."""
    cache = manager.create_kv_cache(tokens, reuse_scope=scope)
    reused = cache.num_reused_tokens
    assert_holds(manager, cache, scope, tokens[:reused])
    cache.resize(len(tokens))
    ref = ref_kv(scope, tokens)
    for layer in range(LAYERS):
        write_kv(manager, cache, layer, reused, ref[layer, 0, reused:], ref[layer, 1, reused:])
    cache.commit(tokens[reused:])
    assert_holds(manager, cache, scope, tokens)
    if stop:
        cache.stop_committing()
    if close:
        cache.close()
    return cache


@dataclass
class CopyLog:
    calls: list[tuple[int, list[int], int, list[int], list[int] | None]] = field(
        default_factory=list
    )


def log_copies(manager: KVCacheManager, monkeypatch: pytest.MonkeyPatch) -> CopyLog:
    storage = storage_of(manager)
    log = CopyLog()
    real = storage.copy_pages

    def spy(
        src_tier: int,
        src_pages: Sequence[int],
        dst_tier: int,
        dst_pages: Sequence[int],
        num_tokens: Sequence[int] | None = None,
    ) -> None:
        counts = None if num_tokens is None else list(num_tokens)
        log.calls.append((src_tier, list(src_pages), dst_tier, list(dst_pages), counts))
        real(src_tier, src_pages, dst_tier, dst_pages, num_tokens)

    monkeypatch.setattr(storage, "copy_pages", spy)
    return log


PROMPT = list(range(100, 112))  # three full blocks


@pytest.mark.parametrize("dtype", DTYPES)
def test_full_blocks_are_reused_with_their_kv(dtype: str) -> None:
    manager = make_manager(dtype)
    first = engine_step(manager, PROMPT, close=False)
    second = manager.create_kv_cache([*PROMPT, 7, 8])
    assert second.num_reused_tokens == 12
    # Full blocks are shared: the same device pages, no copy.
    assert second.page_indices()[:3] == first.page_indices()[:3]
    assert_holds(manager, second, None, PROMPT)


@pytest.mark.parametrize("dtype", DTYPES)
def test_partially_matched_block_is_a_private_copy_with_the_matched_kv(
    dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    manager = make_manager(dtype)
    first = engine_step(manager, PROMPT, close=False)
    log = log_copies(manager, monkeypatch)
    tokens = [*PROMPT[:10], 55, 56, 57]  # shares 2 full blocks + 2 tokens of the third
    second = manager.create_kv_cache(tokens)
    assert second.num_reused_tokens == 10
    shared, private = first.page_indices(), second.page_indices()
    assert private[:2] == shared[:2] and private[2] != shared[2]
    # One copy-on-write call, of just the 2 matched tokens.
    assert log.calls == [(0, [shared[2]], 0, [private[2]], [2])]
    assert_holds(manager, second, None, tokens[:10])


def test_writes_to_the_private_copy_never_reach_the_shared_page() -> None:
    manager = make_manager()
    first = engine_step(manager, PROMPT, close=False)
    before = gather_kv(manager, first).clone()
    tokens = [*PROMPT[:10], 55, 56, 57]
    second = engine_step(manager, tokens, close=False)  # writes positions 10.. of its copy
    assert torch.equal(gather_kv(manager, first), before)
    assert_holds(manager, second, None, tokens)
    first.close()
    # A third sequence reusing the original prefix still reads the original KV.
    third = manager.create_kv_cache([*PROMPT, 1])
    assert third.num_reused_tokens == 12
    assert_holds(manager, third, None, PROMPT)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_survives_offload_to_host_and_onboarding(
    dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    manager = make_manager(dtype)
    engine_step(manager, PROMPT)  # 3 cached blocks on the device tier
    other = list(range(500, 524))  # 6 blocks: the whole device tier
    engine_step(manager, other)
    stats = manager.stats
    assert stats.offloads == 3 and stats.tiers["host"].used == 3
    log = log_copies(manager, monkeypatch)
    again = manager.create_kv_cache([*PROMPT, 9])
    assert again.num_reused_tokens == 12 and manager.stats.onboards == 3
    assert_holds(manager, again, None, PROMPT)
    # Batched: one device->host call for the room made, one host->device call for the three.
    pairs = [(c[0], c[2], len(c[1])) for c in log.calls]
    assert pairs == [(0, 1, 3), (1, 0, 3)]
    again.close()
    # The other prompt's blocks, evicted to make room, still hold their KV on the host tier
    # (engine_step checks every reused position).
    assert engine_step(manager, other[:21]).num_reused_tokens == 20


def test_onboarding_and_copy_on_write_from_the_host_share_one_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    manager = make_manager()
    engine_step(manager, PROMPT)
    engine_step(manager, list(range(500, 524)))  # the prompt's 3 blocks go to the host
    log = log_copies(manager, monkeypatch)
    tokens = [*PROMPT[:10], 55, 56]  # 2 full blocks to onboard + 2 tokens of the third
    cache = manager.create_kv_cache(tokens)
    assert cache.num_reused_tokens == 10
    assert_holds(manager, cache, None, tokens[:10])
    up = [c for c in log.calls if (c[0], c[2]) == (1, 0)]
    assert len(up) == 1 and len(log.calls) == 2  # plus one device->host call for the room
    assert up[0][4] is not None and sorted(up[0][4]) == [2, TPB, TPB]


@pytest.mark.parametrize("dtype", DTYPES)
def test_suspended_sequence_gets_its_kv_back_on_resume(
    dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    manager = make_manager(dtype)
    tokens = PROMPT[:10]
    cache = engine_step(manager, tokens, close=False)
    # Also KV written ahead of the commit (positions 10, 11) must come back.
    cache.resize(12)
    ahead = ref_kv(None, PROMPT)
    for layer in range(LAYERS):
        write_kv(manager, cache, layer, 10, ahead[layer, 0, 10:12], ahead[layer, 1, 10:12])
    cache.suspend()
    engine_step(manager, list(range(500, 524)))  # needs every device page: ours move out
    assert manager.stats.offloads >= 3
    log = log_copies(manager, monkeypatch)
    cache.resume()
    up = [c for c in log.calls if (c[0], c[2]) == (1, 0)]
    assert len(up) == 1 and len(up[0][1]) == 3  # all three pages in one batched call
    assert_holds(manager, cache, None, PROMPT)
    cache.commit(PROMPT[10:])
    cache.close()
    assert_holds(manager, engine_step(manager, [*PROMPT, 3], close=False), None, PROMPT)


def test_dropped_pages_reallocated_never_read_as_reused() -> None:
    manager = make_manager(device_blocks=4, host_blocks=None)  # no host: eviction drops
    engine_step(manager, PROMPT)
    engine_step(manager, list(range(300, 316)))  # takes all 4 pages, drops the prompt's blocks
    assert manager.stats.drops == 3
    cache = manager.create_kv_cache([*PROMPT, 1])
    assert cache.num_reused_tokens == 0
    assert manager.probe_reuse([*PROMPT, 1]) == 0
    cache.close()
    # The recycled pages now hold the other prompt's KV and are reused only for it.
    cache = manager.create_kv_cache([*range(300, 316), 1])
    assert cache.num_reused_tokens == 16
    assert_holds(manager, cache, None, list(range(300, 316)))


def test_another_scope_never_reads_the_pages() -> None:
    manager = make_manager(device_blocks=12)
    engine_step(manager, PROMPT)
    tenant = ReuseScope.for_request(cache_salt="tenant-b")
    assert not torch.equal(ref_kv(tenant, PROMPT), ref_kv(None, PROMPT))
    cache = manager.create_kv_cache([*PROMPT, 1], reuse_scope=tenant)
    assert cache.num_reused_tokens == 0
    cache.close()
    engine_step(manager, PROMPT, tenant)  # the tenant computes (and caches) its own KV
    # Each scope now reuses its own pages and reads its own KV (checked in engine_step).
    assert engine_step(manager, [*PROMPT, 1], tenant).num_reused_tokens == 12
    assert engine_step(manager, [*PROMPT, 1]).num_reused_tokens == 12


def test_random_traffic_never_serves_wrong_kv() -> None:
    """Many requests over shared prefixes, two scopes, tiny tiers: every reused position
    always holds the KV of that very prefix (checked inside engine_step)."""
    rng = random.Random(7)
    manager = make_manager("float16", device_blocks=10, host_blocks=8)
    scopes = [None, ReuseScope(lora_id=3)]
    stems = [[rng.randrange(50) for _ in range(rng.randrange(6, 20))] for _ in range(5)]
    suspended: list[tuple[KVCache, ReuseScope | None, list[int]]] = []
    for _ in range(120):
        stem = rng.choice(stems)
        tokens = stem[: rng.randrange(1, len(stem) + 1)] + [
            rng.randrange(50) for _ in range(rng.randrange(0, 6))
        ]
        scope = rng.choice(scopes)
        if len(tokens) > 4 * TPB:
            tokens = tokens[: 4 * TPB]
        try:
            cache = engine_step(manager, tokens, scope, close=False, stop=rng.random() < 0.3)
        except Exception as exc:
            if type(exc).__name__ != "OutOfPagesError":
                raise
            for held, _, _ in suspended:
                held.close()
            suspended.clear()
            continue
        if rng.random() < 0.3 and len(suspended) < 2:
            cache.suspend()
            suspended.append((cache, scope, tokens))
        else:
            cache.close()
        if suspended and rng.random() < 0.3:
            held, held_scope, held_tokens = suspended.pop(0)
            try:
                held.resume()
            except Exception as exc:
                if type(exc).__name__ != "OutOfPagesError":
                    raise
                held.close()
                continue
            assert_holds(manager, held, held_scope, held_tokens)
            held.close()
        if rng.random() < 0.05:
            manager.clear_reusable_blocks()
    stats = manager.stats
    assert stats.offloads > 0 and stats.onboards > 0 and stats.hit_tokens > 0


def test_stats_count_bytes_per_tier() -> None:
    manager = make_manager("bfloat16")
    nbytes = storage_of(manager).page_nbytes()
    assert nbytes == LAYERS * 2 * TPB * HEADS * HEAD_DIM * 2
    live = engine_step(manager, PROMPT, close=False)  # 3 pinned pages
    engine_step(manager, list(range(200, 208)))  # 2 cached (evictable) pages
    device = manager.stats.tiers["device"]
    assert (device.used, device.free, device.evictable) == (5, 1, 2)
    assert device.bytes_used == 5 * nbytes
    assert device.bytes_free == 1 * nbytes
    assert device.bytes_evictable == 2 * nbytes
    assert manager.stats.tiers["host"].bytes_free == 12 * nbytes
    live.close()
    assert manager.stats.tiers["device"].bytes_evictable == 5 * nbytes


def test_page_tensors_are_the_storage_tensors() -> None:
    manager = make_manager("float16")
    storage = manager.storage
    assert isinstance(storage, TorchPageStorage)
    tensors = manager.page_tensors
    assert [tuple(t.shape) for t in tensors] == [
        (6, LAYERS, 2, TPB, HEADS, HEAD_DIM),
        (12, LAYERS, 2, TPB, HEADS, HEAD_DIM),
    ]
    assert all(a is b for a, b in zip(tensors, storage.tensors, strict=True))


def test_helpers_refuse_to_overwrite_reused_positions() -> None:
    manager = make_manager()
    engine_step(manager, PROMPT)
    cache = manager.create_kv_cache([*PROMPT, 5])
    k = torch.zeros(1, HEADS, HEAD_DIM)
    with pytest.raises(ValueError, match="already committed"):
        write_kv(manager, cache, 0, 11, k, k)
    k_read, _ = read_kv(manager, cache, 0, 0, 12)
    assert torch.equal(k_read, ref_kv(None, PROMPT)[0, 0])


def test_manager_without_layout_has_no_storage_and_never_imports_torch() -> None:
    code = """
import sys
from kvcache import KVCacheManager
from kvcache.config import KVCacheManagerConfig, TierConfig
config = KVCacheManagerConfig(
    tokens_per_block=4,
    tiers=[TierConfig(name="device", num_blocks=4), TierConfig(name="host", num_blocks=4)],
)
manager = KVCacheManager(config)
for prompt in ([1, 2, 3, 4, 5, 6, 7, 8, 9], [20, 21, 22, 23, 24, 25, 26, 27, 28], [1, 2, 3, 4, 5]):
    with manager.create_kv_cache(prompt) as cache:
        cache.commit(prompt[cache.num_reused_tokens:])
assert manager.storage is None
assert manager.stats.tiers["device"].bytes_used == 0
assert manager.stats.offloads > 0
assert "torch" not in sys.modules, "torch was imported without a KVLayout"
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)

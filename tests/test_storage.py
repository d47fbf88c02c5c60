"""TorchPageStorage on its own: tensor shapes, batched page copies against a per-page model,
partial (copy-on-write) copies, argument checks, and the engine read/write helpers."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcache.storage as storage_mod
from kvcache.config import KVCacheManagerConfig, KVLayout, TierConfig
from kvcache.storage import TorchPageStorage, gather_kv, read_kv, write_kv

TPB = 4
DTYPES = ["float32", "float16", "bfloat16"]


def make_storage(
    dtype: str = "float32", blocks: tuple[int, ...] = (8, 6, 5), device: str = "cpu"
) -> TorchPageStorage:
    config = KVCacheManagerConfig(
        tokens_per_block=TPB,
        tiers=[TierConfig(name=f"t{i}", num_blocks=n) for i, n in enumerate(blocks)],
        kv_layout=KVLayout(num_layers=3, num_kv_heads=2, head_dim=5, dtype=dtype, device=device),
    )
    return TorchPageStorage(config)


def fill_random(storage: TorchPageStorage, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    for tensor in storage.tensors:
        tensor.copy_(torch.randn(tensor.shape, generator=gen).to(tensor.dtype))


def snapshot(storage: TorchPageStorage) -> list[torch.Tensor]:
    storage.synchronize()
    return [t.detach().cpu().clone() for t in storage.tensors]


def model_copy(
    before: list[torch.Tensor],
    src_tier: int,
    src: list[int],
    dst_tier: int,
    dst: list[int],
    num_tokens: list[int] | None = None,
) -> list[torch.Tensor]:
    """The naive meaning of copy_pages: read every source page first, then write page by page."""
    after = [t.clone() for t in before]
    counts = [TPB] * len(src) if num_tokens is None else num_tokens
    for s, d, n in zip(src, dst, counts, strict=True):
        after[dst_tier][d, :, :, :n] = before[src_tier][s, :, :, :n]
    return after


def assert_same(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for a, e in zip(actual, expected, strict=True):
        assert torch.equal(a, e)


def test_tensors_have_the_layout_shape_dtype_and_cpu_device() -> None:
    storage = make_storage("bfloat16")
    assert [tuple(t.shape) for t in storage.tensors] == [
        (8, 3, 2, TPB, 2, 5),
        (6, 3, 2, TPB, 2, 5),
        (5, 3, 2, TPB, 2, 5),
    ]
    assert all(t.dtype == torch.bfloat16 for t in storage.tensors)
    assert all(t.device.type == "cpu" for t in storage.tensors)
    assert storage.page_nbytes() == 3 * 2 * TPB * 2 * 5 * 2
    assert all(not t.any() for t in storage.tensors)  # a never-written page reads as zeros


def test_auto_device_is_cpu_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the CUDA test covers auto placement")
    storage = make_storage(device="auto")
    assert storage.device == torch.device("cpu")


# Page patterns reaching each copy path: both sides a range (one slice copy), destination a
# range (one gather), source a range (one scatter), neither (gather + scatter), reversed order.
PATTERNS = {
    "both_ranges": ([2, 3, 4], [1, 2, 3]),
    "dst_range_unordered": ([7, 0, 5], [3, 1, 2]),
    "src_range_unordered": ([4, 2, 3], [5, 0, 2]),
    "scattered": ([7, 1, 4], [5, 0, 2]),
    "single": ([6], [4]),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pattern", sorted(PATTERNS))
@pytest.mark.parametrize("tiers", [(0, 1), (1, 0), (1, 2), (0, 0)])
def test_full_page_copy_matches_the_per_page_model(
    dtype: str, pattern: str, tiers: tuple[int, int]
) -> None:
    storage = make_storage(dtype, blocks=(8, 8, 8))
    fill_random(storage)
    src, dst = PATTERNS[pattern]  # on one tier, some patterns overlap their own destinations
    before = snapshot(storage)
    storage.copy_pages(tiers[0], src, tiers[1], dst)
    assert_same(snapshot(storage), model_copy(before, tiers[0], src, tiers[1], dst))
    assert storage.copies_issued == 1  # one indexed copy for the whole batch


def test_staged_copy_in_several_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    storage = make_storage()
    fill_random(storage)
    # Two pages per staging chunk, so five scattered pages take three chunks.
    monkeypatch.setattr(storage_mod, "_STAGING_BYTES", 2 * storage.page_nbytes())
    src, dst = [7, 1, 4, 0, 6], [5, 0, 2, 4, 1]
    before = snapshot(storage)
    storage.copy_pages(0, src, 1, dst)
    assert_same(snapshot(storage), model_copy(before, 0, src, 1, dst))


def test_same_tier_overlapping_pages_read_sources_before_writing() -> None:
    storage = make_storage()
    fill_random(storage)
    before = snapshot(storage)
    # A rotation: every destination is also a source of the same batch.
    storage.copy_pages(0, [1, 2, 3], 0, [2, 3, 1])
    after = snapshot(storage)
    assert torch.equal(after[0][2], before[0][1])
    assert torch.equal(after[0][3], before[0][2])
    assert torch.equal(after[0][1], before[0][3])
    storage.copy_pages(0, [4, 5], 0, [5, 6])  # a shifted range: source 5 is also written
    again = snapshot(storage)
    assert torch.equal(again[0][5], after[0][4])
    assert torch.equal(again[0][6], after[0][5])


def test_self_copy_and_empty_batch_change_nothing() -> None:
    storage = make_storage()
    fill_random(storage)
    before = snapshot(storage)
    storage.copy_pages(0, [], 1, [])
    storage.copy_pages(1, [2, 3], 1, [2, 3])
    storage.copy_pages(0, [1], 1, [1], num_tokens=[0])
    assert_same(snapshot(storage), before)
    assert storage.copies_issued == 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_partial_copy_copies_only_the_first_tokens(dtype: str) -> None:
    storage = make_storage(dtype)
    fill_random(storage)
    before = snapshot(storage)
    src, dst, counts = [3, 5, 6], [0, 7, 2], [1, TPB, 3]
    storage.copy_pages(0, src, 0, dst, num_tokens=counts)
    after = snapshot(storage)
    assert_same(after, model_copy(before, 0, src, 0, dst, counts))
    # The tokens beyond the copied ones keep what the destination page held.
    assert torch.equal(after[0][0, :, :, 1:], before[0][0, :, :, 1:])
    assert storage.copies_issued == 1


def test_partial_copy_across_tiers() -> None:
    storage = make_storage()
    fill_random(storage)
    before = snapshot(storage)
    storage.copy_pages(1, [4], 0, [6], num_tokens=[2])
    assert_same(snapshot(storage), model_copy(before, 1, [4], 0, [6], [2]))


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_random_batches_match_the_model(data: st.DataObject) -> None:
    storage = make_storage("float16")
    fill_random(storage, seed=data.draw(st.integers(0, 1000)))
    sizes = [t.shape[0] for t in storage.tensors]
    src_tier = data.draw(st.integers(0, 2))
    dst_tier = data.draw(st.integers(0, 2))
    n = data.draw(st.integers(0, min(sizes[src_tier], sizes[dst_tier])))
    src = data.draw(st.lists(st.integers(0, sizes[src_tier] - 1), min_size=n, max_size=n))
    dst = data.draw(st.permutations(range(sizes[dst_tier])))[:n]
    counts = data.draw(
        st.none() | st.lists(st.integers(0, TPB), min_size=n, max_size=n), label="num_tokens"
    )
    before = snapshot(storage)
    storage.copy_pages(src_tier, src, dst_tier, dst, num_tokens=counts)
    assert_same(snapshot(storage), model_copy(before, src_tier, src, dst_tier, dst, counts))


@pytest.mark.parametrize(
    ("args", "error", "message"),
    [
        ((0, [1, 2], 1, [1]), ValueError, "one destination per source"),
        ((0, [8], 1, [1]), IndexError, "source page 8 is out of range"),
        ((0, [1], 1, [-1]), IndexError, "destination page -1"),
        ((3, [1], 1, [1]), IndexError, "tier 3 does not exist"),
        ((0, [1, 2], 1, [3, 3]), ValueError, "destination page twice"),
    ],
)
def test_bad_copy_arguments_are_rejected_before_any_write(
    args: tuple[int, list[int], int, list[int]], error: type[Exception], message: str
) -> None:
    storage = make_storage()
    fill_random(storage)
    before = snapshot(storage)
    with pytest.raises(error, match=message):
        storage.copy_pages(*args)
    assert_same(snapshot(storage), before)


def test_bad_num_tokens_are_rejected() -> None:
    storage = make_storage()
    with pytest.raises(ValueError, match="outside"):
        storage.copy_pages(0, [1], 1, [1], num_tokens=[TPB + 1])
    with pytest.raises(ValueError, match="num_tokens entries"):
        storage.copy_pages(0, [1], 1, [1], num_tokens=[1, 2])


def test_config_problems_are_clear() -> None:
    config = KVCacheManagerConfig(tokens_per_block=TPB, tiers=[TierConfig(name="d", num_blocks=2)])
    with pytest.raises(ValueError, match="kv_layout"):
        TorchPageStorage(config)
    with pytest.raises(ValueError, match="not a torch device"):
        make_storage(device="tpu-ish")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            make_storage(device="cuda")


# --- engine helpers over a fake block table ---------------------------------------------------


@dataclass
class FakeCache:
    pages: list[int]
    num_tokens: int = 0

    def page_indices(self) -> list[int]:
        return list(self.pages)


@dataclass
class FakeManager:
    storage: object | None = field(default=None)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_then_read_through_a_scattered_block_table(dtype: str) -> None:
    storage = make_storage(dtype)
    manager = FakeManager(storage)
    cache = FakeCache(pages=[5, 2, 7])  # positions 0-3 on page 5, 4-7 on page 2, 8-11 on 7
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(10, 2, 5, generator=gen)
    v = torch.randn(10, 2, 5, generator=gen)
    write_kv(manager, cache, 1, 1, k, v)
    rk, rv = read_kv(manager, cache, 1, 1, 11)
    assert torch.equal(rk, k.to(storage.dtype)) and torch.equal(rv, v.to(storage.dtype))
    # Position 5 is token 1 of block 1, which lives on page 2.
    assert torch.equal(storage.tensors[0][2, 1, 0, 1], k[4].to(storage.dtype))
    assert not storage.tensors[0][:, 0].any()  # another layer untouched
    cache.num_tokens = 11
    everything = gather_kv(manager, cache)
    assert everything.shape == (3, 2, 11, 2, 5)
    assert torch.equal(everything[1, 0, 1:], k.to(storage.dtype))
    assert torch.equal(everything[1, 1, 1:], v.to(storage.dtype))


def test_helpers_refuse_what_would_corrupt_or_overrun() -> None:
    storage = make_storage()
    manager = FakeManager(storage)
    cache = FakeCache(pages=[1, 2], num_tokens=5)
    kv = torch.zeros(2, 2, 5)
    with pytest.raises(ValueError, match="already committed"):
        write_kv(manager, cache, 0, 4, kv, kv)
    with pytest.raises(ValueError, match=r"call cache.resize"):
        write_kv(manager, cache, 0, 7, kv, kv)
    with pytest.raises(ValueError, match="shape"):
        write_kv(manager, cache, 0, 5, torch.zeros(2, 3, 5), torch.zeros(2, 3, 5))
    with pytest.raises(IndexError, match="layer 3"):
        read_kv(manager, cache, 3, 0, 1)
    with pytest.raises(ValueError, match="no KV tensors"):
        read_kv(FakeManager(None), cache, 0, 0, 1)
    assert not storage.tensors[0].any()


def test_importing_kvcache_and_its_config_does_not_import_torch() -> None:
    code = (
        "import sys, kvcache, kvcache.config, kvcache.storage_protocol\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# --- CUDA -------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_device_tier_pinned_host_and_copies_in_every_direction(dtype: str) -> None:
    storage = make_storage(dtype, blocks=(8, 8, 8), device="auto")
    assert storage.tensors[0].is_cuda
    assert all(t.device.type == "cpu" and t.is_pinned() for t in storage.tensors[1:])
    fill_random(storage, seed=3)
    state = snapshot(storage)
    for (src_tier, dst_tier), (src, dst), counts in [
        ((0, 1), PATTERNS["scattered"], None),
        ((0, 1), PATTERNS["both_ranges"], None),
        ((1, 0), PATTERNS["dst_range_unordered"], None),
        ((1, 0), PATTERNS["src_range_unordered"], None),
        ((1, 2), PATTERNS["scattered"], None),
        ((0, 0), ([1, 2, 3], [2, 3, 1]), None),
        ((1, 0), ([4, 5], [6, 7]), [3, 1]),
    ]:
        storage.copy_pages(src_tier, src, dst_tier, dst, num_tokens=counts)
        state = model_copy(state, src_tier, src, dst_tier, dst, counts)
        assert_same(snapshot(storage), state)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_copy_is_ordered_after_writes_on_the_callers_stream() -> None:
    storage = make_storage("float16", device="auto")
    manager = FakeManager(storage)
    cache = FakeCache(pages=[3])
    k = torch.full((TPB, 2, 5), 7.0, device="cuda")
    for _ in range(3):
        write_kv(manager, cache, 2, 0, k, k)  # queued on the default stream
        storage.copy_pages(0, [3], 1, [0])  # runs on the copy stream, after the write
        k = k + 1
    storage.synchronize()
    assert torch.all(storage.tensors[1][0, 2] == 9.0)

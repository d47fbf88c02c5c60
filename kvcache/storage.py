"""Real KV tensors behind the pages: one torch tensor per tier, copied with every page move.

Each tier ``t`` owns one tensor of shape::

    [num_blocks(t), num_layers, 2, tokens_per_block, num_kv_heads, head_dim]
        page index ─┘      K/V ─┘

so a page is one contiguous slab of ``page_nbytes()`` bytes and a page move is a row copy. The
device tier (tier 0) lives on CUDA when the layout says ``device="auto"`` and a GPU is present,
else on the CPU; slower tiers live on the CPU, in pinned memory when the device tier is on CUDA
(pinned pages are what lets a host<->device copy run asynchronously by DMA).

``copy_pages`` is batched: the manager calls it once per (source tier, destination tier) per
operation, and it turns the whole batch into one indexed copy (a gather, a scatter, or both when
neither side's pages form a contiguous range), never one copy per page. On CUDA the copies run
on a dedicated stream ordered after the work already queued on the caller's stream, and the
caller's stream is made to wait for them, so an engine that reads the pages next sees the data
without a host-side wait.

This module is the only place in kvcache that imports torch; the manager imports it lazily, only
when a ``KVLayout`` is configured.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Final, Protocol

import torch

DTYPES: Final[dict[str, torch.dtype]] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}

# Rows of the two-pass (gather then scatter) copy go through a bounded staging buffer kept for
# the storage's lifetime: a temporary as big as the batch costs more in fresh-memory page faults
# than the copy itself (measured: 0.15 of a plain copy with one, 0.6 with a reused 8 MiB one).
_STAGING_BYTES: Final = 8 * 1024 * 1024


class _LayoutLike(Protocol):
    @property
    def num_layers(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def dtype(self) -> str: ...
    @property
    def device(self) -> str: ...


class _TierLike(Protocol):
    @property
    def num_blocks(self) -> int: ...


class StorageConfig(Protocol):
    """What the storage reads of ``KVCacheManagerConfig``."""

    @property
    def tokens_per_block(self) -> int: ...
    @property
    def tiers(self) -> Sequence[_TierLike]: ...
    @property
    def kv_layout(self) -> _LayoutLike | None: ...


def resolve_device(device: str) -> torch.device:
    """Map a layout's ``device`` setting to the device tier's torch device.

    ``"auto"`` picks CUDA when available, else the CPU; anything else must name a torch device
    (``"cpu"``, ``"cuda"``, ``"cuda:1"``), and a CUDA device must exist.
    """
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(
            f"KVLayout.device={device!r} is not a torch device; use 'auto', 'cpu' or 'cuda[:N]'"
        ) from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"KVLayout.device={device!r} asks for CUDA but no CUDA device is available; "
            "use device='auto' to fall back to the CPU"
        )
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"KVLayout.device={device!r}: only 'cpu' and 'cuda' devices are supported")
    return resolved


def _contiguous_start(pages: Sequence[int]) -> int | None:
    """First page when ``pages`` is exactly ``first, first+1, ...``; else None."""
    first = pages[0]
    for offset, page in enumerate(pages):
        if page != first + offset:
            return None
    return first


class TorchPageStorage:
    """Holds the KV data of every page of every tier as torch tensors (see the module doc)."""

    def __init__(self, config: StorageConfig) -> None:
        layout = config.kv_layout
        if layout is None:
            raise ValueError("TorchPageStorage needs a config with kv_layout set")
        if layout.dtype not in DTYPES:
            raise ValueError(
                f"KVLayout.dtype={layout.dtype!r} is not supported; use one of {sorted(DTYPES)}"
            )
        if not config.tiers:
            raise ValueError("TorchPageStorage needs at least one tier")
        self.tokens_per_block: Final = config.tokens_per_block
        self.num_layers: Final = layout.num_layers
        self.num_kv_heads: Final = layout.num_kv_heads
        self.head_dim: Final = layout.head_dim
        self.dtype: Final = DTYPES[layout.dtype]
        self.device: Final = resolve_device(layout.device)
        on_cuda = self.device.type == "cuda"
        cpu = torch.device("cpu")
        self.tensors: Final[list[torch.Tensor]] = []
        for index, tier in enumerate(config.tiers):
            shape = (
                tier.num_blocks,
                self.num_layers,
                2,
                self.tokens_per_block,
                self.num_kv_heads,
                self.head_dim,
            )
            # Zero-filled so that a never-written page reads as zeros, not as leftover memory.
            if index == 0:
                tensor = torch.zeros(shape, dtype=self.dtype, device=self.device)
            else:
                tensor = torch.zeros(shape, dtype=self.dtype, device=cpu, pin_memory=on_cuda)
            self.tensors.append(tensor)
        self._nbytes = (
            self.num_layers
            * 2
            * self.tokens_per_block
            * self.num_kv_heads
            * self.head_dim
            * self.tensors[0].element_size()
        )
        # A page viewed as one row of the widest integer type that divides it: the indexed
        # copies then move few wide elements per row instead of many half-precision ones.
        self._row_dtype = next(
            dt
            for dt in (torch.int64, torch.int32, torch.int16, torch.uint8)
            if self._nbytes % dt.itemsize == 0
        )
        self._rows = [self._as_rows(t) for t in self.tensors]
        self._stream: torch.cuda.Stream | None = None
        if on_cuda:
            self._stream = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]
        self._staging: dict[torch.device, torch.Tensor] = {}
        self.copies_issued = 0  # indexed copy operations issued, for tests and benchmarks

    def _as_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.view(tensor.shape[0], -1).view(self._row_dtype)

    @property
    def num_tiers(self) -> int:
        """Number of tiers (tensors)."""
        return len(self.tensors)

    def page_nbytes(self) -> int:
        """Bytes of KV data held by one page."""
        return self._nbytes

    def tier_device(self, tier: int) -> torch.device:
        """Device of tier ``tier``'s tensor."""
        return self.tensors[self._check_tier(tier)].device

    def synchronize(self) -> None:
        """Wait until every copy issued so far is complete (a no-op on the CPU)."""
        if self._stream is not None:
            self._stream.synchronize()

    def copy_pages(
        self,
        src_tier: int,
        src_pages: Sequence[int],
        dst_tier: int,
        dst_pages: Sequence[int],
        num_tokens: Sequence[int] | None = None,
    ) -> None:
        """Copy page ``src_pages[i]`` of ``src_tier`` into ``dst_pages[i]`` of ``dst_tier``.

        ``num_tokens[i]``, when given, limits the copy to the first tokens of the page (every
        layer, K and V); the rest of the destination page is left as it was. Source pages are
        read before any destination page is written, so a same-tier batch whose page sets
        overlap copies what the sources held at the call.
        """
        self._check_tier(src_tier)
        self._check_tier(dst_tier)
        if len(src_pages) != len(dst_pages):
            raise ValueError(
                f"copy_pages got {len(src_pages)} source pages but {len(dst_pages)} destination "
                "pages; pass one destination per source"
            )
        if num_tokens is not None and len(num_tokens) != len(src_pages):
            raise ValueError(
                f"copy_pages got {len(num_tokens)} num_tokens entries for {len(src_pages)} pages"
            )
        self._check_pages(src_tier, src_pages, "source")
        self._check_pages(dst_tier, dst_pages, "destination")
        if len(set(dst_pages)) != len(dst_pages):
            raise ValueError("copy_pages got a destination page twice; each must be written once")
        counts = [self.tokens_per_block] * len(src_pages) if num_tokens is None else num_tokens
        for count in counts:
            if not 0 <= count <= self.tokens_per_block:
                raise ValueError(
                    f"copy_pages num_tokens={count} is outside [0, {self.tokens_per_block}]"
                )
        # Self-copies and empty copies are no-ops; dropping them keeps the fast paths reachable.
        triples = [
            (s, d, n)
            for s, d, n in zip(src_pages, dst_pages, counts, strict=True)
            if n > 0 and not (src_tier == dst_tier and s == d)
        ]
        if not triples:
            return
        with self._on_copy_stream():
            if all(n == self.tokens_per_block for _, _, n in triples):
                self._copy_full(src_tier, dst_tier, [(s, d) for s, d, _ in triples])
            else:
                self._copy_partial(src_tier, dst_tier, triples)

    def _check_tier(self, tier: int) -> int:
        if not 0 <= tier < len(self.tensors):
            raise IndexError(f"tier {tier} does not exist; tiers are 0..{len(self.tensors) - 1}")
        return tier

    def _check_pages(self, tier: int, pages: Sequence[int], what: str) -> None:
        if not pages:
            return
        limit = self.tensors[tier].shape[0]
        low, high = min(pages), max(pages)
        if low < 0 or high >= limit:
            bad = low if low < 0 else high
            raise IndexError(f"{what} page {bad} is out of range for tier {tier} (0..{limit - 1})")

    def _on_copy_stream(self) -> AbstractContextManager[None]:
        if self._stream is None:
            return nullcontext()
        return _copy_stream_scope(self._stream)

    def _cpu_barrier(self, *tensors: torch.Tensor) -> None:
        """Before the CPU itself touches host pages, let queued DMA copies into them land."""
        if self._stream is not None and any(t.device.type == "cpu" for t in tensors):
            self._stream.synchronize()

    def _index(self, pages: Sequence[int], device: torch.device) -> torch.Tensor:
        return torch.tensor(pages, dtype=torch.long, device=device)

    def _copy_full(self, src_tier: int, dst_tier: int, pairs: list[tuple[int, int]]) -> None:
        src, dst = self._rows[src_tier], self._rows[dst_tier]
        overlap = src_tier == dst_tier and not {s for s, _ in pairs}.isdisjoint(d for _, d in pairs)
        # Sorting by one side turns an unordered but contiguous page set into a slice.
        by_dst = sorted(pairs, key=lambda p: p[1])
        src_pages = [s for s, _ in by_dst]
        dst_pages = [d for _, d in by_dst]
        d0 = _contiguous_start(dst_pages)
        s0 = _contiguous_start(src_pages)
        n = len(pairs)
        self.copies_issued += 1
        if not overlap and d0 is not None and s0 is not None:
            dst[d0 : d0 + n].copy_(src[s0 : s0 + n], non_blocking=True)
            return
        if src.device == dst.device:
            self._cpu_barrier(src)
        # One tensor cannot be both the input and the output of an indexed op, even when the
        # pages differ: a same-tier batch goes through the staging buffer.
        if src.device == dst.device and src_tier != dst_tier:
            if d0 is not None:
                idx = self._index(src_pages, src.device)
                torch.index_select(src, 0, idx, out=dst[d0 : d0 + n])
                return
            by_src = sorted(pairs)
            s0 = _contiguous_start([s for s, _ in by_src])
            if s0 is not None:
                idx = self._index([d for _, d in by_src], dst.device)
                dst.index_copy_(0, idx, src[s0 : s0 + n])
                return
        if src.device == dst.device:
            self._copy_staged(src, dst, src_pages, dst_pages, overlap)
            return
        # Across devices: gather on the source side (unless already a slice), one transfer,
        # scatter on the destination side (unless the destination is a slice).
        if s0 is not None:
            gathered = src[s0 : s0 + n]
        else:
            pinned = src.device.type == "cpu" and dst.device.type == "cuda"
            self._cpu_barrier(src)
            gathered = torch.empty(
                (n, src.shape[1]), dtype=src.dtype, device=src.device, pin_memory=pinned
            )
            torch.index_select(src, 0, self._index(src_pages, src.device), out=gathered)
        if d0 is not None:
            dst[d0 : d0 + n].copy_(gathered, non_blocking=True)
        else:
            # A device->host copy must land before the CPU scatters it, so it is synchronous.
            self._cpu_barrier(dst)
            moved = gathered.to(dst.device, non_blocking=dst.device.type == "cuda")
            dst.index_copy_(0, self._index(dst_pages, dst.device), moved)

    def _copy_staged(
        self,
        src: torch.Tensor,
        dst: torch.Tensor,
        src_pages: list[int],
        dst_pages: list[int],
        overlap: bool,
    ) -> None:
        """Gather then scatter on one device, through a bounded staging buffer."""
        n = len(src_pages)
        src_idx = self._index(src_pages, src.device)
        dst_idx = self._index(dst_pages, dst.device)
        if overlap:
            # Every source must be read before any destination is written: one full gather.
            dst.index_copy_(0, dst_idx, src.index_select(0, src_idx))
            return
        chunk = max(1, min(n, _STAGING_BYTES // self._nbytes))
        staging = self._staging.get(src.device)
        if staging is None or staging.shape[0] < chunk:
            # Only same-device copies use it, in stream order, so reusing it is race-free.
            staging = torch.empty((chunk, src.shape[1]), dtype=src.dtype, device=src.device)
            self._staging[src.device] = staging
        for start in range(0, n, chunk):
            stop = min(n, start + chunk)
            part = staging[: stop - start]
            torch.index_select(src, 0, src_idx[start:stop], out=part)
            dst.index_copy_(0, dst_idx[start:stop], part)

    def _copy_partial(
        self, src_tier: int, dst_tier: int, triples: list[tuple[int, int, int]]
    ) -> None:
        """Copy the first tokens of pages: one gather of (page, token) pairs, one scatter."""
        src, dst = self.tensors[src_tier], self.tensors[dst_tier]
        src_pages: list[int] = []
        dst_pages: list[int] = []
        tokens: list[int] = []
        for s, d, count in triples:
            src_pages.extend([s] * count)
            dst_pages.extend([d] * count)
            tokens.extend(range(count))
        self.copies_issued += 1
        self._cpu_barrier(src, dst)
        # Advanced indices on dims 0 and 3 around two slices: the selection is
        # [pairs, num_layers, 2, num_kv_heads, head_dim], and the same indices scatter it back.
        values = src[self._index(src_pages, src.device), :, :, self._index(tokens, src.device)]
        values = values.to(dst.device, non_blocking=dst.device.type == "cuda")
        dst[self._index(dst_pages, dst.device), :, :, self._index(tokens, dst.device)] = values


@contextmanager
def _copy_stream_scope(stream: torch.cuda.Stream) -> Iterator[None]:
    """Run the enclosed copies on ``stream``, ordered after and before the caller's stream."""
    caller = torch.cuda.current_stream(stream.device)
    # Pages the engine is still writing on its stream must be complete before they move.
    stream.wait_stream(caller)
    with torch.cuda.stream(stream):
        yield
    # Whatever the engine queues next on its stream runs after the copies.
    caller.wait_stream(stream)


# --- Engine access through a sequence's block table -------------------------------------------


class _HasStorage(Protocol):
    @property
    def storage(self) -> object | None: ...


class _BlockTable(Protocol):
    @property
    def num_tokens(self) -> int: ...
    def page_indices(self) -> list[int]: ...


def storage_of(manager: _HasStorage) -> TorchPageStorage:
    """The manager's :class:`TorchPageStorage`; raises when it was built without a KVLayout."""
    storage = manager.storage
    if not isinstance(storage, TorchPageStorage):
        raise ValueError(
            "this manager holds no KV tensors; set KVCacheManagerConfig.kv_layout to get them"
        )
    return storage


def _slots(
    storage: TorchPageStorage, cache: _BlockTable, start_pos: int, end_pos: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(page, offset) index tensors on the device tier for token positions [start, end)."""
    pages = cache.page_indices()
    tpb = storage.tokens_per_block
    capacity = len(pages) * tpb
    if not 0 <= start_pos <= end_pos <= capacity:
        raise ValueError(
            f"positions [{start_pos}, {end_pos}) are outside the sequence's {capacity} allocated "
            "token slots; call cache.resize(end_pos) before writing past its capacity"
        )
    device = storage.tensors[0].device
    positions = torch.arange(start_pos, end_pos, device=device)
    table = torch.tensor(pages, dtype=torch.long, device=device)
    return table[positions // tpb], positions % tpb


def _check_layer(storage: TorchPageStorage, layer: int) -> None:
    if not 0 <= layer < storage.num_layers:
        raise IndexError(f"layer {layer} does not exist; layers are 0..{storage.num_layers - 1}")


def write_kv(
    manager: _HasStorage,
    cache: _BlockTable,
    layer: int,
    start_pos: int,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Write K and V (each ``[n, num_kv_heads, head_dim]``) of one layer at positions
    ``[start_pos, start_pos + n)`` of ``cache``, through its device-tier block table.

    Only positions at or after ``cache.num_tokens`` may be written: earlier ones are committed,
    and their pages may be shared with other sequences (a reused block is never written).
    """
    storage = storage_of(manager)
    _check_layer(storage, layer)
    expected = (storage.num_kv_heads, storage.head_dim)
    if k.dim() != 3 or tuple(k.shape[1:]) != expected or k.shape != v.shape:
        raise ValueError(
            f"k and v must both have shape [n, {expected[0]}, {expected[1]}], "
            f"got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if start_pos < cache.num_tokens:
        raise ValueError(
            f"position {start_pos} is already committed (the sequence holds {cache.num_tokens} "
            "tokens) and its page may be shared; write from cache.num_tokens onwards"
        )
    pages, offsets = _slots(storage, cache, start_pos, start_pos + k.shape[0])
    tensor = storage.tensors[0]
    tensor[pages, layer, 0, offsets] = k.to(device=tensor.device, dtype=tensor.dtype)
    tensor[pages, layer, 1, offsets] = v.to(device=tensor.device, dtype=tensor.dtype)


def read_kv(
    manager: _HasStorage, cache: _BlockTable, layer: int, start_pos: int, end_pos: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V (each ``[end_pos - start_pos, num_kv_heads, head_dim]``, a copy) of one layer at
    positions ``[start_pos, end_pos)`` of ``cache``."""
    storage = storage_of(manager)
    _check_layer(storage, layer)
    pages, offsets = _slots(storage, cache, start_pos, end_pos)
    tensor = storage.tensors[0]
    return tensor[pages, layer, 0, offsets], tensor[pages, layer, 1, offsets]


def gather_kv(manager: _HasStorage, cache: _BlockTable, end_pos: int | None = None) -> torch.Tensor:
    """KV of every layer at positions ``[0, end_pos)`` (default: the committed tokens) as one
    tensor ``[num_layers, 2, n, num_kv_heads, head_dim]`` (a copy)."""
    storage = storage_of(manager)
    pages, offsets = _slots(storage, cache, 0, cache.num_tokens if end_pos is None else end_pos)
    return storage.tensors[0][pages, :, :, offsets].permute(1, 2, 0, 3, 4)

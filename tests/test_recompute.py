"""Recomputation: a tiny deterministic attention model gives the same output for a prompt's
continuation whether the prompt's KV comes from reused pages or is computed from scratch.

The model (2 layers, grouped-query attention with 4 query heads over 2 KV heads, fixed random
weights) computes every row on its own (one vector-matrix product per token, one softmax per
query), so its result for a position does not depend on how the sequence was chunked into
requests. Any difference between the cached and the from-scratch output then comes from the
KV the pages handed back, and float32, float16 and bfloat16 must all match exactly. The
half-precision outputs are also compared with an independent batched float32 reference
(``scaled_dot_product_attention``), to the tolerance each format allows.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import pytest
import torch
import torch.nn.functional as F

from kvcache import KVCacheManager, ReuseScope
from kvcache.config import KVCacheManagerConfig, KVLayout, TierConfig
from kvcache.storage import read_kv, write_kv

VOCAB, D_MODEL, Q_HEADS, KV_HEADS, HEAD_DIM, LAYERS, MAX_POS = 64, 32, 4, 2, 8, 2, 64
TPB = 4
DTYPE = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Cached vs from-scratch output in the same dtype is asserted exactly equal (so within any
# tolerance, 1e-3 included). Against the independent float32 reference, a half-precision model
# differs by its own rounding whatever the cache does: hidden states here reach |h| ~ 5.3, where
# one float16 ulp is 4e-3 and one bfloat16 ulp 3e-2 (measured max differences: 4.7e-3 and
# 3.3e-2), so 1e-3 is impossible there and the bounds below are a couple of ulps.
REFERENCE_ATOL = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 6e-2}


@pytest.fixture(autouse=True, scope="module")
def _one_cpu_thread() -> Iterator[None]:
    # Hundreds of tiny ops: a thread pool only adds contention on a busy machine.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class TinyAttention:
    """Token + position embeddings, then ``LAYERS`` residual GQA attention layers."""

    def __init__(self, dtype: torch.dtype, device: torch.device, seed: int = 1234) -> None:
        gen = torch.Generator().manual_seed(seed)

        def weight(*shape: int, scale: float) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)

        s = 1 / math.sqrt(D_MODEL)
        self.dtype, self.device = dtype, device
        self.embed = weight(VOCAB, D_MODEL, scale=1.0)
        self.pos = weight(MAX_POS, D_MODEL, scale=0.5)
        self.wq = [weight(D_MODEL, Q_HEADS * HEAD_DIM, scale=s) for _ in range(LAYERS)]
        self.wk = [weight(D_MODEL, KV_HEADS * HEAD_DIM, scale=s) for _ in range(LAYERS)]
        self.wv = [weight(D_MODEL, KV_HEADS * HEAD_DIM, scale=s) for _ in range(LAYERS)]
        self.wo = [weight(Q_HEADS * HEAD_DIM, D_MODEL, scale=s) for _ in range(LAYERS)]

    def _rows(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # One vector-matrix product per row: the same arithmetic whatever the chunk size.
        return torch.stack([x[i] @ w for i in range(x.shape[0])])

    def forward(
        self,
        tokens: Sequence[int],
        start: int,
        kv_io: tuple[object, object] | None = None,
    ) -> torch.Tensor:
        """Hidden states of positions ``[start, len(tokens))``, given the KV of positions
        before ``start``. ``kv_io`` is ``(write(layer, k, v), read(layer) -> (k, v))`` over
        whatever holds the KV; None computes from scratch with a plain in-memory KV."""
        n = len(tokens)
        new = torch.tensor(tokens[start:], device=self.device)
        h = self.embed[new] + self.pos[torch.arange(start, n, device=self.device)]
        plain: list[tuple[torch.Tensor, torch.Tensor]] = []
        for layer in range(LAYERS):
            k = self._rows(h, self.wk[layer]).view(-1, KV_HEADS, HEAD_DIM)
            v = self._rows(h, self.wv[layer]).view(-1, KV_HEADS, HEAD_DIM)
            q = self._rows(h, self.wq[layer]).view(-1, Q_HEADS, HEAD_DIM)
            if kv_io is None:
                assert start == 0, "from scratch means from position 0"
                plain.append((k, v))
                keys, values = k, v
            else:
                write, read = kv_io
                write(layer, k, v)  # type: ignore[operator]
                keys, values = read(layer)  # type: ignore[operator]
            group = Q_HEADS // KV_HEADS
            keys = keys.repeat_interleave(group, dim=1)  # [n, Q_HEADS, HEAD_DIM]
            values = values.repeat_interleave(group, dim=1)
            out = []
            for row in range(q.shape[0]):
                visible = start + row + 1  # causal: keys of positions <= this one
                scores = torch.einsum("hd,thd->ht", q[row], keys[:visible]) / math.sqrt(HEAD_DIM)
                probs = torch.softmax(scores.float(), dim=-1).to(self.dtype)
                out.append(torch.einsum("ht,thd->hd", probs, values[:visible]))
            attn = torch.stack(out).reshape(-1, Q_HEADS * HEAD_DIM)
            h = h + self._rows(attn, self.wo[layer])
        return h

    def reference(self, tokens: Sequence[int]) -> torch.Tensor:
        """An independent batched float32 computation of every position's hidden state, on
        the CPU whatever the model's device (no TF32 or fused-kernel differences)."""
        idx = torch.tensor(tokens)

        def f(w: torch.Tensor) -> torch.Tensor:
            return w.float().cpu()

        h = f(self.embed)[idx] + f(self.pos)[: len(tokens)]
        for layer in range(LAYERS):
            q = (h @ f(self.wq[layer])).view(-1, Q_HEADS, HEAD_DIM).transpose(0, 1)
            k = (h @ f(self.wk[layer])).view(-1, KV_HEADS, HEAD_DIM).transpose(0, 1)
            v = (h @ f(self.wv[layer])).view(-1, KV_HEADS, HEAD_DIM).transpose(0, 1)
            group = Q_HEADS // KV_HEADS
            k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            h = h + attn.transpose(0, 1).reshape(-1, Q_HEADS * HEAD_DIM) @ f(self.wo[layer])
        return h


def make_manager(dtype: str, device: str, device_blocks: int = 8) -> KVCacheManager:
    config = KVCacheManagerConfig(
        tokens_per_block=TPB,
        tiers=[
            TierConfig(name="device", num_blocks=device_blocks),
            TierConfig(name="host", num_blocks=16),
        ],
        kv_layout=KVLayout(
            num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=dtype, device=device
        ),
    )
    return KVCacheManager(config)


def serve(
    manager: KVCacheManager,
    model: TinyAttention,
    tokens: list[int],
    scope: ReuseScope | None = None,
) -> tuple[int, torch.Tensor]:
    """Run one request through the cache: (tokens reused, hidden states of the rest)."""
    with manager.create_kv_cache(tokens, reuse_scope=scope) as cache:
        start = cache.num_reused_tokens
        cache.resize(len(tokens))

        def write(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
            write_kv(manager, cache, layer, start, k, v)

        def read(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
            return read_kv(manager, cache, layer, 0, len(tokens))

        out = model.forward(tokens, start, (write, read))
        cache.commit(tokens[start:])
        return start, out


PROMPT = [5, 17, 3, 42, 8, 8, 23, 61, 0, 33, 12, 7, 19, 50, 2, 44, 9, 31]  # 4 blocks + 2
# Shares 3 full blocks and 2 tokens of the fourth with PROMPT, then goes its own way.
CONTINUATION = [*PROMPT[:14], 11, 27, 60, 4, 38, 21, 15]

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=[
            pytest.mark.cuda,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ],
    ),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", sorted(DTYPE))
@pytest.mark.parametrize("offload", [False, True], ids=["on_device", "via_host"])
def test_output_with_reused_pages_equals_from_scratch(
    dtype: str, device: str, offload: bool
) -> None:
    manager = make_manager(dtype, device)
    model = TinyAttention(DTYPE[dtype], manager.page_tensors[0].device)
    reused, _ = serve(manager, model, PROMPT)
    assert reused == 0
    if offload:
        # Another prompt that needs every device page pushes the cached prompt to the host.
        reused, _ = serve(manager, model, [(t * 7 + 1) % VOCAB for t in range(32)])
        assert manager.stats.offloads >= 4
    reused, cached = serve(manager, model, CONTINUATION)
    assert reused == 14  # 3 full blocks + 2 tokens by copy-on-write
    if offload:
        assert manager.stats.onboards >= 3
    scratch = model.forward(CONTINUATION, 0)[reused:]
    assert torch.equal(cached, scratch)
    reference = model.reference(CONTINUATION)[reused:]
    torch.testing.assert_close(cached.float().cpu(), reference, atol=REFERENCE_ATOL[dtype], rtol=0)


@pytest.mark.parametrize("dtype", sorted(DTYPE))
def test_a_request_under_another_scope_reuses_no_pages(dtype: str) -> None:
    manager = make_manager(dtype, "cpu")
    model = TinyAttention(DTYPE[dtype], torch.device("cpu"))
    serve(manager, model, PROMPT)
    tenant = ReuseScope.for_request(lora_id=None, cache_salt="another-tenant")
    assert manager.probe_reuse(CONTINUATION, reuse_scope=tenant) == 0
    reused, out = serve(manager, model, CONTINUATION, tenant)
    assert reused == 0
    assert torch.equal(out, model.forward(CONTINUATION, 0))
    # The default scope still reuses what it cached, and nothing the tenant wrote.
    reused, cached = serve(manager, model, CONTINUATION)
    assert reused == 14
    assert torch.equal(cached, model.forward(CONTINUATION, 0)[reused:])

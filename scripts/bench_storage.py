"""Benchmark: batched page copies (offload to host, onboard back) against a plain tensor.copy_.

Layout 32 layers x 8 KV heads x head_dim 128, float16, 16 tokens per block: one page is 2 MiB,
and a batch of 256 pages moves 512 MiB each way. Every figure comes from the same run, with the
timings of the storage and of the baseline interleaved, so the ratio compares like with like:

    ratio = (seconds of one plain ``dst[:n].copy_(src[:n])`` of the same bytes)
            / (seconds of one ``TorchPageStorage.copy_pages`` of the batch)

Page patterns: ``ranges`` (both sides contiguous), ``device_scattered`` (device pages anywhere,
host pages a range: the usual eviction into free host pages and onboarding from them), and
``both_scattered`` (neither side a range: a gather and a scatter). A per-page ``copy_`` loop is
shown beside them for reference.

    python scripts/bench_storage.py [--pages 256] [--repeats 7] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable

import torch

from kvcache.config import KVCacheManagerConfig, KVLayout, TierConfig
from kvcache.storage import TorchPageStorage


def timed(fn: Callable[[], None], sync: Callable[[], None]) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--tokens-per-block", type=int, default=16)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads", type=int, default=0, help="torch CPU threads (0: torch's default)"
    )
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    n = args.pages
    tier_blocks = 2 * n  # room for scattered pages
    config = KVCacheManagerConfig(
        tokens_per_block=args.tokens_per_block,
        tiers=[
            TierConfig(name="device", num_blocks=tier_blocks),
            TierConfig(name="host", num_blocks=tier_blocks),
        ],
        kv_layout=KVLayout(
            num_layers=32, num_kv_heads=8, head_dim=128, dtype="float16", device=args.device
        ),
    )
    storage = TorchPageStorage(config)
    device, host = storage.tensors
    device.normal_()
    host.normal_()  # touch every page now, so no copy pays first-touch faults
    on_cuda = device.is_cuda

    def sync() -> None:
        storage.synchronize()
        if on_cuda:
            torch.cuda.synchronize()

    rng = random.Random(args.seed)
    ranges = (list(range(n)), list(range(n, 2 * n)))
    patterns = {
        "ranges": ranges,
        "device_scattered": (rng.sample(range(tier_blocks), n), ranges[1]),
        "both_scattered": (rng.sample(range(tier_blocks), n), rng.sample(range(tier_blocks), n)),
    }
    nbytes = n * storage.page_nbytes()

    def plain(dst: torch.Tensor, src: torch.Tensor) -> Callable[[], None]:
        return lambda: dst[:n].copy_(src[:n], non_blocking=True)

    def per_page(
        src_t: torch.Tensor, src_p: list[int], dst_t: torch.Tensor, dst_p: list[int]
    ) -> Callable[[], None]:
        def run() -> None:
            for s, d in zip(src_p, dst_p, strict=True):
                dst_t[d].copy_(src_t[s], non_blocking=True)

        return run

    results: dict[str, dict[str, float]] = {}
    print(
        f"device tier on {device.device}, host tier on {host.device}"
        f"{' (pinned)' if host.is_pinned() else ''}; {n} pages x "
        f"{storage.page_nbytes() / 2**20:.1f} MiB = {nbytes / 2**20:.0f} MiB per batch; "
        f"{torch.get_num_threads()} CPU threads; "
        f"best of {args.repeats} interleaved runs each"
    )
    print(
        f"{'direction':<9} {'pattern':<17} {'plain GB/s':>10} {'batched GB/s':>12} "
        f"{'ratio':>6} {'per-page GB/s':>13}"
    )
    for direction in ("offload", "onboard"):
        for name, (dev_pages, host_pages) in patterns.items():
            if direction == "offload":
                batched = lambda d=dev_pages, h=host_pages: storage.copy_pages(0, d, 1, h)  # noqa: E731
                baseline = plain(host, device)
                loop = per_page(device, dev_pages, host, host_pages)
            else:
                batched = lambda d=dev_pages, h=host_pages: storage.copy_pages(1, h, 0, d)  # noqa: E731
                baseline = plain(device, host)
                loop = per_page(host, host_pages, device, dev_pages)
            timed(batched, sync)  # warm-up: first-touch of pages, allocator, kernels
            timed(baseline, sync)
            plain_s: list[float] = []
            batched_s: list[float] = []
            loop_s: list[float] = []
            for _ in range(args.repeats):
                plain_s.append(timed(baseline, sync))
                batched_s.append(timed(batched, sync))
                loop_s.append(timed(loop, sync))
            # The fastest of interleaved runs: on a shared machine the slower ones measure
            # the neighbours, not the copy.
            p, b = min(plain_s), min(batched_s)
            row = {
                "plain_gbps": nbytes / p / 1e9,
                "batched_gbps": nbytes / b / 1e9,
                "ratio": p / b,
                "per_page_gbps": nbytes / min(loop_s) / 1e9,
            }
            results[f"{direction}/{name}"] = row
            print(
                f"{direction:<9} {name:<17} {row['plain_gbps']:>10.2f} "
                f"{row['batched_gbps']:>12.2f} {row['ratio']:>6.2f} {row['per_page_gbps']:>13.2f}"
            )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": str(device.device), "pages": n, "results": results}, fh, indent=2)


if __name__ == "__main__":
    main()

"""Benchmark: batched page copies (offload to host, onboard back) against a plain tensor.copy_.

Layout 32 layers x 8 KV heads x head_dim 128, float16, 16 tokens per block: one page is 2 MiB,
and a batch of 256 pages moves 512 MiB each way. Every figure comes from the same run, with the
timings of the storage and of the baseline interleaved, so the ratio compares like with like:

    ratio = (seconds of one plain ``dst[:n].copy_(src[:n])`` of the same bytes)
            / (seconds of one ``TorchPageStorage.copy_pages`` of the batch)

Two parts:

- ``manager``: a real ``KVCacheManager`` offloads a cached 256-block prompt to the host (a second
  prompt needs the whole device tier) and onboards it back (the first prompt is requested
  again); the copy calls it makes are timed (one call per direction: batched).
- synthetic page patterns through ``copy_pages`` directly: ``ranges`` (both sides contiguous),
  ``device_scattered`` (device pages anywhere, host pages a range), ``both_scattered`` (neither
  side a range: a gather then a scatter). A per-page ``copy_`` loop is shown for reference.

    python scripts/bench_storage.py [--pages 256] [--repeats 7] [--threads N] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable, Sequence

import torch

from kvcache import KVCacheManager
from kvcache.config import KVCacheManagerConfig, KVLayout, TierConfig
from kvcache.storage import TorchPageStorage, storage_of

Row = dict[str, float]


def make_config(args: argparse.Namespace, blocks: int) -> KVCacheManagerConfig:
    return KVCacheManagerConfig(
        tokens_per_block=args.tokens_per_block,
        tiers=[
            TierConfig(name="device", num_blocks=blocks),
            TierConfig(name="host", num_blocks=blocks),
        ],
        kv_layout=KVLayout(
            num_layers=32, num_kv_heads=8, head_dim=128, dtype="float16", device=args.device
        ),
    )


def syncer(storage: TorchPageStorage) -> Callable[[], None]:
    def sync() -> None:
        storage.synchronize()
        if storage.device.type == "cuda":
            torch.cuda.synchronize()

    return sync


def timed(fn: Callable[[], None], sync: Callable[[], None]) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def plain_copy(dst: torch.Tensor, src: torch.Tensor, n: int) -> Callable[[], None]:
    return lambda: dst[:n].copy_(src[:n], non_blocking=True)


def row(nbytes: int, plain_s: float, batched_s: float, loop_s: float | None = None) -> Row:
    out = {
        "plain_gbps": nbytes / plain_s / 1e9,
        "batched_gbps": nbytes / batched_s / 1e9,
        "ratio": plain_s / batched_s,
    }
    if loop_s is not None:
        out["per_page_gbps"] = nbytes / loop_s / 1e9
    return out


def print_row(direction: str, name: str, r: Row) -> None:
    loop = f"{r['per_page_gbps']:>13.2f}" if "per_page_gbps" in r else f"{'-':>13}"
    print(
        f"{direction:<9} {name:<17} {r['plain_gbps']:>10.2f} {r['batched_gbps']:>12.2f} "
        f"{r['ratio']:>6.2f} {loop}"
    )


def bench_manager(args: argparse.Namespace) -> dict[str, Row]:
    """Offload and onboard of ``pages`` blocks as the manager issues them."""
    n, tpb = args.pages, args.tokens_per_block
    manager = KVCacheManager(make_config(args, n))
    storage = storage_of(manager)
    sync = syncer(storage)
    device, host = storage.tensors
    device.normal_()
    host.normal_()  # touch every page now, so no copy pays first-touch faults
    calls: list[tuple[int, int, int, float]] = []
    real = storage.copy_pages

    def spy(
        src_tier: int,
        src_pages: Sequence[int],
        dst_tier: int,
        dst_pages: Sequence[int],
        num_tokens: Sequence[int] | None = None,
    ) -> None:
        seconds = timed(lambda: real(src_tier, src_pages, dst_tier, dst_pages, num_tokens), sync)
        calls.append((src_tier, dst_tier, len(src_pages), seconds))

    storage.copy_pages = spy  # type: ignore[method-assign]
    first = list(range(n * tpb))
    second = [t + n * tpb for t in first]

    def request(tokens: list[int]) -> None:
        with manager.create_kv_cache(tokens) as cache:
            cache.resize(len(tokens))
            cache.commit(tokens[cache.num_reused_tokens :])

    request(first)  # cached on the device tier
    times: dict[str, list[float]] = {"offload": [], "onboard": []}
    plain: dict[str, list[float]] = {"offload": [], "onboard": []}
    for _ in range(args.repeats):
        calls.clear()
        request(second)  # needs every device page: the first prompt goes to the host
        with manager.create_kv_cache([*first, 1]):  # reuses it: onboarded back (the second
            pass  # prompt has nowhere to go: the host holds the first, so it is dropped)
        offloads = [c for c in calls if (c[0], c[1]) == (0, 1)]
        onboards = [c for c in calls if (c[0], c[1]) == (1, 0)]
        assert [c[2] for c in offloads] == [n] and [c[2] for c in onboards] == [n], calls
        times["offload"].append(offloads[0][3])
        times["onboard"].append(onboards[0][3])
        plain["offload"].append(timed(plain_copy(host, device, n), sync))
        plain["onboard"].append(timed(plain_copy(device, host, n), sync))
    nbytes = n * storage.page_nbytes()
    return {d: row(nbytes, min(plain[d]), min(times[d])) for d in ("offload", "onboard")}


def bench_patterns(args: argparse.Namespace) -> dict[str, dict[str, Row]]:
    n = args.pages
    blocks = 2 * n  # room for scattered pages
    storage = TorchPageStorage(make_config(args, blocks))
    sync = syncer(storage)
    device, host = storage.tensors
    device.normal_()
    host.normal_()
    rng = random.Random(args.seed)
    ranges = (list(range(n)), list(range(n, 2 * n)))
    patterns = {
        "ranges": ranges,
        "device_scattered": (rng.sample(range(blocks), n), ranges[1]),
        "both_scattered": (rng.sample(range(blocks), n), rng.sample(range(blocks), n)),
    }
    nbytes = n * storage.page_nbytes()

    def per_page(
        src_t: torch.Tensor, src_p: list[int], dst_t: torch.Tensor, dst_p: list[int]
    ) -> Callable[[], None]:
        def run() -> None:
            for s, d in zip(src_p, dst_p, strict=True):
                dst_t[d].copy_(src_t[s], non_blocking=True)

        return run

    results: dict[str, dict[str, Row]] = {"offload": {}, "onboard": {}}
    for direction in ("offload", "onboard"):
        for name, (dev, hst) in patterns.items():
            if direction == "offload":
                batched = lambda d=dev, h=hst: storage.copy_pages(0, d, 1, h)  # noqa: E731
                baseline = plain_copy(host, device, n)
                loop = per_page(device, dev, host, hst)
            else:
                batched = lambda d=dev, h=hst: storage.copy_pages(1, h, 0, d)  # noqa: E731
                baseline = plain_copy(device, host, n)
                loop = per_page(host, hst, device, dev)
            timed(batched, sync)  # warm-up: allocator, staging buffer, kernels
            timed(baseline, sync)
            plain_s, batched_s, loop_s = [], [], []
            for _ in range(args.repeats):
                plain_s.append(timed(baseline, sync))
                batched_s.append(timed(batched, sync))
                loop_s.append(timed(loop, sync))
            results[direction][name] = row(nbytes, min(plain_s), min(batched_s), min(loop_s))
    return results


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

    managed = bench_manager(args)
    patterns = bench_patterns(args)
    probe = TorchPageStorage(make_config(args, 1))
    page_mib = probe.page_nbytes() / 2**20
    host = probe.tensors[1]
    print(
        f"device tier on {probe.device}, host tier on cpu{' (pinned)' if host.is_pinned() else ''};"
        f" {args.pages} pages x {page_mib:.1f} MiB = {args.pages * page_mib:.0f} MiB per batch;"
        f" {torch.get_num_threads()} CPU threads; fastest of {args.repeats} interleaved runs"
        " (on a shared machine the slower runs measure the neighbours)"
    )
    print(
        f"{'direction':<9} {'pages':<17} {'plain GB/s':>10} {'batched GB/s':>12} "
        f"{'ratio':>6} {'per-page GB/s':>13}"
    )
    for direction in ("offload", "onboard"):
        print_row(direction, "manager", managed[direction])
        for name, r in patterns[direction].items():
            print_row(direction, name, r)
    if args.json:
        with open(args.json, "w") as fh:
            out = {"device": str(probe.device), "pages": args.pages, "manager": managed}
            json.dump({**out, "patterns": patterns}, fh, indent=2)


if __name__ == "__main__":
    main()

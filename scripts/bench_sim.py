"""Benchmark: the whole Mooncake conversation trace through the simulator.

Prints, per (policy, tokens per block, device blocks), the wall time of the run beside the
quality figures (hit rate and its ratio to the compulsory-miss bound, TTFT p50/p99, load
max/mean), all from one invocation. Not part of the test suite.

    python scripts/bench_sim.py                                   # kv_overlap, 8 workers
    python scripts/bench_sim.py --policies round_robin random kv_overlap predicted_ttft
    python scripts/bench_sim.py --policies 'kv_overlap:{"overlap_weight": 4}' --spread-ms 3000
    python scripts/bench_sim.py --device-blocks 65536,4096 --tokens-per-block 512,128
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

from router_sim.bound import compulsory_bound
from router_sim.sim import SimConfig, simulate
from router_sim.trace import load_trace


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default="mooncake")
    parser.add_argument(
        "--policies", nargs="+", default=["kv_overlap"], help="NAME or NAME:{json options}"
    )
    parser.add_argument("--spread-ms", type=float, default=0.0)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--tokens-per-block", default="512")
    parser.add_argument("--device-blocks", default="65536")
    parser.add_argument("--max-requests", type=int)
    parser.add_argument("--seed", default="0", help="comma-separated seeds: one row per seed")
    args = parser.parse_args()
    seeds = [int(x) for x in args.seed.split(",")]

    t0 = time.perf_counter()
    requests = load_trace(args.trace, max_requests=args.max_requests, spread_ms=args.spread_ms)
    print(
        f"loaded {len(requests)} requests in {time.perf_counter() - t0:.2f} s "
        f"(spread {args.spread_ms:g} ms, {args.workers} workers)"
    )
    header = (
        f"{'policy':<34}{'tpb':>5}{'dev blocks':>11}{'wall s':>8}{'hit %':>7}{'of bound':>9}"
        f"{'TTFT p50':>9}{'p99':>8}{'max/mean':>9}{'busy m/m':>9}{'given up':>9}"
    )
    for tpb in (int(x) for x in args.tokens_per_block.split(",")):
        t0 = time.perf_counter()
        bound = compulsory_bound(requests, tpb)
        print(
            f"tokens_per_block {tpb}: bound {bound.token_hit_rate:.2%} of tokens, "
            f"{bound.block_hit_rate:.2%} of blocks ({time.perf_counter() - t0:.2f} s)"
        )
        print(header)
        for blocks in (int(x) for x in args.device_blocks.split(",")):
            for spec, seed in itertools.product(args.policies, seeds):
                policy, _, options = spec.partition(":")
                config = SimConfig(
                    workers=args.workers,
                    tokens_per_block=tpb,
                    device_blocks=blocks,
                    seed=seed,
                    policy_options={policy: json.loads(options)} if options else {},
                )
                t0 = time.perf_counter()
                f = simulate(requests, policy, config).as_dict()
                wall = time.perf_counter() - t0
                hit = float(f["hit_rate"])
                label = spec + (f" seed {seed}" if len(seeds) > 1 else "")
                print(
                    f"{label:<34}{tpb:>5}{blocks:>11}{wall:>8.1f}{hit:>7.1%}"
                    f"{hit / bound.token_hit_rate:>9.1%}{f['ttft_p50_ms']:>9.0f}"
                    f"{f['ttft_p99_ms']:>8.0f}{f['load_max_over_mean']:>9.3f}"
                    f"{f['busy_max_over_mean']:>9.3f}{f['locality_given_up']:>9.2%}",
                    flush=True,
                )


if __name__ == "__main__":
    main()

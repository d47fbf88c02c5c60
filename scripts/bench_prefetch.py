"""Benchmark: the simulator's prompt thread (``router_sim.sim._prefetch``) on and off.

Runs the Mooncake replay with the thread and without it (``router_sim.sim.prefetch.ENABLED``),
alternating in one process so that load on the machine hits both alike, and prints the median
wall and CPU seconds of each beside their ratio. A run is timed as ``bench_sim.py`` times it: up
to its report, the cache trees freed after the clock stops. Not part of the test suite.

    python scripts/bench_prefetch.py                        # kv_overlap and round_robin at 4x
    python scripts/bench_prefetch.py --speedup 1 --policies kv_overlap --repeats 5
"""

from __future__ import annotations

import argparse
import statistics

from bench_sim import _timed_run  # scripts/ is on sys.path when run as a script

import router_sim.sim.prefetch as prefetch
from router_sim.sim.simulator import SimConfig
from router_sim.sim.trace import load_trace


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", default="mooncake")
    parser.add_argument("--policies", nargs="+", default=["kv_overlap", "round_robin"])
    parser.add_argument("--speedup", type=float, default=4.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    requests = load_trace(args.trace, speedup=args.speedup)
    config = SimConfig(workers=8, tokens_per_block=512, device_blocks=65536)
    runs: dict[tuple[str, bool], list[tuple[float, float]]] = {}
    for _ in range(args.repeats):
        for policy in args.policies:
            for on in (True, False):
                prefetch.ENABLED = on
                _, wall, cpu = _timed_run(requests, policy, config)
                runs.setdefault((policy, on), []).append((wall, cpu))
    prefetch.ENABLED = True
    print(f"{args.speedup:g}x, medians of {args.repeats}; wall and CPU seconds, thread on / off")
    for policy in args.policies:
        on = runs[(policy, True)]
        off = runs[(policy, False)]
        w_on, w_off = (statistics.median(r[0] for r in x) for x in (on, off))
        c_on, c_off = (statistics.median(r[1] for r in x) for x in (on, off))
        print(
            f"{policy:<16} wall {w_on:6.2f} / {w_off:6.2f} ({w_off / w_on:.2f}x)"
            f"   CPU {c_on:6.2f} / {c_off:6.2f} ({c_off / c_on:.2f}x)"
        )


if __name__ == "__main__":
    main()

"""Benchmark: the whole Mooncake conversation trace through the simulator.

Prints, per (speed-up, policy, tokens per block, device blocks), the wall and CPU seconds of
the run beside the quality figures (hit rate and its ratio to the compulsory-miss bound, TTFT
p50/p99, load max/mean), all from one invocation. Not part of the test suite. A run's wall
and CPU are what ``router-sim run`` spends on it up to its report, the trace already loaded:
the command leaves the run's cache trees to the process exit, so they are freed here after the
clock stops (about 0.3-0.5 s at the trace's 4x speed-up, which Dynamo's figures include).

    python scripts/bench_sim.py                                   # kv_overlap, 8 workers
    python scripts/bench_sim.py --policies round_robin random kv_overlap predicted_ttft
    python scripts/bench_sim.py --policies 'kv_overlap:{"overlap_weight": 4}' --spread-ms 3000
    python scripts/bench_sim.py --device-blocks 65536,4096 --tokens-per-block 512,128
    python scripts/bench_sim.py --policies round_robin kv_overlap predicted_ttft --speedups 1,4

``--against-dynamo PYTHON`` runs NVIDIA Dynamo's Rust mocker (``ai-dynamo-runtime``, installed
in its own environment whose interpreter is PYTHON; never a dependency of this project) on the
same trace, fleet and block size, side by side with router-sim, as recorded and at each
``--speedups`` factor: wall and CPU seconds, hit rate and TTFT for both, medians of
``--repeats`` runs, each run alternating between the two simulators so that load on the
machine hits both alike. Dynamo has two modes: ``round_robin`` is compared with ours, every
other policy with its ``kv_router``.

    python scripts/bench_sim.py --against-dynamo /path/to/venv/bin/python \\
        --policies round_robin kv_overlap predicted_ttft --speedups 1,4 --repeats 3
"""

from __future__ import annotations

import argparse
import gc
import gzip
import itertools
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from router_sim.build_info import is_compiled
from router_sim.sim.bound import compulsory_bound
from router_sim.sim.simulator import SimConfig, simulate
from router_sim.sim.trace import load_trace, resolve_trace

# Runs in Dynamo's interpreter: one replay, its wall and CPU seconds (threads included) and
# the summary fields we compare. Engine shape as ours: 512-token blocks, 65536 device blocks
# per worker, 8192-token steps and 256 sequences (Dynamo's defaults for the last two).
_DYNAMO_RUNNER = r"""
import json, resource, sys, time
from dynamo._core import run_mocker_trace_replay
trace, workers, mode, speedup, tpb, blocks = sys.argv[1:7]
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
c0, t0 = cpu(), time.perf_counter()
res = run_mocker_trace_replay(
    [trace],
    extra_engine_args={"engine": {"block_size": int(tpb), "num_gpu_blocks": int(blocks)}},
    num_workers=int(workers),
    router_mode=mode,
    arrival_speedup_ratio=float(speedup),
    trace_block_size=int(tpb),
)
wall, used = time.perf_counter() - t0, cpu() - c0
s = res.summary
print(json.dumps({"wall": wall, "cpu": used, "hit": s["prefix_cache_reused_ratio"],
                  "p50": s["median_ttft_ms"], "p99": s["p99_ttft_ms"],
                  "completed": s["completed_requests"]}))
"""


def _plain_trace(path: Path, out_dir: Path, max_requests: int | None) -> Path:
    """Dynamo reads plain JSONL: a decompressed copy of the first ``max_requests`` lines."""
    if path.suffix != ".gz" and max_requests is None:
        return path
    plain = out_dir / "trace.jsonl"
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as src, plain.open("w") as dst:
        dst.writelines(itertools.islice(src, max_requests))
    return plain


def _num(value: object) -> float:
    assert isinstance(value, (int, float))
    return float(value)


def _cpu_s() -> float:
    return time.process_time()  # every thread of this process


def _timed_run(requests: list[Any], policy: str, config: SimConfig) -> tuple[Any, float, float]:
    """One run timed as ``router-sim run`` spends it: up to its report. The command leaves the
    run's cache trees for the process exit to reclaim (``simulate(exit_after=True)``); here they
    are freed after the clock stops (``gc.unfreeze`` + ``gc.collect``), so that the next run
    starts from a clean heap."""
    gc.collect()
    c0, t0 = _cpu_s(), time.perf_counter()
    summary = simulate(requests, policy, config, exit_after=True)
    wall, cpu = time.perf_counter() - t0, _cpu_s() - c0
    gc.unfreeze()
    gc.collect()
    return summary, wall, cpu


def _ours(requests: list[Any], policy: str, config: SimConfig) -> dict[str, float]:
    summary, wall, cpu = _timed_run(requests, policy, config)
    f = summary.as_dict()
    return {
        "wall": wall,
        "cpu": cpu,
        "hit": _num(f["hit_rate"]),
        "p50": _num(f["ttft_p50_ms"]),
        "p99": _num(f["ttft_p99_ms"]),
        "completed": _num(f["completed"]),
    }


def _dynamo(python: str, trace: Path, args: argparse.Namespace, mode: str, speedup: float) -> Any:
    cmd = [python, "-c", _DYNAMO_RUNNER, str(trace), str(args.workers), mode, str(speedup)]
    cmd += [args.tokens_per_block.split(",")[0], args.device_blocks.split(",")[0]]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"Dynamo's mocker failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _build() -> str:
    """Whether the simulator's hot modules run compiled (router_sim.build_info)."""
    if is_compiled():
        return "hot modules compiled (mypyc)"
    return "hot modules pure Python (compare: python3 scripts/pure_python.py scripts/bench_sim.py)"


def _median(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def against_dynamo(args: argparse.Namespace) -> None:
    tpb = int(args.tokens_per_block.split(",")[0])
    blocks = int(args.device_blocks.split(",")[0])
    with tempfile.TemporaryDirectory() as tmp:
        trace = _plain_trace(resolve_trace(args.trace), Path(tmp), args.max_requests)
        print(
            f"trace {args.trace}, {args.workers} workers, {tpb}-token blocks, {blocks} device "
            f"blocks per worker; medians of {args.repeats} run(s); CPU = user + system seconds"
        )
        print(f"ours: {_build()}")
        print(
            f"{'speedup':>7} {'policy':<24}{'ours wall':>10}{'Dynamo':>8}{'ratio':>7}"
            f"{'ours CPU':>10}{'Dynamo':>8}{'hit %':>7}{'Dynamo':>8}{'TTFT p50':>9}{'Dynamo':>8}"
            f"{'p99':>7}{'Dynamo':>8}  ratio per repeat: median (range)"
        )
        for speedup in (float(x) for x in (args.speedups or "1,4").split(",")):
            t0 = time.perf_counter()
            requests = load_trace(args.trace, speedup=speedup, max_requests=args.max_requests)
            load_s = time.perf_counter() - t0
            for spec in args.policies:
                policy, _, options = spec.partition(":")
                config = SimConfig(
                    workers=args.workers,
                    tokens_per_block=tpb,
                    device_blocks=blocks,
                    policy_options={policy: json.loads(options)} if options else {},
                    events=args.events,
                )
                mode = "round_robin" if policy == "round_robin" else "kv_router"
                ours_runs, theirs_runs = [], []
                for _ in range(args.repeats):
                    run = _ours(requests, policy, config)
                    run["wall"] += load_s  # Dynamo's figure includes reading the trace
                    ours_runs.append(run)
                    theirs_runs.append(_dynamo(args.against_dynamo, trace, args, mode, speedup))
                o, d = _median(ours_runs), _median(theirs_runs)
                # each repeat runs both back to back: their ratio is the least exposed to a
                # host whose speed drifts between repeats
                pairs = [a["wall"] / b["wall"] for a, b in zip(ours_runs, theirs_runs, strict=True)]
                # Dynamo's round_robin replay runs no KV event stream either
                label = spec if config.events_for(policy) else f"{spec} (no events)"
                print(
                    f"{speedup:>7g} {label:<24}{o['wall']:>10.2f}{d['wall']:>8.2f}"
                    f"{o['wall'] / d['wall']:>7.2f}{o['cpu']:>10.2f}{d['cpu']:>8.2f}"
                    f"{o['hit']:>7.1%}{d['hit']:>8.1%}{o['p50']:>9.0f}{d['p50']:>8.0f}"
                    f"{o['p99']:>7.0f}{d['p99']:>8.0f}"
                    f"  {statistics.median(pairs):.2f} ({min(pairs):.2f}-{max(pairs):.2f})",
                    flush=True,
                )


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
    parser.add_argument(
        "--against-dynamo",
        metavar="PYTHON",
        help="interpreter of an environment with ai-dynamo-runtime: compare with its mocker",
    )
    parser.add_argument(
        "--speedups",
        help="arrival speed-up factors, comma-separated (default 1; with --against-dynamo 1,4)",
    )
    parser.add_argument("--repeats", type=int, default=1, help="with --against-dynamo")
    parser.add_argument(
        "--events",
        choices=("auto", "on", "off"),
        default="auto",
        help="with --against-dynamo: our event stream (SimConfig.events; auto leaves it out "
        "for policies that never read the index, as Dynamo's round_robin replay does)",
    )
    args = parser.parse_args()
    if args.against_dynamo:
        against_dynamo(args)
        return
    for speedup in (float(x) for x in (args.speedups or "1").split(",")):
        _sweep(args, speedup)


def _sweep(args: argparse.Namespace, speedup: float) -> None:
    seeds = [int(x) for x in args.seed.split(",")]
    t0 = time.perf_counter()
    requests = load_trace(
        args.trace, max_requests=args.max_requests, spread_ms=args.spread_ms, speedup=speedup
    )
    print(
        f"loaded {len(requests)} requests in {time.perf_counter() - t0:.2f} s "
        f"(speed-up {speedup:g}, spread {args.spread_ms:g} ms, {args.workers} workers); "
        f"{_build()}"
    )
    header = (
        f"{'policy':<34}{'tpb':>5}{'dev blocks':>11}{'wall s':>8}{'CPU s':>7}{'hit %':>7}"
        f"{'of bound':>9}{'TTFT p50':>9}{'p99':>8}{'max/mean':>9}{'busy m/m':>9}{'given up':>9}"
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
                summary, wall, cpu = _timed_run(requests, policy, config)
                f = summary.as_dict()
                hit = _num(f["hit_rate"])
                label = spec + (f" seed {seed}" if len(seeds) > 1 else "")
                print(
                    f"{label:<34}{tpb:>5}{blocks:>11}{wall:>8.1f}{cpu:>7.1f}{hit:>7.1%}"
                    f"{hit / bound.token_hit_rate:>9.1%}{f['ttft_p50_ms']:>9.0f}"
                    f"{f['ttft_p99_ms']:>8.0f}{f['load_max_over_mean']:>9.3f}"
                    f"{f['busy_max_over_mean']:>9.3f}{f['locality_given_up']:>9.2%}",
                    flush=True,
                )


if __name__ == "__main__":
    main()

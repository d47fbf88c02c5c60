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

``--against-pure`` runs the same configurations on this install's compiled modules (mypyc, in
this process) and on their Python source (a child process under ``scripts/pure_python.py``),
alternating run by run, and prints both walls and the ratio pure / compiled per row: what the
compiled group pays on the simulator. Both must give the same report (checked per run).

    python scripts/bench_sim.py --against-pure --policies round_robin kv_overlap \\
        predicted_ttft --speedups 1,4 --repeats 3
"""

from __future__ import annotations

import argparse
import gc
import gzip
import itertools
import json
import statistics
import subprocess
import sys
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


def _config(args: argparse.Namespace, spec: str) -> tuple[str, SimConfig]:
    """The policy and configuration of one ``NAME[:{json options}]`` spec, on the first of
    ``--tokens-per-block`` and ``--device-blocks`` (the side-by-side modes run one shape)."""
    policy, _, options = spec.partition(":")
    config = SimConfig(
        workers=args.workers,
        tokens_per_block=int(args.tokens_per_block.split(",")[0]),
        device_blocks=int(args.device_blocks.split(",")[0]),
        policy_options={policy: json.loads(options)} if options else {},
        events=args.events,
    )
    return policy, config


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
                policy, config = _config(args, spec)
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


def _serve_runs(args: argparse.Namespace) -> None:
    """The child of ``--against-pure``: one line per run asked on stdin (``SPEEDUP POLICY``),
    one JSON line of :func:`_ours` back per run; traces are loaded once per speed-up."""
    traces: dict[float, list[Any]] = {}
    print(json.dumps({"build": _build()}), flush=True)
    for line in sys.stdin:
        speedup_text, spec = line.rstrip("\n").split(" ", 1)
        speedup = float(speedup_text)
        if speedup not in traces:
            traces[speedup] = load_trace(
                args.trace, speedup=speedup, max_requests=args.max_requests
            )
        policy, config = _config(args, spec)
        print(json.dumps(_ours(traces[speedup], policy, config)), flush=True)


def against_pure(args: argparse.Namespace) -> None:
    if not is_compiled():
        raise SystemExit("--against-pure: this install runs the Python source already")
    root = Path(__file__).resolve().parent
    argv = [sys.executable, str(root / "pure_python.py"), str(Path(__file__).resolve())]
    argv += ["--serve-runs", "--trace", args.trace, "--workers", str(args.workers)]
    argv += ["--tokens-per-block", args.tokens_per_block, "--device-blocks", args.device_blocks]
    argv += ["--events", args.events]
    if args.max_requests is not None:
        argv += ["--max-requests", str(args.max_requests)]
    child = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdin is not None and child.stdout is not None
    pure_build = json.loads(child.stdout.readline())["build"]
    if "pure Python" not in pure_build:
        raise SystemExit(f"--against-pure: the child did not run the source ({pure_build})")

    def pure(speedup: float, spec: str) -> dict[str, float]:
        assert child.stdin is not None and child.stdout is not None
        child.stdin.write(f"{speedup!r} {spec}\n")
        child.stdin.flush()
        line = child.stdout.readline()
        if not line:
            raise SystemExit("--against-pure: the pure-Python child stopped")
        out: dict[str, float] = json.loads(line)
        return out

    print(
        f"trace {args.trace}, {args.workers} workers, {args.tokens_per_block}-token blocks, "
        f"{args.device_blocks} device blocks per worker; {args.repeats} run(s) each, compiled "
        f"and pure alternating; medians"
    )
    print(
        f"{'speedup':>7} {'policy':<24}{'compiled':>9}{'pure':>7}{'ratio':>7}"
        f"{'CPU ratio':>10}  pure / compiled wall per repeat: median (range)"
    )
    try:
        for speedup in (float(x) for x in (args.speedups or "1,4").split(",")):
            requests = load_trace(args.trace, speedup=speedup, max_requests=args.max_requests)
            for spec in args.policies:
                policy, config = _config(args, spec)
                compiled_runs, pure_runs = [], []
                for r in range(args.repeats):
                    # which goes first alternates, so a drifting host hits both alike
                    if r % 2:
                        pure_runs.append(pure(speedup, spec))
                        compiled_runs.append(_ours(requests, policy, config))
                    else:
                        compiled_runs.append(_ours(requests, policy, config))
                        pure_runs.append(pure(speedup, spec))
                    a, b = compiled_runs[-1], pure_runs[-1]
                    same = ("hit", "p50", "p99", "completed")
                    if any(a[k] != b[k] for k in same):
                        raise SystemExit(
                            f"--against-pure: the builds disagree on {spec} at {speedup:g}x: "
                            f"{ {k: a[k] for k in same} } against { {k: b[k] for k in same} }"
                        )
                c, p = _median(compiled_runs), _median(pure_runs)
                pairs = [
                    b["wall"] / a["wall"] for a, b in zip(compiled_runs, pure_runs, strict=True)
                ]
                print(
                    f"{speedup:>7g} {spec:<24}{c['wall']:>9.2f}{p['wall']:>7.2f}"
                    f"{p['wall'] / c['wall']:>7.2f}{p['cpu'] / c['cpu']:>10.2f}"
                    f"  {statistics.median(pairs):.2f} ({min(pairs):.2f}-{max(pairs):.2f})",
                    flush=True,
                )
    finally:
        child.stdin.close()
        child.wait(timeout=60)


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
    parser.add_argument(
        "--against-pure",
        action="store_true",
        help="compare this install's compiled modules with their Python source, run by run",
    )
    parser.add_argument("--serve-runs", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--repeats", type=int, default=1, help="with --against-dynamo or --against-pure"
    )
    parser.add_argument(
        "--events",
        choices=("auto", "on", "off"),
        default="auto",
        help="with --against-dynamo or --against-pure: our event stream (SimConfig.events; auto "
        "leaves it out for policies that never read the index, as Dynamo's round_robin replay "
        "does)",
    )
    args = parser.parse_args()
    if args.serve_runs:
        _serve_runs(args)
        return
    if args.against_pure:
        against_pure(args)
        return
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

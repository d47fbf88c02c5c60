"""``router-sim sweep`` and ``router-sim plan``: the command-line side of sweeps.

The grid comes from the command line (comma-separated lists) or a JSON file (``--grid``) with
the same names (``policies``, ``workers``, ``device_blocks``, ``speedups``, ``rates_per_s``,
``event_delays_ms``, ``seeds``, ``trace`` or ``workload``, ``max_requests``,
``tokens_per_block``, ...); flags given on the command line win over the file.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from events.tools.limits import MAX_SMALL_FILE_BYTES, InputTooLarge, read_bounded_text
from router_sim.run_args import (
    SYNTH_DEVICE_BLOCKS,
    SYNTH_TOKENS_PER_BLOCK,
    TRACE_DEVICE_BLOCKS,
    TRACE_TOKENS_PER_BLOCK,
    check_sweep,
    parse_policies,
    parse_policy_options,
)
from router_sim.sim.simulator import EVENT_MODES
from router_sim.sim.workloads import WORKLOADS
from router_sim.sweep.output import format_table, write_results
from router_sim.sweep.plan import answer, format_plan, plot_plan
from router_sim.sweep.runner import SweepError, SweepResult, SweepSpec, WorkloadSpec, run_sweep

PLAN_WORKERS = "1,2,4,6,8,12,16,24,32"


def _list(kind: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    def parse(text: str) -> list[Any]:
        try:
            values = [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"want a comma-separated list, got {text!r}") from None
        if not values:
            raise argparse.ArgumentTypeError("the list is empty")
        return values

    return parse


def _common(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--trace", help="Mooncake-format .jsonl[.gz] file, or 'mooncake' (bundled)")
    src.add_argument("--workload", choices=sorted(WORKLOADS), help="synthetic workload")
    p.add_argument("--grid", type=Path, help="JSON file with the grid (flags override it)")
    p.add_argument("--max-requests", type=int)
    p.add_argument("--spread-ms", type=float)
    p.add_argument("--policies", type=parse_policies, help="comma-separated, or 'all'")
    p.add_argument("--device-blocks", type=_list(int), help="list of device blocks per worker")
    p.add_argument("--speedups", type=_list(float), help="list of arrival speed-ups (load)")
    p.add_argument("--rates", type=_list(float), help="synthetic only: list of requests/s")
    p.add_argument("--event-delay-ms", type=_list(float), help="list of event delays")
    p.add_argument("--seeds", type=_list(int), help="list of seeds")
    p.add_argument("--tokens-per-block", type=int)
    p.add_argument("--host-blocks", type=int)
    p.add_argument("--max-batch-tokens", type=int)
    p.add_argument("--policy-options", type=parse_policy_options)
    p.add_argument(
        "--events",
        choices=EVENT_MODES,
        help="the KV event stream (as router-sim run --events; default auto: left out for "
        "policies that never read the router's index)",
    )
    p.add_argument("--out", type=Path, required=True, help="results folder (resumes from it)")
    p.add_argument("--jobs", type=int, help="local worker processes (default: all cores)")
    p.add_argument(
        "--ray",
        metavar="auto|ADDRESS|local",
        help="run the points as Ray tasks: join a cluster ('auto' or an address) or start a "
        "local Ray instance ('local'); needs the 'ray' extra",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def add_parsers(sub: Any) -> None:
    """Add ``sweep`` and ``plan`` to the ``router-sim`` subcommands."""
    sweep = sub.add_parser("sweep", help="run a grid of simulations (local processes or Ray)")
    _common(sweep)
    sweep.add_argument("--workers", type=_list(int), help="list of fleet sizes")
    plan = sub.add_parser("plan", help="smallest fleet per policy that meets a TTFT p99 target")
    _common(plan)
    plan.add_argument("--ttft-p99-ms", type=float, required=True, help="the target")
    plan.add_argument(
        "--workers", type=_list(int), help=f"fleet sizes to try (default {PLAN_WORKERS})"
    )


_FILE_KEYS = {
    "trace": str,
    "workload": str,
    "max_requests": int,
    "spread_ms": float,
    "policies": list,
    "workers": list,
    "device_blocks": list,
    "speedups": list,
    "rates_per_s": list,
    "event_delays_ms": list,
    "seeds": list,
    "tokens_per_block": int,
    "host_blocks": int,
    "max_batch_tokens": int,
    "policy_options": dict,
    "events": str,
}
_FLAG_FOR = {"rates_per_s": "rates", "event_delays_ms": "event_delay_ms"}


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    if args.grid is not None:
        try:
            data = json.loads(read_bounded_text(args.grid, "--grid", MAX_SMALL_FILE_BYTES))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, InputTooLarge) as exc:
            raise SweepError(f"cannot read --grid {args.grid}: {exc}") from None
        if not isinstance(data, dict):
            raise SweepError(f"--grid {args.grid}: want a JSON object")
        for key, value in data.items():
            kind = _FILE_KEYS.get(key)
            if kind is None:
                raise SweepError(
                    f"--grid {args.grid}: unknown key {key!r}; use {sorted(_FILE_KEYS)}"
                )
            if kind is float and isinstance(value, int):
                value = float(value)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise SweepError(f"--grid {args.grid}: {key} must be a {kind.__name__}")
            merged[key] = value
    for key in _FILE_KEYS:
        flag = getattr(args, _FLAG_FOR.get(key, key), None)
        if flag is not None:
            merged[key] = flag
    if "trace" in merged and "workload" in merged:
        if args.trace is not None:
            merged.pop("workload")
        elif args.workload is not None:
            merged.pop("trace")
    return merged


def build_spec(args: argparse.Namespace, *, plan: bool = False) -> SweepSpec:
    """The sweep's spec from the flags and the ``--grid`` file."""
    s = _settings(args)
    trace = s.get("trace")
    if plan:
        default_workers = [int(x) for x in PLAN_WORKERS.split(",")]
    else:
        default_workers = [4, 8] if trace is not None else [2, 4]
    workload = WorkloadSpec(
        trace=trace,
        synthetic=None if trace is not None else s.get("workload", "mixed"),
        max_requests=s.get("max_requests"),
        spread_ms=float(s.get("spread_ms", 0.0)),
    )
    is_trace = trace is not None
    policies = s.get("policies", ["round_robin", "kv_overlap"])
    if isinstance(policies, list) and args.grid is not None and args.policies is None:
        policies = parse_policies(",".join(str(p) for p in policies))
    return SweepSpec(
        workload=workload,
        policies=policies,
        workers=[int(x) for x in s.get("workers", default_workers)],
        device_blocks=[
            int(x)
            for x in s.get(
                "device_blocks", [TRACE_DEVICE_BLOCKS if is_trace else SYNTH_DEVICE_BLOCKS]
            )
        ],
        speedups=[float(x) for x in s.get("speedups", [1.0])],
        rates_per_s=[float(x) for x in s["rates_per_s"]] if "rates_per_s" in s else None,
        event_delays_ms=[float(x) for x in s.get("event_delays_ms", [0.0])],
        seeds=[int(x) for x in s.get("seeds", [0])],
        tokens_per_block=int(
            s.get(
                "tokens_per_block", TRACE_TOKENS_PER_BLOCK if is_trace else SYNTH_TOKENS_PER_BLOCK
            )
        ),
        host_blocks=int(s.get("host_blocks", 0)),
        max_batch_tokens=int(s.get("max_batch_tokens", 8192)),
        policy_options=dict(s.get("policy_options", {})),
        events=str(s.get("events", "auto")),
    )


def _run(spec: SweepSpec, args: argparse.Namespace, stderr: TextIO) -> SweepResult:
    from tqdm import tqdm

    with tqdm(total=len(spec.points()), unit="point", file=stderr, disable=args.no_progress) as bar:

        def progress(done: int, total: int) -> None:
            bar.update(done - bar.n)

        result = run_sweep(
            spec,
            args.out,
            jobs=args.jobs,
            ray_address=args.ray,
            use_ray=args.ray is not None,
            progress=progress,
        )
    stderr.write(
        f"router-sim: {result.ran} point(s) run on {result.backend}, "
        f"{result.resumed} already in {args.out}\n"
    )
    return result


def main(
    args: argparse.Namespace, stdout: TextIO | None = None, stderr: TextIO | None = None
) -> int:
    """``router-sim sweep`` / ``router-sim plan``; exit status 2 on a usage error."""
    stdout = sys.stdout if stdout is None else stdout
    stderr = sys.stderr if stderr is None else stderr
    try:
        if args.command == "plan":
            spec = build_spec(args, plan=True)
            if len(spec.speedups) * len(spec.rates_per_s or [0]) > 1 or len(spec.device_blocks) > 1:
                raise SweepError("a plan varies the fleet size only: give one load and one size")
        else:
            spec = build_spec(args)
        check_sweep(spec, args.jobs, getattr(args, "ttft_p99_ms", None))
        args.out.mkdir(parents=True, exist_ok=True)
        result = _run(spec, args, stderr)
    except (SweepError, ValueError, FileNotFoundError, OSError) as exc:
        stderr.write(f"router-sim: {exc}\n")
        return 2
    meta = {"workload": spec.workload.name, "fixed": spec.fixed(), "backend": result.backend}
    if args.command == "plan":
        plans = answer(result, args.ttft_p99_ms)
        stdout.write(format_plan(plans, args.ttft_p99_ms) + "\n")
        meta["ttft_p99_ms"] = args.ttft_p99_ms
        meta["plan"] = {p.policy: p.workers for p in plans}
        paths = write_results(result.rows, args.out, meta) + plot_plan(
            plans, args.ttft_p99_ms, args.out
        )
    else:
        stdout.write(format_table(result.rows) + "\n")
        paths = write_results(result.rows, args.out, meta)
    stdout.write(f"wrote {', '.join(p.name for p in paths)} to {args.out}\n")
    return 0

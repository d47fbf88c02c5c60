"""``router-sim run``: compare routing policies on a trace or a synthetic workload.

With no arguments it runs the built-in ``mixed`` synthetic workload on 4 workers with every
policy (well under a minute). ``--trace mooncake`` runs the bundled Mooncake conversation trace.
The comparison table goes to stdout, a progress bar (tqdm) to stderr, and with ``--out DIR`` the
report (``report.json``, ``report.csv``, ``report.txt``) and plots (with matplotlib).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any, TextIO

from tqdm import tqdm

from events.tools.cli_args import OneLineParser, error_line
from router_sim.run_args import (
    SYNTH_DEVICE_BLOCKS,
    SYNTH_TOKENS_PER_BLOCK,
    SYNTH_WORKERS,
    TRACE_DEVICE_BLOCKS,
    TRACE_TOKENS_PER_BLOCK,
    TRACE_WORKERS,
    check_requests_fit,
    check_run_args,
    kv_groups_arg,
    parse_policies,
    parse_policy_options,
)
from router_sim.sim.bound import compulsory_bound
from router_sim.sim.metrics import PolicySummary
from router_sim.sim.report import build_report, format_table, write_outputs
from router_sim.sim.simulator import ALL_POLICIES, Restart, SimConfig, simulate
from router_sim.sim.trace import load_trace
from router_sim.sim.workloads import WORKLOADS, Request, SyntheticSpec, synthetic_workload
from router_sim.sweep import cli as sweep_cli


def _parse_restart(text: str) -> Restart:
    worker, sep, at = text.partition("@")
    if not sep:
        raise argparse.ArgumentTypeError(f"--restart wants WORKER@MS, got {text!r}")
    try:
        return Restart(worker=int(worker), at_ms=float(at))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--restart wants WORKER@MS, got {text!r}") from None


def build_parser(services: bool = True) -> argparse.ArgumentParser:
    """The whole CLI; ``services=False`` leaves out ``serve`` and ``worker`` (their modules
    load the HTTP stack, ~0.3 s of a short ``run``'s start-up)."""
    parser = OneLineParser(
        prog="router-sim", description="KV-aware routing simulator: policies vs the bound."
    )
    sub = parser.add_subparsers(dest="command")
    run = sub.add_parser("run", help="simulate and compare routing policies")
    src = run.add_mutually_exclusive_group()
    src.add_argument("--trace", help="Mooncake-format .jsonl[.gz] file, or 'mooncake' (bundled)")
    src.add_argument(
        "--workload", choices=sorted(WORKLOADS), help="built-in synthetic workload (default mixed)"
    )
    run.add_argument("--workers", type=int, help="workers (default 4 synthetic, 8 trace)")
    run.add_argument(
        "--policies",
        type=parse_policies,
        default=list(ALL_POLICIES),
        help="comma-separated policy names or 'all' (default all)",
    )
    run.add_argument("--device-blocks", type=int, help="device KV blocks per worker")
    run.add_argument("--host-blocks", type=int, default=0, help="host KV blocks per worker")
    run.add_argument("--tokens-per-block", type=int, help="tokens per KV block")
    run.add_argument(
        "--transport",
        choices=("auto", "memory", "inproc", "tcp"),
        default="auto",
        help="how event frames travel: memory (in process, same codec), or ZeroMQ inproc/tcp "
        "sockets (default auto: memory, inproc with --drop-rate)",
    )
    run.add_argument(
        "--engine",
        default="native",
        help="whose KV events the workers publish: native, vllm, sglang or trtllm (their "
        "hashes, fields and media; the router keys all by token ids)",
    )
    run.add_argument(
        "--kv-groups",
        help="--engine vllm only: the KV-cache groups its workers publish, as a hybrid model's "
        "vLLM does, comma-separated in group order, each full or sliding_window:TOKENS (e.g. "
        "full,sliding_window:4096; default one full-attention group). Every group holds the "
        "blocks its worker holds (the simulated cache has no sliding window)",
    )
    run.add_argument(
        "--events",
        choices=("auto", "on", "off"),
        default="auto",
        help="the KV event stream from workers to the router's index: on, off (only for "
        "policies that never read the index) or auto (default: off for those policies, "
        "unless --drop-rate, --restart or a ZeroMQ --transport asks for it; their wire "
        "columns then show '-')",
    )
    run.add_argument("--event-delay-ms", type=float, default=0.0)
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--max-requests", type=int, help="stop after this many requests")
    run.add_argument("--speedup", type=float, default=1.0, help="divide arrival times by this")
    run.add_argument(
        "--spread-ms",
        type=float,
        default=0.0,
        help="trace only: spread requests sharing a timestamp evenly over this many ms "
        "(Mooncake timestamps come in ~3000 ms buckets)",
    )
    run.add_argument("--max-batch-tokens", type=int, default=8192, help="step token budget")
    run.add_argument("--drop-rate", type=float, default=0.0, help="fraction of frames lost")
    run.add_argument(
        "--restart", type=_parse_restart, action="append", default=[], help="WORKER@MS fault"
    )
    run.add_argument(
        "--policy-options",
        type=parse_policy_options,
        default={},
        help='JSON, e.g. \'{"kv_overlap": {"overlap_weight": 2}}\'',
    )
    run.add_argument("--out", type=Path, help="write report.json/csv/txt and plots here")
    run.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    if services:
        _add_service_parsers(sub)
    sweep_cli.add_parsers(sub)
    return parser


def _add_service_parsers(sub: Any) -> None:
    """``serve`` and ``worker``: the live service, in :mod:`router_sim.service`."""
    from router_sim.service import app, worker_proc

    app.add_parser(sub)
    worker_proc.add_parser(sub)


def _requests(args: argparse.Namespace) -> tuple[list[Request], dict[str, Any]]:
    if args.trace is not None:
        reqs = load_trace(
            args.trace,
            speedup=args.speedup,
            max_requests=args.max_requests,
            spread_ms=args.spread_ms,
        )
        info = {"name": str(args.trace), "source": "trace", "requests": len(reqs)}
        return reqs, {**info, "spread_ms": args.spread_ms, "speedup": args.speedup}
    name = args.workload or "mixed"
    spec = SyntheticSpec()
    if args.max_requests is not None:
        spec.num_requests = args.max_requests
    reqs = synthetic_workload(name, seed=args.seed, spec=spec)
    if args.speedup != 1.0:
        if args.speedup <= 0:  # the trace loader checks its own
            raise ValueError(f"speedup must be > 0, got {args.speedup}")
        for r in reqs:
            r.arrival_ms /= args.speedup
    return reqs, {"name": name, "source": "synthetic", "requests": len(reqs)}


def _given(value: int | None, default: int) -> int:
    # not ``value or default``: an explicit 0 must reach the config's check, not become the default
    return default if value is None else value


def run(args: argparse.Namespace, stdout: TextIO, stderr: TextIO, *, exiting: bool = False) -> int:
    """``router-sim run``; ``exiting``: the process ends when this returns (then its last
    simulation's objects are left to the exit: see :func:`router_sim.sim.simulator.simulate`)."""
    check_run_args(args)  # every flag and --out, before any work (router_sim.run_args)
    trace = args.trace is not None
    tpb = _given(args.tokens_per_block, TRACE_TOKENS_PER_BLOCK if trace else SYNTH_TOKENS_PER_BLOCK)
    config = SimConfig(
        workers=_given(args.workers, TRACE_WORKERS if trace else SYNTH_WORKERS),
        tokens_per_block=tpb,
        device_blocks=_given(
            args.device_blocks, TRACE_DEVICE_BLOCKS if trace else SYNTH_DEVICE_BLOCKS
        ),
        host_blocks=args.host_blocks,
        max_batch_tokens=args.max_batch_tokens,
        transport=args.transport,
        event_delay_ms=args.event_delay_ms,
        seed=args.seed,
        drop_rate=args.drop_rate,
        restarts=list(args.restart),
        policy_options=dict(args.policy_options),
        engine=args.engine,
        kv_groups=kv_groups_arg(args),
        events=args.events,
    )
    if args.out is not None:
        try:  # before the runs, not after them
            args.out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            stderr.write(f"router-sim: cannot create --out {args.out}: {exc.strerror}\n")
            return 2
    requests, workload = _requests(args)
    if not requests:
        stderr.write("router-sim: the workload has no requests\n")
        return 2
    check_requests_fit(requests, tpb, config.device_blocks)  # else every request is dropped
    bound = compulsory_bound(requests, tpb)
    summaries: dict[str, PolicySummary] = {}
    for name in args.policies:
        # a router-sim process leaves its last run's objects to its exit (see simulate)
        last = exiting and name == args.policies[-1]
        if args.no_progress:  # no bar at all: a disabled tqdm still starts its monitor thread
            summaries[name] = simulate(requests, name, config, exit_after=last)
            continue
        with tqdm(
            total=len(requests),
            desc=f"{name:<14}",
            unit="req",
            file=stderr,
            disable=args.no_progress,
            mininterval=0.2,
        ) as bar:

            def advance(done: int, total: int, bar: tqdm[Any] = bar) -> None:
                bar.update(done - bar.n)

            summaries[name] = simulate(requests, name, config, advance, exit_after=last)
    cfg = {f.name: getattr(config, f.name) for f in fields(config)}
    cfg["restarts"] = [[r.worker, r.at_ms] for r in config.restarts]
    cfg["policy_options"] = config.policy_options
    report = build_report(workload, bound, summaries, cfg)
    stdout.write(format_table(report) + "\n")
    if args.out is not None:
        paths = write_outputs(report, summaries, args.out)
        if not any(p.suffix == ".png" for p in paths):
            stderr.write("router-sim: matplotlib not installed; plots skipped\n")
        stdout.write(f"wrote {', '.join(p.name for p in paths)} to {args.out}\n")
    return 0


_LOCAL_COMMANDS = ("run", "sweep", "plan")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``router-sim`` (and ``python -m router_sim``)."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    if not args_list or (args_list[0].startswith("-") and args_list[0] not in ("-h", "--help")):
        args_list.insert(0, "run")  # bare ``router-sim`` means ``router-sim run``
    # a command that is not a service's parses without the service modules loaded
    parser = build_parser(services=args_list[0] not in _LOCAL_COMMANDS)
    args = parser.parse_args(args_list)
    if args.command in ("sweep", "plan"):
        return sweep_cli.main(args)
    if args.command in ("serve", "worker"):
        from router_sim.service import app, worker_proc

        return app.main(args) if args.command == "serve" else worker_proc.main(args)
    try:
        # argv None: this is the router-sim process itself (tests and embedders pass argv)
        return run(args, sys.stdout, sys.stderr, exiting=argv is None)
    except (ValueError, FileNotFoundError) as exc:
        sys.stderr.write(error_line(f"router-sim: {exc}"))
        return 2


if __name__ == "__main__":
    raise SystemExit(main())

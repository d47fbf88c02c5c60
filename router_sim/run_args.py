"""Up-front checks of ``router-sim run``'s flags and output folder.

Every number is checked for type, finiteness and a sane upper bound before a single request is
simulated: ``--workers 100000`` used to hang building the fleet, ``--device-blocks 1e10`` raised
``MemoryError``, ``--max-requests 10**12`` hung generating a synthetic workload, ``nan`` in a
float flag produced a table of NaN (or, for ``--event-delay-ms``, a run that never applied an
event), and a directory named ``report.json`` in ``--out`` was found only after the whole run.
Violations raise :class:`~events.tools.cli_args.ArgError` (a ``ValueError``): ``router-sim`` prints
it as one line and exits 2.
"""

from __future__ import annotations

import argparse
import inspect
import math
import os
import tempfile
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from events.tools.cli_args import MAX_BLOCK_TOKENS, ArgError, check_float, check_int, loads_json
from router_sim.router.policies import POLICIES, make_policy
from router_sim.sim.dialects import ENGINES, KvGroup, parse_kv_groups
from router_sim.sim.simulator import ALL_POLICIES, needs_event_stream
from router_sim.sim.simulator import check_events as check_events_setting

if TYPE_CHECKING:
    from router_sim.sim.workloads import Request
    from router_sim.sweep.runner import SweepSpec

MAX_WORKERS: Final = 4096
MAX_BLOCKS_PER_WORKER: Final = 2**31
MAX_FLEET_BLOCKS: Final = 2**26
"""Device plus host blocks over the whole fleet: about 45 bytes of simulator state each
(measured: 2**24 blocks on one worker peak at 0.73 GB), so about 3 GB at the bound."""
MAX_BATCH_TOKENS: Final = 2**24
MAX_SYNTHETIC_REQUESTS: Final = 1_000_000
"""A synthetic workload is generated in memory up front; a trace stops at its last line."""
MAX_TRACE_REQUESTS: Final = 100_000_000
MAX_SEED: Final = 2**63 - 1
MAX_MS: Final = 1e12
"""Longest simulated time a flag may name (about 31 years)."""
MAX_SPEEDUP: Final = 1e6
OUTPUT_NAMES: Final = (
    "report.json",
    "report.csv",
    "report.txt",
    "hit_rate.png",
    "ttft_cdf.png",
    "load_per_worker.png",
)
"""What ``router-sim run --out`` writes (router_sim.sim.report.write_outputs)."""


def check_run_args(args: argparse.Namespace) -> None:
    """Raise :class:`ArgError` for the first flag of ``router-sim run`` out of range."""
    check_int("--workers", args.workers, 1, MAX_WORKERS)
    check_int("--device-blocks", args.device_blocks, 1, MAX_BLOCKS_PER_WORKER)
    check_int("--host-blocks", args.host_blocks, 0, MAX_BLOCKS_PER_WORKER)
    check_int("--tokens-per-block", args.tokens_per_block, 1, MAX_BLOCK_TOKENS)
    check_int("--seed", args.seed, 0, MAX_SEED)
    check_int("--max-batch-tokens", args.max_batch_tokens, 1, MAX_BATCH_TOKENS)
    most = MAX_TRACE_REQUESTS if args.trace is not None else MAX_SYNTHETIC_REQUESTS
    check_int("--max-requests", args.max_requests, 1, most)
    check_float("--event-delay-ms", args.event_delay_ms, 0.0, MAX_MS)
    check_float("--speedup", args.speedup, 1.0 / MAX_SPEEDUP, MAX_SPEEDUP)
    check_float("--spread-ms", args.spread_ms, 0.0, MAX_MS)
    check_float("--drop-rate", args.drop_rate, 0.0, 0.99)
    engine = getattr(args, "engine", "native")
    if engine not in ENGINES:
        raise ArgError(f"--engine must be one of {', '.join(ENGINES)}; got {engine!r}")
    kv_groups_arg(args)
    for restart in args.restart:
        check_int("--restart worker", restart.worker, 0, MAX_WORKERS - 1)
        check_float("--restart time", restart.at_ms, 0.0, MAX_MS)
    workers = args.workers if args.workers is not None else 1
    blocks = (args.device_blocks or 0) + (args.host_blocks or 0)
    if workers * blocks > MAX_FLEET_BLOCKS:
        raise ArgError(
            f"{workers} workers x {blocks} blocks = {workers * blocks} KV blocks exceeds the "
            f"simulator's limit of {MAX_FLEET_BLOCKS} (about 3 GB); lower --workers, "
            "--device-blocks or --host-blocks"
        )
    for name, options in args.policy_options.items():
        check_policy_options(name, options)
    check_events(args)
    if args.out is not None:
        check_out_dir(args.out)


def kv_groups_arg(args: argparse.Namespace) -> tuple[KvGroup, ...] | None:
    """``--kv-groups`` parsed (None when not given); :class:`ArgError` for a malformed value
    or an engine other than vLLM."""
    text = getattr(args, "kv_groups", None)
    if text is None:
        return None
    engine = getattr(args, "engine", "native")
    if engine != "vllm":
        raise ArgError(
            f"--kv-groups needs --engine vllm (KV-cache groups are vLLM's); got --engine {engine}"
        )
    try:
        return parse_kv_groups(text)
    except ValueError as exc:
        raise ArgError(str(exc)) from None


def check_events(args: argparse.Namespace) -> None:
    """``--events off`` only for policies that never read the router's index, and not with
    what exercises the event stream (``SimConfig.events``)."""
    needs = needs_event_stream(args.drop_rate, bool(args.restart), args.transport)
    try:
        check_events_setting(
            getattr(args, "events", "auto"),
            args.policies,
            needs,
            "--drop-rate, --restart and --transport inproc/tcp",
        )
    except ValueError as exc:
        raise ArgError(f"--{exc}") from None


def _optional_number(policy: Any, key: str) -> bool:
    """Whether ``policy``'s option ``key`` is declared ``float | None`` (a number or off)."""
    try:
        hint = typing.get_type_hints(policy.__init__).get(key)
    except (NameError, TypeError):  # pragma: no cover - an annotation that does not resolve
        return False
    args = set(typing.get_args(hint))
    return type(None) in args and float in args


def check_requests_fit(
    requests: Sequence[Request], tokens_per_block: int, device_blocks: int
) -> int:
    """How many of ``requests`` fit a worker's device tier alone: the prompt and the output
    in at most ``device_blocks`` blocks (a worker drops, with a warning, any request that
    does not: ``router_sim.sim.worker``'s admission rule). :class:`ArgError` when none does:
    the run would drop them all and print a table of nothing."""
    needs = [-(-(r.input_length + r.output_length) // tokens_per_block) for r in requests]
    fits = sum(1 for n in needs if n <= device_blocks)
    if needs and not fits:
        raise ArgError(
            f"every one of the {len(needs)} requests needs more KV than the device tier "
            f"({device_blocks} blocks of {tokens_per_block} tokens; they need {min(needs)} "
            f"to {max(needs)}), so all would be dropped: raise --device-blocks or "
            "--tokens-per-block"
        )
    return fits


def check_policy_options(name: str, options: dict[str, Any]) -> None:
    """Each option has the type of the policy's default for it, is finite, and the policy
    accepts the set (its constructor's own range checks run here, before any run)."""
    params = inspect.signature(POLICIES[name]).parameters
    for key, value in options.items():
        param = params.get(key)
        if param is None:
            raise ArgError(f"--policy-options: {name!r} takes no option {key!r}")
        default = param.default
        # an option declared ``float | None`` (balance): null turns it off, a number sets it,
        # whether it is on or off by default
        optional = _optional_number(POLICIES[name], key)
        if value is None and optional:
            continue
        if isinstance(default, bool):
            ok = isinstance(value, bool)
        elif isinstance(default, int):
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif optional or isinstance(default, float):
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            ok = ok and math.isfinite(value)
            default = 0.0 if default is None else default  # the message below wants a number
        elif isinstance(default, str):
            ok = isinstance(value, str)
        else:
            raise ArgError(f"--policy-options: {name}.{key} cannot be set from the command line")
        if not ok:
            raise ArgError(
                f"--policy-options: {name}.{key} wants a finite {type(default).__name__} "
                f"like {default!r}, got {value!r}"
            )
    try:
        make_policy(name, **options)
    except (TypeError, ValueError) as exc:
        raise ArgError(f"--policy-options: {exc}") from None


def check_out_dir(out: Path) -> None:
    """``out`` is (or can be made) a writable folder whose report names are free for files.

    Made here, before the runs: a folder that cannot be written used to surface as a traceback
    after the last policy had run.
    """
    if out.exists() and not out.is_dir():
        raise ArgError(f"--out {out} exists and is not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".router-sim-check-"):
            pass
    except OSError as exc:
        raise ArgError(f"cannot create --out {out}: {exc.strerror or exc}") from None
    for name in OUTPUT_NAMES:
        path = out / name
        if path.exists() and (not path.is_file() or not os.access(path, os.W_OK)):
            raise ArgError(f"--out {out}: {name} exists and is not a writable file")


MAX_SWEEP_POINTS: Final = 100_000
MAX_JOBS: Final = 256


def check_sweep(spec: SweepSpec, jobs: int | None, ttft_p99_ms: float | None = None) -> None:
    """Raise :class:`ArgError` for the first value of a ``router-sim sweep`` / ``plan`` grid
    out of range: the same bounds as ``router-sim run``, for every value of every list."""
    for w in spec.workers:
        check_int("--workers", w, 1, MAX_WORKERS)
    for b in spec.device_blocks:
        check_int("--device-blocks", b, 1, MAX_BLOCKS_PER_WORKER)
        if max(spec.workers) * (b + spec.host_blocks) > MAX_FLEET_BLOCKS:
            raise ArgError(
                f"{max(spec.workers)} workers x {b + spec.host_blocks} blocks exceeds the "
                f"simulator's limit of {MAX_FLEET_BLOCKS} KV blocks per run (about 3 GB)"
            )
    check_int("--host-blocks", spec.host_blocks, 0, MAX_BLOCKS_PER_WORKER)
    check_int("--tokens-per-block", spec.tokens_per_block, 1, MAX_BLOCK_TOKENS)
    check_int("--max-batch-tokens", spec.max_batch_tokens, 1, MAX_BATCH_TOKENS)
    for s in spec.speedups:
        check_float("--speedups", s, 1.0 / MAX_SPEEDUP, MAX_SPEEDUP)
    for r in spec.rates_per_s or []:
        check_float("--rates", r, 0.0, 1e6, low_open=True)
    for d in spec.event_delays_ms:
        check_float("--event-delay-ms", d, 0.0, MAX_MS)
    for seed in spec.seeds:
        check_int("--seeds", seed, 0, MAX_SEED)
    workload = spec.workload
    most = MAX_TRACE_REQUESTS if workload.trace is not None else MAX_SYNTHETIC_REQUESTS
    check_int("--max-requests", workload.max_requests, 1, most)
    check_float("--spread-ms", workload.spread_ms, 0.0, MAX_MS)
    for name, options in spec.policy_options.items():
        check_policy_options(name, options)
    check_int("--jobs", jobs, 1, MAX_JOBS)
    check_float("--ttft-p99-ms", ttft_p99_ms, 0.0, MAX_MS, low_open=True)
    points = len(spec.points())
    if points > MAX_SWEEP_POINTS:
        raise ArgError(f"the grid has {points} points; at most {MAX_SWEEP_POINTS} per sweep")


# Trace defaults: Mooncake hash ids cover 512 tokens, so 512-token blocks keep one radix node
# per id (64 gives the same hit rates on this trace but 8x the blocks and events); 65536
# device blocks per worker (33.5M tokens) hold the working set of the whole trace.
TRACE_TOKENS_PER_BLOCK = 512
TRACE_DEVICE_BLOCKS = 65536
TRACE_WORKERS = 8
SYNTH_TOKENS_PER_BLOCK = 32
SYNTH_DEVICE_BLOCKS = 2048
SYNTH_WORKERS = 4


def parse_policies(text: str) -> list[str]:
    if text == "all":
        return list(ALL_POLICIES)
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in POLICIES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown policies {unknown}; choose from {sorted(POLICIES)} or 'all'"
        )
    return names


def parse_policy_options(text: str) -> dict[str, dict[str, Any]]:
    try:  # no NaN/Infinity, no RecursionError on deep nesting
        options = loads_json(text, "--policy-options")
    except ArgError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not isinstance(options, dict) or not all(isinstance(v, dict) for v in options.values()):
        raise argparse.ArgumentTypeError(
            f'want an object of objects, e.g. {{"kv_overlap": {{"overlap_weight": 2}}}}; got {text}'
        )
    for name, opts in options.items():
        factory = POLICIES.get(name)
        if factory is None:
            raise argparse.ArgumentTypeError(
                f"unknown policy {name!r}; choose from {sorted(POLICIES)}"
            )
        try:  # catch an unknown option here, not as a traceback once the run has begun
            inspect.signature(factory).bind_partial(**opts)
        except TypeError as exc:
            raise argparse.ArgumentTypeError(f"bad options for {name!r}: {exc}") from None
    return options

"""The sweep runner: one simulation per point of a grid, in parallel, resumable.

A :class:`SweepSpec` names a workload (a trace or a synthetic generator) and the axes of the
grid: policies, fleet sizes, device blocks per worker, load (trace speed-up, or request rate for
a synthetic workload), event delay and seeds. Each point is an ordinary :func:`simulate` run, so
a point's row holds exactly the figures ``router-sim run`` would report for it.

Points run in worker processes of this machine by default, or as Ray tasks on a cluster
(``ray`` is an optional extra; Ray does the distribution, nothing here re-implements it). Every
finished point is appended at once to ``points.jsonl`` in the output folder, keyed by
everything that defines it, so an interrupted sweep started again with the same spec skips the
points already there and runs only the rest. The results then go to ``sweep.json``,
``sweep.csv`` and plots of hit rate and TTFT against load per policy
(:mod:`router_sim.sweep.output`).
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import json
import multiprocessing
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Final

from router_sim.sim.bound import compulsory_bound
from router_sim.sim.simulator import SimConfig, check_events, simulate
from router_sim.sim.trace import load_trace
from router_sim.sim.workloads import WORKLOADS, Request, SyntheticSpec, synthetic_workload

POINTS_FILE: Final = "points.jsonl"

ROW_METRICS: Final[tuple[str, ...]] = (
    "hit_rate",
    "ttft_p50_ms",
    "ttft_p90_ms",
    "ttft_p99_ms",
    "e2e_p50_ms",
    "e2e_p99_ms",
    "throughput_tok_s",
    "load_max_over_mean",
    "busy_max_over_mean",
    "locality_given_up",
    "preemptions",
    "completed",
    "requests",
    "wire_events",
    "wire_bytes",
    "events",
    "decision_us_p50",
    "wall_s",
)
"""The run figures each row keeps (scalars of :meth:`PolicySummary.as_dict`)."""


class SweepError(ValueError):
    """The sweep's spec or backend cannot work; the message says what to change."""


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """What every point simulates: a trace (path or ``mooncake``) or a synthetic workload."""

    trace: str | None = None
    synthetic: str | None = None
    max_requests: int | None = None
    spread_ms: float = 0.0

    def __post_init__(self) -> None:
        if (self.trace is None) == (self.synthetic is None):
            raise SweepError("give either a trace or a synthetic workload")
        if self.synthetic is not None and self.synthetic not in WORKLOADS:
            raise SweepError(
                f"unknown workload {self.synthetic!r}; choose from {sorted(WORKLOADS)}"
            )

    @property
    def name(self) -> str:
        return self.trace if self.trace is not None else f"synthetic:{self.synthetic}"


@dataclass(slots=True)
class SweepSpec:
    """The grid: every combination of the list-valued fields is one point."""

    workload: WorkloadSpec
    policies: list[str]
    workers: list[int]
    device_blocks: list[int]
    speedups: list[float] = field(default_factory=lambda: [1.0])
    rates_per_s: list[float] | None = None
    """Synthetic workloads only: Poisson arrival rates (requests/s), instead of speed-ups."""
    event_delays_ms: list[float] = field(default_factory=lambda: [0.0])
    seeds: list[int] = field(default_factory=lambda: [0])
    tokens_per_block: int = 32
    host_blocks: int = 0
    max_batch_tokens: int = 8192
    policy_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    events: str = "auto"
    """``SimConfig.events`` of every point."""

    def __post_init__(self) -> None:
        for name in ("policies", "workers", "device_blocks", "speedups", "event_delays_ms"):
            if not getattr(self, name):
                raise SweepError(f"the sweep's {name} list is empty")
        if self.rates_per_s is not None and self.workload.synthetic is None:
            raise SweepError(
                "request rates apply to synthetic workloads; use speed-ups for a trace"
            )
        if any(s <= 0 for s in self.speedups) or any(r <= 0 for r in self.rates_per_s or []):
            raise SweepError("speed-ups and rates must be > 0")
        try:
            check_events(self.events, self.policies, False)  # sweeps inject no faults
        except ValueError as exc:
            raise SweepError(str(exc)) from None

    def fixed(self) -> dict[str, Any]:
        """Everything that is the same for every point (part of each point's key)."""
        return {
            "workload": asdict(self.workload),
            "tokens_per_block": self.tokens_per_block,
            "host_blocks": self.host_blocks,
            "max_batch_tokens": self.max_batch_tokens,
            "policy_options": self.policy_options,
            # only when set: the points of a sweep made before this setting keep their keys
            **({"events": self.events} if self.events != "auto" else {}),
        }

    def points(self) -> list[dict[str, Any]]:
        """The grid's points in a stable order (policy varies fastest)."""
        loads: list[tuple[str, float]] = (
            [("rate_per_s", r) for r in self.rates_per_s]
            if self.rates_per_s is not None
            else [("speedup", s) for s in self.speedups]
        )
        out = []
        for seed, delay, blocks, workers, (load_name, load), policy in itertools.product(
            self.seeds,
            self.event_delays_ms,
            self.device_blocks,
            self.workers,
            loads,
            self.policies,
        ):
            out.append(
                {
                    "policy": policy,
                    "workers": workers,
                    "device_blocks": blocks,
                    load_name: load,
                    "event_delay_ms": delay,
                    "seed": seed,
                }
            )
        return out

    def key(self, point: dict[str, Any]) -> str:
        """The identity of a point's result: the point and the fixed settings."""
        return json.dumps({"fixed": self.fixed(), "point": point}, sort_keys=True)


@lru_cache(maxsize=8)
def _requests(
    workload: WorkloadSpec, speedup: float, rate: float | None, seed: int
) -> tuple[Request, ...]:
    if workload.trace is not None:
        reqs = load_trace(
            workload.trace,
            speedup=speedup,
            max_requests=workload.max_requests,
            spread_ms=workload.spread_ms,
        )
        return tuple(reqs)
    assert workload.synthetic is not None
    spec = SyntheticSpec()
    if workload.max_requests is not None:
        spec.num_requests = workload.max_requests
    if rate is not None:
        spec.rate_per_s = rate
    reqs = synthetic_workload(workload.synthetic, seed=seed, spec=spec)
    for r in reqs:
        r.arrival_ms /= speedup
    return tuple(reqs)


@lru_cache(maxsize=8)
def _bound(workload: WorkloadSpec, rate: float | None, seed: int, tokens_per_block: int) -> float:
    # arrival times do not change the bound: compute it once per request set
    return compulsory_bound(
        list(_requests(workload, 1.0, rate, seed)), tokens_per_block
    ).token_hit_rate


def point_config(spec: SweepSpec, point: dict[str, Any]) -> SimConfig:
    """The :class:`SimConfig` of one point."""
    return SimConfig(
        workers=point["workers"],
        tokens_per_block=spec.tokens_per_block,
        device_blocks=point["device_blocks"],
        host_blocks=spec.host_blocks,
        max_batch_tokens=spec.max_batch_tokens,
        event_delay_ms=point["event_delay_ms"],
        seed=point["seed"],
        policy_options=spec.policy_options,
        events=spec.events,
    )


def run_point(spec: SweepSpec, point: dict[str, Any]) -> dict[str, Any]:
    """Simulate one point; its row: the point, the workload's bound and the run's figures.

    A plain top-level function of picklable arguments, so that a process pool or a Ray task
    can run it anywhere the package is installed.
    """
    speedup = float(point.get("speedup", 1.0))
    rate = point.get("rate_per_s")
    # a trace does not depend on the seed: share one loaded copy between seeds
    seed = point["seed"] if spec.workload.synthetic is not None else 0
    reqs = list(_requests(spec.workload, speedup, rate, seed))
    figures: Mapping[str, object] = simulate(
        reqs, point["policy"], point_config(spec, point)
    ).as_dict()
    row = dict(point)
    row["bound"] = _bound(spec.workload, rate, seed, spec.tokens_per_block)
    for name in ROW_METRICS:
        row[name] = figures[name]
    return row


# ------------------------------------------------------------------------ bookkeeping


def read_done(out_dir: Path, spec: SweepSpec) -> dict[str, dict[str, Any]]:
    """Rows already in ``points.jsonl`` for this spec, by key (a torn last line is ignored)."""
    path = out_dir / POINTS_FILE
    done: dict[str, dict[str, Any]] = {}
    if not path.exists():
        return done
    wanted = {spec.key(p) for p in spec.points()}
    with path.open(encoding="utf-8") as f:
        for line in f:
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue  # the write an interruption cut short: that point runs again
            if isinstance(entry, dict) and entry.get("key") in wanted:
                done[entry["key"]] = entry["row"]
    return done


def _end_torn_line(out_dir: Path) -> None:
    """Close a last line an interruption cut short, so the next entry starts on its own."""
    path = out_dir / POINTS_FILE
    if not path.exists() or path.stat().st_size == 0:
        return
    with path.open("rb+") as f:
        f.seek(-1, os.SEEK_END)
        if f.read(1) != b"\n":
            f.write(b"\n")


def _append(out_dir: Path, key: str, row: dict[str, Any]) -> None:
    with (out_dir / POINTS_FILE).open("a", encoding="utf-8") as f:
        f.write(json.dumps({"key": key, "row": row}) + "\n")
        f.flush()
        os.fsync(f.fileno())


# --------------------------------------------------------------------------- backends


def _local(
    spec: SweepSpec, todo: list[dict[str, Any]], jobs: int
) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    if jobs <= 1:
        for point in todo:
            yield point, run_point(spec, point)
        return
    # spawn: a clean interpreter per worker (no inherited sockets or threads)
    ctx = multiprocessing.get_context("spawn")
    with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        futures = {pool.submit(run_point, spec, p): p for p in todo}
        try:
            for fut in cf.as_completed(futures):
                yield futures[fut], fut.result()
        except BaseException:
            for fut in futures:
                fut.cancel()
            raise


def _ray(
    spec: SweepSpec, todo: list[dict[str, Any]], address: str | None
) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    try:
        import ray
    except ImportError:
        raise SweepError(
            "--ray needs Ray: pip install 'scoped-kv-router[ray]' (or run without --ray on "
            "local processes)"
        ) from None
    if not ray.is_initialized():
        # "local" starts a Ray instance on this machine; "auto" or an address joins a cluster
        ray.init(address=None if address in (None, "local") else address)
    task = ray.remote(num_cpus=1)(run_point)
    spec_ref = ray.put(spec)
    pending = {task.remote(spec_ref, p): p for p in todo}
    try:
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            for ref in ready:
                yield pending.pop(ref), ray.get(ref)
    except BaseException:
        for ref in pending:
            ray.cancel(ref)
        raise


@dataclass(slots=True)
class SweepResult:
    """Rows in grid order, and how many points this call ran (the rest were resumed)."""

    rows: list[dict[str, Any]]
    ran: int
    resumed: int
    backend: str


def run_sweep(
    spec: SweepSpec,
    out_dir: Path,
    *,
    jobs: int | None = None,
    ray_address: str | None = None,
    use_ray: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> SweepResult:
    """Run every point of ``spec`` not yet in ``out_dir``; returns all rows in grid order.

    ``progress(done, total)`` is called after each point, counting resumed points as done.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    points = spec.points()
    _end_torn_line(out_dir)
    done = read_done(out_dir, spec)
    todo = [p for p in points if spec.key(p) not in done]
    total, finished = len(points), len(points) - len(todo)
    if progress is not None:
        progress(finished, total)
    if use_ray:
        backend = f"ray ({ray_address or 'local'})"
        results = _ray(spec, todo, ray_address)
    else:
        n = max(1, min(jobs if jobs is not None else (os.cpu_count() or 1), len(todo) or 1))
        backend = f"local processes ({n})" if n > 1 else "this process"
        results = _local(spec, todo, n)
    ran = 0
    for point, row in results:
        key = spec.key(point)
        _append(out_dir, key, row)
        done[key] = row
        ran += 1
        if progress is not None:
            progress(finished + ran, total)
    rows = [done[spec.key(p)] for p in points]
    return SweepResult(rows=rows, ran=ran, resumed=total - ran, backend=backend)

"""Sweeps and capacity plans: many simulations over a grid, on local processes or Ray.

- :mod:`router_sim.sweep.runner`: the grid (:class:`SweepSpec`), one point's run, the local and
  Ray backends, resuming from ``points.jsonl``;
- :mod:`router_sim.sweep.output`: table, ``sweep.json``, ``sweep.csv`` and plots;
- :mod:`router_sim.sweep.plan`: the smallest fleet per policy that meets a TTFT p99 target;
- :mod:`router_sim.sweep.cli`: ``router-sim sweep`` and ``router-sim plan``.
"""

from router_sim.sweep.runner import (
    SweepError,
    SweepResult,
    SweepSpec,
    WorkloadSpec,
    run_point,
    run_sweep,
)

__all__ = ["SweepError", "SweepResult", "SweepSpec", "WorkloadSpec", "run_point", "run_sweep"]

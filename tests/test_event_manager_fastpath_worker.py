"""Every stretch of pure decoding the worker takes in one go has exactly its defined length.

``SimWorker._fast_forward_steps`` bounds a stretch by the fewest tokens any decoding request
has left to generate or room for in its pages, and by the deadline. Every stretch must be
exactly what that definition gives, computed here from the running requests themselves: longer
would skip a completion or a page boundary, shorter would only cost steps, which the
step-by-step comparison in test_sim cannot see.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

import router_sim.sim.simulator
from router_sim.sim.simulator import Restart, SimConfig, simulate
from router_sim.sim.worker import SimWorker
from router_sim.sim.workloads import SyntheticSpec, synthetic_workload


def _reference_steps(worker: SimWorker, dt: float, t_ms: float) -> int:
    """The stretch by its definition, from the running requests that decode."""
    k = math.ceil((t_ms - worker.clock_ms) / dt) if math.isfinite(t_ms) else 1 << 62
    for s in worker.running:
        if not s.decoding:
            continue
        req = s.req
        k = min(k, req.output_length - s.generated)
        k = min(k, s.cap - (req.input_length + s.generated))
    return max(1, k)


def _checked_worker(stretches: list[int]) -> type[SimWorker]:
    class Checked(SimWorker):
        def _fast_forward_steps(self, decodes: list[Any], dt: float, t_ms: float) -> int:
            k = super()._fast_forward_steps(decodes, dt, t_ms)
            assert k == _reference_steps(self, dt, t_ms)
            stretches.append(k)
            return k

    return Checked


@pytest.mark.pure
@pytest.mark.parametrize(
    "extra",
    [
        {"device_blocks": 220},
        {"device_blocks": 90, "host_blocks": 200},  # preemptions while pages run out
        {"device_blocks": 220, "restarts": [Restart(0, 1500.0)]},
    ],
)
def test_every_stretch_of_decoding_is_the_defined_length(
    monkeypatch: pytest.MonkeyPatch, extra: dict[str, Any]
) -> None:
    stretches: list[int] = []
    monkeypatch.setattr(router_sim.sim.simulator, "SimWorker", _checked_worker(stretches))
    reqs = synthetic_workload("mixed", seed=7, spec=SyntheticSpec(num_requests=80, rate_per_s=40))
    run = simulate(reqs, "kv_overlap", SimConfig(workers=2, tokens_per_block=16, **extra))
    # the runs take stretches both longer than a step and cut short by a bound
    assert len(stretches) > 50
    assert max(stretches) > 1 and stretches.count(1) > 0
    if extra["device_blocks"] < 100:
        assert sum(r.preemptions for r in run.records) > 0

"""How long one engine step of a simulated worker takes (pluggable).

A step of continuous batching runs some prefill tokens (chunks of prompts) and one decode token
for every decoding request. :class:`StepTiming` turns that into milliseconds. The default,
:class:`MixedStepTiming`, adds the prefill time of the step's new tokens and one decode
iteration time, both from a :class:`router_sim.router.load.TimingModel`; its default is
:class:`router_sim.sim.timing_model.PolynomialTiming`, whose coefficients come from NVIDIA Dynamo's
mocker engine: prefill_ms = 4.21e-7 T^2 + 0.01518 T + 16.5 (T = new tokens in the step) and
decode_ms = max(1, -25.74 p^2 + 54.01 p + 5.74) (p = KV usage).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final, Protocol

from router_sim.router.load import TimingModel
from router_sim.sim.timing_model import PolynomialTiming

MIN_DECODE_MS: Final = 1.0
"""Floor of a decode iteration (the Dynamo mocker clamps its fit at 1 ms)."""


class StepTiming(Protocol):
    """Duration of one engine step."""

    def step_ms(self, prefill_tokens: int, decode_requests: int, kv_usage: float) -> float:
        """Milliseconds of a step computing ``prefill_tokens`` new prompt tokens and one token
        for each of ``decode_requests`` decoding requests, at device KV usage ``kv_usage``."""
        ...


@dataclass(frozen=True, slots=True)
class MixedStepTiming:
    """Prefill time of the step's new tokens plus one decode iteration when anything decodes."""

    model: TimingModel = field(default_factory=PolynomialTiming)

    def step_ms(self, prefill_tokens: int, decode_requests: int, kv_usage: float) -> float:
        ms = self.model.prefill_ms(prefill_tokens) if prefill_tokens > 0 else 0.0
        if decode_requests > 0:
            ms += max(MIN_DECODE_MS, self.model.decode_ms(kv_usage))
        return ms


@dataclass(frozen=True, slots=True)
class ConstantStepTiming:
    """Fixed costs (for tests and back-of-envelope runs): per prefill token and per step."""

    ms_per_prefill_token: float = 0.01
    decode_step_ms: float = 10.0

    def step_ms(self, prefill_tokens: int, decode_requests: int, kv_usage: float) -> float:
        ms = self.ms_per_prefill_token * prefill_tokens
        if decode_requests > 0:
            ms += self.decode_step_ms
        return ms


def default_step_timing(speedup: float = 1.0) -> MixedStepTiming:
    """The Dynamo-mocker polynomials, every time divided by ``speedup``."""
    return MixedStepTiming(PolynomialTiming(speedup=speedup))

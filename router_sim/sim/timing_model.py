"""The default timing model: polynomial fits of prefill and decode iteration time.

Coefficients come from NVIDIA Dynamo's mocker engine (its performance model for a mock vLLM
worker): prefill time quadratic in the number of new tokens, decode time quadratic in the
fraction of KV cache in use. They describe one particular GPU and model; pass your own
coefficients to model another.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

# prefill_ms = a*T^2 + b*T + c, T = new prompt tokens in the batch (Dynamo mocker fit).
DEFAULT_PREFILL_COEFFS: Final[tuple[float, float, float]] = (4.21e-7, 0.01518, 16.5)
# decode_ms = a*u^2 + b*u + c, u = fraction of KV cache in use (Dynamo mocker fit).
DEFAULT_DECODE_COEFFS: Final[tuple[float, float, float]] = (-25.74, 54.01, 5.74)


@dataclass(frozen=True, slots=True)
class PolynomialTiming:
    """A :class:`router_sim.router.load.TimingModel` made of two quadratics.

    ``speedup`` divides every time (a faster GPU, or a simulation run faster than real time).
    """

    prefill_coeffs: tuple[float, float, float] = DEFAULT_PREFILL_COEFFS
    decode_coeffs: tuple[float, float, float] = DEFAULT_DECODE_COEFFS
    speedup: float = 1.0

    def __post_init__(self) -> None:
        if not self.speedup > 0:
            raise ValueError(f"PolynomialTiming.speedup must be > 0, got {self.speedup}")

    def prefill_ms(self, num_tokens: int) -> float:
        """Time to prefill ``num_tokens`` new tokens in one batch; 0 when there are none."""
        if num_tokens <= 0:
            return 0.0
        a, b, c = self.prefill_coeffs
        t = float(num_tokens)
        return max(0.0, (a * t + b) * t + c) / self.speedup

    def decode_ms(self, kv_usage: float) -> float:
        """Time of one decode iteration at ``kv_usage`` in [0, 1] (clamped)."""
        u = min(1.0, max(0.0, kv_usage))
        a, b, c = self.decode_coeffs
        return max(0.0, (a * u + b) * u + c) / self.speedup

"""predicted_ttft: the worker where this request's first token is predicted earliest, with
the prefill work a choice adds to the fleet counted as well.

For each candidate the policy predicts, with a :class:`~router_sim.router.load.TimingModel`, how
long
the worker needs to compute its queued prompt tokens plus this request's uncached ones. The
worker runs chunked prefill: at most ``chunk_tokens`` prompt tokens per step, each step also
running one decode iteration (at the worker's KV usage) when requests are decoding there. So
the prediction is a sum of per-step times, linear in the queue once it exceeds a chunk, not
the prefill time of the whole queue in one batch (the model's prefill curve is quadratic:
priced as one batch, a 40k-token queue looks 1.6 times slower than it runs in 8192-token
steps, so a worker holding a popular prefix looked worse than it is in every burst).

Cost = predicted TTFT + ``recompute_weight`` x prefill time of the request's uncached tokens.
The second term is the capacity the choice consumes: the queued tokens are computed whatever
the choice, but the uncached ones are new work that whatever is routed to that worker next
waits for. Minimizing the request's own TTFT alone recomputes a cached prompt on an idle
worker as soon as the cached worker's queue is as long as the prompt, which in bursts is often
and costs the fleet the whole prompt's compute; with ``recompute_weight=1`` a saved
recomputation is worth as much as the request's own wait. 0 gives the pure TTFT estimate.
Ties go to the least loaded worker, then to the tied worker the request's content ranks
first (:func:`~router_sim.router.policies.base.tie_rank`: replicas break them alike).
"""

from __future__ import annotations

from typing import Final

from router_sim.router.load import TimingModel
from router_sim.router.policies.base import (
    BoundedLoad,
    PolicyChoice,
    RouteRequest,
    candidates,
    credited_blocks,
    lowest_cost,
    tie_rank,
)
from router_sim.router.policies.kernels import chunked_prefill_ms, ttft_costs
from router_sim.router.policies.overlap import (
    DEFAULT_BALANCE,
    DEFAULT_RECOMPUTE_WEIGHT,
    check_credits,
)
from router_sim.sim.timing_model import PolynomialTiming

DEFAULT_CHUNK_TOKENS: Final = 8192
"""Prompt tokens per engine step assumed by the prediction: the simulated workers' default
step budget (``max_batch_tokens``); set it to the deployment's chunked-prefill budget."""


class PredictedTtftPolicy:
    """Earliest predicted first token plus the cost of recomputation (module docstring)."""

    name = "predicted_ttft"

    def __init__(
        self,
        timing: TimingModel | None = None,
        device_credit: float = 1.0,
        slower_credit: float = 0.75,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        recompute_weight: float = DEFAULT_RECOMPUTE_WEIGHT,
        seed: int = 0,
        balance: float | None = DEFAULT_BALANCE,
    ) -> None:
        check_credits(device_credit, slower_credit)
        if chunk_tokens < 1 or recompute_weight < 0:
            raise ValueError(
                "predicted_ttft needs chunk_tokens >= 1 and recompute_weight >= 0, got "
                f"{chunk_tokens} and {recompute_weight}"
            )
        self.timing: TimingModel = PolynomialTiming() if timing is None else timing
        self.device_credit = device_credit
        self.slower_credit = slower_credit
        self.chunk_tokens = chunk_tokens
        self.recompute_weight = recompute_weight
        self.bounded = BoundedLoad(balance)
        self.seed = seed  # for ties only

    def chunked_prefill_ms(self, tokens: int, chunk_ms: float | None = None) -> float:
        """Compute time of ``tokens`` prompt tokens run in steps of ``chunk_tokens``
        (``chunk_ms``: one full step's time, when the caller has it already)."""
        if chunk_ms is None:
            chunk_ms = self.timing.prefill_ms(self.chunk_tokens)
        return chunked_prefill_ms(self.timing, self.chunk_tokens, tokens, chunk_ms)

    def uncached_tokens(self, request: RouteRequest, worker: int) -> int:
        """Prompt tokens of ``request`` that ``worker`` would compute."""
        return self._worker(request, worker, None)[3]

    def predict_ms(self, request: RouteRequest, worker: int) -> float:
        """Predicted time to first token of ``request`` on ``worker``: its queued prompt
        tokens and this request's uncached ones in chunks, each step with one decode
        iteration when requests are decoding there."""
        return self._worker(request, worker, None)[1]

    def cost_ms(self, request: RouteRequest, worker: int) -> float:
        """Predicted TTFT plus ``recompute_weight`` x the compute time of the uncached tokens."""
        return self._worker(request, worker, None)[0]

    def _worker(
        self, request: RouteRequest, worker: int, chunk_ms: float | None
    ) -> tuple[float, float, float, int]:
        """(:meth:`cost_ms`, :meth:`predict_ms`, credited cached blocks, uncached tokens) of
        one worker, each term computed once."""
        cached = credited_blocks(
            request.matches.get(worker), self.device_credit, self.slower_credit
        )
        uncached = max(0, request.num_tokens - round(cached * request.tokens_per_block))
        load = request.loads[worker]
        queue = load.pending_prefill_tokens + uncached
        ms = self.chunked_prefill_ms(queue, chunk_ms)
        if load.decode_blocks > 0 and queue > 0:
            ms += -(-queue // self.chunk_tokens) * self.timing.decode_ms(load.kv_usage)
        cost = ms + self.recompute_weight * self.chunked_prefill_ms(uncached, chunk_ms)
        return cost, ms, cached, uncached

    def _figures(
        self,
        request: RouteRequest,
        workers: list[int],
        counts: list[int] | None = None,
        mean: float | None = None,
    ) -> tuple[dict[int, float], dict[int, float], dict[int, float]]:
        """Per worker: cost, predicted TTFT and credited cached blocks: :meth:`_worker`'s
        terms in its order (the same floats), computed by
        :func:`~router_sim.router.policies.kernels.ttft_costs`; with the balance's ``counts`` and
        their ``mean``, its price is in the costs."""
        return ttft_costs(
            workers,
            request.matches,
            request.loads,
            request.num_tokens,
            request.tokens_per_block,
            self.device_credit,
            self.slower_credit,
            self.recompute_weight,
            self.timing,
            self.chunk_tokens,
            counts,
            mean,
        )

    def choose(self, request: RouteRequest) -> PolicyChoice:
        workers, counts, mean = self.bounded.eligible_counts(candidates(request))
        # with the balance's price: one request beyond the mean costs one more block's compute
        costs, predicted, overlap = self._figures(request, workers, counts, mean)
        seed = self.seed
        chosen = lowest_cost(
            costs,
            request.loads,
            None,
            self.bounded.prefer(),
            rank_of=lambda: tie_rank(request.tie_key(seed)),
        )
        self.bounded.record(chosen)
        reason = (
            f"earliest predicted first token ({predicted[chosen]:.1f} ms) "
            f"with recomputation counted (cost {costs[chosen]:.1f} ms)"
        )
        return PolicyChoice(chosen, reason, costs=costs, predicted_overlap=overlap)

    def forget_worker(self, worker: int) -> None:
        self.bounded.forget(worker)


__all__ = ["DEFAULT_CHUNK_TOKENS", "PredictedTtftPolicy"]
